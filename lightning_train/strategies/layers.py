"""The decoder layers of any model: what FSDP2 shards one unit at a time, activation checkpointing
recomputes, and a pipeline splits.

``decoder_layers`` finds them in the model itself, in this order:

1. ``layer_classes`` (``ParallelStrategy``'s option): submodules of those class names;
2. our GPT: its ``blocks``;
3. a transformers model: the classes its ``_no_split_modules`` names (``LlamaDecoderLayer``, ...);
4. the longest ``nn.ModuleList`` of modules of one class (the repeated blocks of most models).

``model_root`` is the module that holds them and the rest of the network (embeddings, final norm,
head): FSDP2's root unit, the module a pipeline splits (``layer_stages.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl
from torch import nn

from lightning_train.errors import UserInputError


def find_transformer(model: nn.Module) -> nn.Module | None:
    """The first submodule holding its layers in an ``nn.ModuleList`` named ``blocks`` (our GPT)."""
    for module in model.modules():
        if isinstance(getattr(module, "blocks", None), nn.ModuleList):
            return module
    return None


def decoder_layers(model: nn.Module, layer_classes: Sequence[str] | None = None) -> list[nn.Module]:
    """The decoder layers of ``model``, in order (module doc); [] when none is found."""
    if layer_classes:
        names = set(layer_classes)
        layers = _outermost(model, lambda module: type(module).__name__ in names)
        if not layers:
            found = sorted({type(m).__name__ for m in model.modules() if any(True for _ in m.parameters())})
            raise UserInputError(
                f"layer_classes={sorted(names)} matches no module of {type(model).__name__}; use class names "
                f"of its repeated layers, among: {', '.join(found)}"
            )
        return layers
    transformer = find_transformer(model)
    if transformer is not None:
        return list(transformer.blocks)
    no_split = {name for module in model.modules() for name in getattr(module, "_no_split_modules", ()) or ()}
    if no_split:
        layers = _outermost(model, lambda module: type(module).__name__ in no_split)
        if layers:
            return layers
    return list(max(_repeated_lists(model), key=len, default=[]))


def model_root(module: nn.Module, layers: Sequence[nn.Module]) -> nn.Module:
    """The network itself: for a LightningModule, its direct child holding the layers (``self.model``);
    else ``module``."""
    if isinstance(module, pl.LightningModule) and layers:
        for child in module.children():
            if any(inner is layers[0] for inner in child.modules()):
                return child
    return module


def _outermost(model: nn.Module, matches: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The submodules ``matches`` accepts, in order, not counting those inside an accepted one."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if matches(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _repeated_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The ``nn.ModuleList``s of two or more modules of one class that hold parameters."""
    return [
        module for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1
        and len({type(child) for child in module}) == 1 and any(True for _ in module.parameters())
    ]
