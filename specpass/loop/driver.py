"""`Decoder`: batched speculative decoding, greedy or sampled, K draft tokens per round.

    dec = Decoder(target, drafter, k=4, max_batch=len(prompts), max_len=256)
    out = dec.generate(prompts, max_new_tokens=64, eos_id=2)   # out.tokens, out.metrics
    out = dec.generate(prompts, 64, temperature=0.6, top_p=0.95, seed=0)   # speculative sampling
    plain = Decoder(target, None, max_batch=..., max_len=...)  # the target's own decoding
    dec.tune_k(prompts, (2, 6), acceptance=out.metrics.acceptance)  # K for this batch size, timed; then used

The driver binds the models to the round shape the drafter gets (shapes.py), compiles the steps
(steps.py) — one graph each, or the whole round as one graph, from the same functions — and the
prefill (one graph for every prompt length), prefills, and loops. KV caches are addressed by
position (rejected slots are masked, then overwritten; nothing is copied), finished requests keep
running in the batch and emit nothing, and the only host sync per round reads one flag, all done?
(on a GPU the previous round's, so the device never waits for the host; none once the rounds run
are as many as the largest budget needs). See docs/loop.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from specpass.loop import background, compiling, tuning
from specpass.loop.checks import (check_background, check_cache_size, check_exact, check_models, check_options,
                                  check_position, check_processors, check_prompts, check_ranks_option, check_sampling,
                                  check_timing, device_of, is_int, probe)
from specpass.loop.distributed import Ranks, RoundCheck, checksum, fingerprint
from specpass.loop.processors import Processing, after_emitting
from specpass.loop.protocols import Drafter, Target
from specpass.loop.compiling import SymbolicBatch, compiler, exact_backend
from specpass.loop.host import DoneFlags, PhaseTimer, clock, right_padded
from specpass.loop.round_buffers import InPlaceRound, replayed
from specpass.loop.shapes import PLAIN, RoundSpec, round_spec
from specpass.loop.steps import Carry, State, Steps, carried, decode_round, decode_round_in_place, prefill_step
from specpass.loop.tree import TreeShape, depth
from specpass.repeated_blocks import mark_repeated_blocks
from specpass.sampling import Params, eos_ids, per_request


@dataclasses.dataclass
class Metrics:
    new_tokens: int
    rounds: int  # decoding rounds (steps, for plain decoding)
    seconds: float  # prefill + rounds, wall clock
    prefill_seconds: float
    accept_length: float  # tokens per round per active request: accepted drafts + the bonus token
    acceptance: list[float]  # per draft position 1..K: the fraction of active request-rounds accepting it
    phase_ms: dict[str, float]  # mean ms per round: "round"; on a GPU "host", the host's time a round not spent
    # waiting for the device; with timing=True (steps apart) also each step
    request_rounds: int = 0  # rounds summed over the requests active in them: what the two above average over

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in self.phase_ms.items())
        acceptance = " ".join(f"{p:.2f}" for p in self.acceptance) or "-"
        return (f"{self.new_tokens} tokens in {self.rounds} rounds, {self.seconds:.2f} s "
                f"({self.tokens_per_s:.1f} tokens/s); mean accepted length {self.accept_length:.2f}; "
                f"acceptance per draft position {acceptance}; ms per round: {phases}")


@dataclasses.dataclass
class Output:
    tokens: list[list[int]]  # per prompt, the generated tokens (EOS included when hit)
    metrics: Metrics


class Run(NamedTuple):
    """A decoding in progress (`Decoder.start`, `Decoder.rounds`), on the device: request b's
    tokens so far are state.out[b, :state.count[b]]. After a fused round its state and carry are
    the round's own buffers (`round_buffers.InPlaceRound`): the next run at that K and batch size
    overwrites them; clone what must outlive it."""

    state: State
    carry: Carry  # what the last catch-up handed the next round
    params: Params | None  # sampling parameters; None: greedy
    k: int | TreeShape  # the K (or tree shape) it runs at


@dataclasses.dataclass(frozen=True)
class Bound:
    """One K's steps, bound and compiled (lazily, on their first call), kept for `use_k`."""

    spec: RoundSpec  # the round shape K runs, K bound
    steps: Steps  # the round shape's functions with the models and K bound (what specpass.explain reads)
    apart: Steps | None  # their compiled forms, one graph each; None when the round is fused
    round: Callable[[State, Carry, Params | None], tuple[State, Carry, Tensor]]  # one round, as the loop calls it
    prefill: Callable[[Tensor, Tensor, Params | None, Processing | None], tuple[Tensor, Carry]]  # `prefill_step`


