"""Muon on the blocks' weight matrices, AdamW on the rest, as one optimizer (``PretrainModule``'s
``optimizer="muon"``).

``torch.optim.Muon`` orthogonalises each matrix's momentum by Newton-Schulz iterations, which must see the
whole matrix: on an FSDP2 or tensor-parallel shard they would orthogonalise the shard instead. Here a
DTensor's update is gathered whole (``full_tensor``: one all-gather a matrix), orthogonalised on every rank
(the same arithmetic as one process), and each rank keeps its own slice (``distribute_tensor`` with
``src_data_rank=None``: no communication). Why gather rather than a DTensor-aware Newton-Schulz: five
iterations of three matmuls on a sharded matrix would redistribute at each matmul, while one gather is one
collective and the iterations then run at full matmul speed; the cost is the whole matrix's Newton-Schulz on
every rank, which for the block matrices is small beside the forward and backward (docs/benchmarks.md).
The momentum buffer stays sharded like its parameter, so the optimizer state is as sharded as AdamW's.

Lightning's automatic optimization drives one optimizer, so ``MuonAdamW`` is one: its ``param_groups`` are
the Muon groups then the AdamW groups (one LR schedule scales both), its ``state`` the two inner
optimizers' shared dict (checkpoints, DCP and the loss scaler see one ordinary optimizer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_train._compat import muon_adjusted_lr, muon_orthogonalise


class GatheringMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz sees the whole matrix of a DTensor parameter (module doc);
    on plain tensors it takes the same steps as ``torch.optim.Muon``."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:  # torch.optim.Muon's name, so either can load the other's
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = _orthogonalised(update, group)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def _orthogonalised(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    if not isinstance(update, DTensor):
        return muon_orthogonalise(update, group)
    whole = muon_orthogonalise(update.full_tensor(), group).to(update.dtype)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer: ``GatheringMuon`` on the groups marked ``"muon": True``, ``torch.optim.AdamW`` on the
    others (module doc). ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to AdamW's RMS, so one
    ``lr`` and one schedule serve both (Moonshot's recipe).

        >>> import torch
        >>> from lightning_train.modules.muon import MuonAdamW
        >>> matrix, bias = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.zeros(8))
        >>> optimizer = MuonAdamW([{"params": [matrix], "muon": True}, {"params": [bias]}], lr=0.02)
        >>> (matrix @ torch.ones(4) + bias).square().sum().backward()
        >>> optimizer.step()
        >>> sorted(optimizer.state[matrix]), sorted(optimizer.state[bias])
        (['momentum_buffer'], ['exp_avg', 'exp_avg_sq', 'step'])
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_kwargs: dict[str, Any] | None = None,
    ) -> None:
        muon_groups = [group for group in param_groups if group.get("muon")]
        adamw_groups = [group for group in param_groups if not group.get("muon")]
        self.muon = GatheringMuon(
            muon_groups, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw"
        )
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, **(adamw_kwargs or {}))
        super().__init__([p for group in param_groups for p in group["params"]], {"lr": lr})
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]  # the inner ones, shared
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state dict: share them again
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self.muon.step(closure)  # the closure runs once, before either update
        self.adamw.step()
        return loss
