"""The tree round's algorithms (specpass/loop/tree_math.py) against brute-force Python references.

Drafting, the ancestor mask, the head's per-step mask and greedy acceptance are compared exactly
with references written per request in plain Python, over many seeds. Sampled acceptance is a
two-sample Pearson chi-square test of the joint distribution of the first two emitted tokens
against plain sampling from the target (N = 20,000 each, vocabulary 8, fixed seeds, α = 1e-3),
and its power is checked: the same test must reject the issue's three wrong rules (a later sibling
accepted with its unrenormalised probability; the residual drawn from p with the rejected siblings
left in; the chain's min(1, p / q) per sibling, q the draft's probability).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpass.loop import tree_math
from specpass.loop.tree_math import (
    Tree,
    accept_greedy,
    accept_sampled,
    ancestors,
    draft_tree,
    expand,
)
from specpass.sampling import Params

ALPHA = 1e-3


# --- references


def ref_draft(root_lp: np.ndarray, table: np.ndarray, root: int, k: int, steps: int, n: int):
    """EAGLE-2's tree for one request, in Python: root_lp [V] fp32 log-probs of depth 1, table
    [steps, V, V] fp32 log-probs of a child given (depth of the parent, its token) -> (tokens,
    parents, depth, and per head call i its mask [k, i*k] and parent rows [k]). Scores are summed
    in fp32 in the order the tree sums them; the final cut breaks ties by creation order."""
    def top(lp):  # the k best (token, log-prob), best first
        order = sorted(range(len(lp)), key=lambda v: (-lp[v], v))[:k]
        return [(v, lp[v]) for v in order]

    nodes = [{"tok": root, "score": np.float32(0), "parent": -1, "depth": 0}]
    frontier = []  # node ids
    for v, lp in top(root_lp):
        nodes.append({"tok": v, "score": np.float32(lp), "parent": 0, "depth": 1})
        frontier.append(len(nodes) - 1)
    slots = [list(frontier)]  # node id in each head slot, by block
    masks, rows = [], []  # per head call: its mask, each row's parent row in the previous call
    for i in range(1, steps):
        anc = [set(chain_of(nodes, f)) for f in frontier]
        masks.append([[slots[t][c] in anc[r] for t in range(i) for c in range(k)] for r in range(k)])
        rows.append([0] * k if i == 1 else [slots[i - 2].index(nodes[f]["parent"]) for f in frontier])
        cands = []
        for f in frontier:
            for v, lp in top(table[i][nodes[f]["tok"]]):
                nodes.append({"tok": v, "score": np.float32(nodes[f]["score"] + np.float32(lp)), "parent": f,
                                  "depth": i + 1})
                cands.append(len(nodes) - 1)
        frontier = sorted(cands, key=lambda c: -nodes[c]["score"])[:k]
        slots.append(list(frontier))
    best = sorted(range(1, len(nodes)), key=lambda c: (-nodes[c]["score"], c))[:n - 1]
    keep = [0] + sorted(best)
    at = {c: i for i, c in enumerate(keep)}
    tokens = [nodes[c]["tok"] for c in keep]
    parents = [-1] + [at[nodes[c]["parent"]] for c in keep[1:]]
    depth = [nodes[c]["depth"] for c in keep]
    return tokens, parents, depth, masks, rows


def chain_of(nodes, c):
    """c and its ancestors, by the parent links of dicts or of a list of ints."""
    out = []
    while c != -1:
        out.append(c)
        c = nodes[c]["parent"] if isinstance(nodes[c], dict) else nodes[c]
    return out


def table_head(table: torch.Tensor, seen: list):
    """A head whose logits after a token at depth i are table[i, token]; it records its masks and
    parent rows."""
    def head(tokens, parent_row, i, mask, state):
        seen.append((mask.clone(), parent_row.clone()))
        return table[i][tokens], state
    return head


# --- drafting


@pytest.mark.parametrize("k,steps,n,peaked", [(2, 4, 8, False), (4, 5, 16, False), (3, 3, 13, False),
                                              (4, 3, 21, False), (1, 4, 5, False), (3, 1, 4, False),
                                              (2, 3, 1, False), (2, 4, 8, True), (3, 3, 10, True)])
def test_draft_tree_matches_the_reference(k, steps, n, peaked):
    """peaked: a child of log-probability 0 (fp32) ties its parent's score: the parent must still
    be kept and come first (the reference breaks ties by creation order)."""
    V, B = 12, 6
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        root_logits = torch.randn(B, V, generator=g) * 2
        table = torch.randn(steps, V, V, generator=g) * 2  # logits given (depth, token)
        if peaked:
            table[..., 0] = 200.0
            assert (torch.log_softmax(table, -1)[..., 0] == 0).all()
        root = torch.randint(V, (B,), generator=g)
        seen = []
        tree = draft_tree(root, expand(root_logits, k), table_head(table, seen), None, steps, n)
        lp_root = torch.log_softmax(root_logits, -1).numpy()
        lp_table = torch.log_softmax(table, -1).numpy()
        for b in range(B):
            tokens, parents, depth, masks, rows = ref_draft(lp_root[b], lp_table, int(root[b]), k, steps, n)
            assert tree.tokens[b].tolist() == tokens, (seed, b)
            assert tree.parents[b].tolist() == parents, (seed, b)
            assert tree.depth[b].tolist() == depth, (seed, b)
            assert len(seen) == steps - 1
            for i, (m, r) in enumerate(zip(masks, rows)):
                assert seen[i][0][b].tolist() == m, (seed, b, i + 1)
                assert seen[i][1][b].tolist() == r, (seed, b, i + 1)
            want = [[j in chain_of(parents, i) for j in range(n)] for i in range(n)]
            assert tree.mask[b].tolist() == want, (seed, b)


def test_the_rounds_compile_whole():
    k, steps, n, V, B = 3, 3, 10, 16, 2
    g = torch.Generator().manual_seed(0)
    table, root_logits, root = torch.randn(steps, V, V, generator=g), torch.randn(B, V, generator=g), torch.arange(B)

    def head(tokens, parent_row, i, mask, state):
        return table[i][tokens] + mask.sum(-1, keepdim=True), state  # the mask reaches the graph

    def round_(root, root_logits, params):
        tree = draft_tree(root, expand(root_logits, k), head, None, steps, n)
        logits = table[0][tree.tokens]
        return tree, accept_greedy(tree, logits.argmax(-1), steps), accept_sampled(tree, logits, params, root, steps)

    params = Params.make(B, B, torch.device("cpu"), temperature=0.7, top_p=0.9, seed=0)
    eager = round_(root, root_logits, params)
    compiled = torch.compile(round_, fullgraph=True, backend="eager")(root, root_logits, params)
    for a, b in zip(eager, compiled):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# --- greedy acceptance


def random_tree(g, B, N, V, steps):
    """Random trees of depth <= steps, parents before children; tokens from a small vocabulary (so
    paths match, and siblings may repeat a token)."""
    parents, depth = torch.full((B, N), -1), torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(1, N):
            while True:
                p = int(torch.randint(i, (1,), generator=g))
                if depth[b, p] < steps:
                    break
            parents[b, i], depth[b, i] = p, depth[b, p] + 1
    tokens = torch.randint(V, (B, N), generator=g)
    return Tree(tokens, parents, depth, ancestors(parents, steps))


def ref_greedy(tokens, parents, depth, target_next):
    """The deepest node whose path is the target's greedy tokens (lowest index on ties): (path,
    bonus)."""
    N = len(tokens)
    ok = [all(tokens[j] == target_next[parents[j]] for j in chain_of(parents, i) if j) for i in range(N)]
    best = min((i for i in range(N) if ok[i]), key=lambda i: (-depth[i], i))
    return chain_of(parents, best)[::-1], target_next[best]


def test_greedy_acceptance_matches_the_reference():
    B, steps = 16, 4
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        N, V = int(torch.randint(1, 20, (1,), generator=g)), 3
        tree = random_tree(g, B, N, V, steps)
        target_next = torch.randint(V, (B, N), generator=g)
        got = accept_greedy(tree, target_next, steps)
        for b in range(B):
            path, bonus = ref_greedy(tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.depth[b].tolist(),
                                     target_next[b].tolist())
            a = len(path) - 1
            assert got.a[b] == a, (seed, b)
            assert got.path[b].tolist() == path + [-1] * (steps - a), (seed, b)
            assert got.y[b, :a + 1].tolist() == [int(tree.tokens[b, j]) for j in path[1:]] + [bonus], (seed, b)


def test_tree_rounds_decode_as_plain_greedy_decoding():
    """Rounds of draft_tree + accept_greedy on Markov models (logits of the next token given the
    last) emit exactly the target's greedy chain, with drafts accepted along the way."""
    Vm, B, rounds = 16, 8, 12
    g = torch.Generator().manual_seed(5)
    target = torch.randn(Vm, Vm, generator=g)
    draft = target + 0.7 * torch.randn(Vm, Vm, generator=g)
    last = torch.arange(B)
    emitted, accepted = [[int(t)] for t in last], 0
    for _ in range(rounds):
        tree = draft_tree(last, expand(draft[last], 3), lambda t, r, i, m, s: (draft[t], s), None, 4, 12)
        got = accept_greedy(tree, target[tree.tokens].argmax(-1), 4)
        for b in range(B):
            emitted[b] += got.y[b, :int(got.a[b]) + 1].tolist()
        accepted += int(got.a.sum())
        last = got.y.gather(1, got.a[:, None])[:, 0]
    for b in range(B):
        want = [b]
        while len(want) < len(emitted[b]):
            want.append(int(target[want[-1]].argmax()))
        assert emitted[b] == want, b
    assert accepted > B * rounds  # more than one draft per round on average: the tree was used


