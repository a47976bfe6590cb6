"""Tensor-parallel zoo models: torch's own plan (`parallelize_module` with ColwiseParallel /
RowwiseParallel), Megatron-style, run on local shards with functional collectives.

    tp = tensor_parallel(zoo.build("tiny-llama-eagle3"), group)   # this rank's shard (a copy)
    tp.setup_caches(B, S)                                         # this rank's K/V heads only
    logits, hidden_out = tp.catch_up(tokens, positions, hidden, live)   # the same on every rank

`specpass.tensor_parallel.shard_plan` names what torch's styles shard: every `Attention`'s heads
and every `SwiGLU` (column- then row-parallel), the lm_head over the vocabulary with its logits
gathered; embeddings, norms and the heads' fc stay whole; a DFlash draft's embedding and lm_head
are its target's (`target=`). Every rank must get the same inputs (SPMD), and gets the same outputs.

`specpass.tensor_parallel.parallelize` applies the plan with `parallelize_module` (torch cuts the
weights: `distribute_tensor`) and keeps each shard as a plain tensor, the styles' DTensor hooks
replaced by the functional collectives they run: DTensor parameters cannot enter specpass's IR
(docs/design.md, "Tensor parallel").
"""

from __future__ import annotations

import copy

import torch.distributed as dist
import torch.nn as nn

from specpass.tensor_parallel import shard


def tensor_parallel(model: nn.Module, group: dist.ProcessGroup, target: nn.Module | None = None) -> nn.Module:
    """A copy of `model` holding this rank's shard (`specpass.tensor_parallel.shard`). target: a
    DFlash draft's, already sharded: the copy holds its input embedding and lm_head in place of the
    ones `model` holds."""
    held = {} if target is None else {id(model.embed_tokens): target.get_input_embeddings(),
                                      id(model.lm_head): target.lm_head}
    return shard(copy.deepcopy(model, held), group)
