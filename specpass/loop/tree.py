"""The tree round: EAGLE-2/3's dynamic draft tree, verified whole, the accepted path moved into
place. A `TreeDrafter` with a `TreeTarget` gets it when the decoder runs at a `TreeShape` (topk,
steps, tokens) instead of an int K; the algorithms are tree_math.py's.

For a request at n (x_n not yet seen by the target), with F_0 = the root's top-k made by the
last catch-up (`Carry.d1`, scores and draft ids [B, topk]):

    draft     steps-1 head steps on the frontier's topk rows; step i's rows sit at position n+i
              and write draft slots n+steps+2+(i-1)*topk+r (past what the catch-up writes), each
              seeing the prefix (positions <= n) and its ancestors' slots -> `Tree`, N nodes
    verify    the target on the N nodes: positions n+depth, slots n..n+N-1 (siblings share a
              position, not a slot), mask = the prefix (slots < n) and the node's ancestors
              -> the accepted path (greedy or sampled, tree_math), then its K/V copied from
              slots n+path[d] to n+d, where later rounds read position n+d
    accept    `steps.accept` on the path's y [B, steps+1], as a chain of K = steps
    catch-up  the chain's, on the path's tokens and the target's states along it -> the next F_0

Why copy the path rather than leave it where it was written: a request's cache then stays
contiguous (slot = position below n), so every later attention keeps the causal mask and the
split-KV op's length bound; the copy is steps+1 rows per cache (docs/loop.md measures it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from specpass.loop.processors import processed
from specpass.loop.protocols import TreeDrafter, TreeTarget, require
from specpass.loop.steps import Carry, State, Steps, accept
from specpass.loop.tree_math import Tree, accept_greedy, accept_sampled, draft_tree, expand
from specpass.sampling import Params


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A tree round's shape, passed where a chain's K goes (`Decoder(k=...)`, `use_k`, `tune_k`):
    `topk` children per node, `steps` levels (the deepest accepted path), `tokens` nodes verified
    per request, the root included (SGLang's num_draft_tokens)."""

    topk: int
    steps: int
    tokens: int

    def __post_init__(self):
        for name in ("topk", "steps", "tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TreeShape.{name} must be an int >= 1, got {value!r}")
        most = 1 + self.topk + (self.steps - 1) * self.topk**2
        if self.tokens > most:
            raise ValueError(f"a tree of topk {self.topk} and {self.steps} steps drafts {most - 1} nodes: "
                             f"tokens (verified nodes, the root included) must be <= {most}, got {self.tokens}")

    def __str__(self) -> str:
        return f"tree {self.topk},{self.steps},{self.tokens}"


TREES = (TreeShape(4, 5, 16), TreeShape(4, 7, 32))  # a small set for `Decoder.tune_k(trees=...)` (docs/loop.md)


def depth(k: int | TreeShape) -> int:
    """The drafts a round can accept: K, or a tree's steps (the length of `Metrics.acceptance`)."""
    return k.steps if isinstance(k, TreeShape) else k


def tree_mask(last_prefix: Tensor, base: Tensor, seen: Tensor, slots: int) -> Tensor:
    """What each row sees: cache slots <= last_prefix [B], and of the W slots from base [B] on,
    those `seen` [B, T, W] marks -> [B, 1, T, slots] bool."""
    B, T, W = seen.shape
    cols = torch.arange(slots, device=base.device)
    at = cols - base[:, None]  # [B, S] the slot's column in `seen`
    inside = (at >= 0) & (at < W)
    block = seen.gather(2, at.clamp(0, W - 1)[:, None, :].expand(B, T, slots)) & inside[:, None, :]
    return ((cols <= last_prefix[:, None])[:, None, :] | block)[:, None]