# --- sampled acceptance

V, K, STEPS, NODES, DRAWS = 8, 3, 3, 8, 20_000


def two_sample(a: torch.Tensor, b: torch.Tensor, vocab: int) -> tuple[float, int, float]:
    """Pearson's chi-square for two samples of equal size of token tuples [N, m] -> (stat, df, p);
    cells with fewer than 10 counts in both samples together pooled into one."""
    cells = vocab ** a.shape[1]
    code = vocab ** torch.arange(a.shape[1])
    ca, cb = (torch.bincount((t * code).sum(1), minlength=cells).double() for t in (a, b))
    small = ca + cb < 10
    ca, cb = (torch.cat([c[~small], c[small].sum()[None]]) for c in (ca, cb))
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    stat = float(((ca - cb) ** 2 / (ca + cb)).sum())
    df = len(ca) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                   torch.tensor(stat / 2, dtype=torch.float64)))


def models(seed: int):
    """A target and a draft over V tokens, Markov chains: logits of the next token given the last."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g)  # close to the target, not equal
    return target, draft


def speculative(target, draft, root, pos, params, chain_rule=False):
    """One tree round per request: x_n root [B] at pos [B] -> (y [B, STEPS+1], a [B]). chain_rule:
    the wrong rule min(1, p / q) per sibling, q the draft's probability of the node."""
    def head(tokens, parent_row, i, mask, state):
        return draft[tokens], state
    tree = draft_tree(root, expand(draft[root], K), head, None, STEPS, NODES)
    if not chain_rule:
        got = accept_sampled(tree, target[tree.tokens], params, pos, STEPS)
        return got.y, got.a
    q = torch.softmax(draft[tree.tokens.gather(1, tree.parents.clamp_min(0))], -1)  # [B, N, V] after the parent
    q = q.gather(2, tree.tokens[..., None])[..., 0]  # [B, N] the draft's probability of each node
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tree_math, "sibling_accepts", lambda u, p, left: u * q < p)
        got = accept_sampled(tree, target[tree.tokens], params, pos, STEPS)
    return got.y, got.a


