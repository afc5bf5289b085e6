"""Test helpers for DataParallelStrategy runs launched through the CLI (importable as ``strategy_probe``
with ``tests/helpers`` on PYTHONPATH).

``PatternDataModule``: deterministic, learnable token sequences (no files, no download), one epoch of a
fixed number of global batches in a fixed order. ``StrategyProbe``: records, per optimizer step, the
loss averaged over all ranks, and at the end the bytes of parameters, gradients and optimizer state
this rank holds, plus what the strategy decided; each rank writes ``<output_dir>/rank<R>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_train import PretrainModule
from lightning_train.strategies.memory import measured_state_bytes


class PatternDataset(Dataset):
    """Sequences ``(start + stride * t) % vocab``: next-token prediction a tiny model learns quickly."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (samples, 1), generator=generator)
        stride = torch.randint(1, 8, (samples, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


class PatternDataModule(L.LightningDataModule):
    def __init__(
        self, samples: int = 96, seq_len: int = 16, vocab_size: int = 64, batch_size: int = 8
    ) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dataset = PatternDataset(samples, seq_len, vocab_size)

    def train_dataloader(self) -> DataLoader:
        # the same order every epoch, dealt round-robin: rank r of W gets samples r, r+W, r+2W, ...
        kwargs = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.dataset, shuffle=False, **kwargs)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler)


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


class LabelSmoothedPretrain(PretrainModule):
    """docs/pretraining.md's subclassing example: a loss torch's vocab-parallel cross-entropy cannot take."""

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                               label_smoothing=0.1)


def _mesh_groups(mesh: Any) -> dict[str, list[int]]:
    """The global ranks of this rank's group along each named dimension of ``mesh``."""
    if mesh is None:
        return {}
    return {name: mesh[name].mesh.flatten().tolist() for name in mesh.mesh_dim_names}


class StrategyProbe(L.Callback):
    def __init__(self, output_dir: str) -> None:
        self.output_dir = Path(output_dir)
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self._pending = 0.0
        self.micro_steps: list[dict[str, Any]] = []
        self.memory: dict[str, int] = {}
        self.logits: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # initial weights, gathered to full tensors: equal across strategies for the same seed
        params = [p.detach() for p in pl_module.parameters()]
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
        self.initial_weights = [[float(w.double().sum()), float(w.double().norm())] for w in full]
        head = next((m for name, m in pl_module.named_modules() if name.endswith("lm_head")), None)
        if head is not None:  # a pipeline's middle stages have none
            head.register_forward_hook(self._record_logits)

    def _record_logits(self, module: Any, args: Any, logits: torch.Tensor) -> None:
        """The logits' layout in training: whole, or this rank's DTensor shard (tensor parallelism)."""
        local = logits.to_local() if hasattr(logits, "to_local") else logits
        self.logits = {
            "dtensor": hasattr(logits, "to_local"), "shape": list(logits.shape),
            "local_shape": list(local.shape),
            "placements": [str(p) for p in getattr(logits, "placements", ())],
        }

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if not hasattr(model, "require_backward_grad_sync"):
            return  # only DDP all-reduces in backward
        grad = next(p.grad for p in pl_module.parameters() if p.grad is not None).sum().reshape(1)
        grads = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(grads, grad)
        self.micro_steps.append(
            {
                "grad_sync": bool(model.require_backward_grad_sync),
                "grads_equal_across_ranks": all(torch.equal(g, grads[0]) for g in grads),
            }
        )

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        # the total gradient norm before Lightning clips: the strategy's (max_norm=inf leaves the
        # gradients as they are), or computed directly in a single process
        if hasattr(trainer.strategy, "clip_grad_norm_"):
            norm = trainer.strategy.clip_grad_norm_(float("inf"))
        else:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in pl_module.parameters() if p.grad is not None]
            )
        self.grad_norms.append(float(norm))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._pending += _mean_over_ranks(outputs["loss"])  # already divided by accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(self._pending)
            self._pending = 0.0
        self.memory = measured_state_bytes(pl_module, trainer.optimizers[0])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        recovery = next((c for c in trainer.callbacks if type(c).__name__ == "NaNRecovery"), None)
        report = {
            # the gradient norm NaNRecovery judged each step by (its recent steps: step, loss, norm)
            "judged_grad_norms": [norm for _, _, norm in recovery.state_dict()["recent"]] if recovery else [],
            "losses": self.losses,
            "initial_weights": self.initial_weights,
            "grad_norms": self.grad_norms,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "mesh_groups": _mesh_groups(getattr(strategy, "device_mesh", None)),
            "strategy": type(strategy).__name__,
            "sharding": getattr(strategy, "sharding", None),
            "registered_comm_hook": getattr(strategy, "registered_comm_hook", None),
            "micro_steps": self.micro_steps,
            "memory": self.memory,
            "logits": self.logits,
            # the modules FSDP2 made units of; the parameters tensor parallelism split
            "fsdp_units": [name for name, m in pl_module.named_modules() if isinstance(m, FSDPModule)],
            "tp_split_params": [
                name for name, p in pl_module.named_parameters()
                if "tp" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())
                and any(placement.is_shard() for placement in p.placements)
            ],
        }
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))
