"""The loop's compiled steps saved to disk: a later process loads them and runs them without
Dynamo, specpass's passes, AOTAutograd or Inductor (torch's precompile: `aot_compile`, then
`save_compiled_function` / `load_compiled_function`).

A step compiles as it does under torch.compile (the same backend, mode and symbolic sizes), into an
AOT compiled function with the guards Dynamo can save (tensor metadata, constants read, types). Its
file is named by a staleness key over what those guards cannot check:

- the models: every module's class (the file that defines it), its config and plain attributes, and
  every parameter's and buffer's name, shape, stride, dtype and device type;
- the step: its name and function, and everything bound to it (the round shape, K, sampling mode,
  helpers, caches), walked the same way;
- the arguments: their structure and each tensor's dtype, device and shape, the symbolic sizes as "*";
- the backend and its options, the mode, grad mode, and the torch, transformers and specpass versions.

A file that cannot be read, fails its digest, was written for another key or another machine
(torch checks the device and its versions), or whose guards fail on the call it should serve is
never run: a warning says why, the step compiles again and the file is replaced. A step that cannot be
saved (its guards hold an object torch cannot save) runs as compiled, with a warning.

Where: `steps/` under specpass's compile cache (`compile_cache.directory()`); off with it
(`SPECPASS_CACHE=0`). Files are pickles, like torch's own caches: the directory must be the user's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from specpass import compile_cache
from specpass.compile_backend import warn
from specpass.loop import background
from specpass.report import Report, collecting_reports, log_report

log = logging.getLogger("specpass")

FORMAT = 1  # the file layout: a new one must change it
MAGIC = b"specpass saved step\n"


class UnusableStep(RuntimeError):
    """A saved step that exists but must not be run (unreadable, foreign, corrupted, stale)."""


def directory() -> Path | None:
    cache = compile_cache.directory()
    return None if cache is None else cache / "steps"


class SavedStep:
    """`fn` (a step with its models bound) compiled as one graph under the code object `code`
    (`compiling.own_code`), saved under `where` (None: not saved), and loaded by later processes. Each
    call runs the compiled function whose guards pass, or the one called last while guards are
    skipped (`compiling.skip_guards`); a call no function serves loads the saved one or compiles, on
    clones of its tensors marked as `batch` marks them (a saved guard rejects a tensor marked at a
    call and not at the compile).

    background: the compile runs on `background.worker` (at `priority`), and the calls until it lands
    run fn uncompiled."""

    def __init__(self, fn: Callable, code: Callable, backend: str | Callable, mode: str | None, batch: Any,
                 where: Path | None, unsaved: Callable[[], Callable], background: bool = False, priority: int = 0):
        self.fn, self.batch, self.where = fn, batch, where
        self.name, self.globals = code.__name__, code.__globals__
        self.make_unsaved, self.unsaved = unsaved, None  # the step under torch.compile, where torch cannot save it
        self.backend = backend
        self.mode = mode
        self.mode_options = torch._inductor.list_mode_options(mode) if mode else {}  # "triton.cudagraphs", ...
        options = {**self.mode_options, "guard_filter_fn": _savable_guards}
        with torch._dynamo.config.patch(enable_aot_compile=True):  # torch 2.11's default is off
            self.compiler = torch.compile(code, backend=_serializable(backend), options=options, fullgraph=True,
                                          dynamic=None)
        self.compiled: list[Any] = []  # AOT compiled functions of fn
        self.last: Any = None  # the one called last, its guards checked; None after an uncompiled call
        self.saving = where is not None
        self.background, self.priority = background, priority
        self.pending: concurrent.futures.Future | None = None  # a compile on the worker

    def __call__(self, *args: Any) -> Any:
        if self.pending is not None and self.pending.done():
            landed, self.pending = self.pending.result(), None
            if landed is not None:
                self._landed(landed)
        if self.unsaved is not None:
            return self.unsaved(*args)
        call = (self.fn, *args)
        if self.last is not None and torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe:
            return self.last.fn(*call)
        self.last = next((compiled for compiled in self.compiled if compiled.guard_check(*call)), None)
        if self.last is None and self.pending is None:
            self.last = self._load_or_compile(args)
        if self.last is None:  # compiling on the worker, or (torch cannot save it) under torch.compile
            return background.uncompiled(self.fn, args) if self.unsaved is None else self.unsaved(*args)
        return self.last.fn(*call)

    def _landed(self, compiled: Any) -> None:
        self.compiled.append(compiled)
        for report in compiled.reports:  # logged on the worker; collected by the caller's `collecting_reports`
            log_report(report, self.name, logged=True)

    def _load_or_compile(self, args: tuple) -> Any:
        """The saved step for args, else one compiled (None while it compiles on the worker)."""
        marks = list(self.batch.marked(args))
        key = None if self.where is None else staleness_key(self.name, self.fn, args, marks, self.backend, self.mode)
        path = None if key is None else self.where / f"{self.name}-{key[:32]}.bin"
        if path is not None and path.exists():
            try:
                compiled, reports = _load(path, key, self.globals, self.mode_options)
                if not compiled.guard_check(self.fn, *args):
                    failed = compiled._artifacts.guard_manager.check_verbose(compiled.prepare_f_locals(self.fn, *args))
                    raise UnusableStep(f"its guards fail on this call: {failed.verbose_code_parts}")
            except UnusableStep as exc:
                warn(f"specpass ignored the saved step {path}: {exc}; compiling {self.name} again")
            else:
                log.info("specpass: %s loaded from %s", self.name, path)
                for report in reports:
                    report.notes.append(f"loaded with the saved step {path}")
                    log_report(report, self.name)
                self.compiled.append(compiled)
                return compiled
        clones = pytree.tree_map(_clone, args)
        clone_of = {id(a): c for a, c in zip(pytree.tree_leaves(args), pytree.tree_leaves(clones))}
        for tensor, dim in marks:
            torch._dynamo.maybe_mark_dynamic(clone_of[id(tensor)], dim)
        compile = functools.partial(self._compile, clones, key, path)
        if self.background:
            self.pending = background.worker.submit(compile, self.priority)
            return None
        compiled = compile()
        if compiled is not None:
            self.compiled.append(compiled)
        return compiled

    def _compile(self, clones: tuple, key: str | None, path: Path | None) -> Any:
        """The step compiled on clones, and saved -> the AOT compiled function (its `reports` set), or
        None where torch cannot save it (`unsaved` is set)."""
        try:
            with collecting_reports(alone=self.background) as reports:  # the worker's: none of the caller's
                compiled = self.compiler.aot_compile(((self.fn, *clones), {}))
        except Exception as exc:  # what torch.compile takes and torch's precompile does not
            warn(f"specpass cannot save the step {self.name} ({type(exc).__name__}: {exc}); compiling it with "
                 "torch.compile, again in each process")
            self.unsaved = self.make_unsaved()
            return None
        compiled.reports = [report for _, report in reports]
        if self.saving:
            try:
                _save(path, key, compiled, compiled.reports, self.globals, self.mode_options)
            except Exception as exc:  # a step that cannot be saved still runs
                self.saving = False
                warn(f"specpass could not save the step {self.name} ({type(exc).__name__}: {exc}); it compiles "
                     "again in each process")
        return compiled


def _savable_guards(entries: list[Any]) -> list[bool]:
    """The guards a saved step keeps: not those on globals or object identity, nor those reading a
    function's closure (what torch cannot save, or cannot rebuild: a decorated function it saves as a
    placeholder). The staleness key covers them: the models, the step, its bound objects and every
    function's cells."""
    from torch._dynamo.guards import CheckFunctionManager
    unsavable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsavable or unsavable.intersection(e.derived_guard_types or ())
                 or "__closure__" in e.name) for e in entries]


