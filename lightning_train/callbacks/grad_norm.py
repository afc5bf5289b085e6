"""GradNormMonitor: gradient norms per layer group, parameter norm and update-to-weight ratios.

The norms are measured by ``lightning_train.plugins.grad_norm.GradNorms`` (one fused pass), once a step
through the Trainer's ``StepControl``, which gradient clipping and ``NaNRecovery`` read too. They stay
on the device and reach the host once per logging interval. Works in any Lightning Trainer.
"""

from __future__ import annotations

import re
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_train._compat import foreach_copy, foreach_sub_
from lightning_train.callbacks._common import is_logging_step, log_metrics
from lightning_train.errors import UserInputError
from lightning_train.plugins.grad_norm import GradNorms, local_tensor
from lightning_train.plugins.step import step_control


class GradNormMonitor(Callback):
    """Logs gradient norms, the parameter norm and update-to-weight ratios per layer group.

    Metrics (step axis: the optimizer step, like ``train/loss``): ``health/grad_norm`` (total,
    before clipping), ``health/grad_norm/<group>``, ``health/param_norm``,
    ``health/update_ratio/<group>`` (‖Δw‖/‖w‖ of that step's optimizer update) and, with
    ``gradient_clip_val``, ``health/clip_fraction`` (steps of the interval whose norm exceeded it).

    Gradients must be unscaled when ``on_before_optimizer_step`` runs (Lightning's AMP plugin skips
    unscaling for fused optimizers; this package's precision plugin always unscales); the monitor warns at
    the start of fit when they would stay scaled. With DDP the gradients are already averaged; with FSDP2
    the local shards' sums of squares are all-reduced, so every rank gets the norm of the full gradient;
    under pipeline parallelism each stage's sums are added over the stages (and a tied embedding's second
    copy, on the last stage, is left out). Shared (tied) parameters count once, in the group where they
    first appear.

    The monitor's groups and ``norm_type`` become the Trainer's gradient-norm measurement
    (``step_control(trainer).grad_norms()``): measured once a step by whoever asks first (this monitor,
    ``NaNRecovery``, gradient clipping when it clips by the same norm type), so the order of the
    callbacks does not matter. Every norm is computed without autograd, on any ``norm_type``.

    Cost: per step one fused norm pass and, when sharded, one all-reduce of a vector of group
    sums; no host synchronisation. On logging steps only, ``update_ratio`` keeps a copy of the
    (local shards of the) trainable parameters from before the optimizer step to after it.

    Args:
        log_every_n_steps: optimizer steps between logs; None: the Trainer's ``log_every_n_steps``.
        groups: None: ``embeddings`` (everything before the block list), ``block.<i>`` per
            transformer block and ``head`` (everything after it: final norm, lm_head). An int:
            group by the first N parts of the parameter names below their common prefix (1 gives
            ``embed``, ``blocks``, ``norm``, ...). A dict ``{group: regex}``: the first regex found
            in a parameter's name (``re.search``) names its group; the rest fall into ``other``.
        blocks: dotted name of the ``nn.ModuleList`` of blocks for the default groups; None: the
            first ModuleList named ``blocks``, ``layers`` or ``h``.
        norm_type: the p of the p-norm (``inf`` allowed); the clip fraction needs 2.0.
        update_ratio: log ``health/param_norm`` and ``health/update_ratio/<group>``.

    Example:

        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import GradNormMonitor
        >>> logger = L.pytorch.loggers.CSVLogger(tempfile.mkdtemp())
        >>> monitor = GradNormMonitor(groups={"attention": r"\\.attn\\.", "mlp": r"\\.mlp\\."})
        >>> trainer = L.Trainer(
        ...     max_steps=3, accelerator="cpu", log_every_n_steps=1, limit_val_batches=0, logger=logger,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ...     callbacks=[monitor],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> columns = open(f"{logger.log_dir}/metrics.csv").readline().strip().split(",")
        >>> sorted(name for name in columns if name.startswith("health/grad_norm"))
        ['health/grad_norm', 'health/grad_norm/attention', 'health/grad_norm/mlp', 'health/grad_norm/other']
        >>> bool(monitor.last_total_norm > 0)  # pre-clip norm of the latest step, still on the device
        True
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        groups: int | dict[str, str] | None = None,
        blocks: str | None = None,
        norm_type: float = 2.0,
        update_ratio: bool = True,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise UserInputError(f"GradNormMonitor log_every_n_steps={log_every_n_steps}: use an int >= 1")
        if not norm_type > 0:
            raise UserInputError(f"GradNormMonitor norm_type={norm_type}: use a p > 0, e.g. 2.0 or inf")
        if isinstance(groups, int) and groups < 1:
            raise UserInputError(f"GradNormMonitor groups={groups}: a depth must be >= 1")
        if isinstance(groups, dict):
            if not groups:
                raise UserInputError("GradNormMonitor groups={}: give at least one {name: regex} or None")
            for name, pattern in groups.items():
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise UserInputError(
                        f"GradNormMonitor groups[{name!r}]={pattern!r} is not a regular expression: {error}"
                    ) from None
        self.log_every_n_steps = log_every_n_steps
        self.groups, self.blocks = groups, blocks
        self.norm_type, self.update_ratio = float(norm_type), update_ratio
        self.norms = GradNorms(groups, blocks, norm_type)  # shared with the Trainer's StepControl in a fit
        self.last_total_norm: torch.Tensor | None = None  # pre-clip total norm of the latest step
        self._clipped_steps: torch.Tensor | int = 0  # device counter between logs (an int when restored)
        self._steps_in_interval = 0
        self._pending: dict[str, Any] | None = None  # a logging step's norms, until after its update

    @property
    def group_names(self) -> list[str]:
        return self.norms.group_names

    def measure(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Gradient norms of ``module`` now: ``{"<group>": ..., "total": ...}``, 0-d tensors on the
        device, without a host synchronisation (FSDP2: a collective every rank must join)."""
        return self.norms.measure(module)

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        control = step_control(trainer)
        control.share_grad_norms(self.norms)
        if control.grads_stay_scaled():
            rank_zero_warn(
                "GradNormMonitor sees gradients still multiplied by the loss scale (the precision plugin "
                "does not unscale them, e.g. Lightning's AMP plugin with a fused optimizer), so the logged "
                "norms are scaled. Use lightning_train's precision plugin or a non-fused optimizer."
            )
        self._pending = None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        norms = step_control(trainer).grad_norms(self.norms)
        self.last_total_norm = norms["total"]
        if _clips_by_norm(trainer) and self.norm_type == 2.0:
            self._clipped_steps = self._clipped_steps + (norms["total"] > trainer.gradient_clip_val).long()
        self._steps_in_interval += 1
        if not is_logging_step(trainer, self.log_every_n_steps, before_step=True):
            return
        self._pending = {"grad": torch.stack(list(norms.values()))}
        if self.update_ratio:
            weights = [[local_tensor(p) for p in bucket.params] for bucket in self.norms.buckets]
            self._pending["param"] = self.norms.of(weights)
            with torch.no_grad():  # the weights before the update (one fused copy per bucket; freed after)
                self._pending["before"] = [foreach_copy(bucket) for bucket in weights]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is None:  # not a logging step, or still accumulating gradients
            return
        pending, self._pending = self._pending, None
        values = [pending["grad"]]
        if self.update_ratio:
            with torch.no_grad():
                for before, bucket in zip(pending["before"], self.norms.buckets, strict=True):
                    foreach_sub_(before, [local_tensor(p) for p in bucket.params])  # now -Δw
            values.append(pending["param"][-1:])
            values.append(self.norms.of(pending["before"])[:-1] / pending["param"][:-1])
        clips = _clips_by_norm(trainer) and self.norm_type == 2.0
        if clips:
            clipped = torch.as_tensor(self._clipped_steps, device=self.norms.device, dtype=torch.float32)
            values.append((clipped / self._steps_in_interval).unsqueeze(0))
        host = torch.cat(values).tolist()  # the one host copy of the interval
        names = ["health/grad_norm/" + g for g in self.group_names] + ["health/grad_norm"]
        if self.update_ratio:
            names += ["health/param_norm"] + ["health/update_ratio/" + g for g in self.group_names]
        if clips:
            names.append("health/clip_fraction")
        log_metrics(trainer, dict(zip(names, host, strict=True)))
        self._clipped_steps, self._steps_in_interval = 0, 0

    # ---- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"clipped_steps": int(self._clipped_steps), "steps_in_interval": self._steps_in_interval}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._clipped_steps = state_dict["clipped_steps"]
        self._steps_in_interval = state_dict["steps_in_interval"]


def _clips_by_norm(trainer: L.Trainer) -> bool:
    return bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")  # None: norm

