"""RoPE as transformers computes it: the default rotary embedding, and Llama-3.1's "llama3"
frequency scaling (`rope_scaling` in a config.json of transformers 4, `rope_parameters` in 5).

    theta, scaling = read_rope(config_json)                     # scaling: None or the llama3 parameters
    cos, sin = rope(positions, head_dim, theta, x.dtype, scaling)  # [B, T, head_dim] each
    q = apply_rope(q, cos, sin)                                 # q [B, T, heads, head_dim]

cos and sin are computed in fp32 and cast to the activations' dtype; the rotation is rotate_half.
A rotary dim below the head dim is partial RoPE (the rest of each head passes through).
"""

from __future__ import annotations

import math
from typing import Any

import torch

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_rope(config: dict[str, Any]) -> tuple[float | None, dict[str, float] | None]:
    """(rope_theta or None when the file has none, the llama3 scaling parameters or None) from a
    config.json's keys. Raises ValueError, saying what to do, for a rope type not modelled here."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling / rope_parameters must be an object, got {params!r}")
    theta = config.get("rope_theta", params.get("rope_theta"))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope type {rope_type!r} is not modelled: only 'default' and 'llama3' (Llama-3.1's "
                         "rope_scaling) are; use a head trained with one of them")
    missing = [key for key in LLAMA3_KEYS if key not in params]
    if missing:
        raise ValueError(f"rope type 'llama3' needs {list(LLAMA3_KEYS)} in rope_scaling; {missing} are missing")
    return theta, {key: params[key] for key in LLAMA3_KEYS}


def inverse_frequencies(dim: int, theta: float, device: torch.device,
                        scaling: dict[str, float] | None = None) -> torch.Tensor:
    """`[dim / 2]` fp32: transformers' default rope init, then its llama3 init when `scaling` is given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim))
    return inv_freq if scaling is None else _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama-3.1's scaling (transformers' `_compute_llama3_parameters`, op for op): long wavelengths
    divided by `factor`, short ones kept, the band between interpolated."""
    factor, low, high, old_len = (scaling[key] for key in LLAMA3_KEYS)
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype,
         scaling: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[B, T, dim]` for `positions [B, T]`, computed exactly as transformers does."""
    inv_freq = inverse_frequencies(dim, theta, positions.device, scaling)  # [dim/2]
    freqs = positions[..., None].float() * inv_freq  # [B, T, dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` features of every head of `x [B, T, heads, d]`.

    A rotary dim below d is partial RoPE (Qwen3-Next/Qwen3.5): the rest pass through unrotated.
    """
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x_pass), dim=-1)
