"""The tree round's pure algorithms: EAGLE-2/3's dynamic draft tree, its greedy and its
lossless sampled acceptance. Static shapes throughout, no host syncs: every function is traceable
with fullgraph=True. A leaf module: torch, specpass.sampling and the counter hash only.

A tree of N nodes per request (node 0: the root, x_n at position n; a node at depth d sits at
position n + d) is `Tree`: tokens, parents, depth [B, N], the ancestor mask [B, N, N]. Nodes are
ordered so that a parent precedes its children.

Drafting (`draft_tree`), with topk children per node and `steps` levels:

    step 0     the top-k of the root's distribution (made by the catch-up) -> F_0 (depth 1)     [B, k]
    step i     the head on F_{i-1}'s k rows -> each row's own top-k: k*k candidates scored by
    (1..s-1)   cumulative log-probability; F_i = the best k of them                              [B, k]
    select     the best N-1 of every candidate ever made, plus the root, in creation order

Candidates live in a buffer of M = 1 + k + (steps-1)*k*k nodes in creation order (so a parent
precedes its children there too). Selection is a stable descending sort: a child's score is at most
its parent's and it was created later, so a kept child's parent is always kept.

The head's own K/V: the call at step i writes slot block i-1 (k slots, one per row of F_{i-1}).
Row r of that call sees the prefix, plus the slots of its ancestors in blocks 0..i-2 and its own
slot: the mask `head` receives, [B, k, i*k] over blocks 0..i-1. EAGLE's hidden input of a row is
the hidden output of its parent's row in the previous call: `head` receives that row's index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from specpass.kernels.counter import key, uniform
from specpass.sampling import ACCEPT, TARGET, Params, floor_of, gumbel_argmax, logprobs


class Tree(NamedTuple):
    """A draft tree per request; a parent precedes its children."""

    tokens: Tensor  # [B, N] int64 target ids; node 0 the root
    parents: Tensor  # [B, N] int64 index into the N nodes; -1 at the root
    depth: Tensor  # [B, N] int64; 0 at the root
    mask: Tensor  # [B, N, N] bool: node i sees node j iff j is i or an ancestor of i


# head(tokens [B, k], parent_row [B, k], step i, mask [B, k, i*k], state) -> (logits [B, k, V], state)
Head = Callable[[Tensor, Tensor, int, Tensor, Any], tuple[Tensor, Any]]


def expand(logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """Logits [..., V] -> (log-probabilities [..., topk] fp32, their tokens [..., topk]): log_softmax
    -> topk, the spelling specpass's arg-max pass rewrites to an exact top-k (no [.., V] probability
    tensor)."""
    return torch.log_softmax(logits.float(), -1).topk(topk, -1)


def draft_tree(root: Tensor, first: tuple[Tensor, Tensor], head: Head, state: Any, steps: int, n: int,
               to_target: Callable[[Tensor], Tensor] | None = None) -> Tree:
    """EAGLE-2/3's dynamic tree: root x_n [B], and F_0 = `expand` of the root's draft logits (log-
    probabilities, draft ids [B, k]: made by the catch-up, so the round carries [B, k], not [B, V])
    -> the best n nodes (root included) of a tree of depth `steps`, k children per node. `head` runs
    the draft on one frontier (see the module's docstring); `state` is its own (the hidden states),
    passed through. to_target maps draft ids to target ids (None: the same vocabulary)."""
    score, tok = first  # [B, k] F_0
    B, k, dev = root.shape[0], tok.shape[1], root.device
    if not 1 <= n <= 1 + k + (steps - 1) * k * k:
        raise ValueError(f"num_draft_tokens {n} must be in [1, {1 + k + (steps - 1) * k * k}] at topk {k}, "
                         f"steps {steps}")
    to_target = (lambda ids: ids) if to_target is None else to_target  # not `or`: torch 2.11 cannot bool() a method
    front = to_target(tok)  # [B, k] the frontier's tokens
    tokens, scores = [root[:, None], front], [score.new_zeros(B, 1), score]
    parents = [torch.full((B, 1), -1, device=dev), torch.zeros(B, k, dtype=torch.long, device=dev)]
    frontier = 1 + torch.arange(k, device=dev).expand(B, k)  # [B, k] buffer index of each row of F_0
    created = 1 + k
    # anc[b, r, s]: head slot s (block t, row r' at s = t*k + r') is row r's ancestor or itself
    anc = torch.zeros(B, k, (steps - 1) * k, dtype=torch.bool, device=dev)
    row = torch.zeros(B, k, dtype=torch.long, device=dev)  # F_0's rows all descend from the root
    for i in range(1, steps):
        anc[:, :, (i - 1) * k:i * k] |= torch.eye(k, dtype=torch.bool, device=dev)  # its own slot
        logits, state = head(front, row, i, anc[:, :, :i * k], state)
        logp, child = expand(logits, k)  # [B, k, k] each row's own top-k
        cand = (score[:, :, None] + logp).flatten(1)  # [B, k*k] cumulative log-probabilities
        tokens.append(to_target(child.flatten(1)))
        scores.append(cand)
        parents.append(frontier.repeat_interleave(k, 1))
        score, pick = cand.topk(k, -1)  # F_i: the best k of the k*k candidates
        row = pick // k  # the F_{i-1} row each F_i row descends from
        frontier = created + pick
        front = tokens[-1].gather(1, pick)
        created += k * k
        anc = anc.gather(1, row[..., None].expand_as(anc))  # an F_i row sees what its parent saw

    # The best n-1 candidates; a stable sort keeps a parent (created earlier, score >= its
    # child's) ahead of its child, then creation order puts parents first.
    all_tokens, all_scores, all_parents = (torch.cat(x, 1) for x in (tokens, scores, parents))  # [B, M]
    best = torch.sort(all_scores[:, 1:], dim=1, descending=True, stable=True).indices[:, :n - 1] + 1
    keep = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), best.sort(1).values], 1)  # [B, n]
    where = torch.full_like(all_tokens, -1).scatter(1, keep, torch.arange(n, device=dev).expand(B, n))  # [B, M]
    node_parents = torch.where(torch.arange(n, device=dev) == 0, -1, where.gather(1, all_parents.gather(1, keep).clamp_min(0)))
    # creation order: the root, k nodes at depth 1, then k*k per depth
    made = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.ones(k, dtype=torch.long, device=dev),
                      torch.arange(2, steps + 1, device=dev).repeat_interleave(k * k)])  # [M]
    depth = made[keep]
    return Tree(all_tokens.gather(1, keep), node_parents, depth, ancestors(node_parents, steps))


def ancestors(parents: Tensor, steps: int) -> Tensor:
    """parents [B, N] (-1 at the root) of a tree of depth <= steps -> mask [B, N, N]: node i sees
    j iff j is i or an ancestor. `steps` parent hops, each a gather (the root is its own parent)."""
    B, N = parents.shape
    up = parents.clamp_min(0)
    at = torch.arange(N, device=parents.device).expand(B, N)
    cols = torch.arange(N, device=parents.device)
    mask = at[..., None] == cols
    for _ in range(steps):
        at = up.gather(1, at)
        mask |= at[..., None] == cols
    return mask


class Accepted(NamedTuple):
    """The path a round accepts: y is the chain's (`steps.accept` takes y, a as it does for a chain)."""

    y: Tensor  # [B, steps+1] the accepted nodes' tokens, then the target's token; the rest padding
    a: Tensor  # [B] nodes accepted past the root (the accepted node's depth)
    path: Tensor  # [B, steps+1] node index at depth 0..a (root first); -1 past a


def _path(tree: Tree, node: Tensor, steps: int) -> Tensor:
    """The node [B] -> its path from the root, [B, steps+1] node indices by depth, -1 past it."""
    on = tree.mask.gather(1, node[:, None, None].expand(-1, 1, tree.mask.shape[2]))[:, 0]  # [B, N] its ancestors
    at = on[:, None, :] & (tree.depth[:, None, :] == torch.arange(steps + 1, device=node.device)[:, None])
    return torch.where(at.any(-1), at.int().argmax(-1), -1)  # [B, steps+1]


def _emitted(tree: Tree, path: Tensor, a: Tensor, token: Tensor) -> Tensor:
    """The tokens at path[1..a], then `token` at column a: [B, steps+1]."""
    y = tree.tokens.gather(1, path[:, 1:].clamp_min(0))  # [B, steps]
    y = torch.cat([y, y[:, :1]], 1)
    return y.scatter(1, a[:, None], token[:, None])


def accept_greedy(tree: Tree, target_next: Tensor, steps: int) -> Accepted:
    """target_next [B, N] the target's arg-max after each node -> the deepest node whose whole path
    is the target's greedy tokens (the first such node when several: only duplicate siblings tie),
    and the bonus token after it. Exactly plain greedy decoding."""
    N = tree.tokens.shape[1]
    root = torch.arange(N, device=tree.tokens.device) == 0
    hit = (tree.tokens == target_next.gather(1, tree.parents.clamp_min(0))) | root  # [B, N] node = greedy after parent
    ok = ~(tree.mask & ~hit[:, None, :]).any(-1)  # [B, N] the whole path is greedy
    # Deepest first, then the lowest index: one arg-max over depth * N - index.
    node = torch.where(ok, tree.depth * N - torch.arange(N, device=ok.device), -1).argmax(1)
    a = tree.depth.gather(1, node[:, None])[:, 0]
    path = _path(tree, node, steps)
    return Accepted(_emitted(tree, path, a, target_next.gather(1, node[:, None])[:, 0]), a, path)


def sibling_accepts(u: Tensor, p: Tensor, left: Tensor) -> Tensor:
    """Sequential conditioning: a sibling of target probability p, tried after earlier siblings
    were rejected and left the mass `left` (1 - their p), is the target's draw with probability
    p / left given that the draw is none of them: u < p / left."""
    return u * left < p


def residual_of(p: Tensor, rejected: Tensor) -> Tensor:
    """log of the target p [B, V] with the rejected siblings (bool [B, V]) removed (unnormalised):
    the target's draw given it is none of them."""
    return torch.log(torch.where(rejected, 0.0, p))


def accept_sampled(tree: Tree, logits: Tensor, params: Params, pos: Tensor, steps: int) -> Accepted:
    """The target's logits [B, N, V] after each node, the root at position pos [B] -> the accepted
    path and the token after it, distributed as plain sampling from the target's processed
    distribution (temperature, top-k, top-p: `logprobs`). Siblings need distinct tokens (top-k).

    From the root: try the current node's children in index order, each accepted with its target
    probability renormalised over what the earlier rejected siblings left (`sibling_accepts`);
    move to the first accepted. When all are rejected (or there are none), draw from the target with
    them removed (`residual_of`). Node j's uniform is keyed (ACCEPT, n + depth_j, column j); the
    token drawn at the end (TARGET, its position), as the chain's are."""
    B, N = tree.tokens.shape
    dev = logits.device
    rows, cols = torch.arange(B, device=dev), torch.arange(N, device=dev)

    def target_at(node: Tensor) -> Tensor:
        """log p [B, V] after each request's node [B]: one row per request and level, never the
        [B, N, V] of every node (0.5 GiB of fp32 at bs 32, 32 nodes, V 128256)."""
        x = logits[rows, node]
        return logprobs(x, params, floor_of(x, params))

    positions = pos[:, None] + torch.arange(steps + 1, device=dev)  # [B, steps+1]
    u = uniform(key(params.seed, positions, ACCEPT), cols)  # [B, steps+1, N]
    u = u.gather(1, tree.depth[:, None, :])[:, 0]  # [B, N] node j's at its own position
    node = torch.zeros(B, dtype=torch.long, device=dev)
    walking = torch.ones(B, dtype=torch.bool, device=dev)
    log_p = target_at(node)
    for _ in range(steps):
        children = (tree.parents == node[:, None]) & walking[:, None]  # [B, N]
        p_c = torch.where(children, log_p.gather(1, tree.tokens).exp(), 0.0)  # [B, N] p of each child
        left = 1 - (p_c.cumsum(1) - p_c)  # mass left after the earlier siblings' rejection
        took = children & sibling_accepts(u, p_c, left)
        first = torch.where(took, N - cols, 0).argmax(1)  # the lowest index accepted
        walking = took.any(1)
        node = torch.where(walking, first, node)
        log_p = target_at(node)
    # Stopped at `node`: every child was rejected (a leaf has none) -> the residual there.
    # (a scatter-add: non-children add 0 wherever they point, so no write races a child's)
    rejected = log_p.new_zeros(log_p.shape).scatter_add(1, tree.tokens, (tree.parents == node[:, None]).float()) > 0
    a = tree.depth.gather(1, node[:, None])[:, 0]
    token = gumbel_argmax(residual_of(log_p.exp(), rejected),
                          key(params.seed, pos + a + 1, TARGET))
    path = _path(tree, node, steps)
    return Accepted(_emitted(tree, path, a, token), a, path)
