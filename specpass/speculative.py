"""Batched greedy speculative decoding: chain drafting (topk = 1), K draft tokens per round.

    dec = Decoder(target, drafter, k=4, max_batch=len(prompts), max_len=256)
    out = dec.generate(prompts, max_new_tokens=64, eos_id=2)   # out.tokens, out.metrics
    plain = Decoder(target, None, max_batch=..., max_len=...)  # the target's own greedy decoding

One round, for a request whose last emitted token x_n sits at position n (the target has not
seen it yet; the drafter has, and holds its guess d_1 for position n+1):

    draft     d_2..d_K: K-1 draft steps at positions n+1..n+K-1                        [B, K]
    verify    the target on [x_n, d_1..d_K] at positions n..n+K -> greedy y_0..y_K     [B, K+1]
    accept    a = the longest prefix with d_{i+1} == y_i; emit d_1..d_a (= y_0..y_{a-1}) and y_a
    catch-up  the drafter on y_0..y_K at positions n+1..n+K+1 (with the target's hidden
              states at n..n+K), live row a -> d_1 of the next round

Everything stays on the device with static shapes: KV caches are addressed by position (rejected
slots are masked, then overwritten; nothing is copied), finished requests keep running in the
batch and emit nothing, and the only host sync per round reads two numbers (all done?, tokens
so far). See docs/loop.md.

specpass does not import the model zoo: a target and a drafter are anything with the methods of
`Target` and `Drafter` below (the zoo's adapters are in models/drafters.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

import specpass


class Target(Protocol):
    """The verified model: a module with static KV caches addressed by per-request position."""

    def parameters(self) -> Any: ...

    def setup_caches(self, max_batch: int, max_len: int) -> None: ...

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions [B, T] -> logits [B, T, V]."""

    def forward_with_hidden(self, tokens: Tensor, positions: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """-> (logits [B, T, V], the hidden states a drafter reads, [B, T, Hh]) for `Drafter.hidden_kind`."""


class Drafter(Protocol):
    """A draft model. Row t of a catch-up holds the token at position p+t and, when the drafter
    reads the target's states (`hidden_kind` is not None), the target's hidden state at p+t-1."""

    hidden_kind: str | None  # the `kind` passed to Target.forward_with_hidden; None: no hidden

    def setup_caches(self, max_batch: int, max_len: int) -> None: ...

    def catch_up(self, tokens: Tensor, positions: Tensor, hidden: Tensor | None,
                 live: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T] tokens and positions, [B, T, Hh] hidden, [B] live row -> (logits [B, Vd], hidden [B, Hd])
        of row live[b]; every row's K/V is written."""

    def draft_step(self, tokens: Tensor, positions: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """[B] token, [B] position, [B, Hd] the previous step's hidden -> (logits [B, Vd], hidden [B, Hd])."""

    def to_target(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (identity when the vocabularies are the same)."""


class State(NamedTuple):
    """Per-request decoding state; every field lives on the device, shapes never change."""

    last: Tensor  # [B] the last emitted token x_n, not yet seen by the target
    pos: Tensor  # [B] its position n (frozen once the request is done)
    out: Tensor  # [B, max_len] emitted tokens; columns past `count` are scratch
    count: Tensor  # [B] tokens emitted
    limit: Tensor  # [B] max_new_tokens (0 for padding rows of the batch)
    eos: Tensor  # [B] the request's EOS id, -1 for none
    done: Tensor  # [B] bool
    stats: Tensor  # [K+1] int64: active request-rounds, then how many accepted draft i = 1..K


@dataclasses.dataclass
class Metrics:
    new_tokens: int
    rounds: int  # decoding rounds (steps, for plain decoding)
    seconds: float  # prefill + rounds, wall clock
    prefill_seconds: float
    accept_length: float  # tokens per round per active request: accepted drafts + the bonus token
    acceptance: list[float]  # per draft position 1..K: the fraction of active request-rounds accepting it
    phase_ms: dict[str, float]  # mean ms per round: "round"; with timing=True (unfused) also draft, verify, catch_up

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in self.phase_ms.items())
        acceptance = " ".join(f"{p:.2f}" for p in self.acceptance) or "-"
        return (f"{self.new_tokens} tokens in {self.rounds} rounds, {self.seconds:.2f} s "
                f"({self.tokens_per_s:.1f} tokens/s); mean accepted length {self.accept_length:.2f}; "
                f"acceptance per draft position {acceptance}; ms per round: {phases}")


@dataclasses.dataclass
class Output:
    tokens: list[list[int]]  # per prompt, the generated tokens (EOS included when hit)
    metrics: Metrics


COMPILERS = ("specpass", "inductor", "eager")


class Decoder:
    """Greedy decoding of `target`, speculative when `drafter` is given.

    compile: "specpass" (default), "inductor", "eager" (no torch.compile), or a backend callable
      (e.g. `specpass.backend(handoff="eager")`). Every step is compiled with static shapes.
    mode: torch.compile's mode; "reduce-overhead" gives CUDA graphs (one per compiled step).
    fused_round: compile draft -> verify -> accept -> catch-up as one graph (one CUDA graph per round).
    max_batch, max_len: the static cache shapes; `generate` pads the batch with idle rows.
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, *, k: int = 4, max_batch: int,
                 max_len: int, compile: str | Callable = "specpass", mode: str | None = None,
                 fused_round: bool = False):
        if drafter is not None and k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if isinstance(compile, str) and compile not in COMPILERS:
            raise ValueError(f"compile must be one of {list(COMPILERS)} or a backend, got {compile!r}")
        self.target, self.drafter = target, drafter
        self.k = k if drafter is not None else 0
        self.max_batch, self.max_len = max_batch, max_len
        self.device = next(target.parameters()).device
        self.cudagraphs = mode == "reduce-overhead" and compile != "eager"
        target.setup_caches(max_batch, max_len)
        if drafter is not None:
            drafter.setup_caches(max_batch, max_len)

        wrap = _compiler(compile, mode)
        if fused_round:
            self._parts = None
            self._round = wrap(self.round_step)
        else:
            # One compiled draft step, called K-1 times, as gpt-fast compiles its decode step.
            self._parts = (functools.partial(self.draft_steps, step=wrap(self.draft_step)),
                           wrap(self.verify_step), wrap(self.catch_up_step))
            self._round = self.round_step

    # --- the steps, as traced by torch.compile (static shapes, no host syncs)

    def draft_step(self, token: Tensor, pos: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step: token [B] at position pos [B], hidden [B, Hd] -> (next token [B], hidden [B, Hd])."""
        logits, h = self.drafter.draft_step(token, pos, h)
        return self._greedy(logits), h

    def draft_steps(self, d1: Tensor, pos: Tensor, h: Tensor, step: Callable | None = None) -> Tensor:
        """d_1 [B], n [B], the catch-up's hidden [B, Hd] -> d_1..d_K [B, K] (target ids), by K-1 `step`s."""
        step = step or self.draft_step
        drafts = [d1]
        for i in range(1, self.k):
            token, h = step(drafts[-1], pos + i, h)
            drafts.append(token)
        return torch.stack(drafts, 1)

    def verify_step(self, state: State, d: Tensor) -> tuple[State, Tensor, Tensor, Tensor | None, Tensor]:
        """Target on [x_n, d] [B, K+1], accept, emit -> (next state, y [B, K+1], a [B], hidden, status [2])."""
        K = d.shape[1]
        t = torch.arange(K + 1, device=d.device)
        tokens = torch.cat([state.last[:, None], d], 1)  # [B, K+1]
        positions = state.pos[:, None] + t  # [B, K+1]
        kind = self.drafter.hidden_kind if self.drafter is not None else None
        if kind is None:
            logits, hidden = self.target(tokens, positions), None
        else:
            logits, hidden = self.target.forward_with_hidden(tokens, positions, kind)  # hidden [B, K+1, Hh]
        y = logits.argmax(-1)  # [B, K+1] the target's greedy token after each row
        a = (d == y[:, :K]).cumprod(1).sum(1)  # [B] drafts accepted: d_{i+1} == y_i for i < a

        # This round emits y_0..y_a (d_1..d_a, then the bonus y_a), cut after an EOS and at the budget.
        emitting = (t <= a[:, None]) & ~state.done[:, None]  # [B, K+1]
        is_eos = (y == state.eos[:, None]) & emitting
        emitting &= (is_eos.cumsum(1) - is_eos.long()) == 0  # nothing after the first EOS
        emitting &= state.count[:, None] + t < state.limit[:, None]
        m = emitting.sum(1)  # [B] tokens emitted this round (a prefix of y)
        # Columns past count + m are scratch: the next round (or nothing) overwrites them.
        out = state.out.scatter(1, state.count[:, None] + t, y)
        count = state.count + m
        done = state.done | (count >= state.limit) | (is_eos & emitting).any(1)

        active = ~state.done
        accepted = (a[:, None] > t[:K]) & active[:, None]  # [B, K] draft i+1 accepted
        stats = state.stats + torch.cat([active.sum()[None], accepted.sum(0)])
        pos = torch.where(active, state.pos + a + 1, state.pos)  # y_a, at n+a+1, is the new x_n
        last = torch.where(active, y.gather(1, a[:, None])[:, 0], state.last)
        status = torch.stack([done.all().long(), count.sum()])  # what the host reads each round
        # State(...) spelled out: torch 2.11's Dynamo rebuilds NamedTuple._replace as an empty tuple.
        state = State(last=last, pos=pos, out=out, count=count, limit=state.limit, eos=state.eos, done=done,
                      stats=stats)
        return state, y, a, hidden, status

    def catch_up_step(self, y: Tensor, pos: Tensor, hidden: Tensor | None, a: Tensor) -> tuple[Tensor, Tensor]:
        """The drafter on y_0..y_K at positions n+1..n+K+1, live row a -> (next d_1 [B], hidden [B, Hd]).

        All K+1 rows write their K/V; only row a is sampled: the graph specpass's live-row pass rewrites.
        """
        positions = pos[:, None] + 1 + torch.arange(y.shape[1], device=y.device)  # [B, K+1]
        logits, h = self.drafter.catch_up(y, positions, hidden, a)
        return self._greedy(logits), h

    def round_step(self, state: State, d1: Tensor | None, h: Tensor | None,
                   tick: Callable[[str], None] | None = None) -> tuple[State, Tensor | None, Tensor | None, Tensor]:
        """One round: draft -> verify + accept -> catch-up. -> (state, d1, h, status)."""
        draft, verify, catch_up = self._parts or (self.draft_steps, self.verify_step, self.catch_up_step)
        tick = tick or _no_tick
        pos = state.pos
        # Plain decoding verifies no drafts: an empty [B, 0] block.
        d = draft(d1, pos, h) if self.drafter is not None else pos[:, None][:, :0]
        tick("draft")
        state, y, a, hidden, status = verify(state, d)
        tick("verify")
        if self.drafter is not None:
            d1, h = catch_up(y, pos, hidden, a)
        tick("catch_up")
        return state, d1, h, status

    def _greedy(self, logits: Tensor) -> Tensor:
        # topk = 1 written the way engines write it; specpass's arg-max pass drops the softmax.
        # Only the index is used.
        return self.drafter.to_target(torch.softmax(logits.float(), -1).max(-1).indices)

    # --- the loop

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 eos_id: int | Sequence[int] | None = None, timing: bool = False,
                 progress: bool = False) -> Output:
        """Greedy-decode each prompt; per-request `max_new_tokens` and `eos_id` (an int or one per prompt).

        timing=True synchronises around each compiled step to split the round time (extra syncs).
        """
        B = len(prompts)
        limits = _per_request(max_new_tokens, B, "max_new_tokens")
        eos = _per_request(-1 if eos_id is None else eos_id, B, "eos_id")
        self._check(prompts, limits)
        clock = _clock(self.device)
        start = clock()
        state, d1, h = self._prefill(prompts, limits, eos)
        prefill_end = clock()

        phase_s: dict[str, float] = {}
        # A fused round is one call, plain decoding one step: nothing to split.
        timed = timing and self._parts is not None and self.drafter is not None
        rounds = 0
        with _progress_bar(progress, sum(limits)) as bar:
            while True:
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                state, d1, h, status = self._round(state, d1, h, _ticker(clock, phase_s) if timed else None)
                if self.cudagraphs:  # the next replay overwrites this one's outputs
                    state, d1, h = _clone(state, d1, h)
                rounds += 1
                finished, emitted = status.tolist()  # the round's one host sync
                if bar is not None:
                    bar.update(emitted - bar.n)
                if finished:
                    break
        end = clock()

        out, count, stats = state.out.tolist(), state.count.tolist(), state.stats.tolist()
        active = max(stats[0], 1)
        metrics = Metrics(
            new_tokens=sum(count), rounds=rounds, seconds=end - start, prefill_seconds=prefill_end - start,
            accept_length=1 + sum(stats[1:]) / active, acceptance=[s / active for s in stats[1:]],
            phase_ms={"round": 1e3 * (end - prefill_end) / rounds, **{k: 1e3 * v / rounds for k, v in phase_s.items()}})
        return Output([row[:n] for row, n in zip(out[:B], count[:B])], metrics)

    def _check(self, prompts: Sequence[Sequence[int]], limits: list[int]) -> None:
        if not 0 < len(prompts) <= self.max_batch:
            raise ValueError(f"{len(prompts)} prompts; this decoder holds 1 to {self.max_batch} (max_batch)")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        need = max(len(p) for p in prompts) + max(limits) + 2 * self.k + 1
        if need > self.max_len:
            # A finished request keeps running frozen; a round writes up to K+1 slots past it.
            raise ValueError(f"max_len {self.max_len} is too small: the longest prompt + max_new_tokens "
                             f"+ 2k + 1 = {need} cache slots are needed")

    def _prefill(self, prompts: Sequence[Sequence[int]], limits: list[int],
                 eos: list[int]) -> tuple[State, Tensor | None, Tensor | None]:
        """Right-padded prompts through the target (and the drafter); emits each request's first token.

        Runs once per generate, uncompiled (its shapes depend on the prompts).
        """
        B, P, dev = self.max_batch, max(len(p) for p in prompts), self.device
        idle = B - len(prompts)  # padding rows: a one-token prompt, no budget, done from the start
        lengths = torch.tensor([len(p) for p in prompts] + [1] * idle, device=dev)
        tokens = torch.zeros(B, P + 1, dtype=torch.long, device=dev)  # [B, P+1]: prompt, then x_n
        tokens[: len(prompts), :P] = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], device=dev)
        positions = torch.arange(P + 1, device=dev).expand(B, -1)
        kind = self.drafter.hidden_kind if self.drafter is not None else None
        if kind is None:
            logits, hidden = self.target(tokens[:, :P], positions[:, :P]), None
        else:
            logits, hidden = self.target.forward_with_hidden(tokens[:, :P], positions[:, :P], kind)
        first = logits[torch.arange(B, device=dev), lengths - 1].argmax(-1)  # x_n, at position n = length
        tokens.scatter_(1, lengths[:, None], first[:, None])

        d1 = h = None
        if self.drafter is not None:
            # A drafter that reads target states starts at position 1: row t pairs the token at t+1
            # with the target's state at t. A standalone one reads the prompt from position 0.
            o = 0 if kind is None else 1
            logits, h = self.drafter.catch_up(tokens[:, o:], positions[:, o:], hidden, lengths - o)
            d1 = self._greedy(logits)

        limit = torch.tensor(limits + [0] * idle, device=dev)
        eos_t = torch.tensor(eos + [-1] * idle, device=dev)
        out = torch.zeros(B, self.max_len, dtype=torch.long, device=dev)  # wider than any budget + K + 1
        out[:, 0] = first
        count = (limit > 0).long()
        state = State(last=first, pos=lengths, out=out, count=count, limit=limit, eos=eos_t,
                      done=(count >= limit) | (first == eos_t),
                      stats=torch.zeros(self.k + 1, dtype=torch.long, device=dev))
        return state, d1, h


