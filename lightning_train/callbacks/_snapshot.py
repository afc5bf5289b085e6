"""Host-memory snapshots of the training state, for ``NaNRecovery``'s rollbacks.

A snapshot holds the LightningModule's ``state_dict`` tensors, every optimizer's state and
hyper-parameters, the LR schedulers' and the precision plugin's (GradScaler's) state. Each rank keeps
its own local tensors: under FSDP2 these are the DTensors' local shards, so a snapshot costs every
rank (parameters + optimizer state) / world_size of host memory — with AdamW, three copies of the
(local) parameters. Host buffers are allocated once and refilled in place.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch

from lightning_train.callbacks._common import local_tensor


class HostSnapshot:
    """The training state at optimizer step ``step``, in host memory; ``take`` refills it, ``restore``
    writes it back in place (same tensors, so the optimizer keeps pointing at the parameters)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self._model: dict[str, torch.Tensor] = {}
        self._optimizers: list[dict[str, Any]] = []
        self._schedulers: list[dict[str, Any]] = []
        self._precision: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        tensors = list(self._model.values()) + [
            value for opt in self._optimizers for state in opt["state"] for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def take(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step
        for name, tensor in pl_module.state_dict().items():
            self._model[name] = _host_copy(tensor, self._model.get(name))
        previous = self._optimizers
        self._optimizers = []
        for i, optimizer in enumerate(trainer.optimizers):
            old_states = previous[i]["state"] if i < len(previous) else []
            states = []
            for j, param in enumerate(_params(optimizer)):
                old = old_states[j] if j < len(old_states) else {}
                state = optimizer.state.get(param, {})
                states.append({key: _host_copy(value, old.get(key)) if isinstance(value, torch.Tensor)
                               else copy.deepcopy(value) for key, value in state.items()})
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                      for g in optimizer.param_groups]
            self._optimizers.append({"state": states, "groups": groups})
        self._schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        self._precision = copy.deepcopy(trainer.precision_plugin.state_dict())

    def restore(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.step is None:
            raise RuntimeError("HostSnapshot.restore before take")
        with torch.no_grad():
            for name, tensor in pl_module.state_dict().items():
                local_tensor(tensor).copy_(self._model[name])
            for optimizer, saved in zip(trainer.optimizers, self._optimizers, strict=True):
                for param, state in zip(_params(optimizer), saved["state"], strict=True):
                    if not state:  # no state yet at the snapshot: as if never stepped
                        optimizer.state.pop(param, None)
                        continue
                    live = optimizer.state[param]
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor):
                            local_tensor(live[key]).copy_(value)
                        else:
                            live[key] = copy.deepcopy(value)
                for group, saved_group in zip(optimizer.param_groups, saved["groups"], strict=True):
                    group.update(copy.deepcopy(saved_group))
        for config, state in zip(trainer.lr_scheduler_configs, self._schedulers, strict=True):
            config.scheduler.load_state_dict(copy.deepcopy(state))
        if self._precision:
            trainer.precision_plugin.load_state_dict(copy.deepcopy(self._precision))


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _host_copy(tensor: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    local = local_tensor(tensor.detach())
    if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
        buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
    return buffer.copy_(local)
