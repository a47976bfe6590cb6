"""The state and carry that cross rounds: in the fused round's own buffers, written in place
(`InPlaceRound`), or cloned from a CUDA-graph replay's outputs, which the next replay overwrites
(`replayed`, steps apart)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

def clone(value: Any) -> Any:
    """A copy of a CUDA-graph replay's outputs (tensors in nested tuples), which the next replay overwrites."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, tuple):
        items = map(clone, value)
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def replayed(run_round: Callable) -> Callable:
    """run_round (state, carry, params) -> (state, carry, done) as CUDA graphs replay it: a new
    step of the graph trees begins, and the state and carry that cross rounds are cloned (the
    next replay overwrites its outputs). The done flag is read before that."""

    def run(state: Any, carry: Any, params: Any) -> tuple[Any, Any, Tensor]:
        torch.compiler.cudagraph_mark_step_begin()
        state, carry, finished = run_round(state, carry, params)
        return clone(state), clone(carry), finished

    return run


class InPlaceRound:
    """The fused round as the loop calls it, (state, carry, params) -> (state, carry, all done), from
    `run_round` (`steps.decode_round_in_place`), which writes the next state and carry over the
    ones it gets. They live in buffers of this round's own, one set per batch size, marked static:
    CUDA graphs take them at their addresses, so a replay neither copies them in nor needs its
    outputs cloned (`replayed` does both: 16 copies a step of plain decoding, docs/results.md). A
    state from elsewhere (the prefill, another K's round) is copied in first. So a `Run` this round
    returns holds these buffers: the next run at this K and batch size overwrites it."""

    def __init__(self, run_round: Callable, cudagraphs: bool):
        self.run_round, self.cudagraphs = run_round, cudagraphs
        self.buffers: dict[tuple, tuple[Any, Any]] = {}  # the leaves' shapes and dtypes -> (state, carry)

    def __call__(self, state: Any, carry: Any, params: Any) -> tuple[Any, Any, Tensor]:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if not any(state is own[0] and carry is own[1] for own in self.buffers.values()):  # rounds 2 on: in place
            state, carry = self._copied_in(state, carry)
        return state, carry, self.run_round(state, carry, params)

    def _copied_in(self, state: Any, carry: Any) -> tuple[Any, Any]:
        leaves, spec = pytree.tree_flatten((state, carry))  # tensors, and None where a field is unused
        key = (str(spec), tuple((t.shape, t.dtype) if isinstance(t, Tensor) else t for t in leaves))
        if key not in self.buffers:
            own = [torch.empty_like(t) if isinstance(t, Tensor) else t for t in leaves]
            for t in own:
                if isinstance(t, Tensor):
                    torch._dynamo.mark_static_address(t)
            self.buffers[key] = pytree.tree_unflatten(own, spec)
        own_state, own_carry = self.buffers[key]
        for mine, given in zip(pytree.tree_leaves((own_state, own_carry)), leaves):
            if mine is not given:
                mine.copy_(given)
        return own_state, own_carry
