"""Packing fine-tuning examples into full rows of ``seq_len`` tokens (``SFTDataModule(packing=True)``).

Padded batches spend most of each row on padding when examples are short; packed rows hold several
examples back to back. The model keeps them apart: each row's ``position_ids`` count from 0 at every
example's first token, and our GPT attends only within an example and rotates by those positions
(``models/documents.py``), so each example's loss is the one it has alone in a padded batch.

The examples are packed once, in one order seeded by the data's seed (a row mixes examples from the whole
file, not neighbours of a sorted one): each goes into the current row while it fits, and starts the next
row when it does not (next-fit, as torchtune packs; an example is never split). The rows are the
dataset's samples, so the data position (``position.py``) counts rows and a run resumes on any device
count as with padded examples.

    >>> from lightning_train.data.packing import pack
    >>> pack([3, 4, 2, 5, 1], seq_len=8)  # example lengths -> the examples of each row
    [[0, 1], [2, 3, 4]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


def pack(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """The examples (indices into ``lengths``, in its order) of each row of at most ``seq_len`` tokens."""
    rows: list[list[int]] = []
    used = seq_len  # no row open yet
    for index, length in enumerate(lengths):
        if used + length > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


class PackedExamples(Dataset):
    """Rows of ``seq_len`` tokens packed from ``examples`` (``SFTExamples``: (input ids, labels) pairs no
    longer than ``seq_len``), each ``{"input_ids", "labels", "position_ids"}`` of length ``seq_len``. A row's
    rest is padding: ``pad_id`` inputs, -100 labels, positions counting from 0 as one more example of its
    own, so no real example sees it."""

    def __init__(self, examples: Dataset, seq_len: int, pad_id: int, seed: int) -> None:
        self.seq_len, self.pad_id = seq_len, pad_id
        self.prompts, self.max_token_id = examples.prompts, examples.max_token_id
        order = np.random.default_rng(seed).permutation(len(examples.rows))
        rows = [examples.rows[i] for i in order]
        self.rows = [[rows[i] for i in row] for row in pack([len(ids) for ids, _ in rows], seq_len)]
        self.num_examples = len(rows)
        self.real_tokens = sum(len(ids) for ids, _ in rows)

    @property
    def padding_fraction(self) -> float:
        """The share of the rows' tokens that are padding."""
        return 1 - self.real_tokens / (len(self.rows) * self.seq_len) if self.rows else 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_len,), -100, dtype=torch.long)
        position_ids = torch.empty(self.seq_len, dtype=torch.long)
        start = 0
        for ids, example_labels in self.rows[i]:
            end = start + len(ids)
            input_ids[start:end], labels[start:end] = torch.tensor(ids), torch.tensor(example_labels)
            position_ids[start:end] = torch.arange(len(ids))
            start = end
        position_ids[start:] = torch.arange(self.seq_len - start)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
