"""Pipeline stages of a transformers causal LM (Llama, Mistral, Qwen2 and the like: ``embed_tokens``,
``layers``, ``norm`` and ``rotary_emb`` under ``model.<base_model_prefix>``, then ``lm_head``).

A stage (``CausalLMStage``) holds the whole model's own modules under their whole-model names, as the
GPT's stages do (``pipeline.stage_model``): some decoder layers (keyed by their index in the whole
model), the token embedding on the first stage, the final norm and head on the last, the rotary
embedding (no parameters) on every stage. It runs the model's own code: the base model's ``forward``
with ``input_ids`` on the first stage, with the previous stage's hidden states as ``inputs_embeds`` on
the others, so masks and positions are computed as the whole model computes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_train.errors import UserInputError
from lightning_train.strategies.pipeline import split_by_cost

_PARTS = ("embed_tokens", "layers", "norm")


def base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """(attribute, module): the base model a causal LM holds (``model`` for Llama); one clear error where
    ``model`` is not a transformers causal LM a pipeline can split."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    missing = [part for part in _PARTS if not hasattr(base, part)] if base is not None else list(_PARTS)
    if missing or not hasattr(model, "lm_head"):
        raise UserInputError(
            "pipeline_parallel splits the GPT or a transformers causal LM (embed_tokens, layers, norm, "
            f"lm_head: Llama, Mistral, Qwen2, ...); {type(model).__name__} has no "
            f"{', '.join(missing) or 'lm_head'}. Use pipeline_parallel=1 (fsdp and tensor_parallel take "
            "any model)"
        )
    if model.lm_head.weight is base.embed_tokens.weight:
        raise UserInputError(
            f"pipeline_parallel with {type(model).__name__}'s tied input and output embeddings is not "
            "supported: the first and the last stage would each hold it; build it with "
            "tie_word_embeddings=False"
        )
    return prefix, base


def split_layers(model: nn.Module, num_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage, balanced by parameters (the first stage counts the embedding,
    the last the final norm and head), or cut at ``split_points``."""
    _, base = base_model(model)
    cost = [sum(p.numel() for p in layer.parameters()) for layer in base.layers]
    if cost:
        cost[0] += base.embed_tokens.weight.numel()
        cost[-1] += model.lm_head.weight.numel() + sum(p.numel() for p in base.norm.parameters())
    return split_by_cost(cost, num_stages, split_points)


class CausalLMStage(nn.Module):
    """What one pipeline stage (or one rank's stages) of a causal LM computes (module doc): token ids
    (first stage) or hidden states in, hidden states or logits (last stage) out."""

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        prefix, base = base_model(model)
        inner = _shallow_copy(base)
        kept = nn.ModuleList()
        for index in layers:
            kept.add_module(str(index), base.layers[index])  # the global index: names do not change
        inner.layers = kept
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm = nn.Identity()
        self.base_model_prefix, self.first = prefix, first  # transformers' name: plans.builtin_plan reads it
        self.add_module(prefix, inner)
        self.lm_head = model.lm_head if last else None
        self.config = model.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = getattr(self, self.base_model_prefix)(**inputs, use_cache=False).last_hidden_state
        return hidden if self.lm_head is None else self.lm_head(hidden)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new ``module`` of the same class sharing its attributes and children, with hooks and a children
    dict of its own (so a stage can drop children, and FSDP or TP hook it, without touching the model)."""
    copy = type(module).__new__(type(module))
    nn.Module.__init__(copy)
    own = set(copy.__dict__)
    copy.__dict__.update({key: value for key, value in module.__dict__.items() if key not in own})
    copy._modules.update(module._modules)
    copy._parameters.update(module._parameters)
    copy._buffers.update(module._buffers)
    copy._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    copy.training = module.training
    return copy
