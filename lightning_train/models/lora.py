"""LoRA adapters for our GPT through peft (no Lightning imports).

peft's ``inject_adapter_in_model`` works on any ``nn.Module``: it swaps the targeted ``nn.Linear``
layers for LoRA layers in place (the frozen weight moves to ``<name>.base_layer``; ``lora_A``/``lora_B``
are added) and freezes everything else. The model stays our ``GPT``, so generation, FSDP wrapping
and checkpointing work unchanged; ``merge_lora`` folds the adapters back into plain ``nn.Linear``s.

q, k and v get an adapter each, as peft gives the separate ``q_proj``/``k_proj``/``v_proj`` of a
Hugging Face Llama: the fused ``attn.qkv`` layer is first split (from outside the model) into a
``SplitQKV`` of three ``nn.Linear``s whose outputs it concatenates. Targeting ``qkv`` instead keeps
the fused layer with one joint adapter, as peft adapts GPT-2's fused ``c_attn``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_train.errors import UserInputError
from lightning_train.models.layers import Attention

ADAPTER = "default"
PROJECTIONS = ("q", "k", "v")  # the parts of the fused qkv layer, in its output order
FUSED = "qkv"
# The default targets, where the model has them.
BLOCK_LINEARS = (*PROJECTIONS, "proj", "gate", "up", "down")


@dataclass
class LoRAConfig:
    """Low-rank adapters ``W + (alpha / rank) * B @ A`` on the named linear layers.

    Args:
        rank: inner dimension of ``B @ A``.
        alpha: scale numerator; the update is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input.
        target_modules: names of the layers to adapt: ``q``, ``k``, ``v`` (attention's query, key
            and value projections, an adapter each, as peft on a Hugging Face Llama), ``proj``
            (attention's output), ``gate`` (SwiGLU only), ``up``, ``down`` (MLP), ``lm_head`` (an
            untied one). ``qkv`` instead of ``q``/``k``/``v``: one joint adapter on the fused projection
            (as peft on GPT-2's ``c_attn``). None: ``q``, ``k``, ``v``, ``proj``, ``gate``, ``up``, ``down``
            (those the model has).

    Example (``FinetuneModule(lora=LoRAConfig(...))`` does the same inside a Trainer):

        >>> import torch
        >>> from lightning_train import GPT, GPTConfig, LoRAConfig
        >>> from lightning_train.models.lora import apply_lora, lora_layers, merge_lora
        >>> model = GPT(GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_embd=32, n_head=2))
        >>> model = apply_lora(model, LoRAConfig(rank=4, target_modules=["q", "k", "v", "proj"]))
        >>> [name for name, _ in lora_layers(model)]
        ['blocks.0.attn.qkv.q', 'blocks.0.attn.qkv.k', 'blocks.0.attn.qkv.v', 'blocks.0.attn.proj']
        >>> with torch.no_grad():  # as if trained: B starts at zero, so a fresh adapter changes nothing
        ...     for name, param in model.named_parameters():
        ...         _ = param.normal_(std=0.1) if "lora_B" in name else None
        >>> tokens = torch.tensor([[1, 2, 3]])
        >>> with_adapters = model(tokens)
        >>> model = merge_lora(model)  # plain nn.Linear layers again, the adapters folded into the weights
        >>> type(model.blocks[0].attn.qkv).__name__, torch.allclose(model(tokens), with_adapters, atol=1e-5)
        ('Linear', True)
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None


class SplitQKV(nn.Module):
    """A fused q|k|v ``nn.Linear`` as three (``q``, ``k``, ``v``) whose outputs are concatenated: the
    same function, with a layer for each projection that peft can adapt on its own."""

    def __init__(self, fused: nn.Linear, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = sizes
        weights = fused.weight.split(sizes)
        biases = fused.bias.split(sizes) if fused.bias is not None else [None] * len(sizes)
        for name, weight, bias in zip(PROJECTIONS, weights, biases, strict=True):
            layer = nn.Linear(fused.in_features, weight.shape[0], bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=fused.weight.requires_grad)
            if bias is not None:
                layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=fused.bias.requires_grad)
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)

    def fused(self) -> nn.Linear:
        """The one ``nn.Linear`` these three layers are (after ``merge_lora`` folded their adapters in)."""
        parts = [getattr(self, name) for name in PROJECTIONS]
        first = parts[0].weight
        layer = nn.Linear(first.shape[1], sum(self.sizes), bias=parts[0].bias is not None, device="meta")
        layer.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]))
        if parts[0].bias is not None:
            layer.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]))
        return layer


