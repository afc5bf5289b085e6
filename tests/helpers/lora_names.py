"""A plain ``GPT`` state dict in a LoRA model's names, to compare a loaded LoRA model with its source."""

from __future__ import annotations

import torch
from torch import nn

from lightning_train.models.lora import plain_names


def to_adapted_names(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` (a plain ``GPT``'s) in the names of ``model`` after ``apply_lora``
    (``models.lora.plain_names``): views of the rows each holds; the adapters themselves are left out."""
    own = model.state_dict()
    return {
        key: state_dict[plain].narrow(0, row, len(own[key]))
        for key, (plain, row) in plain_names(model).items() if plain in state_dict
    }
