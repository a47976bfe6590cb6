"""The model zoo's numerics: Llama against transformers, and for every model, cached decoding
(token by token, chunked with per-request live rows) against one full prefill, and the
catch-up step against its rows run one at a time. fp32, CPU, tiny configs."""

import pytest
import torch

from models import zoo
from models.deepseek import Experts

B, S = 3, 24  # requests, cache slots
N = 18  # sequence length of the reference prefill
PREFIX = torch.tensor([2, 5, 7])  # per-request prompt lengths: positions differ per request

DRAFTS = ["tiny-llama-draft", "tiny-llama-eagle3", "tiny-deepseek-eagle3-mla", "tiny-deepseek-nextn",
          "tiny-qwen3.5-nextn", "tiny-qwen3.5-moe-nextn"]


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, expected, rtol=kw.get("rtol", 1e-5), atol=kw.get("atol", 1e-5))


def hidden_width(model, fused: bool) -> int | None:
    """Width of the `hidden` input: None (standalone), 3·Ht (EAGLE-3 catch-up) or H."""
    name = type(model).__name__
    if name == "Llama":
        return None
    if name == "Eagle3Head" and fused:
        return 3 * model.config.target_hidden_size
    return model.config.hidden_size


def make_model(name: str, moe_impl: str | None = None):
    cfg = zoo.config(name)
    if moe_impl is not None:
        cfg.moe_impl = moe_impl
    model = zoo.build(cfg, seed=1)
    model.setup_caches(B, S)
    return model


def sequence(model, fused: bool, seed: int = 0, length: int = N):
    """Random tokens [B, L] and hidden inputs [B, L, Hh] (or None), one per position."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (B, length), generator=g)
    width = hidden_width(model, fused)
    hidden = None if width is None else torch.randn(B, length, width, generator=g)
    return tokens, hidden


def take(x, index):
    """Per-request rows: x [B, L, ...], index [B, T] -> [B, T, ...]."""
    return None if x is None else x[torch.arange(x.shape[0])[:, None], index]


def garbage_like(tokens, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, int(tokens.max()) + 1, tokens.shape, generator=g),
            None if hidden is None else torch.randn(hidden.shape, generator=g))


def caches(model):
    return {name: b.clone() for name, b in model.named_buffers() if "cache" in name}


@torch.no_grad()
def reference(model, tokens, hidden):
    """Every row of the sequence in one call on a fresh cache: logits [B, L, V], hidden_out [B, L, H]."""
    model.setup_caches(B, S)
    positions = torch.arange(tokens.shape[1]).expand(B, -1)
    out = model.forward_rows(tokens, positions, hidden)
    model.setup_caches(B, S)
    return out


@torch.no_grad()
def prefill_prefix(model, tokens, hidden):
    """Catch up on each request's prompt (PREFIX[b] rows); the shorter ones padded with garbage rows."""
    T = int(PREFIX.max())
    positions = torch.arange(T).expand(B, -1)
    pad_tokens, pad_hidden = garbage_like(tokens[:, :T], None if hidden is None else hidden[:, :T], seed=99)
    valid = positions < PREFIX[:, None]
    rows_tokens = torch.where(valid, tokens[:, :T], pad_tokens)
    rows_hidden = None if hidden is None else torch.where(valid[..., None], hidden[:, :T], pad_hidden)
    return model.catch_up(rows_tokens, positions, rows_hidden, PREFIX - 1)


# EAGLE-3 heads take two hidden widths: the target's fused 3·Ht (fc applied) and their own H.
DECODE_CASES = [(name, True) for name in DRAFTS] + [(name, False) for name in DRAFTS if "eagle3" in name]


@pytest.mark.parametrize("name,fused", DECODE_CASES)
def test_decode_token_by_token_matches_prefill(name, fused):
    model = make_model(name)
    tokens, hidden = sequence(model, fused)
    ref_logits, ref_hidden = reference(model, tokens, hidden)

    logits, hidden_out = prefill_prefix(model, tokens, hidden)
    last = PREFIX - 1
    close(logits, take(ref_logits, last[:, None])[:, 0])
    close(hidden_out, take(ref_hidden, last[:, None])[:, 0])
    pos = PREFIX.clone()
    with torch.no_grad():
        for _ in range(N - int(PREFIX.max())):
            logits, hidden_out = model.draft_step(
                take(tokens, pos[:, None])[:, 0], pos, None if hidden is None else take(hidden, pos[:, None])[:, 0])
            close(logits, take(ref_logits, pos[:, None])[:, 0])
            close(hidden_out, take(ref_hidden, pos[:, None])[:, 0])
            pos += 1


@pytest.mark.parametrize("name", DRAFTS)
def test_chunked_catch_up_with_rejections_matches_prefill(name):
    """The speculative loop: T=3 rows per round, request b keeps live[b]+1 of them; the rest are
    rejected drafts (garbage) whose K/V are written, never attended, then overwritten."""
    model = make_model(name)
    tokens, hidden = sequence(model, fused=True)
    ref_logits, ref_hidden = reference(model, tokens, hidden)
    prefill_prefix(model, tokens, hidden)
    pos = PREFIX.clone()
    T = 3
    lives = [torch.tensor([0, 2, 1]), torch.tensor([2, 0, 1]), torch.tensor([1, 1, 2])]
    for round_, live in enumerate(lives):
        index = pos[:, None] + torch.arange(T)  # [B, T] per-request positions
        rows_tokens, rows_hidden = take(tokens, index), take(hidden, index)
        bad_tokens, bad_hidden = garbage_like(rows_tokens, rows_hidden, seed=round_)
        rejected = torch.arange(T)[None, :] > live[:, None]
        rows_tokens = torch.where(rejected, bad_tokens, rows_tokens)
        if hidden is not None:
            rows_hidden = torch.where(rejected[..., None], bad_hidden, rows_hidden)
        with torch.no_grad():
            logits, hidden_out = model.catch_up(rows_tokens, index, rows_hidden, live)
        close(logits, take(ref_logits, (pos + live)[:, None])[:, 0])
        close(hidden_out, take(ref_hidden, (pos + live)[:, None])[:, 0])
        pos += live + 1