def apply_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Inject LoRA layers into ``model`` in place and freeze every non-adapter parameter."""
    from peft import LoraConfig
    from peft.functional import inject_adapter_in_model

    targets = _targets(model, config)
    if config.rank < 1:
        raise UserInputError(f"lora.rank={config.rank} must be at least 1")
    if set(targets) & set(PROJECTIONS):
        for attention in [m for m in model.modules() if isinstance(m, Attention)]:
            kv = attention.n_kv_head * attention.head_dim
            attention.qkv = SplitQKV(attention.qkv, [attention.n_head * attention.head_dim, kv, kv])
    peft_config = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=targets,
    )
    return inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)


def _targets(model: nn.Module, config: LoRAConfig) -> list[str]:
    """``config.target_modules`` (or the default), checked against the model's layers."""
    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if FUSED in linear_names:
        linear_names |= set(PROJECTIONS)
    targets = config.target_modules
    if targets is None:
        targets = [name for name in BLOCK_LINEARS if name in linear_names]
    unknown = [t for t in targets if t not in linear_names]
    if unknown or not targets:
        raise UserInputError(
            f"lora.target_modules={targets} names no linear layer of the model ({unknown}); "
            f"pick from {sorted(linear_names)}"
        )
    both = [t for t in targets if t in PROJECTIONS]
    if FUSED in targets and both:
        raise UserInputError(
            f"lora.target_modules has both 'qkv' (one adapter on the fused projection) and {both} (an "
            "adapter each); keep one of the two"
        )
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if "lm_head" in targets and tied:
        raise UserInputError(
            "lora.target_modules includes 'lm_head', whose weight is tied to the embedding; merging would "
            "change the embedding too. Leave 'lm_head' out or use a model with tie_embeddings: false"
        )
    return list(targets)


def adapted_layers(keys: Iterable[str]) -> list[str]:
    """The names (last component) of the layers that hold adapters in a state dict with ``keys``."""
    found = {key.split(".lora_A.")[0].rsplit(".", 1)[-1] for key in keys if ".lora_A." in key}
    return [name for name in (FUSED, *BLOCK_LINEARS, "lm_head") if name in found]


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every peft LoRA layer in ``model``."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def adapters(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (A, B)}`` of every adapter, the layer named as in ``model`` (``blocks.0.attn.qkv.q``
    for a per-projection adapter, ``blocks.0.attn.qkv`` for the fused one)."""
    return {
        name: (layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach())
        for name, layer in lora_layers(model)
    }


def plain_names(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Each weight of ``model`` after ``apply_lora`` (adapters left out) as ``(name, first_row)`` in a plain
    ``GPT``'s state dict: the adapted weights sit under ``<layer>.base_layer``, and a split qkv's q, k and v
    are rows of the fused ``qkv``."""
    splits = {name: m.sizes for name, m in model.named_modules() if isinstance(m, SplitQKV)}
    out = {}
    for key in model.state_dict():
        if "lora_" in key:
            continue
        plain = key.replace(".base_layer", "")
        layer, _, kind = plain.rpartition(".")
        fused, _, part = layer.rpartition(".")
        if fused in splits and part in PROJECTIONS:
            index = PROJECTIONS.index(part)
            out[key] = (f"{fused}.{kind}", sum(splits[fused][:index]))
        else:
            out[key] = (plain, 0)
    return out


def reset_lora(model: nn.Module) -> None:
    """Re-initialise the adapters (A random, B zero: the model starts unchanged); needed after a
    strategy materialised a meta-device model with each module's generic ``reset_parameters``."""
    for _, layer in lora_layers(model):
        layer.reset_lora_parameters(ADAPTER, True)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain ``nn.Linear`` back, the split qkv
    fused again (in place): a plain ``GPT`` with ``GPT.state_dict()``'s names."""
    for name, layer in lora_layers(model):
        layer.merge()
        _replace(model, name, layer.get_base_layer())
    for name, split in [(n, m) for n, m in model.named_modules() if isinstance(m, SplitQKV)]:
        _replace(model, name, split.fused())
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
