"""Test-only fault injection for the recovery tests: a callback that breaks chosen optimizer steps, and a
tiny learnable dataset. Usable from YAML/CLI by class path (``tests.helpers.nan_faults.InjectFault``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_train.callbacks import NaNRecovery


class InjectFault(Callback):
    """Breaks the optimizer steps in ``steps`` (and every ``every``-th step), on ``rank`` or on all ranks.

    kinds: ``nan_loss`` (the module's output becomes NaN, so loss and gradients do), ``spike`` (the
    output is multiplied by ``factor``: a finite, much larger loss), ``inf_grad`` (one gradient entry of
    the parameters whose name contains ``param`` becomes inf, after backward), ``bad_batch`` (the batch's
    first row becomes all zeros, a row ``PatternTokens`` never makes, and a forward of any batch holding
    such a row gives NaN: the fault travels with the batch, whichever rank computes it).
    ``once``: ``nan_loss``/``spike`` hit the step's first forward only (a transient fault: a rerun of the
    step computes cleanly); otherwise every forward until the batch ends.
    Records ``trained_batches``: ``(global_step, input_ids)`` of every batch that reached ``training_step``.
    """

    def __init__(
        self,
        kind: Literal["nan_loss", "spike", "inf_grad", "bad_batch"] = "nan_loss",
        steps: list[int] | None = None,
        every: int | None = None,
        from_step: int | None = None,
        rank: int | None = None,
        param: str = "blocks.0.mlp",
        factor: float = 50.0,
        once: bool = False,
    ) -> None:
        self.kind, self.steps, self.every, self.from_step = kind, set(steps or []), every, from_step
        self.rank, self.param, self.factor, self.once = rank, param, factor, once
        self._hook: Any = None
        self.injected: list[int] = []
        self.trained_batches: list[tuple[int, torch.Tensor]] = []

    def _active(self, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        chosen = (step in self.steps or (self.every is not None and (step + 1) % self.every == 0)
                  or (self.from_step is not None and step >= self.from_step))
        return chosen and (self.rank is None or trainer.global_rank == self.rank)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.kind == "bad_batch":  # for the whole run: NaN wherever a poisoned batch is computed
            pl_module.register_forward_hook(_nan_for_poisoned_rows)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.kind == "bad_batch" and self._active(trainer):
            batch["input_ids"][0] = 0
            self.injected.append(trainer.global_step)
        self.trained_batches.append((trainer.global_step, batch["input_ids"].clone()))
        if self.kind in ("nan_loss", "spike") and self._active(trainer):
            factor = float("nan") if self.kind == "nan_loss" else self.factor

            def hit(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
                if self.once:
                    self._hook.remove()
                return output * factor

            self._hook = pl_module.register_forward_hook(hit)
            self.injected.append(trainer.global_step)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.kind == "inf_grad" and self._active(trainer):
            for name, param in pl_module.named_parameters():
                if self.param in name and param.grad is not None:
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    grad.view(-1)[0] = float("inf")  # FSDP2: this rank's shard
            self.injected.append(trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _nan_for_poisoned_rows(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    """A forward hook: NaN logits for token ids holding an all-zero row (DDP's redirected call of the
    module with the whole batch, which Lightning makes too, passes through)."""
    ids = args[0] if args else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and (ids == 0).all(1).any():
        return output * float("nan")
    return output


class PatternTokens(Dataset):
    """Sequences ``t[i+1] = (a * t[i] + b) % vocab`` with a few (a, b) rules: learnable in a few hundred
    steps by a tiny model, so a damaged run shows in the loss."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        rules = torch.tensor([[1, 1], [1, 3], [5, 7], [3, 2]])
        rule = rules[torch.randint(0, len(rules), (num_samples,), generator=g)]
        tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=g)
        for i in range(seq_len):
            tokens[:, i + 1] = (rule[:, 0] * tokens[:, i] + rule[:, 1]) % vocab_size
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


class PatternDataModule(L.LightningDataModule):
    """``PatternTokens`` behind a StatefulDataLoader (its position is saved in checkpoints)."""

    def __init__(
        self, num_samples: int = 4096, seq_len: int = 16, vocab_size: int = 64, batch_size: int = 8
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.train = PatternTokens(num_samples, seq_len, vocab_size, seed=1)
        self.val = PatternTokens(64, seq_len, vocab_size, seed=2)

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self.train, batch_size=self.batch_size, shuffle=True,
                                  generator=torch.Generator().manual_seed(0))

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self.val, batch_size=self.batch_size)


class DumpState(Callback):
    """At the end of training, every rank writes ``rank<r>.json`` into ``folder``: a digest of its
    parameters and optimizer state, its LR-schedule position and NaNRecovery's counters."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        digest = hashlib.sha256()
        optimizer = trainer.optimizers[0]
        for param in pl_module.parameters():  # local shards under FSDP2
            for tensor in (param, *optimizer.state[param].values()):
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                digest.update(local.detach().numpy().tobytes())
        recovery = next(c for c in trainer.callbacks if isinstance(c, NaNRecovery))
        record = {"rank": trainer.global_rank, "digest": digest.hexdigest(),
                  "global_step": trainer.global_step, **recovery.state_dict(),
                  "last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch}
        path = Path(self.folder) / f"rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, default=str))