def _serializable(backend: str | Callable) -> str | Callable:
    """The backend, with a graph it returns to run as it is (specpass's handoff="eager") made a
    callable torch can save."""
    if isinstance(backend, str):
        return backend

    def compile_savable(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
        from torch._dynamo.aot_compile_types import (BundledAOTAutogradSerializableCallable,
                                                     GraphModuleSerializableCallable, SerializableCallable)
        compiled = backend(gm, example_inputs, **kwargs)
        if isinstance(compiled, torch.fx.GraphModule):
            return GraphModuleSerializableCallable(compiled)
        if not isinstance(compiled, SerializableCallable) and getattr(compiled, "serialize", None) is not None:
            return BundledAOTAutogradSerializableCallable(compiled)  # Inductor's output (torch 2.11 wraps only its own)
        return compiled

    return compile_savable


def _save(path: Path, key: str, compiled: Any, reports: list[Report], f_globals: dict[str, Any],
          mode_options: dict[str, Any]) -> None:
    """Write the step, once it loads back: torch saves the guards' objects it cannot keep as
    placeholders, and a guard that reads one (a method of an object it left out) fails only when
    loaded."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    payload = compiled.serialize(compiled).serialized_data
    with _loading(mode_options):
        AOTCompiledFunction.deserialize(payload, f_globals)
    header = json.dumps({"format": FORMAT, "key": key, "reports": [r.to_json() for r in reports]}).encode()
    body = len(header).to_bytes(8, "little") + header + payload
    path.parent.mkdir(parents=True, exist_ok=True)
    compile_cache.write_atomically(path, MAGIC + hashlib.sha256(body).digest() + body)


def _clone(x: Any) -> Any:
    """A tensor's clone to compile on, with its static-address mark: CUDA graphs take the inputs
    marked so (a round's state buffers) at their addresses, and accept the round's writes to them
    instead of skipping the graph."""
    if not isinstance(x, Tensor):
        return x
    clone = x.clone()
    static = getattr(x, "_dynamo_static_input_type", None)
    if static is not None:
        torch._dynamo.mark_static_address(clone, guard=static == "guarded")
    return clone


def _load(path: Path, key: str, f_globals: dict[str, Any], mode_options: dict[str, Any]) -> tuple[Any, list[Report]]:
    from torch._dynamo.aot_compile import AOTCompiledFunction
    data = path.read_bytes()
    body = data[len(MAGIC) + 32:]
    if not data.startswith(MAGIC) or hashlib.sha256(body).digest() != data[len(MAGIC):len(MAGIC) + 32]:
        raise UnusableStep("it fails its digest (not written whole, or changed since)")
    size = int.from_bytes(body[:8], "little")
    try:
        header = json.loads(body[8:8 + size])
    except ValueError as exc:
        raise UnusableStep(f"its header cannot be read ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
        raise UnusableStep("it was written for another step, models or options (another key or layout)")
    try:
        with _loading(mode_options):
            compiled = AOTCompiledFunction.deserialize(body[8 + size:], f_globals)
    except Exception as exc:  # another machine, torch or device (torch checks), or an unreadable payload
        raise UnusableStep(f"torch cannot load it ({type(exc).__name__}: {exc})") from exc
    return compiled, [Report.from_json(r) for r in header["reports"]]


@contextlib.contextmanager
def _loading(mode_options: dict[str, Any]) -> Iterator[None]:
    """What loading a step needs of torch's state: the mode's Inductor options (torch reads whether
    to replay CUDA graphs from the global config as it loads), and a tracing context for the guard
    sources that install a guard as they are rebuilt (an import's)."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._inductor.config.patch(mode_options), torch._guards.tracing(context):
        yield


def staleness_key(name: str, fn: Callable, args: tuple, marks: list[tuple[Tensor, int]], backend: Any,
                  mode: str | None) -> str:
    """What a saved step's guards cannot check (see the module's docstring), hashed."""
    symbolic = {(id(t), d) for t, d in marks}
    leaves, spec = pytree.tree_flatten(args)
    arguments = [(x.dtype, x.device.type, tuple("*" if (id(x), d) in symbolic else n for d, n in enumerate(x.shape)))
                 if isinstance(x, Tensor) else repr(x) for x in leaves]
    facts = (FORMAT, torch.__version__, torch.version.git_version, _version("transformers"),
             compile_cache.specpass_source(), name, _Walk().describe(fn), str(spec), arguments,
             _describe_backend(backend), mode, torch.is_grad_enabled())
    return hashlib.sha256(repr(facts).encode()).hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe_backend(backend: Any) -> Any:
    options = getattr(backend, "options", None)  # specpass.backend(...)'s
    return backend if isinstance(backend, str) else (_qualname(backend), repr(options))


class _Walk:
    """A step's bound objects as plain values: what they are, never where they are (no ids)."""

    def __init__(self) -> None:
        # id -> (the order it was first met, the object: held, so that its id is not reused)
        self.seen: dict[int, tuple[int, Any]] = {}

    def describe(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
            return repr(value)
        if isinstance(value, Tensor):
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type)
        if id(value) in self.seen:
            return ("seen", self.seen[id(value)][0])
        self.seen[id(value)] = (len(self.seen), value)
        if isinstance(value, torch.nn.Module):
            return self._module(value)
        if isinstance(value, functools.partial):
            return ("partial", self.describe(value.func), self.describe(value.args), self.describe(value.keywords))
        if isinstance(value, types.MethodType):
            return ("method", self.describe(value.__func__), self.describe(value.__self__))
        if isinstance(value, types.FunctionType):
            cells = [c.cell_contents for c in value.__closure__ or ()]
            return ("function", _qualname(value), _source(value), value.__code__.co_code.hex(),
                    self.describe(value.__defaults__), self.describe(cells))
        if isinstance(value, (list, tuple, set, frozenset)):
            items = sorted(map(repr, value)) if isinstance(value, (set, frozenset)) else value
            return (type(value).__name__, [self.describe(v) for v in items])
        if isinstance(value, dict):
            return ("dict", [(repr(k), self.describe(v)) for k, v in value.items()])
        if isinstance(value, type):
            return ("class", _qualname(value), _source(value))
        state = getattr(value, "__dict__", None)
        if state is None:  # a builtin, an op, a slotted object: its type and text, less any address
            return (_qualname(type(value)), re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value)) if callable(value) else "")
        # Public state only: private attributes are an object's bookkeeping (a hash of itself, a
        # derived cache), and a traced read of one is a guard the step keeps.
        public = {k: v for k, v in state.items() if not k.startswith("_")}
        return (_qualname(type(value)), _source(type(value)), self.describe(public))

    def _module(self, module: torch.nn.Module) -> Any:
        """A module's classes (their files), configs, plain attributes and tensors' metadata, submodule
        by submodule; its other objects (a cache, a helper) walked as any bound object."""
        parts = []
        for name, sub in module.named_modules(remove_duplicate=False):
            plain = {k: v for k, v in vars(sub).items() if not k.startswith("_") and not isinstance(v, torch.nn.Module)}
            tensors = [(n, self.describe(t)) for n, t in [*sub.named_parameters(recurse=False),
                                                          *sub.named_buffers(recurse=False)]]
            parts.append((name, _qualname(type(sub)), _source(type(sub)), tensors, self.describe(plain),
                          self.describe(vars(sub).get("forward"))))  # a marked block's (its cells)
        return ("module", parts)


def _qualname(value: Any) -> str:
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _source(value: Any) -> str | None:
    """A digest of the file that defines value (a class, a function); None for a builtin."""
    try:
        path = inspect.getsourcefile(value)
    except TypeError:
        return None
    return _file_digest(path) if path else None


@functools.cache
def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
