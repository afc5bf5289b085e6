"""Checking a state dict against a model before loading it (plain torch).

    >>> from lightning_train.models.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    >>> load_into(model, GPT(model.config).state_dict(), "a copy")
    >>> try:
    ...     check_keys({"embed.weight": torch.Size([64, 16])}, {"embed.weight": torch.zeros(3, 3)}, "w.pt")
    ... except UserInputError as error:
    ...     print(str(error).split(";")[0])
    weights of 'w.pt' do not fit the model (wrong shape: embed.weight (3, 3) vs model (64, 16))
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_train.errors import UserInputError


def load_into(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """``model.load_state_dict(state_dict)`` after ``check_keys``; a tied ``lm_head.weight`` may be
    absent (it is the embedding)."""
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    check_keys(expected, state_dict, source, optional={"lm_head.weight"} if tied else set())
    model.load_state_dict(state_dict, strict=False)  # checked above


def check_keys(
    expected: dict[str, torch.Size], state_dict: dict[str, torch.Tensor], source: str,
    optional: set[str] | None = None,
) -> None:
    """Raise one error naming every missing, unexpected or misshapen key of ``state_dict``."""
    missing = [k for k in expected if k not in state_dict and k not in (optional or set())]
    unexpected = [k for k in state_dict if k not in expected]
    misshapen = [
        f"{k} {tuple(state_dict[k].shape)} vs model {tuple(shape)}"
        for k, shape in expected.items()
        if k in state_dict and state_dict[k].shape != shape
    ]
    problems = [
        f"{label}: {_shorten(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
        if keys
    ]
    if problems:
        raise UserInputError(
            f"weights of {str(source)!r} do not fit the model ({'; '.join(problems)}); check that the "
            "config (model.config or the source's config.json) describes the same architecture"
        )


def _shorten(keys: list[str], limit: int = 6) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more