def first_two(target, draft, params, chain_rule=False):
    """The first two tokens each request emits from root 0 at position 5: [B, 2]."""
    B = params.seed.shape[0]
    root, pos = torch.zeros(B, dtype=torch.long), torch.full((B,), 5)
    y, a = speculative(target, draft, root, pos, params, chain_rule)
    # A round emits a+1 >= 1 tokens: a second round from y_a makes two in every request.
    root2 = y.gather(1, a[:, None])[:, 0]
    y2, _ = speculative(target, draft, root2, pos + a + 1, params, chain_rule)
    second = torch.where(a > 0, y[:, 1], y2[:, 0])
    return torch.stack([y[:, 0], second], 1)


def plain(target, temperature, seed):
    """DRAWS pairs by plain sampling from the target's Markov chain from token 0 (torch's sampler)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(target / temperature, -1)
    x1 = torch.multinomial(p[torch.zeros(DRAWS, dtype=torch.long)], 1, generator=g)[:, 0]
    x2 = torch.multinomial(p[x1], 1, generator=g)[:, 0]
    return torch.stack([x1, x2], 1)


def cut(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Plain sampling's filters, row by row in Python: keep the top_k largest logits, then, in
    descending order, those whose mass before them (at the temperature, after top-k) is < top_p;
    the rest -inf."""
    out = torch.full_like(logits, float("-inf"))
    for r, row in enumerate(logits.tolist()):
        order = sorted(range(len(row)), key=lambda v: -row[v])[:top_k or len(row)]
        p = torch.softmax(torch.tensor([row[v] for v in order]) / temperature, 0).tolist()
        before = 0.0
        for v, pv in zip(order, p):
            if top_p is not None and before >= top_p:
                break
            out[r, v] = row[v]
            before += pv
    return out


