"""The choice among drafters: `tune_k` on one Decoder per drafter (a chain or tree head, a block
draft, ...), each on the same prompts at the same batch size, then the one whose choice decodes the
most tokens per ms. tune_k chooses among off, the chain's K and trees for its drafter; this chooses
among drafters, each at its own best.

    name, choices = choose_drafter({"eagle": Decoder(t, eagle, ...), "block": Decoder(t, dflash, ...)},
                                  prompts, {"eagle": dict(ks=(4, 8), trees=TREES), "block": dict(ks=(8, 15))})
    decoders[name].generate(prompts, 256)   # each decoder keeps its own choice and compiled rounds
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specpass.loop.cost import KChoice
from specpass.loop.driver import Decoder


def choose_drafter(decoders: Mapping[str, Decoder], prompts: Sequence[Sequence[int]],
                   options: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[str, dict[str, KChoice]]:
    """`Decoder.tune_k(prompts, **options[name])` on each decoder (their tokens per ms per request
    are comparable: the same prompts, the same batch size) -> (the name whose chosen K or tree gives
    the most, every decoder's KChoice). Every decoder is left set to its own choice."""
    options = dict(options or {})
    if not decoders:
        raise ValueError("choose_drafter needs at least one Decoder (name -> Decoder, one per drafter)")
    unknown = sorted(set(options) - set(decoders))
    if unknown:
        raise ValueError(f"options for {unknown}, which are not among the decoders {sorted(decoders)}")
    batch = {dec.max_batch for dec in decoders.values()}
    if len(batch) > 1:
        raise ValueError(f"the decoders' max_batch differ ({sorted(batch)}): a choice is for one batch size; build "
                         "each drafter's Decoder with the same max_batch")
    choices = {name: dec.tune_k(prompts, **options.get(name, {})) for name, dec in decoders.items()}
    best = max(choices, key=lambda name: choices[name].tokens_per_ms[choices[name].k])
    return best, choices
