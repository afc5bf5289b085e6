"""Materialising a model built on the meta device, after the strategy laid it out: each rank allocates
only its own shards (``to_empty``) and initialises them.

A module with an ``init_weights()`` (our ``GPT``: layout-independent values, ``models.init``; the
convention of torchtitan and transformers) initialises itself and everything under it; any other module
gets its own ``reset_parameters()`` (PyTorch's layers), which, for a model of the user's own, gives
correct but layout-dependent values on CPU (DTensor's RNG matches one process on CUDA only). A
LightningModule with an ``init_weights()`` of its own sets everything allocated under it instead
(``FinetuneModule``: this rank's slices of its pretrained weights, no values drawn to be overwritten).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_train.errors import UserInputError


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta tensors under ``module`` (a LightningModule) on ``device``, a sharded parameter
    only its local shard, and initialise them (its own ``init_weights()``, where it has one). Each child
    whose tensors are all on meta is materialised whole (``to_empty``); the rest (metric states, weights
    already loaded) is left as it is."""
    own_init = getattr(module, "init_weights", None)
    _allocate(module, device, initialise=not callable(own_init))
    if callable(own_init):
        own_init()


def _allocate(module: nn.Module, device: torch.device, initialise: bool) -> None:
    for child in module.children():
        tensors = _tensors(child)
        if not any(t.is_meta for t in tensors):
            continue
        if all(t.is_meta for t in tensors):
            tied = _tied_names(child)
            child.to_empty(device=device)  # gives each name of a shared parameter a tensor of its own:
            for first, *others in tied:  # tie them again (a tied embedding and lm_head)
                for name in others:
                    owner, _, leaf = name.rpartition(".")
                    child.get_submodule(owner).register_parameter(leaf, child.get_parameter(first))
            if initialise:
                _initialise(child)
        else:
            _allocate(child, device, initialise)
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise UserInputError(
            f"{type(module).__name__} holds parameters or buffers of its own built on the meta device "
            f"({', '.join(left)}); build them in a child module, e.g. self.model in configure_model"
        )


def _tied_names(module: nn.Module) -> list[list[str]]:
    """The names of each parameter that ``module`` holds under several names."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _initialise(module: nn.Module) -> None:
    init_weights = getattr(module, "init_weights", None)
    if callable(init_weights):
        init_weights()  # the whole subtree: it knows its own scheme
        return
    reset_parameters = getattr(module, "reset_parameters", None)
    if callable(reset_parameters):
        reset_parameters()
    for child in module.children():
        _initialise(child)
