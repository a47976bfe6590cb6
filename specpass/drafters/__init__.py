"""Public draft formats: EAGLE-3, P-EAGLE and DFlash heads, their checkpoint loader, and the adapter that
puts a draft model behind the loop's `Drafter` protocol (specpass/loop/protocols.py).

    drafter = specpass.load_drafter("eagle3-dir", model)   # model: a transformers PreTrainedModel
    out = specpass.generate(model, ids, assistant_model=drafter, max_new_tokens=64)

| module | job |
|---|---|
| `rope.py` | RoPE (default, llama3) as transformers computes it |
| `attention.py` | the cache mask and write, plain-SDPA attention, the cached GQA `Attention` |
| `layers.py` | `SwiGLU`, the pre-norm `DecoderLayer` |
| `base.py` | `CachedModel` (`setup_caches`), `Draft` (`catch_up`, `draft_step`), `select_live` |
| `eagle3.py`, `peagle.py` | `Eagle3Head`, `ParallelEagle3Head` and their configs |
| `dflash.py` | `DFlashDraft` (block drafting over the target's embedding and lm_head) and its config |
| `config.py`, `files.py` | config.json as a dataclass; reading a checkpoint folder's files |
| `load.py` | `load_drafter`: a public checkpoint folder, checked against the target |
| `adapter.py` | `DraftAdapter`, `ParallelDraftAdapter`, `adapt` |
"""

from specpass.drafters.adapter import DraftAdapter, ParallelDraftAdapter, adapt
from specpass.drafters.dflash import DFlashConfig, DFlashDraft
from specpass.drafters.eagle3 import Eagle3Config, Eagle3Head
from specpass.drafters.files import CheckpointError
from specpass.drafters.load import load_drafter
from specpass.drafters.peagle import ParallelEagle3Config, ParallelEagle3Head

__all__ = ["CheckpointError", "DFlashConfig", "DFlashDraft", "DraftAdapter", "Eagle3Config", "Eagle3Head", "ParallelDraftAdapter",
           "ParallelEagle3Config", "ParallelEagle3Head", "adapt", "load_drafter"]
