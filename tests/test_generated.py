"""Random draft-step programs (tests/programs.py), compiled with specpass and compared with eager.

Default (CI): a fixed sequence of programs (derandomize), stopping at the first failure, which
hypothesis shrinks and prints as a runnable program. `--long`: 5,000 random programs (seed:
`--hypothesis-seed`, else a random one); the first failure of each signature is shrunk and
printed, the others are counted, and generation goes on; prints the seed, the count, the
fraction rewritten, how many programs each pass rewrote or left alone, and the failures.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import re
import traceback
import warnings
from collections import Counter

import torch
from hypothesis import HealthCheck, assume, given, seed, settings

import specpass
from tests.programs import TOLERANCE, Program, programs

_COMMON = dict(database=None, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("generated-ci", max_examples=400, derandomize=True, **_COMMON)
settings.register_profile("generated-long", max_examples=5000, **_COMMON)
MIN_REWRITTEN = 0.5  # the grammar's weights keep most programs within reach of a rewrite


class Failure(AssertionError):
    """specpass broke a program: `signature` groups failures that look alike."""

    def __init__(self, signature: str, detail: str):
        super().__init__(f"{signature}\n{detail}")
        self.signature = signature
        self.program: Program | None = None  # set where it was raised


def check(program: Program) -> specpass.Report:
    """Raise Failure where specpass differs from eager; -> the rewrite's report."""
    module, inputs = program.build()
    eager, compiled = copy.deepcopy(module), copy.deepcopy(module)
    eager_args, compiled_args = inputs(), inputs()
    with torch.no_grad():
        try:
            want = eager(*eager_args)
        except Exception:
            assume(False)  # the grammar drew an invalid program
        torch._dynamo.reset()
        step = torch.compile(compiled, backend=specpass.backend(handoff="eager"), fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = step(*compiled_args)
            except Exception as exc:
                assume(_dynamo_runs(module, inputs))  # a program Dynamo itself cannot compile
                raise Failure(f"crash: {_origin(exc)}", _describe(exc)) from exc
        for w in caught:
            if issubclass(w.category, specpass.SpecpassWarning):
                raise Failure(f"warning: {_normalized(str(w.message))}", str(w.message))

        tolerance = TOLERANCE[program.low_precision]
        want_leaves = torch.utils._pytree.tree_leaves(want)
        try:
            _compare("output", torch.utils._pytree.tree_leaves(got), want_leaves, tolerance)
        except Failure as mismatch:
            if mismatch.signature != "mismatch: output indices":
                raise
            # Documented: ties among rounded probabilities go to the largest input (docs/passes.md,
            # "Ties"); with argmax_ties="eager" the indices must be eager's.
            torch._dynamo.reset()
            eager_ties = torch.compile(copy.deepcopy(module), fullgraph=True,
                                       backend=specpass.backend(handoff="eager", argmax_ties="eager"))
            _compare("output", torch.utils._pytree.tree_leaves(eager_ties(*inputs())), want_leaves, tolerance)
        _compare("buffer", list(compiled.state_dict().values()), list(eager.state_dict().values()), tolerance)
        _compare("input", list(compiled_args), list(eager_args), tolerance)

        torch._dynamo.reset()
        try:
            report = specpass.rewrite(specpass.capture(copy.deepcopy(module), *inputs())).report
        except Exception as exc:
            raise Failure(f"capture: {_origin(exc)}", _describe(exc)) from exc
    if report.errors:
        raise Failure(f"report error: {_normalized(report.errors[0])}", str(report))
    for finding in report.of("live_rows"):
        if finding.fired and finding.rows is not None and not finding.rows[1] < finding.rows[0]:
            raise Failure("claim: rows not fewer", str(report))
    before, after = report.matmul_flops
    if after > before:
        raise Failure("claim: more matmul FLOPs", str(report))
    return report


def _compare(what: str, got: list, want: list, tolerance: dict) -> None:
    """Floats within tolerance, then integers exactly (so that an index mismatch comes last)."""
    if len(got) != len(want):
        raise Failure(f"mismatch: {what} count", f"{len(got)} {what}s, eager has {len(want)}")
    for i in sorted(range(len(want)), key=lambda i: not want[i].is_floating_point()):
        exact = not want[i].is_floating_point()
        try:
            torch.testing.assert_close(got[i], want[i], equal_nan=True, **(dict(rtol=0, atol=0) if exact else tolerance))
        except AssertionError as exc:
            raise Failure(f"mismatch: {what}{' indices' if exact else ''}", f"{what} {i}: {exc}") from None


def _dynamo_runs(module: torch.nn.Module, inputs) -> bool:
    torch._dynamo.reset()
    try:
        torch.compile(copy.deepcopy(module), backend="eager", fullgraph=True)(*inputs())
    except Exception:
        return False
    return True


def _innermost(exc: BaseException) -> BaseException:
    """Dynamo wraps what a backend raises: the exception at the end of the chain."""
    seen = set()
    while id(exc) not in seen and (exc.__cause__ or exc.__context__) is not None:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return exc


def _origin(exc: BaseException) -> str:
    """Type and innermost specpass frame (else the innermost frame) of what was raised."""
    inner = _innermost(exc)
    frames = traceback.extract_tb(inner.__traceback__)
    ours = [f for f in frames if "/specpass/" in f.filename] or frames[-1:]
    where = f" at {ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}" if ours else ""
    return f"{type(inner).__name__}{where}"


def _describe(exc: BaseException) -> str:
    inner = _innermost(exc)
    return "".join(traceback.format_exception(type(inner), inner, inner.__traceback__)[-6:])


def _normalized(message: str) -> str:
    """A message without the node-name suffixes and sizes that differ between programs."""
    return re.sub(r"\d+", "#", re.sub(r"_\d+\b", "", message.splitlines()[0]))[:160]


@dataclasses.dataclass
class _Run:
    """Counts over the programs hypothesis generates; failures by signature, with a shrunk program."""

    programs: int = 0
    rewritten: int = 0
    verdicts: Counter[str] = dataclasses.field(default_factory=Counter)  # "gqa rewrote": programs
    failures: Counter[str] = dataclasses.field(default_factory=Counter)  # generated programs per signature
    first: dict[str, Program] = dataclasses.field(default_factory=dict)  # the first program per signature
    shrunk: set[str] = dataclasses.field(default_factory=set)  # signatures hypothesis has shrunk and printed
    shrinking: bool = False  # after hypothesis saw a new failure: its calls are not new programs

    def record(self, program: Program, keep_going: bool) -> None:
        """Check one program; raise a failure whose signature has no shrunk program yet (or any,
        unless keep_going), so that hypothesis shrinks it."""
        try:
            report = check(program)
        except Failure as failure:
            failure.program = program
            if not self.shrinking:
                self.failures[failure.signature] += 1
                self.first.setdefault(failure.signature, program)
            if failure.signature not in self.shrunk or not keep_going:
                self.shrinking = True
                raise
            report = specpass.Report()
        if not self.shrinking:
            self.programs += 1
            self.rewritten += bool(report.rewrites)
            self.verdicts.update({f"{f.pass_name} {'rewrote' if f.fired else 'left alone'}" for f in report.findings})

    def run(self, profile: settings, first_seed: int | None, keep_going: bool) -> None:
        """Generate up to profile.max_examples programs; with keep_going, every new failure is
        shrunk and generation goes on (from the next seed) until the count is reached."""
        for attempt in itertools.count():
            self.shrinking = False

            @settings(profile, max_examples=profile.max_examples - self.programs)
            @given(programs())
            def each(program):
                self.record(program, keep_going)

            try:
                (each if first_seed is None else seed(first_seed + attempt)(each))()
                return
            except (Failure, ExceptionGroup) as exc:
                failures = exc.exceptions if isinstance(exc, ExceptionGroup) else [exc]
                if not keep_going or not all(isinstance(f, Failure) for f in failures):
                    raise
                for failure in failures:  # shrinking may end on another signature than it began with
                    self.shrunk.add(failure.signature)
                    self.failures[failure.signature] += 0
                    print(f"\n=== {failure.signature}\n{failure.program!r}", flush=True)
                if self.programs >= profile.max_examples:
                    return

    def summary(self, seed_used: int | None) -> str:
        fraction = self.rewritten / max(self.programs, 1)
        return (f"generated programs: {self.programs}, seed {seed_used if seed_used is not None else 'derandomized'}, "
                f"rewritten {self.rewritten} ({fraction:.0%}), distinct failures {len(self.failures)}\n"
                f"programs where a pass {', '.join(f'{k} {v}' for k, v in sorted(self.verdicts.items()))}")


def test_generated_programs(request, capsys):
    long = request.config.getoption("--long")
    profile = settings.get_profile("generated-long" if long else "generated-ci")
    seed_used = int(request.config.getoption("--hypothesis-seed") or random.randrange(2**32)) if long else None
    run = _Run()
    with capsys.disabled():  # a long run reports each failure as it is shrunk
        if long:
            print(f"\ngenerated programs: seed {seed_used}", flush=True)
        run.run(profile, seed_used, keep_going=long)
        print(f"\n{run.summary(seed_used)}")
        for signature, count in run.failures.most_common():
            print(f"  {count} x {signature}" if count else f"  (while shrinking) {signature}")
        for signature in run.failures.keys() - run.shrunk:
            print(f"\n=== not shrunk: {signature}\n{run.first[signature]!r}")
    assert not run.failures, f"{len(run.failures)} distinct failures: {list(run.failures)}"
    assert run.rewritten >= MIN_REWRITTEN * run.programs, run.summary(seed_used)
