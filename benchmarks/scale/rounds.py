"""The models at Llama-3-8B shape, a decoder per variant, and its ms per round (see the package doc)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any

import torch
import torch.distributed as dist

import specpass
from benchmarks import harness
from benchmarks.lean import LeanDecoder
from models import zoo
from models.drafters import adapt
from models.tp import tensor_parallel
from specpass.drafters import DFlashConfig
from specpass.loop import Decoder, TreeShape

HEADS = {"eagle3": "eagle3", "parallel": "peagle3", "block": "dflash"}  # --drafter -> the zoo's head, llama3-8b-<this>


@dataclasses.dataclass(kw_only=True)
class RoundRow(harness.Row):
    """ms per round of one variant at one point (batch size x prompt length) and K (0: the decode step)."""

    bs: int
    prompt: int
    max_len: int
    k: int
    round_ms: float
    prefill_ms: float | None = None  # the generates' prefill (0.0: rounds from a moved one-token prefill)
    samples_ms: list[float] | None = None  # each repeat's ms per round; round_ms is their median
    floor_ms: dict[str, float]  # `floors.floors`: per phase, and the round's
    seconds: float  # to build, compile and time it
    phase_ms: dict[str, float] | None = None  # apart: each step's ms, CUDA events after each


class Bench:
    """The target and the head (random weights, built once and shared by every variant's decoder).

    base: the zoo's target (its head: `base`-eagle3); group: a process group to shard both over
    (`models.tp.tensor_parallel`, built on the meta device: a rank allocates its shard alone). Tree
    rounds run the EAGLE-3 head (built when first asked for, if --drafter is another)."""

    def __init__(self, args, base: str = "llama3-8b", group: dist.ProcessGroup | None = None):
        self.args, self.device, self.group = args, torch.device(args.device), group
        self.base = "tiny-llama" if args.quick else base
        self.dtype = torch.float32 if args.quick else torch.bfloat16
        self.target = self._build(self.base)
        head = zoo.config(f"{self.base}-{HEADS[args.drafter]}")
        if args.head_layers:
            head = dataclasses.replace(head, num_hidden_layers=args.head_layers)
        self.head = self._head(head)
        self.heads = {args.drafter: self.head}
        self.mode = "reduce-overhead" if self.device.type == "cuda" else None
        harness.dynamo_limits(1024)
        self.gemm_times: dict[tuple, float] = {}  # `floors.gemm_floor`'s, by the linears and rows

    def prompts(self, bs: int, length: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(bs * 7919 + length)
        return torch.randint(0, self.target.config.vocab_size, (bs, length), generator=g).tolist()

    def _build(self, name_or_config, **kw):
        shard = None if self.group is None else functools.partial(tensor_parallel, group=self.group)
        return zoo.build(name_or_config, device=self.device, dtype=self.dtype, shard=shard, **kw)

    def _head(self, config):
        if isinstance(config, DFlashConfig):  # over the target's embedding and lm_head
            return self._build(config, target=self.target)
        head = self._build(config)
        head.embed_tokens = self.target.model.embed_tokens  # EAGLE-3 uses the target's, by reference
        return head

    def decoder(self, bs: int, max_len: int, k: int | TreeShape, backend: str | dict[str, Any], fused: bool) -> Decoder:
        """K drafts per round (0: the target alone) or a tree shape; backend: "specpass", "inductor",
        specpass options, or "lean" (the lean baseline, K 0)."""
        if backend == "lean":
            if self.group is not None:
                raise ValueError("the lean baseline runs on one device: leave the lean variant out at tensor parallel")
            return LeanDecoder(self.target, max_batch=bs, max_len=max_len, mode=self.mode,
                               backend="eager" if self.args.quick else "inductor")
        if isinstance(k, TreeShape) and "eagle3" not in self.heads:
            self.heads["eagle3"] = self._head(zoo.config(f"{self.base}-eagle3"))
        head = self.heads["eagle3"] if isinstance(k, TreeShape) else self.head
        drafter = adapt(head) if k else None
        return Decoder(self.target, drafter, k=k, max_batch=bs, max_len=max_len, compile=self.compiler(backend),
                       mode=self.mode, fused_round=fused, compile_prefill=False,  # its time cancels out
                       group=self.group)

    def compiler(self, backend: str | dict[str, Any]):
        options = backend if isinstance(backend, dict) else {}
        if self.args.quick:  # the rewritten graphs run eagerly: Inductor's C++ builds would take minutes
            return "eager" if backend == "inductor" else specpass.backend(handoff="eager", **options)
        return specpass.backend(**options) if options else backend

    def round_ms(self, dec: Decoder, prompts, short: int, long: int) -> tuple[float, dict]:
        """ms per round from the difference of a long and a short generate (median of repeats; each in samples_ms)."""
        dec.generate(prompts, short)  # compiles, records the CUDA graphs
        samples = []
        with harness.exclusive(self.args.gpu_lock):
            for _ in range(self.args.repeats):
                a, b = (dec.generate(prompts, n).metrics for n in (short, long))
                loop_seconds = (b.seconds - b.prefill_seconds) - (a.seconds - a.prefill_seconds)
                samples.append(loop_seconds / (b.rounds - a.rounds))
        return 1e3 * statistics.median(samples), dict(prefill_ms=1e3 * a.prefill_seconds,
                                                      samples_ms=[1e3 * s for s in samples])

    def round_ms_direct(self, dec: Decoder, prompts, short: int, long: int) -> tuple[float, dict]:
        """ms per round without the prefill, whose logits do not fit at 64 x 4K (67 GB): a one-token
        prefill, every request moved to the prompt's position (the slots below hold zeros: a round's
        time does not depend on them, its shapes are static), then rounds replayed as `generate` runs
        them; the synchronised clock over `long - short` rounds after `short`, median of repeats."""
        # after `long` tokens a request runs frozen
        run = dec.start([p[:1] for p in prompts], long, position=len(prompts[0]))
        run = dec.rounds(run, short)  # compiles, records the CUDA graphs
        samples = []
        with harness.exclusive(self.args.gpu_lock):
            for _ in range(self.args.repeats):
                start = harness.now(dec.device)
                run = dec.rounds(run, long - short)
                samples.append((harness.now(dec.device) - start) / (long - short))
        return 1e3 * statistics.median(samples), dict(prefill_ms=0.0, samples_ms=[1e3 * s for s in samples])

    def release(self) -> None:
        harness.release(self.device)
