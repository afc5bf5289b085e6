"""LoRA adapters for our GPT through peft (no Lightning imports).

peft's ``inject_adapter_in_model`` works on any ``nn.Module``: it swaps the targeted ``nn.Linear``
layers for LoRA layers in place (the frozen weight moves to ``<name>.base_layer``; ``lora_A``/``lora_B``
are added) and freezes everything else. The model stays our ``GPT``, so generation, FSDP wrapping
and checkpointing work unchanged; ``merge_lora`` folds the adapters back into plain ``nn.Linear``s.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_train.errors import UserInputError

ADAPTER = "default"
BLOCK_LINEARS = ("qkv", "proj", "gate", "up", "down")  # the default targets, where the model has them


@dataclass
class LoRAConfig:
    """Low-rank adapters ``W + (alpha / rank) * B @ A`` on the named linear layers.

    Args:
        rank: inner dimension of ``B @ A``.
        alpha: scale numerator; the update is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input.
        target_modules: names (last component) of the ``nn.Linear`` layers to adapt; our GPT's are
            ``qkv`` and ``proj`` (attention), ``gate`` (SwiGLU only), ``up`` and ``down`` (MLP).
            None: every one of those the model has.

    Example (``FinetuneModule(lora=LoRAConfig(...))`` does the same inside a Trainer):

        >>> import torch
        >>> from lightning_train import GPT, GPTConfig, LoRAConfig
        >>> from lightning_train.models.lora import apply_lora, merge_lora
        >>> model = GPT(GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_embd=32, n_head=2))
        >>> model = apply_lora(model, LoRAConfig(rank=4, target_modules=["qkv", "proj"]))
        >>> sorted({n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad})
        ['proj', 'qkv']
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


def apply_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Inject LoRA layers into ``model`` in place and freeze every non-adapter parameter."""
    from peft import LoraConfig
    from peft.functional import inject_adapter_in_model

    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    linear_names = sorted({name.rsplit(".", 1)[-1] for name in linears})
    targets = config.target_modules
    if targets is None:
        targets = [name for name in BLOCK_LINEARS if name in linear_names]
    unknown = [t for t in targets if t not in linear_names]
    if unknown or not targets:
        raise UserInputError(
            f"lora.target_modules={targets} names no linear layer of the model ({unknown}); "
            f"pick from {linear_names}"
        )
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if "lm_head" in targets and tied:
        raise UserInputError(
            "lora.target_modules includes 'lm_head', whose weight is tied to the embedding; merging would "
            "change the embedding too. Leave 'lm_head' out or use a model with tie_embeddings: false"
        )
    if config.rank < 1:
        raise UserInputError(f"lora.rank={config.rank} must be at least 1")
    peft_config = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
        target_modules=list(targets),
    )
    return inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every peft LoRA layer in ``model``."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def reset_lora(model: nn.Module) -> None:
    """Re-initialise the adapters (A random, B zero: the model starts unchanged); needed after a
    strategy materialised a meta-device model with each module's generic ``reset_parameters``."""
    for _, layer in lora_layers(model):
        layer.reset_lora_parameters(ADAPTER, True)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain ``nn.Linear`` back (in place)."""
    for name, layer in lora_layers(model):
        layer.merge()
        parent_name, _, child = name.rpartition(".")
        base = layer.get_base_layer()
        base.weight.requires_grad_(True)
        if base.bias is not None:
            base.bias.requires_grad_(True)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, base)
    return model
