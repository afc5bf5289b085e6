"""Optimizer states keyed by parameter name: a single checkpoint file numbers an optimizer's parameters
in the order of its groups, which only the same model and layout can read back. Naming them lets a part
of the model (a pipeline stage) find its own, and ``set_optimizer_state_dict`` load them into shards.

Kept apart from ``sharded`` so that saving a single file never imports ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_train.errors import UserInputError


def name_optimizer_states(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Record beside each of ``checkpoint``'s numbered optimizer states (a single file's) the names of its
    parameters, in torch's numbering order: a layout that holds part of the model (a pipeline stage)
    then finds its own parameters' state (``optimizer_state_by_name``). Sharded states are keyed by
    name already and are left as they are."""
    name_of = {id(param): name for name, param in module.named_parameters()}
    for state, optimizer in zip(checkpoint.get("optimizer_states", []), optimizers, strict=False):
        numbered = [index for group in state.get("param_groups", []) for index in group["params"]]
        if numbered and all(isinstance(index, int) for index in numbered):
            state["param_names"] = [
                name_of[id(param)] for group in optimizer.param_groups for param in group["params"]
            ]


def optimizer_state_by_name(
    state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as a checkpoint file holds it (parameters numbered in the order of the
    optimizer's groups) keyed by parameter name, the form ``set_optimizer_state_dict`` loads. A file that
    records the names (``param_names``, as ``name_optimizer_states`` writes) may hold more parameters than
    ``module`` (a pipeline stage): only this module's are kept.

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); optimizer.step()
        >>> keyed = optimizer_state_by_name(optimizer.state_dict(), model, optimizer)
        >>> sorted(keyed["state"]), keyed["param_groups"][0]["params"]
        (['0.bias', '0.weight'], ['0.weight', '0.bias'])
    """
    name_of = {id(param): name for name, param in module.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    numbered = [index for group in state["param_groups"] for index in group["params"]]
    if "param_names" in state:
        name_by_index, own = dict(zip(numbered, state["param_names"], strict=True)), set(names)
        return {
            "state": {name_by_index[i]: v for i, v in state["state"].items() if name_by_index[i] in own},
            "param_groups": [
                {**group, "params": [name_by_index[i] for i in group["params"] if name_by_index[i] in own]}
                for group in state["param_groups"]
            ],
        }
    if len(numbered) != len(names):
        raise UserInputError(
            f"the checkpoint's optimizer state covers {len(numbered)} parameters, this model's optimizer "
            f"{len(names)}; resume with the model and optimizer settings the checkpoint was trained with"
        )
    name_by_index = dict(zip(numbered, names, strict=True))
    return {
        "state": {name_by_index[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [name_by_index[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def numbered_optimizer_state(
    by_name: dict[str, Any], module: nn.Module, param_groups: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``{"state": {name: ...}, "settings": {name: ...}}``, as
    ``sharded.read_whole_sharded_checkpoint`` reads it from a folder) numbered the way
    ``Optimizer.load_state_dict`` expects it of an optimizer built from ``param_groups`` over ``module``'s
    parameters: the groups in order, each with the saved settings of its parameters.

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> groups = [{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}]
        >>> saved = {"state": {"bias": {"step": 3}}, "settings": {"weight": {"lr": 0.1}, "bias": {"lr": 0.2}}}
        >>> numbered_optimizer_state(saved, model, groups)
        {'state': {1: {'step': 3}}, 'param_groups': [{'lr': 0.1, 'params': [0]}, {'lr': 0.2, 'params': [1]}]}
    """
    name_of = {id(param): name for name, param in module.named_parameters()}
    state: dict[int, Any] = {}
    numbered: list[dict[str, Any]] = []
    start = 0
    for group in param_groups:
        names = [name_of[id(param)] for param in group["params"]]
        missing = [name for name in names if name not in by_name["settings"]]
        if missing:
            raise UserInputError(
                f"the checkpoint's optimizer state has no entry for {len(missing)} of this model's "
                f"parameters (e.g. {missing[:3]}); resume with the model and optimizer settings it was "
                "trained with"
            )
        indices = list(range(start, start + len(names)))
        start += len(names)
        state.update({i: by_name["state"][name] for i, name in zip(indices, names, strict=True)
                      if name in by_name["state"]})
        own = {key: value for key, value in group.items() if key != "params"}  # a group with no parameters
        settings = by_name["settings"][names[0]] if names else own
        numbered.append({**settings, "params": indices})
    return {"state": state, "param_groups": numbered}