@pytest.mark.parametrize("name", DRAFTS)
def test_catch_up_equals_rows_one_at_a_time(name):
    model = make_model(name)
    tokens, hidden = sequence(model, fused=True)
    prefill_prefix(model, tokens, hidden)
    before = caches(model)
    T, live = 4, torch.tensor([0, 3, 1])
    index = PREFIX[:, None] + torch.arange(T)
    rows_tokens, rows_hidden = take(tokens, index), take(hidden, index)
    with torch.no_grad():
        logits, hidden_out = model.catch_up(rows_tokens, index, rows_hidden, live)
    after_rows = caches(model)

    for name_, buf in model.named_buffers():  # back to the state before the catch-up
        if name_ in before:
            buf.copy_(before[name_])
    one_logits, one_hidden = [], []
    with torch.no_grad():
        for t in range(T):  # the same rows as T single-row steps
            lg, hd = model.catch_up(rows_tokens[:, t:t + 1], index[:, t:t + 1],
                                    None if rows_hidden is None else rows_hidden[:, t:t + 1], torch.zeros(B, dtype=torch.long))
            one_logits.append(lg)
            one_hidden.append(hd)
    one_logits, one_hidden = torch.stack(one_logits, 1), torch.stack(one_hidden, 1)
    close(logits, take(one_logits, live[:, None])[:, 0])
    close(hidden_out, take(one_hidden, live[:, None])[:, 0])
    after_single = caches(model)
    for key in after_rows:  # every row's K/V written either way, stale slots untouched alike
        close(after_rows[key], after_single[key])
        assert not torch.equal(after_rows[key], before[key]), f"{key} was not written"


def test_moe_forms_decode_alike():
    """The dense and the dispatch MoE forms of the same weights give the same logits and hidden
    states on every row (within 1e-5: they add the experts' outputs in a different order) and the
    same greedy tokens, from a chunked catch-up on the prompts then one token at a time; each form
    also matches its own full prefill through the chunked catch-up."""
    dense = make_model("tiny-deepseek-nextn", moe_impl="dense")
    dispatch = make_model("tiny-deepseek-nextn", moe_impl="dispatch")
    dispatch.load_state_dict(dense.state_dict())
    assert [m.impl for m in dense.modules() if isinstance(m, Experts)] == ["dense"]
    assert [m.impl for m in dispatch.modules() if isinstance(m, Experts)] == ["dispatch"]
    tokens, hidden = sequence(dense, fused=True)
    references = [reference(model, tokens, hidden) for model in (dense, dispatch)]  # [B, N, V], [B, N, H]
    close(references[1][0], references[0][0])
    close(references[1][1], references[0][1])

    greedy = []
    for model, (ref_logits, _) in zip((dense, dispatch), references):
        logits, _ = prefill_prefix(model, tokens, hidden)
        close(logits, take(ref_logits, (PREFIX - 1)[:, None])[:, 0])
        pos, drafted = PREFIX.clone(), [logits.argmax(-1)]
        with torch.no_grad():
            for _ in range(N - int(PREFIX.max())):  # each request's own greedy continuation
                logits, _ = model.draft_step(drafted[-1], pos, take(hidden, pos[:, None])[:, 0])
                drafted.append(logits.argmax(-1))
                pos += 1
        greedy.append(torch.stack(drafted, 1))  # [B, steps]
    assert torch.equal(greedy[1], greedy[0]), (greedy[0], greedy[1])
    assert greedy[0].unique().numel() > 1  # a continuation, not one token repeated


def test_target_decode_matches_prefill_and_stale_slots_are_hidden():
    """The target's forward with per-request positions; garbage in slots past a position is masked."""
    model = make_model("tiny-llama")
    tokens, _ = sequence(model, fused=False)
    with torch.no_grad():
        full = model(tokens, torch.arange(N).expand(B, -1))
        model.setup_caches(B, S)
        for attn in (layer.self_attn for layer in model.model.layers):  # stale slots: garbage
            attn.k_cache.normal_()
            attn.v_cache.normal_()
        pos = torch.zeros(B, dtype=torch.long)
        for _ in range(6):  # chunks of 3: positions p..p+2, a different p per request
            chunk = pos[:, None] + torch.arange(3)
            out = model(take(tokens, chunk), chunk)
            close(out, take(full, chunk))
            pos += torch.tensor([3, 2, 1])


def test_a_zoo_dflash_draft_holds_its_target_s_embedding_and_lm_head():
    target = zoo.build("tiny-llama")
    draft = zoo.build("tiny-llama-dflash", seed=4, target=target)
    assert draft.embed_tokens is target.get_input_embeddings() and draft.lm_head is target.lm_head
    assert torch.equal(zoo.build("tiny-llama-dflash", seed=4, target=target).fc.weight, draft.fc.weight)
    for name, target_ in (("tiny-llama-dflash", None), ("tiny-llama-eagle3", target)):
        with pytest.raises(ValueError, match="target= is a DFlash draft's"):
            zoo.build(name, target=target_)
