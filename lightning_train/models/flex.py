"""FlexAttention for packed rows: attention that skips the blocks of keys another example holds.

SDPA with a (B, 1, T, T) boolean mask (``Documents.mask``) keeps packed examples apart, but a mask takes
CUDA's flash kernel away and costs T² booleans a row. ``flex_attention`` takes a ``BlockMask`` instead: per
128 x 128 tile, whether it is empty, full or partial, from a ``mask_mod`` (same example, causal, within
the sliding window); empty tiles are skipped. Soft-capping (Gemma 2) is its ``score_mod``.

Which kernel runs (``GPTConfig.packed_attention``): "sdpa" (the default) everywhere; "auto" is flex on CUDA
and SDPA elsewhere, opt-in while no GPU run of this project has checked the CUDA kernels. On CPU,
torch 2.13's FlexAttention is inference only (its front door refuses inputs that require grad: "does not
support backward on CPU") and runs unfused unless compiled, so "flex" there serves checks and evaluation.
On CUDA both the mask's creation and the attention are compiled: uncompiled, ``flex_attention`` writes out
every score (slower than SDPA) and ``create_block_mask`` the whole boolean mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from lightning_train.models.config import GPTConfig

COMPILED_ON = ("cuda",)  # the device types whose flex kernels go through torch.compile (module doc)


def uses_flex(config: GPTConfig, device: torch.device) -> bool:
    """Whether packed rows on ``device`` attend through FlexAttention. "auto": on CUDA, unless the
    attention has dropout, which flex_attention does not do (GPTConfig refuses "flex" with dropout)."""
    if config.packed_attention == "auto":
        return device.type == "cuda" and config.dropout == 0
    return config.packed_attention == "flex"


def document_block_mask(ids: torch.Tensor, window: int | None) -> BlockMask:
    """The ``BlockMask`` of ``Documents.mask``'s pattern for example ids ``ids`` (B, T), one for all heads."""

    def same_example_causal(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        seen = (ids[batch, query] == ids[batch, key]) & (key <= query)
        return seen if window is None else seen & (query - key < window)

    B, T = ids.shape
    create = _for_device(create_block_mask, ids.device)
    return create(same_example_causal, B, None, T, T, device=ids.device)


def flex_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of q (B, H, T, D) over k, v (B, H_kv, T, D) within ``block_mask``, scores times ``scale``
    and, with ``softcap``, squashed by ``cap * tanh(score / cap)`` as ``softcapped_attention`` does."""

    def capped(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
               key: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score / softcap) * softcap

    attend = _for_device(flex_attention, q.device)
    # contiguous: compiled in one graph with the qkv projection, torch 2.13's CPU kernel misreads v as a
    # view into that output (wrong values, seen); CUDA's is unchecked, and a copy of v is cheap
    return attend(
        q, k, v.contiguous(), score_mod=capped if softcap is not None else None, block_mask=block_mask,
        scale=scale, enable_gqa=k.shape[1] != q.shape[1],
    )


def _for_device(kernel: Callable, device: torch.device) -> Callable:
    """``kernel`` compiled on ``COMPILED_ON``, as it is where the whole model is compiled already."""
    compiled = device.type in COMPILED_ON and not torch.compiler.is_compiling()
    return _compiled(kernel) if compiled else kernel


@functools.cache
def _compiled(kernel: Callable) -> Callable:
    # fullgraph: a graph break would fall back to the unfused kernel silently
    return torch.compile(kernel, fullgraph=True)
