"""Packed rows: several examples (documents) in one row of a batch, told apart by their positions.

A row's ``position_ids`` (Hugging Face's name) restart at 0 where each example starts, so one tensor
gives both what rotary (or learned) positions need and where each example begins: the tokens from one 0
to the next are one example. ``Documents`` turns it into what attention needs, once a forward pass,
shared by every layer: the rotary tables at each token's own position, and a block-diagonal causal mask
(a query sees the keys of its own example only, at or before it): booleans for SDPA, or FlexAttention's
``BlockMask`` of the same pattern where packed rows attend through it (``models/flex.py``).

    >>> import torch
    >>> documents = Documents(torch.tensor([[0, 1, 2, 0, 1]]))
    >>> documents.ids.tolist()
    [[1, 1, 1, 2, 2]]
    >>> documents.mask(window=None)[0, 0].int().tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask

from lightning_train.models.flex import document_block_mask
from lightning_train.models.rope import RotaryEmbedding


class Documents:
    """The layout of packed rows, from their ``position_ids`` (B, T): an example starts at each 0.
    ``flex``: attention takes ``block_mask`` and runs FlexAttention, else ``mask`` and SDPA."""

    def __init__(self, position_ids: torch.Tensor, flex: bool = False) -> None:
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} must be (batch, tokens)")
        self.positions, self.flex = position_ids, flex
        self.ids = (position_ids == 0).cumsum(dim=-1)  # the example each token belongs to
        # by sliding window: built once a forward
        self._masks: dict[int | None, torch.Tensor] = {}
        self._block_masks: dict[int | None, BlockMask] = {}

    def rope_tables(self, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each token's position, shaped (B, 1, T, dim) to broadcast over the heads."""
        lengths = self.lengths if rope.switch is not None else None  # only LongRoPE's tables need them
        cos, sin = rope.at(self.positions, lengths)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """(B, T): the length of each token's example (its last position + 1), on the device."""
        ends = torch.zeros(self.ids.shape[0], self.ids.shape[1] + 1, dtype=self.positions.dtype,
                           device=self.ids.device)  # ids run from 0 (a row that starts mid-example) to T
        ends.scatter_reduce_(1, self.ids, self.positions + 1, reduce="amax")
        return ends.gather(1, self.ids)

    def mask(self, window: int | None) -> torch.Tensor:
        """(B, 1, T, T) booleans: query t sees key s of the same example with s <= t (and, with a sliding
        window, s > t - window)."""
        if window not in self._masks:
            T = self.ids.shape[1]
            query = torch.arange(T, device=self.ids.device)[:, None]
            key = torch.arange(T, device=self.ids.device)
            causal = key <= query if window is None else (key <= query) & (key > query - window)
            same = self.ids[:, :, None] == self.ids[:, None, :]
            self._masks[window] = (same & causal).unsqueeze(1)
        return self._masks[window]

    def block_mask(self, window: int | None) -> BlockMask:
        """``mask``'s pattern as FlexAttention's ``BlockMask``, the same for every head."""
        if window not in self._block_masks:
            self._block_masks[window] = document_block_mask(self.ids, window)
        return self._block_masks[window]
