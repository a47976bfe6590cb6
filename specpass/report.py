"""What the passes did to a graph, and what they left alone and why; and where each report goes
(`log_report`: the "specpass" logger, and every `collecting_reports` block of the caller's context)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator

import torch
import torch.fx as fx

from specpass import kernels  # noqa: F401  (registers torch.ops.specpass.*, counted below)
from specpass.graph import is_region_call, region_body, val

aten = torch.ops.aten
log = logging.getLogger("specpass")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One rewrite that fired (`fired=True`) or one candidate left alone, with the reason."""

    pass_name: str
    where: str  # node name(s) in the graph the pass saw
    fired: bool
    message: str
    rows: tuple[int, int] | None = None  # token rows computed before -> after
    matmul_flops: tuple[int, int] | None = None  # before -> after, for the nodes involved
    calls: int = 0  # in a region body (`where` is "body.node"): how many calls run it; 0 outside one

    @property
    def nodes(self) -> list[str]:
        return self.where.split(", ")

    def __str__(self) -> str:
        head = f"[{self.pass_name}] {'rewrote' if self.fired else 'left alone'} {self.where}: {self.message}"
        extras = [f"a region body: {self.calls} call{'s' if self.calls > 1 else ''} run it"] if self.calls else []
        if self.rows is not None:
            extras.append(f"rows {self.rows[0]} -> {self.rows[1]}")
        if self.matmul_flops is not None:
            extras.append(f"matmul FLOPs {_si(self.matmul_flops[0])} -> {_si(self.matmul_flops[1])}")
        return head + (f" ({'; '.join(extras)})" if extras else "")


@dataclasses.dataclass
class Report:
    findings: list[Finding] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # a pass raised or broke an invariant
    notes: list[str] = dataclasses.field(default_factory=list)  # capture-level facts (no candidates, switches off)
    # Set when the graph was compiled without rewrites after all: why (the findings are what the
    # passes did to a graph that does not run).
    fallback: str | None = None
    matmul_flops: tuple[int, int] | None = None  # whole graph, before -> after
    # Wall time of specpass's own work per part: "capture", then "<part>/<step>" for the
    # preparation and each pass that ran ("argmax/rewrite", "argmax/propagate", ...).
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Adds the wall time of the block to `seconds[part]`, also when it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start

    @property
    def rewrites(self) -> list[Finding]:
        return [f for f in self.findings if f.fired]

    @property
    def refusals(self) -> list[Finding]:
        return [f for f in self.findings if not f.fired]

    def of(self, pass_name: str) -> list[Finding]:
        return [f for f in self.findings if f.pass_name == pass_name]

    def to_json(self) -> str:
        """The findings, errors, notes and FLOPs (not the seconds) as JSON: what a cache entry or a
        saved step keeps of the report."""
        # not dataclasses.asdict: it deep-copies a symbolic count (rows under dynamic shapes), fake tensors and all
        findings = [{field.name: getattr(f, field.name) for field in dataclasses.fields(f)} for f in self.findings]
        return json.dumps({"findings": findings, "errors": self.errors, "notes": self.notes,
                           "matmul_flops": self.matmul_flops, "fallback": self.fallback}, default=str)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        pair = lambda v: tuple(v) if v is not None else None  # noqa: E731  (JSON has lists, Finding tuples)
        findings = [Finding(**{**f, "rows": pair(f["rows"]), "matmul_flops": pair(f["matmul_flops"])})
                    for f in data["findings"]]
        return cls(findings=findings, errors=data["errors"], notes=data["notes"], matmul_flops=pair(data["matmul_flops"]),
                   fallback=data.get("fallback"))

    def __str__(self) -> str:
        head = f"specpass: {len(self.rewrites)} rewrite(s), {len(self.refusals)} left alone"
        if self.matmul_flops is not None:
            before, after = self.matmul_flops
            ratio = f", {before / after:.2f}x fewer" if _number(before) and _number(after) and after != before \
                and after else ""
            head += f"; graph matmul FLOPs {_si(before)} -> {_si(after)}{ratio}"
        lines = [head] + ([f"  compiled without rewrites: {self.fallback}"] if self.fallback else [])
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  {f}" for f in self.findings]
        return "\n".join(lines)

    def timing(self) -> str:
        """`seconds` in one line, per part with its steps: "specpass seconds: capture 0.100;
        argmax 0.030 (copy 0.010, rewrite 0.020)". Apart from str(report), which says only what
        the passes did (the same on every run)."""
        return f"specpass seconds: {_seconds_text(self.seconds)}"


