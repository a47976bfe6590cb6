"""The zoo's parallel-drafting EAGLE-3 head (P-EAGLE): the library's `ParallelEagle3Head`
(specpass/drafters/peagle.py: mask slots, `draft_parallel`, the checkpoint layout) with the zoo's
EAGLE-3 config and checkpoint names (models/eagle3.py)."""

from __future__ import annotations

import dataclasses

from models.eagle3 import Eagle3Config, Eagle3Head
from specpass import drafters


@dataclasses.dataclass
class ParallelEagle3Config(Eagle3Config, drafters.ParallelEagle3Config):
    pass


class ParallelEagle3Head(Eagle3Head, drafters.ParallelEagle3Head):
    config_class = ParallelEagle3Config
