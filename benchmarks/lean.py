"""The lean plain baseline: gpt-fast's decoding of the target, nothing else.

One compiled step per token (`mode="reduce-overhead"`: one CUDA graph replay), the next token its
arg-max; outside the graph, as gpt-fast's `decode_n_tokens` does, the position's increment, a copy
of the token, and (as any loop of CUDA-graph trees must in a process that marks steps) a step
marked before each replay. No EOS, no per-request limits, no state: the leanest loop torch.compile
gives, against which `benchmarks/e2e.py` and `benchmarks/scale` state every speed-up (with the loop's own
plain decoding: the faster of the two). The prefill is compiled apart with its length symbolic, as
gpt-fast's; prompts of a batch are padded on the right and each request starts from its own last
position (the model's cache is addressed by position, so the padding's slots are overwritten
before any step reads them).

    dec = LeanDecoder(target, max_batch=8, max_len=512)   # a zoo model: setup_caches, forward(tokens, positions)
    out = dec.generate(prompts, 256)                        # out.tokens, out.metrics (a specpass.loop Metrics)
"""

from __future__ import annotations

import time

import torch

from specpass.loop import Metrics, Output


class LeanDecoder:
    k = 0  # no drafts: the loop's plain decoding's K

    def __init__(self, target: torch.nn.Module, *, max_batch: int, max_len: int, mode: str | None = "reduce-overhead",
                 backend: str = "inductor"):
        self.target = target
        target.setup_caches(max_batch, max_len)
        self.device = next(target.parameters()).device
        self.step = torch.compile(self._step, backend=backend, mode=mode, fullgraph=True)
        self.prefill = torch.compile(self._prefill, backend=backend, dynamic=True, fullgraph=True)

    @torch.no_grad()
    def _step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.target.forward(token[:, None], pos[:, None])[:, -1].argmax(-1)  # [B]

    @torch.no_grad()
    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        logits = self.target.forward(tokens, positions)  # [B, L, V]
        return logits[torch.arange(len(last), device=last.device), last].argmax(-1)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Output:
        width = max(map(len, prompts))
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        start = self._clock()
        token = self.prefill(tokens, torch.arange(width, device=self.device).expand(len(prompts), width), lengths - 1)
        pos = lengths.clone()
        prefill_s = self._clock() - start
        new = [token]
        for _ in range(max_new_tokens - 1):  # gpt-fast's decode_n_tokens
            # Once any code in the process marks a step (the Decoder does), CUDA-graph trees begin a
            # new generation only at a mark: unmarked, each step would be recorded anew below the last
            # one (38 ms a step, docs/results.md). A mark frees the last replay's outputs: the token
            # is a copy, as gpt-fast's next_token.clone()
            torch.compiler.cudagraph_mark_step_begin()
            token = self.step(token, pos).clone()
            pos += 1
            new.append(token)
        out = torch.stack(new, 1).tolist()  # the one host sync of the decoding
        seconds = self._clock() - start
        steps = max_new_tokens - 1
        metrics = Metrics(new_tokens=len(prompts) * max_new_tokens, rounds=steps, seconds=seconds,
                          prefill_seconds=prefill_s, accept_length=1.0, acceptance=[],
                          phase_ms={"round": 1e3 * (seconds - prefill_s) / max(steps, 1)}, request_rounds=steps * len(prompts))
        return Output(out, metrics)
