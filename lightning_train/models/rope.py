"""Rotary position embeddings: the cos/sin tables and their application, with the frequency scalings
that long-context checkpoints use (``rope_scaling``, Hugging Face's ``rope_parameters`` less
``rope_theta``): ``linear`` (positions interpolated), ``llama3`` (Llama 3.1+: low frequencies
interpolated, high ones kept, a smooth ramp between) and ``yarn`` (a ramp by rotations, cos/sin scaled
by an attention factor). Each is the formula of transformers' ``modeling_rope_utils``, so the tables
equal theirs.

    >>> import torch
    >>> plain = inverse_frequencies(8, 10000.0, None)[0]
    >>> linear, scale = inverse_frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    >>> torch.allclose(linear, plain / 4), scale
    (True, 1.0)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_train.errors import UserInputError

# the keys each scaling needs (beyond rope_type); yarn's optional ones have transformers' defaults
SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def check_scaling(scaling: dict[str, Any] | None) -> None:
    """Refuse a ``rope_scaling`` these tables cannot reproduce, naming what is missing or unknown."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in SCALINGS:
        raise UserInputError(
            f"rope_scaling rope_type={kind!r} is not one of {', '.join(SCALINGS)}; use rope_scaling=None "
            "for plain rotary embeddings"
        )
    missing = [key for key in SCALINGS[kind] if scaling.get(key) is None]
    if missing:
        raise UserInputError(f"rope_scaling of rope_type={kind!r} lacks {missing}")


def inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """The ``dim // 2`` rotation frequencies and the factor cos/sin are multiplied by."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)  # long waves: slowed
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor, old_context = s["factor"], s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim else _yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    inv_freq = 1.0 / (factor * positions) * (1 - extrapolated) + 1.0 / positions * extrapolated
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary embeddings (the "rotate half" layout used by Llama checkpoints)."""

    def __init__(
        self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta, self.scaling = head_dim, max_len, theta, scaling
        # Non-persistent: derived from the config, so not in checkpoints; rebuilt by reset_parameters()
        # after a strategy materialises the model from the meta device.
        self.register_buffer("cos", torch.empty(self.max_len, self.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(self.max_len, self.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device if self.cos.device.type != "meta" else None
        inv_freq, scale = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        angles = torch.outer(torch.arange(self.max_len, device=device).float(), inv_freq.to(device))
        angles = torch.cat([angles, angles], dim=-1)
        with torch.no_grad():
            self.cos.copy_(angles.cos() * scale)
            self.sin.copy_(angles.sin() * scale)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables of positions ``start .. start + length - 1``, each (length, head_dim)."""
        return self.cos[start : start + length], self.sin[start : start + length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, heads, T, head_dim) by the angles whose cos/sin are given (their first
    dimensions only where the tables are narrower)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # x is bf16/fp16 under autocast
    if cos.shape[-1] < x.shape[-1]:  # partial rotary (GPT-NeoX): the rest of each head passes as it is
        rotated, kept = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat([apply_rotary(rotated, cos, sin), kept], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