def _compiler(compile: str | Callable, mode: str | None) -> Callable[[Callable], Callable]:
    if compile == "eager":
        return lambda fn: fn
    backend = specpass if compile == "specpass" else compile  # the module is a backend; "inductor"; a callable
    return lambda fn: torch.compile(fn, backend=backend, mode=mode, fullgraph=True, dynamic=False)


def _per_request(value: int | Sequence[int], n: int, name: str) -> list[int]:
    values = [int(value)] * n if isinstance(value, int) else [int(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} prompts")
    return values


def _clone(state: State, *tensors: Tensor | None) -> tuple:
    """Copies of a CUDA-graph replay's outputs, which the next replay overwrites."""
    return (State(*(t.clone() for t in state)), *(None if t is None else t.clone() for t in tensors))


def _no_tick(name: str) -> None:
    pass


def _clock(device: torch.device) -> Callable[[], float]:
    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def _ticker(clock: Callable[[], float], totals: dict[str, float]) -> Callable[[str], None]:
    """tick(name) adds the time since the previous tick (or the ticker's creation) to totals[name]."""
    last = [clock()]

    def tick(name: str) -> None:
        now = clock()
        totals[name] = totals.get(name, 0.0) + now - last[0]
        last[0] = now

    return tick


class _progress_bar:
    """A tqdm bar over emitted tokens, shown only on runs longer than a second (None when off)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            self.bar = None
        else:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="tok", delay=1.0, leave=False)
        return self.bar

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