class Decoder:
    """Decoding of `target`, greedy or sampled, speculative when `drafter` is given (a `Drafter`,
    or a `ParallelDrafter`: its round shape is decided once, from the Protocol it satisfies).

    k: drafts per round (0: plain decoding), a `TreeShape(topk, steps, tokens)` (tree rounds), or
      the `RoundSpec` that `round_spec(drafter, k)` made (K checked once, taken as it is).
    compile: "specpass" (default), "inductor", "eager" (no torch.compile), or a backend callable
      (e.g. `specpass.backend(handoff="eager")`). Every step is compiled once with the batch
      symbolic (`compiling.SymbolicBatch`) and the other sizes static; the prefill
      (`steps.prefill_step`) with the prompt length symbolic too, in the default mode.
    mode: torch.compile's mode; "reduce-overhead" gives CUDA graphs (one per compiled graph).
    fused_round: compile the whole round as one graph (one CUDA graph replay per round) instead
      of one graph per step (draft, verify, accept, catch-up).
    greedy_drafts: when sampling, draft the arg-max (q one-hot, vLLM's default) instead of drawing
      drafts from the draft's distribution; the output distribution is the same either way.
    max_batch, max_len: the caches' capacity in requests and their length in slots. A call runs
      its own batch size, in cache rows 0..B-1, through the same compiled steps (B 1 runs as 2 rows,
      one idle, unless max_batch is 1); more prompts than max_batch grow the caches (to at least
      twice as many rows), which compiles the steps again.
    compile_prefill: False runs the prefill uncompiled (a benchmark of the rounds alone skips its
      compile, about a minute at 8B shape).
    skip_guards: rounds 3 on of a call run without Dynamo's guard evaluation (`compiling.skip_guards`);
      False keeps every guard (what that saves, measured). An attribute too: `dec.skip_guards = False`.
    group: the torch.distributed process group the models are sharded over (tensor parallel), or None
      (one process). Every rank builds this Decoder and calls it with the same arguments; every rank
      returns the same tokens. The ranks' probe logits, generate's arguments and its output are
      checked equal across ranks (`specpass.loop.distributed`). A group of one runs as one process.
    check_ranks: with a group, also compare the ranks' state after every round (a debug mode: one
      small all-reduce per round, no host sync; a divergence names the first round that differed).
    regional: compile each repeated block of the models (their decoder layers) once, not once per
      layer and step (`specpass.mark_repeated_blocks`: it marks the models' layers, which run as
      before in eager mode). False compiles every layer inline.
    exact: every step adds its sums in an order fixed by a row's own sizes, never by the rows run
      with it (specpass's exact pass: passes/exact.py), so plain and speculative decoding give the
      target's logits bit for bit alike, at every batch size: the same greedy tokens, and sampling
      from the same distributions. Needs compile="specpass" (or a specpass backend) and one process.
    background_compile: the steps compile on a worker thread (loop/background.py) while the call
      decodes with them uncompiled, and each step switches to its compiled form between rounds once
      it lands: tokens from the first moment, by the same functions on the same state (the same
      greedy tokens and distributions; in bf16 the uncompiled kernels round otherwise, as every
      two kernels may). specpass's backend or Inductor; not with exact mode or a group.
      `dec.wait_compiled()` waits for them.

    `generate` decodes; `start`, `rounds`, `clock`, `round_ms`, `use_k`, `tune_k`, `reserve` and
    `steps` are its parts, public for benchmarks (docs/loop.md, driving the rounds).
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, *, k: int | TreeShape | RoundSpec = 4,
                 max_batch: int,
                 max_len: int, compile: str | Callable = "specpass", mode: str | None = None,
                 fused_round: bool = False, greedy_drafts: bool = False, compile_prefill: bool = True,
                 skip_guards: bool = True, group: Any = None, check_ranks: bool = False, regional: bool = True,
                 exact: bool = False, background_compile: bool = False):
        check_models(target, drafter)
        spec = self._spec_of(drafter, k if drafter is not None else 0)  # before any cache is allocated
        check_options(max_batch, max_len, compile, compile_prefill, skip_guards, regional)
        check_ranks_option(group, check_ranks)
        check_exact(exact, compile, compile_prefill, group, device_of(target))
        check_background(background_compile, exact, group)
        compile = exact_backend(compile) if exact else compile
        self.target, self.drafter = target, drafter
        self.max_batch, self.max_len = max_batch, max_len
        self.device = device_of(target)
        self.ranks = Ranks.of(group, self.device)  # None: one process
        self.check_ranks = check_ranks
        self.cudagraphs = mode == "reduce-overhead" and compile != "eager"
        self.fused_round = fused_round
        self.greedy_drafts = greedy_drafts
        self.skip_guards = skip_guards
        self._setup_caches(max_batch)
        if regional and compile != "eager":
            for model in (target, drafter):
                if isinstance(model, torch.nn.Module):
                    mark_repeated_blocks(model)
        self._hidden_kind = drafter.hidden_kind if drafter is not None else None
        self._batch = SymbolicBatch()
        saved = self.ranks is None  # sharded steps compile in each process
        self.background_compile = background_compile
        self.compiles = compile != "eager"  # a host callback inside a step (logits_processor) needs it False
        self._wrap = compiler(compile, mode, self._batch, saved, background_compile)
        # In the background the rounds compile first: an uncompiled prefill costs about what a compiled one does.
        self._wrap_prefill = compiler(compile if compile_prefill else "eager", None, self._batch, saved,
                                      background_compile, priority=1)
        self._bound: dict[int | TreeShape, Bound] = {}  # K -> its steps and compiled forms (`use_k` switches K)
        self._use(spec)

    def _setup_caches(self, max_batch: int) -> None:
        """The models' caches for max_batch requests, then the probe (`checks.probe`), which also
        allocates a cache that is made on its first write (transformers')."""
        self.target.setup_caches(max_batch, self.max_len)
        if self.drafter is not None:
            self.drafter.setup_caches(max_batch, self.max_len)
        self.vocab_size = probe(self.target, self.drafter, max_batch, self.device, self.ranks)
        self.max_batch = max_batch

    def reserve(self, requests: int) -> None:
        """Caches for at least `requests` requests (grown, never shrunk). Their capacity is static in
        the compiled steps (a symbolic one slowed the rounds: docs/results.md, cold start), so growing
        them compiles the steps again at the next call: reserve the largest batch before the first."""
        check_cache_size("requests", requests)
        if requests > self.max_batch:
            self._setup_caches(requests)

    def _rows(self, requests: int) -> int:
        """The batch a call of `requests` runs: its own size, but 1 in two rows (one idle) where the
        caches hold two, so that every size shares the graph compiled with the batch symbolic
        (Dynamo specializes a size of 1)."""
        return max(requests, min(2, self.max_batch))

    @property
    def k(self) -> int | TreeShape:
        """Draft tokens per round (0: plain decoding), or the tree shape of tree rounds."""
        return self._spec.k

    @property
    def steps(self) -> Steps:
        """The current K's steps with the models bound, uncompiled: what `specpass.explain` reads."""
        return self._bound[self.k].steps

    def use_k(self, k: int | TreeShape | RoundSpec) -> None:
        """Decode with K drafts per round from now on (0: the drafter off; a `TreeShape`: tree
        rounds; a `RoundSpec` that `round_spec` made for this drafter): the steps with K bound,
        compiled (lazily) once per K and kept, so switching back compiles nothing."""
        self._use(self._spec_of(self.drafter, k))

    @staticmethod
    def _spec_of(drafter: Drafter | None, k: int | TreeShape | RoundSpec) -> RoundSpec:
        return k if isinstance(k, RoundSpec) else round_spec(drafter, k)

    def _use(self, spec: RoundSpec) -> None:
        if spec.k not in self._bound:
            self._bound[spec.k] = self._bind(spec)
        self._spec = spec

    def _bind(self, spec: RoundSpec) -> Bound:
        sampled = not self.greedy_drafts
        steps = spec.bind(self.target, self.drafter, sampled, self.max_len)
        if self.fused_round:
            apart = None
            run_round = InPlaceRound(self._wrap(functools.partial(decode_round_in_place, steps), "decode_round"),
                                     self.cudagraphs)
        else:  # `carried` moves nothing: no graph
            apart = Steps(*(s if s is None or s is carried else self._wrap(s, name)
                            for name, s in zip(Steps._fields, steps)))
            run_round = functools.partial(decode_round, apart)
            run_round = replayed(run_round) if self.cudagraphs else run_round
        # Prompt lengths vary: one graph with a symbolic length, no CUDA graphs (one would be
        # recorded per length, for one call of large kernels per generate).
        # A shape whose prefill does not read K (the chain's) compiles it once for every K.
        shared = not spec.prefill_reads_k and next((b for b in self._bound.values() if b.spec.shape is spec.shape),
                                                   None)
        hidden_kind = None if spec.shape is PLAIN else self._hidden_kind
        prefill = shared.prefill if shared else self._wrap_prefill(functools.partial(
            prefill_step, self.target, hidden_kind, spec.prefill_catch_up(self.drafter, sampled)), "prefill")
        return Bound(spec, steps, apart, run_round, prefill)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 eos_id: int | Sequence[int | Sequence[int]] | None = None, timing: bool = False, *,
                 temperature: float | Sequence[float] = 0.0, top_k: int | Sequence[int] | None = None,
                 top_p: float | Sequence[float] | None = None, seed: int | Sequence[int] | None = None,
                 min_new_tokens: int | Sequence[int] = 0, repetition_penalty: float | Sequence[float] = 1.0,
                 penalty_context: Sequence[Sequence[int]] | None = None, no_repeat_ngram_size: int = 0,
                 prefix_context: Sequence[Sequence[int]] | None = None,
                 logits_processor: Callable[[Tensor, Tensor], Tensor] | None = None,
                 on_round: Callable[[State], None] | None = None) -> Output:
        """Decode each prompt; per-request `max_new_tokens`, `eos_id` and sampling parameters (a
        value for all or one per prompt). A request's `eos_id` may be several ids, any of which stops
        it (`eos_id=[[2, 7]] * len(prompts)`).

        temperature: 0 (default) is greedy decoding; > 0 samples from softmax(logits / temperature),
          cut to the `top_k` largest logits (0: off) and then to the smallest set of mass `top_p`
          (1: off), as plain sampling from the target would (specpass/sampling.py). Speculative
          sampling keeps that distribution exactly. seed: one int (each request gets its own
          stream of it) or one per request; the same seeds give the same tokens. None: a fresh one.
        min_new_tokens, repetition_penalty, no_repeat_ngram_size: transformers' logits processors of
          those names, applied to the target's logits at every position with the prefix plain
          decoding would have there (processors.py): the same greedy tokens as plain decoding with
          them, and the processed distribution when sampling. penalty_context, prefix_context: per
          request, the ids the penalty (and the n-gram ban and logits_processor) read before the
          emitted ones (default: the prompt; transformers reads its input_ids, a left-padded
          batch's padding included).
        logits_processor(input_ids [1, L], scores [1, V]) -> scores: any other processor, e.g.
          transformers' `LogitsProcessorList`, called on the host for every verified position of
          every request (one request at a time, as fp32 scores after the processors above), with the
          prefix plain decoding has there: a function of its arguments, as transformers' own are
          (speculation calls it at positions it then rejects). Needs compile="eager".
        timing=True also splits the round time into its steps (steps compiled apart): CUDA events
        (the host clock on CPU) after each step, read once at the end, so no sync is added.
        on_round(state): called after the prefill and after each round with its `State` (`out`,
          `count`: what each request has emitted so far), before the next round starts; what it reads
          to the host costs a sync a round (streaming does).
        """
        B = len(prompts)
        prompts, limits, eos, params, processing = self._request(
            prompts, max_new_tokens, eos_id, temperature, top_k, top_p, seed,
            (min_new_tokens, repetition_penalty, penalty_context, no_repeat_ngram_size, prefix_context,
             logits_processor))
        with contextlib.ExitStack() as held:  # round 1's compile queued before the prefill's (`background`)
            if self.background_compile:
                held.enter_context(background.worker.holding())
            start = self.clock()
            run = self._prefill(prompts, limits, eos, params, processing)
            prefill_end = self.clock()
            if on_round is not None:
                on_round(run.state)

            timer = PhaseTimer(self.device) if timing and not self.fused_round else None
            run_round = self._bound[self.k].round if timer is None else self._timed_round(timer)
            rounds, flags, state = 0, DoneFlags(self.device), run.state
            most = max(limits) - 1  # a round emits a token or more for every request still running
            check = self._round_check()
            with contextlib.closing(self._replay(run_round, run, check)) as replay:
                for state, _, finished in replay:
                    held.close()
                    rounds += 1
                    if on_round is not None:
                        on_round(state)
                    if rounds >= most:  # every budget spent: no flag to wait for, no round past the last
                        break
                    if flags.push(finished):  # the round's one host sync
                        rounds -= flags.lag  # a round run after all were done emitted nothing
                        break
        loop_end = time.perf_counter()
        end = self.clock()
        if check is not None:
            check.raise_if_differed()
        if self.ranks is not None:
            self.ranks.check_output(state.out, state.count, state.stats)

        out, count, stats = state.out.tolist(), state.count.tolist(), state.stats.tolist()
        active = max(stats[0], 1)
        phases = {k: 1e3 * v / rounds for k, v in (timer.totals() if timer else {}).items()}
        if flags.lag:  # the host's own time a round (launching it, reading the flag), not waiting for the GPU
            phases["host"] = 1e3 * (loop_end - prefill_end - flags.waited) / rounds
        metrics = Metrics(
            new_tokens=sum(count), rounds=rounds, seconds=end - start, prefill_seconds=prefill_end - start,
            accept_length=1 + sum(stats[1:]) / active, acceptance=[s / active for s in stats[1:]],
            phase_ms={"round": 1e3 * (end - prefill_end) / rounds, **phases}, request_rounds=stats[0])
        return Output([row[:n] for row, n in zip(out[:B], count[:B])], metrics)

    @torch.no_grad()
    def start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
              eos_id: int | Sequence[int | Sequence[int]] | None = None, *, temperature: float | Sequence[float] = 0.0,
              top_k: int | Sequence[int] | None = None, top_p: float | Sequence[float] | None = None,
              seed: int | Sequence[int] | None = None, min_new_tokens: int | Sequence[int] = 0,
              repetition_penalty: float | Sequence[float] = 1.0, penalty_context: Sequence[Sequence[int]] | None = None,
              no_repeat_ngram_size: int = 0, prefix_context: Sequence[Sequence[int]] | None = None,
              logits_processor: Callable[[Tensor, Tensor], Tensor] | None = None, position: int | None = None) -> Run:
        """The checks and the prefill of `generate` (the same arguments) -> the first round's `Run`;
        each request has emitted its first token.

        position: then move every request to that position, as if its prompt ended there (the cache
          slots below hold whatever the prefill left: a round's time does not depend on them, its
          shapes are static): what a benchmark of long contexts runs when the real prefill's logits
          would not fit. Every request must still fit max_len from there.
        """
        prompts, limits, eos, params, processing = self._request(
            prompts, max_new_tokens, eos_id, temperature, top_k, top_p, seed,
            (min_new_tokens, repetition_penalty, penalty_context, no_repeat_ngram_size, prefix_context,
             logits_processor))
        if position is not None:
            check_position(position, prompts, limits, self.max_len, self._spec)
        run = self._prefill(prompts, limits, eos, params, processing)
        if position is None:
            return run
        return run._replace(state=run.state._replace(pos=torch.full_like(run.state.pos, position)))

    @torch.no_grad()
    def rounds(self, run: Run, n: int) -> Run:
        """n rounds of `run` as `generate` runs them (CUDA graphs' bookkeeping; rounds 3 on of the
        call without guard evaluation), with no host sync: the device may still be running them on
        return (`clock` waits). Requests that finish stay in the batch and emit nothing."""
        if not is_int(n) or n < 0:
            raise ValueError(f"n (rounds to run) must be an int >= 0, got {n!r}")
        if run.k != self.k:
            raise ValueError(f"the run was started at K {run.k} and the decoder is at K {self.k}: "
                             f"call use_k({run.k!r}) first, or start a new run")
        state, carry = run.state, run.carry
        check = self._round_check()
        with contextlib.closing(self._replay(self._bound[self.k].round, run, check)) as replay:
            for _, (state, carry, _) in zip(range(n), replay):
                pass
        if check is not None:
            check.raise_if_differed()
        return Run(state, carry, run.params, run.k)

    def clock(self) -> float:
        """Seconds (time.perf_counter), after the device has finished what was queued."""
        return clock(self.device)

    def wait_compiled(self) -> None:
        """Until every step compiling in the background (`background_compile`) has landed; each
        switches to its compiled form at its next call."""
        background.worker.wait()

    def round_ms(self, prompts: Sequence[Sequence[int]], short: int, long: int,
                 repeats: int = 3, sampling: Mapping[str, Any] | None = None) -> tuple[float, Metrics]:
        """The current K's ms per round on `prompts` (a batch of their number, as `generate` runs
        it): the loop time of a `long`-token generate less a `short` one over the rounds
        between, median of `repeats` (one generate first compiles; on a GPU, records the CUDA
        graphs), so the prefill and compiling cancel -> (ms, the last long generate's Metrics:
        its acceptance per draft position). sampling: generate's temperature / top_k / top_p /
        seed (default greedy), as the traffic is served: a sampled round costs more, and accepts less."""
        check_timing(short, long, repeats)
        sampling = check_sampling(sampling)
        self.generate(prompts, short, **sampling)  # compiles; on a GPU, records the CUDA graphs
        if self.background_compile:  # that call ran uncompiled steps: once more compiled
            self.wait_compiled()
            self.generate(prompts, short, **sampling)
        samples = []
        for _ in range(repeats):
            a, b = (self.generate(prompts, n, **sampling).metrics for n in (short, long))
            samples.append((b.seconds - b.prefill_seconds - a.seconds + a.prefill_seconds) / (b.rounds - a.rounds))
        return 1e3 * statistics.median(samples), b

    tune_k = tuning.tune_k  # the round for this batch size, timed and priced: loop/tuning.py

    # --- the loop's parts

    def _request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 eos_id: int | Sequence[int | Sequence[int]] | None, temperature: Any, top_k: Any, top_p: Any,
                 seed: Any, processors: tuple[Any, ...],
                 ) -> tuple[list[list[int]], list[int], list[list[int]], Params | None, Processing | None]:
        """generate's arguments checked -> (prompts, budgets, EOS ids, sampling parameters or None,
        the logits processors or None)."""
        B = len(prompts)
        limits = per_request(max_new_tokens, B, "max_new_tokens", int, lambda v: v >= 1, ">= 1")
        eos = eos_ids(eos_id, B)
        if seed is None and self.ranks is not None:
            seed = self.ranks.shared_seed()  # not one fresh seed per rank
        prompts = check_prompts(prompts, limits, self.vocab_size, self.max_len, self._spec)
        min_new, penalty, penalty_context, ngram, prefix_context, custom = check_processors(
            *processors, prompts, self.vocab_size, self.max_len, self.compiles, self.ranks is not None)
        params = Params.make(B, self._rows(B), self.device, temperature, top_k, top_p, seed)  # None: greedy
        if self.ranks is not None:
            sampling = -1 if params is None else checksum(*(t for t in params if t is not None))
            self.ranks.check_request({"prompts": fingerprint(prompts), "max_new_tokens": fingerprint(limits),
                                      "eos_id": fingerprint(eos), "sampling parameters": sampling,
                                      "processors": fingerprint(processors),  # as given: contexts default None
                                      "K": fingerprint(self.k)})
        if B > self.max_batch:  # every rank grows alike: the prompts were checked equal
            self.reserve(max(B, 2 * self.max_batch))
        processing = Processing.make(self._rows(B), self.vocab_size, self.max_len, self.device, eos, min_new, penalty,
                                     penalty_context, ngram, prefix_context, custom)
        return prompts, limits, eos, params, processing

    def _prefill(self, prompts: list[list[int]], limits: list[int], eos: list[list[int]],
                 params: Params | None, processing: Processing | None) -> Run:
        """The prompts, right-padded (and a batch of one with an idle row, `_rows`), through the
        compiled prefill; emits each request's first token. -> the first round's run."""
        B, device = self._rows(len(prompts)), self.device
        # Two columns or more: one would specialize the compiled prefill to a single column (Dynamo's size-1 rule).
        P = max(2, *(len(p) for p in prompts))
        idle = B - len(prompts)  # padding rows: a one-token prompt, no budget, done from the start
        lengths = torch.tensor([len(p) for p in prompts] + [1] * idle, device=device)
        tokens = torch.zeros(B, P + 1, dtype=torch.long, device=device)  # [B, P+1]: prompt, then x_n
        tokens[: len(prompts), :P] = right_padded(prompts, P).to(device)
        with self._batch.marking(B, self.max_batch, more=[(tokens, 1)]):  # one graph for every prompt length
            first, carry = self._bound[self.k].prefill(tokens, lengths, params, processing)

        limit = torch.tensor(limits + [0] * idle, device=device)
        E = max(1, *map(len, eos))
        eos_t = torch.tensor([ids + [-1] * (E - len(ids)) for ids in eos] + [[-1] * E] * idle, device=device)
        out = torch.zeros(B, self.max_len, dtype=torch.long, device=device)  # wider than any budget + K + 1
        out[:, 0] = first
        count = (limit > 0).long()
        state = State(last=first, pos=lengths, out=out, count=count, limit=limit, eos=eos_t,
                      done=(count >= limit) | (first[:, None] == eos_t).any(1),
                      stats=torch.zeros(depth(self.k) + 1, dtype=torch.long, device=device),
                      processing=after_emitting(processing, first[:, None], count[:, None] > 0))
        return Run(state, carry, params, self.k)

    def _timed_round(self, timer: PhaseTimer) -> Callable[[State, Carry, Params | None], tuple[State, Carry, Tensor]]:
        """The round with its steps apart, a timer mark after each step and before the round."""
        steps = Steps(*(timer.timed(name, step) for name, step in zip(Steps._fields, self._bound[self.k].apart)))

        def run_round(state: State, carry: Carry, params: Params | None) -> tuple[State, Carry, Tensor]:
            timer.mark("between")
            return decode_round(steps, state, carry, params)

        return replayed(run_round) if self.cudagraphs else run_round

    def _round_check(self) -> RoundCheck | None:
        return RoundCheck(self.ranks) if self.check_ranks and self.ranks is not None else None

    def _replay(self, run_round: Callable, run: Run,
                check: RoundCheck | None = None) -> Iterator[tuple[State, Carry, Tensor]]:
        """Rounds from `run`, one per step of the iteration: (state, carry, all done). Rounds 3 on
        run without guard evaluation (`compiling.skip_guards`), which ends with the iteration. check:
        each round's state compared across ranks (`check_ranks`)."""
        state, carry, params, _ = run
        with contextlib.ExitStack() as unguarded:
            for number in itertools.count(1):
                # Rounds 1 and 2 may compile (every guard runs): their batch is marked symbolic.
                with self._batch.marking(len(state.last), self.max_batch) if number <= 2 else contextlib.nullcontext():
                    state, carry, finished = run_round(state, carry, params)
                if check is not None:  # every rank stops after the same round, even diverged: no hang
                    tensors = (state.last, state.pos, state.out, state.count, state.done, state.stats)
                    finished = check.observe(number, tensors, finished)
                yield state, carry, finished
                if number == 2 and self.skip_guards:
                    unguarded.enter_context(compiling.skip_guards())
