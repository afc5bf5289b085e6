"""Host-memory snapshots of the training state, for ``NaNRecovery``'s rollbacks.

A snapshot holds the LightningModule's ``state_dict`` tensors, every optimizer's state and
hyper-parameters, and the step object's state: the LR schedulers' and the GradScaler's. Each rank keeps
its own local tensors: under FSDP2 these are the DTensors' local shards, so a snapshot costs every
rank (parameters + optimizer state) / world_size of host memory — with AdamW, three copies of the
(local) parameters. Host buffers are allocated once and refilled in place.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_train.plugins.grad_norm import local_tensor
from lightning_train.plugins.step import step_control


class HostSnapshot:
    """The training state at optimizer step ``step``, in host memory; ``take`` refills it, ``restore``
    writes it back in place (same tensors, so the optimizer keeps pointing at the parameters)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self._model: dict[str, torch.Tensor] = {}
        self._optimizers: list[dict[str, Any]] = []
        self._step_state: dict[str, Any] = {}  # StepControl.state_dict: LR schedulers, loss scale
        self._reported_nbytes = 0

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
        self._step_state = copy.deepcopy(step_control(trainer).state_dict())
        if self.nbytes > self._reported_nbytes:  # the first one, and once the optimizer state exists
            self._reported_nbytes = self.nbytes
            size = f"{self.nbytes / 2**20:.1f} MiB"
            rank_zero_info(f"NaNRecovery: snapshots take {size} of host memory per rank")

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
        step_control(trainer).load_state_dict(copy.deepcopy(self._step_state))


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _host_copy(tensor: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    local = local_tensor(tensor.detach())
    if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
        buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
    return buffer.copy_(local)
