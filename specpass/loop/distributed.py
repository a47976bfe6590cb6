"""The ranks of a tensor-parallel loop agree: every rank runs the same `Decoder` on its shard of the
models, and this module checks that they make the same decisions.

Why they do: every value a decision reads (the target's logits, the drafter's, the hidden states
the drafter reads) is replicated, made by an all-reduce or an all-gather, which hand every rank the
same bits (NCCL and gloo both), then by the same kernels on the same inputs on every rank; sampling
draws counter-based numbers keyed by (seed, position, stream), not a generator's state; and every
rank is given the same prompts, budgets and sampling parameters. What is checked, each with one
all-reduce of a few int64 (MAX of [x, -x] gives every rank max and min):

    models      at `Decoder(...)`: the probe's logits, target's and drafter's (width and values): a
                model whose logits are a rank's vocabulary shard, or differ, is refused
    request     at `generate` / `start`: prompts, budgets, EOS ids, sampling parameters, K
    output      at the end of `generate`: the emitted tokens, counts and acceptance statistics
    rounds      (`Decoder(check_ranks=True)`, a debug mode) after every round: the state's
                checksum, folded on the device into the first round that differed, read at the end
                (no host sync added per round); the done flag is agreed too, so diverged ranks run
                the same rounds (without it, ranks that disagree on when to stop would wait on
                each other's collectives: a run that hangs at TP is one to rerun with it)

A mismatch raises `RanksDisagree` on every rank, naming what differs. A group of one is no group.
At the end, `destroy_process_group` frees the CUDA graphs that hold the group's collectives first.
"""

from __future__ import annotations

import gc
import hashlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class RanksDisagree(RuntimeError):
    """The ranks of a tensor-parallel `Decoder` were given, or computed, different values."""


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """`dist.destroy_process_group(group)`, after freeing the CUDA graphs that captured its collectives.

    NCCL destroys a communicator only once every CUDA graph holding one of its collectives is
    destroyed (pytorch/pytorch#115388): while the loop's graphs live, `dist.destroy_process_group()`
    waits forever and a torchrun job never exits. This frees torch's cudagraph trees, where every
    compiled step's graphs live (`torch.compiler.reset()`: compiled code is dropped too), and the
    Decoders `specpass.generate` keeps. Decoders built on the group are not to be called again."""
    generate = sys.modules.get("specpass.hf.generate")  # imported only where generate was used
    if generate is not None:
        generate.generate.cache.clear()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    torch.compiler.reset()
    gc.collect()  # graphs held in reference cycles
    dist.destroy_process_group(group)


def checksum(*tensors: Tensor) -> Tensor:
    """[] int64: a position-weighted sum of the tensors' values (as int64, wrapping), on their device."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        flat = t.reshape(-1)
        if flat.is_floating_point():  # every bit of a float counts
            flat = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[flat.element_size()])
        weights = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) * 2654435761 + 97
        total = total * 31 + (flat.long() * weights).sum()
    return total


def fingerprint(value: Any) -> int:
    """An int64 of a Python value's repr (ints, floats, lists, tuples, None)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


class Ranks:
    """The process group a `Decoder`'s models are sharded over, and the checks that its ranks agree."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group, self.device = group, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    @staticmethod
    def of(group: Any, device: torch.device) -> "Ranks | None":
        """None for no group or a group of one (one process: nothing to agree on)."""
        if group is None:
            return None
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be the torch.distributed ProcessGroup the models are sharded over "
                            f"(e.g. dist.group.WORLD) or None, got {type(group).__name__}")
        return Ranks(group, device) if dist.get_world_size(group) > 1 else None

    def agree(self, what: str, values: dict[str, int | Tensor], advice: str) -> None:
        """Every rank holds the same `values` (ints, or [] int64 tensors on the device), else
        RanksDisagree naming those that differ. One all-reduce."""
        names = list(values)
        local = torch.stack([torch.as_tensor(values[n], dtype=torch.int64, device=self.device) for n in names])
        both = torch.cat([local, -local])
        dist.all_reduce(both, dist.ReduceOp.MAX, group=self.group)
        high, low = both[: len(names)].tolist(), (-both[len(names):]).tolist()
        differ = [n for n, h, lo in zip(names, high, low) if h != lo]
        if differ:
            raise RanksDisagree(f"the {self.size} ranks of the tensor-parallel Decoder differ in the {what}: "
                                f"{', '.join(differ)} (this is rank {self.rank}). {advice}")

    def shared_seed(self) -> int:
        """A fresh seed, rank 0's on every rank (a seed None would otherwise draw one per rank)."""
        seed = torch.randint(0, 2**62, (1,), device=self.device)
        dist.broadcast(seed, dist.get_global_rank(self.group, 0), group=self.group)
        return int(seed.item())

    def check_models(self, logits: Tensor, draft_logits: Tensor | None) -> None:
        """The probe's logits [B, 1, V] (and the drafter's [B, Vd]) are the same on every rank."""
        values: dict[str, int | Tensor] = {"target vocabulary": logits.shape[-1], "target logits": checksum(logits)}
        if draft_logits is not None:
            values.update({"draft vocabulary": draft_logits.shape[-1], "draft logits": checksum(draft_logits)})
        self.agree("logits of one probe token", values,
                   "Every rank must return the whole vocabulary's logits, the same on every rank: gather a "
                   "vocabulary-parallel lm_head's logits (a rank's shard of the vocabulary cannot be sampled "
                   "alone), shard the target and the drafter over this group, and give every rank the same weights")

    def check_request(self, fields: dict[str, Any]) -> None:
        self.agree("arguments of generate", {name: fingerprint(value) for name, value in fields.items()},
                   "Every rank runs generate (or start) with the same prompts and settings: read them on one "
                   "rank and broadcast them (dist.broadcast_object_list)")

    def check_output(self, out: Tensor, count: Tensor, stats: Tensor) -> None:
        """The emitted tokens (out [B, S] up to count [B]) and the statistics [K+1] agree."""
        emitted = torch.where(torch.arange(out.shape[1], device=out.device) < count[:, None], out, -1)
        self.agree("tokens generated", {"tokens": checksum(emitted, count), "acceptance": checksum(stats)},
                   _DIVERGED)


class RoundCheck:
    """`Decoder(check_ranks=True)`: after each round, the state's checksum compared across ranks on
    the device; the first round that differed is kept there and read once, at the end."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=ranks.device)

    def observe(self, number: int, tensors: Sequence[Tensor], finished: Tensor) -> Tensor:
        """Round `number`'s state tensors and done flag [] -> the flag every rank agrees on (all
        done on every rank), so that diverged ranks still run the same rounds and collectives."""
        value = checksum(*tensors)
        both = torch.stack([value, -value, -finished.long()])
        dist.all_reduce(both, dist.ReduceOp.MAX, group=self.ranks.group)  # async on a GPU: no host sync
        differs = (both[0] != -both[1]) & (self.first_bad < 0)
        self.first_bad = torch.where(differs, number, self.first_bad)
        return both[2] < 0  # the most of -done is -1 only where every rank is done

    def raise_if_differed(self) -> None:
        number = int(self.first_bad.item())
        if number >= 0:
            raise RanksDisagree(f"the {self.ranks.size} ranks of the tensor-parallel Decoder differ in their state "
                                f"after round {number} (this is rank {self.ranks.rank}). {_DIVERGED}")


_DIVERGED = ("The ranks computed different values from the same inputs: check that every rank holds the same "
             "replicated weights (norms, embeddings), that the collectives of the sharded models are over this "
             "group, and that no kernel is nondeterministic")
