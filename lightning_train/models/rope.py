"""Rotary position embeddings: the cos/sin tables and their application, with the frequency scalings
that long-context checkpoints use (``rope_scaling``, Hugging Face's ``rope_parameters`` less
``rope_theta``): ``linear`` (positions interpolated), ``llama3`` (Llama 3.1+: low frequencies
interpolated, high ones kept, a smooth ramp between), ``yarn`` (a ramp by rotations, cos/sin scaled
by an attention factor) and ``longrope`` (Phi-3's LongRoPE: a factor per frequency, one list for sequences
within the original context and another past it, cos/sin scaled by an attention factor). Each is the
formula of transformers' ``modeling_rope_utils``, so the tables equal theirs.

    >>> import torch
    >>> plain = inverse_frequencies(8, 10000.0, None, max_len=64)[0]
    >>> linear, scale = inverse_frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4.0}, max_len=64)
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
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def check_scaling(scaling: dict[str, Any] | None, rotary_dim: int) -> None:
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
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        if len(scaling[key]) != rotary_dim // 2:
            raise UserInputError(
                f"rope_scaling {key} has {len(scaling[key])} values; LongRoPE needs one per rotated pair of "
                f"dimensions: {rotary_dim // 2}"
            )


def longrope_switch(scaling: dict[str, Any] | None) -> int | None:
    """LongRoPE's original context: a forward that reaches past it rotates by the long factors; None for
    the other scalings."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return None
    return scaling["original_max_position_embeddings"]


def cache_needs_recompute(scaling: dict[str, Any] | None, cached: int, total: int) -> bool:
    """Whether generation computes its KV cache of ``cached`` positions again in the forward that takes the
    sequence to ``total``: the first past LongRoPE's switch, when the cached keys were rotated by the short
    factors. transformers' Phi-3 generation drops its cache there too, so a generation with the cache gives
    the tokens of one without it."""
    switch = longrope_switch(scaling)
    return switch is not None and cached <= switch < total


def inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_len: int, length: int | None = None
) -> tuple[torch.Tensor, float]:
    """The ``dim // 2`` rotation frequencies and the factor cos/sin are multiplied by, for a model of
    ``max_len`` positions and a forward that reaches ``length`` of them (LongRoPE's choice of factors)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "longrope":
        return _longrope(dim, theta, scaling, max_len, length)
    factor = scaling["factor"]
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


def _longrope(
    dim: int, theta: float, s: dict[str, Any], max_len: int, length: int | None
) -> tuple[torch.Tensor, float]:
    old_context = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_len / old_context  # Phi-3 gives the two contexts, not the factor
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(old_context)) if factor > 1 else 1.0
    long = length is not None and length > old_context
    ext_factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (ext_factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary embeddings (the "rotate half" layout used by Llama checkpoints).

    LongRoPE has two pairs of tables, its short factors' and its long factors', both precomputed for every
    position. As in transformers, a forward rotates all its positions by one pair, chosen by how far it
    reaches: the long one once its last position is past ``original_max_position_embeddings``. Keys a KV
    cache already holds stay as they were rotated; generation computes them again at the switch
    (``cache_needs_recompute``)."""

    def __init__(
        self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta, self.scaling = head_dim, max_len, theta, scaling
        self.switch = longrope_switch(scaling)
        # Non-persistent: derived from the config, so not in checkpoints; rebuilt by reset_parameters()
        # after a strategy materialises the model from the meta device.
        for name in ("cos", "sin") if self.switch is None else ("cos", "sin", "long_cos", "long_sin"):
            self.register_buffer(name, torch.empty(self.max_len, self.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device if self.cos.device.type != "meta" else None
        lengths = {"": None} if self.switch is None else {"": None, "long_": self.switch + 1}
        for prefix, length in lengths.items():  # None: the short factors
            inv_freq, scale = inverse_frequencies(
                self.head_dim, self.theta, self.scaling, self.max_len, length
            )
            angles = torch.outer(torch.arange(self.max_len, device=device).float(), inv_freq.to(device))
            angles = torch.cat([angles, angles], dim=-1)
            with torch.no_grad():
                getattr(self, f"{prefix}cos").copy_(angles.cos() * scale)
                getattr(self, f"{prefix}sin").copy_(angles.sin() * scale)

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables of a forward whose last position is ``length - 1``."""
        if self.switch is not None and length > self.switch:
            return self.long_cos, self.long_sin
        return self.cos, self.sin

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables of positions ``start .. start + length - 1``, each (length, head_dim)."""
        cos, sin = self.tables(start + length)
        return cos[start : start + length], sin[start : start + length]

    def at(
        self, positions: torch.Tensor, lengths: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at each of ``positions`` (packed rows, (B, T)); LongRoPE's pair is picked by each
        token's ``lengths`` (its example's; None without LongRoPE), so an example is rotated as it would be
        alone (transformers would pick one pair for the batch by its largest position)."""
        cos, sin = self.cos[positions], self.sin[positions]
        if lengths is None:
            return cos, sin
        long = (lengths > self.switch).unsqueeze(-1)
        return (torch.where(long, self.long_cos[positions], cos),
                torch.where(long, self.long_sin[positions], sin))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, heads, T, head_dim) by the angles whose cos/sin are given (their first
    dimensions only where the tables are narrower)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # x is bf16/fp16 under autocast
    if cos.shape[-1] < x.shape[-1]:  # partial rotary (GPT-NeoX): the rest of each head passes as it is
        rotated, kept = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat([apply_rotary(rotated, cos, sin), kept], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
