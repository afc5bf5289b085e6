"""The tensor/pipeline layout options of the tools that run a model on torchrun's ranks (``generate``,
``evaluate``): checked here before torch is imported; the layout itself is
``strategies.generation.shard_under_torchrun``'s."""

from __future__ import annotations

from lightning_train.errors import UserInputError


def check_layout_sizes(tensor_parallel: int, pipeline_parallel: int) -> None:
    """Refuse sizes below 1 in one line, before any weights are read."""
    if min(tensor_parallel, pipeline_parallel) < 1:
        raise UserInputError(
            f"--tensor_parallel {tensor_parallel} --pipeline_parallel {pipeline_parallel}: use ints >= 1"
        )