def _seconds_text(seconds: dict[str, float]) -> str:
    groups: dict[str, dict[str, float]] = {}
    for part, s in seconds.items():
        group, _, step = part.partition("/")
        groups.setdefault(group, {})[step] = s
    texts = []
    for group, steps in groups.items():
        inner = ", ".join(f"{step} {s:.3f}" for step, s in steps.items() if step)
        texts.append(f"{group} {sum(steps.values()):.3f}" + (f" ({inner})" if inner else ""))
    return "; ".join(texts)


def _number(n: object) -> bool:
    return isinstance(n, (int, float))


def _si(n: int) -> str:
    """1.23K, 4.5G; a symbolic count (dynamic shapes) as its expression, `8192*s0`."""
    if not _number(n):
        return str(n)
    if n < 1000:
        return str(n)
    exp = min(int(math.log10(n) // 3), 4)
    return f"{n / 10 ** (3 * exp):.3g}{' KMGT'[exp]}"


def _val(x) -> torch.Tensor | None:
    v = val(x)
    return v if isinstance(v, torch.Tensor) else None


def node_matmul_flops(node: fx.Node) -> int:
    """Multiply-add FLOPs (2 per MAC) of a matmul-like node, from its meta shapes; 0 otherwise."""
    if node.op != "call_function":
        return 0
    out = _val(node)
    if out is None:
        return 0
    attention = {aten.scaled_dot_product_attention.default: -2, torch.ops.specpass.attend_split.default: 1}
    if node.target in attention:  # the slot axis of k: SDPA's [*, S, E], attend_split's [B, S, hk, E]
        q, k, v = (_val(a) for a in node.args[:3])
        if q is None or k is None or v is None:
            return 0
        # QK^T and PV: [*, L, E] x [*, S, E] and [*, L, S] x [*, S, Ev] over q's batch dims.
        rows = q.numel() // q.shape[-1]
        return 2 * rows * k.shape[attention[node.target]] * (q.shape[-1] + v.shape[-1])
    first_operand = {
        aten.linear.default: 0,
        aten.mm.default: 0,
        aten.bmm.default: 0,
        aten.matmul.default: 0,
        aten.addmm.default: 1,
        aten.baddbmm.default: 1,
        torch.ops.specpass.gemv.default: 0,
        torch.ops.specpass.gemv_group.default: 0,
        torch.ops.specpass.exact_linear.default: 0,
    }.get(node.target)
    if first_operand is None:
        return 0
    a = _val(node.args[first_operand])
    if a is None:
        return 0
    return 2 * out.numel() * a.shape[-1]


def graph_matmul_flops(gm: fx.GraphModule) -> int:
    """The graph's matmul FLOPs, a region body's counted once per call."""
    return sum(graph_matmul_flops(region_body(n)) if is_region_call(n) else node_matmul_flops(n)
               for n in gm.graph.nodes)


def log_to_stderr_if_asked() -> None:
    """SPECPASS_LOG=1: the \"specpass\" logger's INFO records to stderr (one handler, added once)."""
    if os.environ.get("SPECPASS_LOG", "0") not in ("", "0") and not any(
        getattr(h, "_specpass_stderr", False) for h in log.handlers
    ):
        handler = logging.StreamHandler(sys.stderr)
        handler._specpass_stderr = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.setLevel(logging.INFO)


# Per context (a thread's own, and what a job on the compile worker copies from its caller).
_collectors: contextvars.ContextVar[tuple[list[tuple[str, Report]], ...]] = contextvars.ContextVar(
    "specpass_report_collectors", default=())


@contextlib.contextmanager
def collecting_reports(alone: bool = False) -> Iterator[list[tuple[str, Report]]]:
    """(step name, report) of every graph compiled in the block, and of every saved step loaded
    (`specpass.loop.saved_steps` logs the reports it saved): what `return_dict_in_generate` returns.
    alone: the enclosing blocks do not get them."""
    collected: list[tuple[str, Report]] = []
    token = _collectors.set((collected,) if alone else (*_collectors.get(), collected))
    try:
        yield collected
    finally:
        _collectors.reset(token)


def log_report(report: Report, step: str = "", logged: bool = False) -> None:
    """report to every collector, and to the log. logged: it was logged where it was made (on the
    compile worker): collected only."""
    for collected in _collectors.get():
        collected.append((step, report))
    if logged:
        return
    log_to_stderr_if_asked()
    if log.isEnabledFor(logging.INFO):
        # formatted here, where the backend catches a failure, not in a handler; the Report itself
        # rides on the record (`record.report`) for tools that read its figures
        log.info(f"{report}\n  {report.timing()}", extra={"report": report, "step": step})
