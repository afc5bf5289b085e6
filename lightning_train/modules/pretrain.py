"""PretrainModule: next-token-prediction training of a GPT, made to be subclassed.

Override ``build_model`` (another architecture), ``compute_loss`` (another objective) or
``configure_param_groups`` (other weight-decay / LR rules); everything else stays as is.

    >>> import lightning as L
    >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
    >>> module = PretrainModule(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64))
    >>> trainer = L.Trainer(max_steps=20, accelerator="cpu")  # doctest: +SKIP
    >>> trainer.fit(module, TextDataModule(seq_len=64, batch_size=8))  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lightning_train.errors import UserInputError
from lightning_train.models.float8 import check_float8_device, convert_to_float8
from lightning_train.models.gpt import GPT, GPTConfig


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1 over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio`` at ``decay_steps``, constant after that."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class PretrainModule(L.LightningModule):
    """Trains a causal language model on batches ``{"input_ids": (B, T), "labels": (B, T)}``;
    label -100 is ignored.

    Args:
        config: the model's shape (see ``GPTConfig``).
        learning_rate: peak LR after warmup.
        min_lr: LR at the end of the cosine decay.
        warmup_steps: optimizer steps of linear warmup.
        decay_steps: optimizer step at which the cosine reaches ``min_lr``; None: the Trainer's
            ``max_steps`` (or its estimate of the total steps).
        weight_decay: AdamW decay for matrices; norms, biases and embeddings get none.
        betas, eps: AdamW's.
        compile: ``torch.compile`` the model (after a strategy has wrapped it).
        float8: run the Linear layers' matmuls in float8 (torchao; a CUDA GPU with compute capability
            >= 8.9, e.g. H100). Applied before ``compile``; see ``lightning_train.models.float8``.
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        learning_rate: float = 1e-3,
        min_lr: float = 1e-4,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        compile: bool = False,
        float8: bool = False,
    ) -> None:
        super().__init__()
        for name, value, bad, fix in (  # each bad value as one line naming it and the fix
            ("learning_rate", learning_rate, learning_rate <= 0, "must be > 0, e.g. 1e-3"),
            ("min_lr", min_lr, not 0 <= min_lr <= learning_rate, "must be in [0, learning_rate]"),
            ("warmup_steps", warmup_steps, warmup_steps < 0, "must be >= 0 (0: no warmup)"),
            ("decay_steps", decay_steps, decay_steps is not None and decay_steps < 1, "must be >= 1 or null"),
            ("weight_decay", weight_decay, weight_decay < 0, "must be >= 0, e.g. 0.1"),
            ("betas", betas, not all(0 <= b < 1 for b in betas), "must each be in [0, 1), e.g. [0.9, 0.95]"),
            ("eps", eps, eps <= 0, "must be > 0, e.g. 1e-8"),
        ):
            if bad:
                raise UserInputError(f"{name}={value} {fix}")
        self.save_hyperparameters()
        self.config = config or GPTConfig()
        self.model: nn.Module | None = None
        self.val_loss = MeanMetric()

    # ---- hooks meant for subclasses -------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The network; called once in ``configure_model`` (under the strategy's init context)."""
        return GPT(self.config)

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the labels that are not -100."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def configure_param_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: weight decay on matrices only (not on norms, biases or embeddings)."""
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            is_embedding = "embed" in name.split(".")[0]
            (decay if param.ndim >= 2 and not is_embedding else no_decay).append(param)
        return [
            {"name": "decay", "params": decay, "weight_decay": self.hparams.weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]

    # ---- Lightning hooks ------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = self.build_model()
        device = self.trainer.strategy.root_device if self._trainer else torch.device("cpu")
        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls autocast leaves
        if self.hparams.float8:
            check_float8_device(device)
            convert_to_float8(self.model)
        if self.hparams.compile:
            self.model.compile()

    def setup(self, stage: str) -> None:
        self.configure_model()  # so the model exists outside a Trainer too, e.g. in tests
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
        if datamodule is None or not isinstance(self.model, GPT):
            return
        max_id, seq_len = getattr(datamodule, "max_token_id", None), getattr(datamodule, "seq_len", None)
        if max_id is not None and max_id >= self.config.vocab_size:
            raise UserInputError(
                f"the data holds token id {max_id} but the model's vocab_size is {self.config.vocab_size}; "
                f"set model.config.vocab_size >= {max_id + 1} or prepare the data with the model's tokenizer"
            )
        if seq_len is not None and seq_len > self.config.block_size:
            raise UserInputError(
                f"data.seq_len={seq_len} is longer than the model's context "
                f"model.config.block_size={self.config.block_size}; lower seq_len or raise block_size"
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(self(batch["input_ids"]), batch["labels"])
        # Not prog_bar=True: Lightning would read the loss to the host (a GPU sync) after every batch, shown
        # or not. TokenProgressBar reads it when it redraws.
        self.log("train/loss", loss)
        # A logged float is copied to the device each time: log it when it is written.
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def on_validation_epoch_start(self) -> None:
        # Reset here, not at the epoch's end, and outside inference mode: states left as inference tensors
        # by a `trainer.validate()` could not be updated by a later `fit()` (torch refuses in-place updates).
        with torch.inference_mode(False):
            self.val_loss.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self.compute_loss(self(batch["input_ids"]), batch["labels"])
        self.val_loss.update(loss, weight=(batch["labels"] != -100).sum())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # synced across ranks by torchmetrics
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", loss.exp())

    def configure_optimizers(self) -> dict[str, Any]:
        params = self.configure_param_groups()
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.learning_rate, betas=self.hparams.betas, eps=self.hparams.eps,
            **_fastest_adamw_kwargs(params),
        )
        decay_steps = self.hparams.decay_steps or self._total_steps()
        min_ratio = self.hparams.min_lr / self.hparams.learning_rate
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, decay_steps, min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.trainer.max_steps and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise UserInputError(
                "cannot infer the length of the LR schedule: set trainer.max_steps, trainer.max_epochs "
                "or model.decay_steps"
            )
        return int(steps)


def _fastest_adamw_kwargs(param_groups: list[dict[str, Any]]) -> dict[str, bool]:
    """``fused=True`` where every parameter is a plain floating tensor on a device with a fused
    kernel (CUDA, CPU); otherwise the multi-tensor ``foreach`` path (e.g. FSDP2's DTensors)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in param_groups for p in group["params"]]
    fusable = all(
        not isinstance(p, DTensor) and p.is_floating_point() and p.device.type in ("cuda", "cpu")
        for p in params
    )
    return {"fused": True} if fusable and params else {"foreach": True}
