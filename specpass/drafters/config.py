"""A model config that is also a Hugging Face-style config.json: a dataclass whose field names are
the file's keys. Known keys are read, others (Hugging Face bookkeeping) ignored."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from specpass.drafters.files import CONFIG_FILE, CheckpointError


@dataclasses.dataclass
class ConfigBase:
    model_type: ClassVar[str] = ""

    def architectures(self) -> list[str]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": self.architectures(), "model_type": self.model_type, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Known fields are read, others ignored; required fields must be there."""
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in d]
        if missing:
            raise CheckpointError(f"{CONFIG_FILE} lacks {missing}, required by {cls.__name__}")
        return cls(**{f.name: d[f.name] for f in fields if f.name in d})


def check_llama_block(d: dict[str, Any]) -> None:
    """Refuse (ValueError) what a Llama block here does not model: biases, another activation."""
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"{flag}=true is not modelled")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not modelled; only silu is")
