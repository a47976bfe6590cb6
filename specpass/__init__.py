"""specpass: a torch.compile backend of FX rewrites for speculative-decoding draft models.

    torch.compile(draft_step, backend=specpass)                 # this module is the backend
    torch.compile(draft_step, backend="specpass")               # entry point
    torch.compile(draft_step, backend=specpass.backend(q_slice=False))
    print(specpass.explain(draft_step, *args))                  # what the passes would do
    specpass.mark_repeated_blocks(model)                        # its decoder layers compiled once
    draft = specpass.load_drafter("eagle3-dir", hf_model)       # a public EAGLE-3 / P-EAGLE checkpoint
    out = specpass.generate(hf_model, input_ids, assistant_model=draft, max_new_tokens=64)  # transformers
    program = specpass.export(step_module, args)                # torch.export, rewritten
    specpass.destroy_process_group()                            # at TP: frees the CUDA graphs, then the group
"""

import sys
import types

from specpass.compile_backend import ExactModeError, SpecpassWarning, backend, default_backend
from specpass.capture import CaptureError, capture
from specpass.drafters import load_drafter
from specpass.export_program import export
from specpass.loop import ChainDrafter, Decoder, Drafter, ParallelDrafter, Target, TreeDrafter, TreeShape, TreeTarget
from specpass.loop.distributed import destroy_process_group
from specpass.options import Options
from specpass.passes.row_rules import register_row_rule
from specpass.pipeline import PASSES, RewriteResult, explain, rewrite
from specpass.repeated_blocks import mark_repeated_blocks
from specpass.report import Finding, Report

__all__ = [
    "PASSES",
    "CaptureError",
    "ChainDrafter",
    "Decoder",
    "DecoderCache",
    "Drafter",
    "ExactModeError",
    "Finding",
    "Options",
    "ParallelDrafter",
    "Report",
    "RewriteResult",
    "SpecpassWarning",
    "Target",
    "TreeDrafter",
    "TreeShape",
    "TreeTarget",
    "backend",
    "capture",
    "destroy_process_group",
    "explain",
    "export",
    "generate",
    "load_drafter",
    "mark_repeated_blocks",
    "register_row_rule",
    "rewrite",
]


_FROM_HF = ("DecoderCache", "generate")  # they import transformers: imported on first access, not by `import specpass`


def __getattr__(name):
    """`specpass.generate` and `specpass.DecoderCache`, imported on first access (PEP 562)."""
    if name not in _FROM_HF:
        raise AttributeError(f"module 'specpass' has no attribute {name!r}")
    from specpass.hf.generate import DecoderCache, generate

    globals().update(DecoderCache=DecoderCache, generate=generate)  # later accesses skip this hook
    return globals()[name]


def __dir__():
    return sorted({*globals(), *_FROM_HF})


class _BackendModule(types.ModuleType):
    """Lets `torch.compile(model, backend=specpass)` take the module itself."""

    def __call__(self, gm, example_inputs, **kwargs):
        return default_backend(gm, example_inputs, **kwargs)


sys.modules[__name__].__class__ = _BackendModule
