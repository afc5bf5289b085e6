"""PretrainModule: next-token-prediction training of a GPT, made to be subclassed.

Override ``build_model`` (another architecture), ``compute_loss`` (another objective) or
``configure_param_groups`` (other weight-decay / LR rules); everything else stays as is.
The config's ``vocab_size`` may be left None: the model then gets the data's (a data module's ``vocab_size``,
or its tokenizer's) padded to a multiple of 64, at set-up; a smaller ``vocab_size`` is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric

from lightning_train._compat import attached_trainer
from lightning_train.callbacks._common import is_logging_step
from lightning_train.checkpoint.optimizer_state import name_optimizer_states, numbered_optimizer_state
from lightning_train.errors import UserInputError
from lightning_train.models.float8 import check_float8_device, convert_to_float8
from lightning_train.models.gpt import GPT, GPTConfig, padded_vocab_size
from lightning_train.modules.muon import MuonAdamW
from lightning_train.plugins.step import step_control


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, cosine to ``min_lr_ratio`` at decay_steps."""
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
        config: the model's shape (see ``GPTConfig``); ``vocab_size`` None takes the data's, padded up to a
            multiple of 64 (258 byte tokens: 320).
        learning_rate: peak LR after warmup.
        min_lr: LR at the end of the cosine decay.
        warmup_steps: optimizer steps of linear warmup.
        decay_steps: optimizer step at which the cosine reaches ``min_lr``; None: the Trainer's
            ``max_steps`` (or its estimate of the total steps).
        weight_decay: AdamW decay for matrices; norms, biases and embeddings get none.
        betas, eps: AdamW's.
        optimizer: "adamw", or "muon": ``torch.optim.Muon`` on the blocks' weight matrices (embeddings, head,
            norms and biases stay on AdamW), its update scaled to AdamW's RMS so that ``learning_rate`` and
            the schedule serve both; correct under FSDP and tensor parallelism (``modules/muon.py``).
        compile: ``torch.compile`` the model (after a strategy has wrapped it).
        float8: run the Linear layers' matmuls in float8 (torchao; a CUDA GPU with compute capability
            >= 8.9, e.g. H100). Applied before ``compile``; see ``lightning_train.models.float8``.

    Example (a few steps on the default corpus; the vocabulary, 258 byte tokens padded to 320, comes from
    the data):

        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16), warmup_steps=2)
        >>> trainer = L.Trainer(
        ...     max_steps=3, accelerator="cpu", log_every_n_steps=1, limit_val_batches=2, logger=False,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> trainer.global_step, module.config.vocab_size
        (3, 320)
        >>> val = trainer.validate(module, TextDataModule(seq_len=16, batch_size=4), verbose=False)[0]
        >>> 0 < val["val/loss"] < 6  # ln(320) = 5.77 before any training
        True
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
        optimizer: str = "adamw",
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
            ("optimizer", repr(optimizer), optimizer not in ("adamw", "muon"), "must be 'adamw' or 'muon'"),
        ):
            if bad:
                raise UserInputError(f"{name}={value} {fix}")
        self.save_hyperparameters()
        self.config = GPTConfig(**config) if isinstance(config, dict) else config or GPTConfig()
        self.model: nn.Module | None = None
        self.val_loss = MeanMetric()  # token-weighted, synced across ranks by torchmetrics
        self.val_ppl = math.e ** self.val_loss  # a Metric too: exp of the synced mean
        self.val_source_loss: nn.ModuleDict | None = None  # name -> MeanMetric, for a mixture's sources
        self._step_loss_sums: torch.Tensor | None = None  # (loss x tokens, tokens) of this optimizer step

    # ---- hooks meant for subclasses -------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The network; called once in ``configure_model`` (under the strategy's init context)."""
        return GPT(self.config)

    @property
    def builds_on_meta(self) -> bool:
        """A sharding strategy may build the model on meta: the ``GPT``'s initial weights are one process's
        under any layout (``models.init``); an overridden ``build_model`` returns False unless told."""
        return type(self).build_model is PretrainModule.build_model

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the labels that are not -100. Under tensor parallelism the
        logits are a DTensor sharded by vocabulary (``ParallelStrategy(loss_parallel=True)``, the default),
        and ``F.cross_entropy`` of them runs vocab-parallel."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def configure_param_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: weight decay on matrices only (not on norms, biases or embeddings); with
        ``optimizer="muon"`` the blocks' 2-D matrices form a group of their own, marked ``"muon": True``."""
        muon, decay, no_decay = [], [], []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            top = name.split(".")[0]
            if param.ndim == 2 and top == "blocks" and self.hparams.get("optimizer") == "muon":
                muon.append(param)
            else:
                (decay if param.ndim >= 2 and "embed" not in top else no_decay).append(param)
        groups = [
            {"name": "muon", "params": muon, "weight_decay": self.hparams.weight_decay, "muon": True},
            {"name": "decay", "params": decay, "weight_decay": self.hparams.weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]
        return [group for group in groups if group["params"]]  # DCP's optimizer state refuses an empty group

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The built network before the speed settings: as is here; FinetuneModule adds LoRA, freezes."""
        return model

    # ---- Lightning hooks ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Builds the model once, the same way for every module: ``build_model``, ``prepare_model``, then
        float8 and ``torch.compile`` as asked. No process-wide setting: TF32 is the CLI's (or the user's)."""
        if self.model is not None:
            return
        if getattr(self.config, "vocab_size", 0) is None:
            raise UserInputError(
                "model.config.vocab_size is not set and no data module gave one; set model.config.vocab_size "
                "to the tokenizer's vocabulary size, or fit with a TextDataModule or SFTDataModule"
            )
        model = self.prepare_model(self.build_model())
        if self.hparams.float8:
            device = self.trainer.strategy.root_device if attached_trainer(self) else torch.device("cpu")
            check_float8_device(device)
            convert_to_float8(model)
        if self.hparams.compile:
            model.compile()
        self.model = model

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if attached_trainer(self) else None
        if datamodule is not None and isinstance(self.config, GPTConfig):
            self._fit_config_to(datamodule)
        names = getattr(datamodule, "source_names", None) or []
        if len(names) > 1 and self.val_source_loss is None:  # val/<source>/loss for each mixture source
            self.val_source_loss = nn.ModuleDict({name: MeanMetric() for name in names})
        if not attached_trainer(self):  # a Trainer calls configure_model next, under its strategy's contexts
            self.configure_model()  # so the model exists outside a Trainer too, e.g. in tests

    def _fit_config_to(self, datamodule: Any) -> None:
        """Take the data's vocabulary size (padded) where the config has none; refuse data it cannot read."""
        max_id, seq_len = getattr(datamodule, "max_token_id", None), getattr(datamodule, "seq_len", None)
        data_vocab_size = _data_vocab_size(datamodule)
        if self.config.vocab_size is None and data_vocab_size is not None:
            vocab_size = padded_vocab_size(data_vocab_size)
            self.config = dataclasses.replace(self.config, vocab_size=vocab_size)
            # Checkpoints record the vocabulary the model has, in the form given (the CLI's is a dict).
            given = self.hparams.get("config")
            resolved = {**given, "vocab_size": vocab_size} if isinstance(given, dict) else self.config
            self.hparams["config"] = resolved
        vocab_size = self.config.vocab_size
        if vocab_size is not None and data_vocab_size is not None and vocab_size < data_vocab_size:
            padded = padded_vocab_size(data_vocab_size)
            raise UserInputError(
                f"model.config.vocab_size={vocab_size} is smaller than the data's tokenizer vocabulary "
                f"({data_vocab_size} tokens); set model.config.vocab_size to at least {data_vocab_size}, "
                f"or to null to take the data's (padded to {padded})"
            )
        if max_id is not None and vocab_size is not None and max_id >= vocab_size:
            raise UserInputError(
                f"the data holds token id {max_id} but the model's vocab_size is {vocab_size}; "
                f"set model.config.vocab_size >= {max_id + 1} (or leave it unset to take the data's) "
                "or prepare the data with the model's tokenizer"
            )
        if seq_len is not None and seq_len > self.config.block_size:
            raise UserInputError(
                f"data.seq_len={seq_len} is longer than the model's context "
                f"model.config.block_size={self.config.block_size}; lower seq_len or raise block_size"
            )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; ``position_ids`` mark packed rows (``SFTDataModule(packing=True)``), which need our GPT."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        if kwargs and not isinstance(self.model, GPT):  # another model would let packed examples mix
            model = type(self.model).__name__
            raise UserInputError(f"data.packing=true needs our GPT (model: {model}); set data.packing=false")
        output = self.model(input_ids, **kwargs)
        return getattr(output, "logits", output)  # a transformers model (build_model's) returns an object

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        pipeline = self._pipeline()
        if pipeline is None:
            loss = self._loss(self(batch["input_ids"], batch.get("position_ids")), batch["labels"])
        else:  # the strategy's schedule runs forward and backward of every microbatch (loss detached)
            accumulation = self.trainer.accumulate_grad_batches
            loss = pipeline.train_step(
                batch["input_ids"], batch["labels"], self._loss, accumulation,
                scale=step_control(self.trainer).scale_loss, position_ids=batch.get("position_ids"),
                starts_step=batch_idx % accumulation == 0, ends_step=self._ends_step(batch_idx),
            )
        self._log_train_loss(loss, batch["labels"], batch_idx)
        # A logged float is copied to the device each time: log it when it is written.
        if is_logging_step(self.trainer, before_step=True):
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        # Lightning zeroes gradients between training_step and backward; a pipeline schedule runs backward
        # inside training_step and zeroes them before it (Pipeline.train_step)
        if self._pipeline() is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        control = step_control(self.trainer)
        by_norm = gradient_clip_val and gradient_clip_algorithm in (None, "norm")
        if by_norm and not control.grads_stay_scaled():  # scaled gradients: Lightning refuses to clip
            # by the step's one norm measurement, over every shard and pipeline stage (Lightning's own
            # clipping would measure again, and see this stage's gradients only)
            control.clip_grad_norm_(gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a single file's optimizer states name their parameters: a pipeline stage resumes its own part
        name_optimizer_states(checkpoint, self, self.trainer.optimizers)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a sharded folder read whole by a one-process strategy keys its optimizer state by parameter name:
        # number it as this module's optimizer numbers its parameters (the optimizer is not built yet)
        states = checkpoint.get("optimizer_states", [])
        if states and "settings" in states[0]:
            checkpoint["optimizer_states"] = [
                numbered_optimizer_state(states[0], self, self.configure_param_groups()), *states[1:]
            ]

    def _ends_step(self, batch_idx: int) -> bool:
        """Whether the optimizer steps after this batch (the last of ``accumulate_grad_batches``, or of the
        epoch)."""
        accumulate = self.trainer.accumulate_grad_batches
        return (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == self.trainer.num_training_batches

    def _pipeline(self) -> Any:
        """The strategy's pipeline schedule under pipeline parallelism (``ParallelStrategy``), else None."""
        return getattr(self.trainer.strategy, "pipeline", None) if attached_trainer(self) else None

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``compute_loss`` as a plain tensor. A vocab-parallel loss is a replicated DTensor: every rank of
        the tensor-parallel group holds the whole value, so its local tensor is the loss (and backward
        through it stays in the DTensor graph)."""
        try:
            loss = self.compute_loss(logits, labels)
        except RuntimeError as error:  # an op DTensor refuses: plain tensors mixed in, or no sharding
            if not isinstance(logits, DTensor) or not any(
                sign in str(error) for sign in ("DTensor", "sharding strategy")
            ):
                raise
            raise UserInputError(
                f"{type(self).__name__}.compute_loss failed on logits sharded by vocabulary (tensor "
                f"parallelism's vocab-parallel loss): {str(error).splitlines()[0]}; compute it with "
                "F.cross_entropy (torch's loss_parallel has no label_smoothing), or set "
                "trainer.strategy.loss_parallel=false to get the whole logits"
            ) from error
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The model's logits for ``input_ids`` (and packed rows' ``position_ids``), without backward; under
        pipeline parallelism the forward schedule's, on the ranks of the last stage (None on the others);
        under tensor parallelism a DTensor sharded by vocabulary (``full_tensor()`` gathers it)."""
        pipeline = self._pipeline()
        return (pipeline.forward if pipeline is not None else self)(input_ids, position_ids)

    def _log_train_loss(self, loss: torch.Tensor, labels: torch.Tensor, batch_idx: int) -> None:
        """``train/loss``: the token-weighted mean over the optimizer step's global batch (every data-parallel
        rank, every accumulated micro-batch), summed across ranks on logging steps only. Between them this
        rank's own value, for the progress bar: no collective, no host read. Not prog_bar=True: Lightning
        would read it to the host (a GPU sync) after every batch."""
        tokens = (labels != -100).sum()
        sums = torch.stack([loss.detach().float() * tokens, tokens.float()])
        accumulate = self.trainer.accumulate_grad_batches
        if batch_idx % accumulate and self._step_loss_sums is not None:  # a later micro-batch of the step
            sums = sums + self._step_loss_sums
        self._step_loss_sums = sums
        if self._ends_step(batch_idx) and is_logging_step(self.trainer, before_step=True):
            sums = self.trainer.strategy.reduce(sums.clone(), reduce_op="sum")
        self.log("train/loss", sums[0] / sums[1])

    def on_validation_epoch_start(self) -> None:
        # Reset here, not at the epoch's end, and outside inference mode: states left as inference tensors
        # by a `trainer.validate()` could not be updated by a later `fit()` (torch refuses in-place updates).
        with torch.inference_mode(False):
            self.val_loss.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits, labels = self.logits(batch["input_ids"], batch.get("position_ids")), batch["labels"]
        if logits is None:  # a pipeline stage without the head: the last stage's ranks count this batch
            for metric in [self.val_loss, *(self.val_source_loss or {}).values()]:
                metric.update(torch.zeros((), device=labels.device), weight=0)  # synced states, no warning
            return
        loss = self._loss(logits, labels)
        self.val_loss.update(loss, weight=(labels != -100).sum())
        if "source" in batch and self.val_source_loss is not None:
            for index, metric in enumerate(self.val_source_loss.values()):
                # the other sources' labels ignored, not their rows cut out: sharded logits stay as they are
                source_labels = labels.masked_fill((batch["source"] != index)[:, None], -100)
                weight = (source_labels != -100).sum()  # every rank updates every metric: they sync together
                value = self._loss(logits, source_labels) if weight else loss  # weight 0: no-op
                metric.update(value, weight=weight)

    def on_validation_epoch_end(self) -> None:
        # Metric objects: Lightning computes them (torchmetrics syncs the ranks) and knows they are synced.
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)
        for name, metric in (self.val_source_loss or {}).items():
            self.log(f"val/{name}/loss", metric)

    def configure_optimizers(self) -> dict[str, Any]:
        params = self.configure_param_groups()
        adamw = {"lr": self.hparams.learning_rate, "betas": self.hparams.betas, "eps": self.hparams.eps}
        adamw_params = [group for group in params if not group.get("muon")]
        if len(adamw_params) < len(params):
            optimizer = MuonAdamW(params, weight_decay=self.hparams.weight_decay, **adamw,
                                  adamw_kwargs=_fastest_adamw_kwargs(adamw_params))
        else:
            optimizer = torch.optim.AdamW(params, **adamw, **_fastest_adamw_kwargs(params))
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
            raise UserInputError("cannot infer the length of the LR schedule: set trainer.max_steps, "
                                 "trainer.max_epochs or model.decay_steps")
        return int(steps)


def _data_vocab_size(datamodule: Any) -> int | None:
    """The vocabulary a data module was tokenized with: its ``vocab_size``, else its tokenizer's."""
    vocab_size, tokenizer = getattr(datamodule, "vocab_size", None), getattr(datamodule, "tokenizer", None)
    return vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)


def _fastest_adamw_kwargs(param_groups: list[dict[str, Any]]) -> dict[str, bool]:
    """``fused=True`` where every parameter is a plain floating tensor on a device with a fused
    kernel (CUDA, CPU); otherwise the multi-tensor ``foreach`` path (e.g. FSDP2's DTensors)."""
    params = [p for group in param_groups for p in group["params"]]
    fusable = all(
        not isinstance(p, DTensor) and p.is_floating_point() and p.device.type in ("cuda", "cpu")
        for p in params
    )
    return {"fused": True} if fusable and params else {"foreach": True}