def frontier(logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The root's draft logits [B, Vd] -> F_0: (log-probabilities fp32, draft ids) [B, topk]."""
    scores, ids = expand(logits, topk)
    return scores, ids


def head_step(drafter: TreeDrafter, shape: TreeShape, slots: int, pos: Tensor, tokens: Tensor, parent_row: Tensor,
              i: int, seen: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """tree_math's `Head`: the drafter on the frontier's rows tokens [B, k] at position n+i, each
    with its parent's hidden output (hidden [B, rows of the previous call, Hd]) -> (logits
    [B, k, Vd], hidden [B, k, Hd])."""
    k = shape.topk
    hidden = hidden.gather(1, parent_row[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, k, Hd]
    first = pos + shape.steps + 2  # [B] the first head slot, past the catch-up's n+1..n+steps+1
    rows = (first + (i - 1) * k)[:, None] + torch.arange(k, device=pos.device)  # [B, k] this call's slots
    mask = tree_mask(pos, first, seen, slots)
    return drafter.draft_tree_step(tokens, (pos + i)[:, None].expand(-1, k), rows, hidden, mask)


def draft(drafter: TreeDrafter, shape: TreeShape, slots: int, f0: tuple[Tensor, Tensor], q: None, pos: Tensor,
          h: Tensor, params: Params | None) -> tuple[Tree, None]:
    """F_0 (the carry), n [B], the catch-up's hidden [B, Hd] -> the tree (its root's token is
    filled in by the verify, which holds x_n). Drafts are the top-k, sampled or not: the
    acceptance makes the output the target's distribution (tree_math.accept_sampled)."""
    head = functools.partial(head_step, drafter, shape, slots, pos)
    return draft_tree(torch.zeros_like(pos), f0, head, h[:, None], shape.steps, shape.tokens,
                      drafter.to_target), None


def verify(target: TreeTarget, hidden_kind: str | None, shape: TreeShape, slots: int, state: State, tree: Tree,
           q: None, params: Params | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The target on the tree's N nodes -> (y [B, steps+1] the path's tokens then the target's,
    a [B] nodes accepted past the root, the target's hidden states along the path [B, steps+1, Hh]);
    the path's K/V moved to slots n..n+a."""
    pos = state.pos
    N, steps, dev = shape.tokens, shape.steps, pos.device
    tokens = torch.cat([state.last[:, None], tree.tokens[:, 1:]], 1)  # [B, N] the root is x_n
    tree = Tree(tokens, tree.parents, tree.depth, tree.mask)
    at = pos[:, None] + torch.arange(N, device=dev)  # [B, N] node i's slot
    mask = tree_mask(pos - 1, pos, tree.mask, slots)
    logits, hidden = target.forward_tree(tokens, pos[:, None] + tree.depth, at, mask, hidden_kind)
    # A node follows its ancestors (a processor reads that prefix).
    logits = processed(state.processing, logits, state.count, tokens, tree.depth, tree.mask)
    path = (accept_greedy(tree, logits.argmax(-1), steps) if params is None
            else accept_sampled(tree, logits, params, pos, steps))
    along = path.path.clamp_min(0)  # [B, steps+1] past a: the root, copied into scratch
    level = pos[:, None] + torch.arange(steps + 1, device=dev)
    target.copy_slots(pos[:, None] + along, level)
    if hidden is not None:
        hidden = hidden.gather(1, along[..., None].expand(-1, -1, hidden.shape[-1]))
    return path.y, path.a, hidden


def catch_up_round(drafter: TreeDrafter, shape: TreeShape, y: Tensor, pos: Tensor, hidden: Tensor | None,
                   a: Tensor, params: Params | None) -> tuple[tuple[Tensor, Tensor], None, Tensor]:
    """The chain's catch-up on the path y [B, steps+1] at n+1.., live row a -> (the next F_0, None, hidden)."""
    positions = pos[:, None] + 1 + torch.arange(y.shape[1], device=y.device)
    logits, h = drafter.catch_up(y, positions, hidden, a)
    return frontier(logits, shape.topk), None, h


def catch_up_prompt(drafter: TreeDrafter, shape: TreeShape, tokens: Tensor, positions: Tensor,
                    hidden: Tensor | None, live: Tensor, n: Tensor, params: Params | None) -> Carry:
    """The prefill's drafter half: the prompt and x_n, live row [B] -> the first round's F_0."""
    logits, h = drafter.catch_up(tokens, positions, hidden, live)
    return Carry(frontier(logits, shape.topk), None, h)


class TreeRound:
    """The `RoundShape` of a `TreeDrafter` at a `TreeShape`: a drafted tree verified whole per round."""

    drafter_protocol = TreeDrafter
    prefill_reads_k = True  # the prefill's catch-up makes F_0, topk wide

    def takes(self, k: object) -> bool:
        return isinstance(k, TreeShape)

    def cache_slots(self, prompt_len: int, max_new_tokens: int, k: TreeShape) -> int:
        """A finished request runs on frozen at a position up to prompt + budget + steps - 1; past it
        the verify writes N slots (the path's copy steps+1), the drafter steps+1 catch-up rows and
        (steps-1)*topk head rows after them."""
        frozen = prompt_len + max_new_tokens + k.steps - 1
        return frozen + max(k.tokens, k.steps + 1, k.steps + 2 + (k.steps - 1) * k.topk)

    def bind(self, target: TreeTarget, drafter: TreeDrafter, k: TreeShape, sampled: bool, slots: int) -> Steps:
        require(target, "target", TreeTarget, optional=("forward_with_hidden",))
        return Steps(draft=functools.partial(draft, drafter, k, slots),
                     verify=functools.partial(verify, target, drafter.hidden_kind, k, slots),
                     accept=accept,
                     catch_up=functools.partial(catch_up_round, drafter, k))

    def prefill_catch_up(self, drafter: TreeDrafter, k: TreeShape, sampled: bool) -> Callable[..., Carry]:
        return functools.partial(catch_up_prompt, drafter, k)


TREE = TreeRound()