@pytest.mark.parametrize("seed,temperature,top_k,top_p", [(0, 1.0, None, None), (1, 0.6, None, None),
                                                          (2, 1.0, 5, None), (3, 0.8, None, 0.8),
                                                          (4, 0.7, 5, 0.9)])
def test_sampled_acceptance_keeps_the_distribution(seed, temperature, top_k, top_p):
    target, draft = models(seed)
    params = Params.make(DRAWS, DRAWS, torch.device("cpu"), temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed)
    ours = first_two(target, draft, params)
    ref = plain(cut(target, temperature, top_k, top_p), temperature, seed + 100)
    stat, df, p = two_sample(ours, ref, V)
    assert p > ALPHA, f"chi-square {stat:.1f} on {df} df, p = {p:.2e} <= α = {ALPHA:.0e}"


def unrenormalised(u, p, left):
    return u < p  # a later sibling accepted with its own p, not p / left


def residual_with_rejected(p, rejected):
    return torch.log(p)  # the rejected siblings left in


@pytest.mark.parametrize("name,wrong", [("sibling_accepts", unrenormalised), ("residual_of", residual_with_rejected)])
def test_a_wrong_rule_is_rejected(name, wrong, monkeypatch):
    monkeypatch.setattr(tree_math, name, wrong)
    target, draft = models(0)
    params = Params.make(DRAWS, DRAWS, torch.device("cpu"), temperature=1.0, seed=0)
    stat, df, p = two_sample(first_two(target, draft, params), plain(target, 1.0, 100), V)
    assert p < ALPHA, f"{name} -> {wrong.__name__} not rejected: chi-square {stat:.1f} on {df} df, p = {p:.2e}"


def test_the_chain_rule_on_siblings_is_rejected():
    """min(1, p / q) per sibling, q the draft's probability: the candidates were not drawn from q."""
    target, draft = models(0)
    params = Params.make(DRAWS, DRAWS, torch.device("cpu"), temperature=1.0, seed=0)
    stat, df, p = two_sample(first_two(target, draft, params, chain_rule=True), plain(target, 1.0, 100), V)
    assert p < ALPHA, f"the chain rule not rejected: chi-square {stat:.1f} on {df} df, p = {p:.2e}"


def test_greedy_rows_of_a_sampled_batch_accept_greedily():
    g = torch.Generator().manual_seed(3)
    B, steps = 32, 3
    target, draft = models(3)
    root = torch.randint(V, (B,), generator=g)
    tree = draft_tree(root, expand(draft[root], K), lambda t, r, i, m, s: (draft[t], s), None, steps, NODES)
    logits = target[tree.tokens]
    params = Params.make(B, B, torch.device("cpu"), temperature=[0.0] * (B // 2) + [1.0] * (B // 2), seed=1)
    got = accept_sampled(tree, logits, params, torch.zeros(B, dtype=torch.long), steps)
    want = accept_greedy(tree, logits.argmax(-1), steps)
    half = B // 2
    assert torch.equal(got.a[:half], want.a[:half])
    assert torch.equal(got.path[:half], want.path[:half])
    assert torch.equal(got.y[:half], want.y[:half])
