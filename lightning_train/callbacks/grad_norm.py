"""GradNormMonitor: gradient norms per layer group, parameter norm and update-to-weight ratios.

All norms of a step come from one fused pass (``torch._foreach_norm`` per device/dtype bucket, then
one ``index_add_`` into the per-group sums), stay on the device, and reach the host once per
logging interval. Works in any Lightning Trainer (see the class docstring).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_train._compat import foreach_copy, foreach_norm, foreach_sub_, scaler_unscaled
from lightning_train.callbacks._common import is_logging_step, local_tensor, log_metrics
from lightning_train.errors import UserInputError

BLOCK_LIST_NAMES = ("blocks", "layers", "h")  # nanoGPT/this package, Llama/Mistral, GPT-2


@dataclass
class _Bucket:
    """Parameters that share a device, a dtype and a sharding: one ``_foreach_norm`` call."""

    params: list[nn.Parameter]
    group_index: torch.Tensor  # group of each parameter, on the parameters' device
    shard_groups: tuple[dist.ProcessGroup, ...]  # process groups to sum local shards over (FSDP2)


class GradNormMonitor(Callback):
    """Logs gradient norms, the parameter norm and update-to-weight ratios per layer group.

    Metrics (step axis: the optimizer step, like ``train/loss``): ``health/grad_norm`` (total,
    before clipping), ``health/grad_norm/<group>``, ``health/param_norm``,
    ``health/update_ratio/<group>`` (‖Δw‖/‖w‖ of that step's optimizer update) and, with
    ``gradient_clip_val``, ``health/clip_fraction`` (steps of the interval whose norm exceeded it).

    Gradients must be unscaled when ``on_before_optimizer_step`` runs (Lightning's AMP plugin
    skips unscaling for fused optimizers; this package's precision plugin always unscales); the
    monitor warns once if it finds scaled gradients. With DDP the gradients are already averaged;
    with FSDP2 the local shards' sums of squares are all-reduced, so every rank gets the norm of
    the full gradient; under pipeline parallelism each stage's sums are added over the stages (and a
    tied embedding's second copy, on the last stage, is left out). Shared (tied) parameters count once,
    in the group where they first appear.

    ``step_norms`` gives other callbacks (``NaNRecovery``) this step's norms: computed once a step by
    whichever callback asks first, so the order of the callbacks does not matter. Every norm is computed
    without autograd (``torch.no_grad``), on any ``norm_type``.

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
        self.last_total_norm: torch.Tensor | None = None  # pre-clip total norm of the latest step
        self.group_names: list[str] = []
        self._module: nn.Module | None = None
        self._buckets: list[_Bucket] = []
        self._device = torch.device("cpu")
        self._clipped_steps: torch.Tensor | int = 0  # device counter between logs (an int when restored)
        self._steps_in_interval = 0
        self._pending: dict[str, Any] | None = None  # a logging step's norms, until after its update
        self._step_key: tuple[int, int] | None = None  # (global_step, batch) of the norms in _step_norms
        self._step_norms = torch.zeros(0)
        self._warned_scaled = False
        self._pipeline: Any = None  # the strategy's pipeline schedule, under pipeline parallelism

    # ---- the fused norm computation -------------------------------------------------------------
    def measure(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Gradient norms of ``module`` now: ``{"total": ..., "<group>": ...}``, 0-d tensors on the
        device, without a host synchronisation (FSDP2: a collective every rank must join)."""
        self._build_groups(module)
        return self._named(self._grad_norms())

    def step_norms(self, trainer: L.Trainer, module: nn.Module) -> dict[str, torch.Tensor]:
        """This optimizer step's pre-clip gradient norms, as ``measure`` gives them, computed once a step
        (call it in ``on_before_optimizer_step``; the first caller's measurement is everyone's)."""
        return self._named(self._norms_of_step(trainer, module))

    def _norms_of_step(self, trainer: L.Trainer, module: nn.Module) -> torch.Tensor:
        key = (trainer.global_step, trainer.fit_loop.total_batch_idx)
        if key != self._step_key or module is not self._module:
            self._build_groups(module)
            self._step_norms, self._step_key = self._grad_norms(), key
        return self._step_norms

    def _grad_norms(self) -> torch.Tensor:
        return self._group_norms([[p.grad for p in bucket.params] for bucket in self._buckets])

    def _named(self, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip([*self.group_names, "total"], norms.unbind(), strict=True))

    def _build_groups(self, module: nn.Module) -> None:
        if module is self._module:
            return
        pipeline = self._pipeline
        named = [
            (name, p) for name, p in module.named_parameters()
            if p.requires_grad and not (pipeline is not None and pipeline.is_tied_copy(p))
        ]
        if not named:
            raise UserInputError("GradNormMonitor found no trainable parameters in the module")
        group_of = _assign_groups(module, [name for name, _ in named], self.groups, self.blocks)
        self.group_names = list(dict.fromkeys(group_of.values()))
        if pipeline is not None:  # each stage holds other layers: one list of all stages' groups, in order
            gathered: list[Any] = [None] * dist.get_world_size(pipeline.group)
            dist.all_gather_object(gathered, self.group_names, group=pipeline.group)
            self.group_names = list(dict.fromkeys(name for names in gathered for name in names))
        index = {group: i for i, group in enumerate(self.group_names)}
        by_key: dict[tuple, list[tuple[nn.Parameter, int]]] = {}
        for name, param in named:
            shard_groups = _shard_groups(param)
            local = local_tensor(param)
            key = (local.device, local.dtype, shard_groups)
            by_key.setdefault(key, []).append((param, index[group_of[name]]))
        self._buckets = [
            _Bucket([p for p, _ in members], torch.tensor([i for _, i in members], device=key[0]), key[2])
            for key, members in by_key.items()
        ]
        self._device = self._buckets[0].group_index.device
        self._module = module

    @torch.no_grad()  # norms of weights that require grad must not record an autograd graph
    def _group_norms(self, tensors: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor:
        """Norms per group plus the total, as one vector of length ``len(group_names) + 1``, from
        one list of (possibly sharded or missing) tensors per bucket."""
        p, n_groups = self.norm_type, len(self.group_names)
        by_shard_groups: dict[tuple, torch.Tensor] = {}
        for bucket, bucket_tensors in zip(self._buckets, tensors, strict=True):
            present = [i for i, t in enumerate(bucket_tensors) if t is not None]
            acc = by_shard_groups.setdefault(
                bucket.shard_groups, torch.zeros(n_groups, device=self._device, dtype=torch.float32)
            )
            if not present:
                continue
            local = [local_tensor(bucket_tensors[i]) for i in present]
            index = bucket.group_index if len(present) == len(bucket_tensors) else bucket.group_index[present]
            norms = torch.stack(foreach_norm(local, p)).float()
            if math.isinf(p):
                partial = norms.new_zeros(n_groups).scatter_reduce_(0, index, norms, "amax")
                torch.maximum(acc, partial.to(self._device), out=acc)
            else:
                acc += norms.new_zeros(n_groups).index_add_(0, index, norms.pow(p)).to(self._device)
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        for shard_groups, acc in by_shard_groups.items():
            for group in shard_groups:  # local shards -> the full tensors' sums (or maxima)
                dist.all_reduce(acc, op=op, group=group)
        if math.isinf(p):
            per_group = torch.stack(list(by_shard_groups.values())).amax(0)
        else:
            per_group = torch.stack(list(by_shard_groups.values())).sum(0)
        if self._pipeline is not None:  # the other stages' layers
            dist.all_reduce(per_group, op=op, group=self._pipeline.group)
        if math.isinf(p):
            return torch.cat([per_group, per_group.max().unsqueeze(0)])
        return torch.cat([per_group, per_group.sum().unsqueeze(0)]).pow(1 / p)

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pipeline = getattr(trainer.strategy, "pipeline", None)
        self._build_groups(pl_module)
        self._pending, self._step_key = None, None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._warn_if_scaled(trainer, optimizer)
        norms = self._norms_of_step(trainer, pl_module)
        self.last_total_norm = norms[-1]
        if _clips_by_norm(trainer) and self.norm_type == 2.0:
            self._clipped_steps = self._clipped_steps + (norms[-1] > trainer.gradient_clip_val).long()
        self._steps_in_interval += 1
        if not is_logging_step(trainer, self.log_every_n_steps, before_step=True):
            return
        self._pending = {"grad": norms}
        if self.update_ratio:
            weights = [[local_tensor(p) for p in bucket.params] for bucket in self._buckets]
            self._pending["param"] = self._group_norms(weights)
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
                for before, bucket in zip(pending["before"], self._buckets, strict=True):
                    foreach_sub_(before, [local_tensor(p) for p in bucket.params])  # now -Δw
            values.append(pending["param"][-1:])
            values.append(self._group_norms(pending["before"])[:-1] / pending["param"][:-1])
        clips = _clips_by_norm(trainer) and self.norm_type == 2.0
        if clips:
            clipped = torch.as_tensor(self._clipped_steps, device=self._device, dtype=torch.float32)
            values.append((clipped / self._steps_in_interval).unsqueeze(0))
        host = torch.cat(values).tolist()  # the one host copy of the interval
        names = ["health/grad_norm/" + g for g in self.group_names] + ["health/grad_norm"]
        if self.update_ratio:
            names += ["health/param_norm"] + ["health/update_ratio/" + g for g in self.group_names]
        if clips:
            names.append("health/clip_fraction")
        log_metrics(trainer, dict(zip(names, host, strict=True)))
        self._clipped_steps, self._steps_in_interval = 0, 0

    def _warn_if_scaled(self, trainer: L.Trainer, optimizer: torch.optim.Optimizer) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self._warned_scaled or scaler is None or not scaler.is_enabled():
            return
        if not scaler_unscaled(scaler, optimizer):
            rank_zero_warn(
                "GradNormMonitor sees gradients still multiplied by the loss scale (the precision plugin "
                "did not unscale them, e.g. Lightning's AMP plugin with a fused optimizer), so the logged "
                "norms are scaled. Use lightning_train's precision plugin or a non-fused optimizer."
            )
            self._warned_scaled = True

    # ---- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"clipped_steps": int(self._clipped_steps), "steps_in_interval": self._steps_in_interval}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._clipped_steps = state_dict["clipped_steps"]
        self._steps_in_interval = state_dict["steps_in_interval"]


def _shard_groups(param: nn.Parameter) -> tuple[dist.ProcessGroup, ...]:
    """Process groups over which a DTensor is sharded (its shards' sums must be added); replicated
    mesh dimensions hold copies and are left out (HSDP, tensor parallel + FSDP). Not ``is_shard()``:
    FSDP2 over a tensor-parallel dim-0 shard places a strided shard, for which it is False."""
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return tuple(
        mesh.get_group(dim) for dim, placed in enumerate(param.placements)
        if not (placed.is_replicate() or placed.is_partial())
    )


def _clips_by_norm(trainer: L.Trainer) -> bool:
    return bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")  # None: norm


def _assign_groups(
    module: nn.Module, names: list[str], groups: int | dict[str, str] | None, blocks: str | None
) -> dict[str, str]:
    """Parameter name -> group name (see ``GradNormMonitor``'s ``groups``)."""
    if isinstance(groups, dict):
        compiled = [(group, re.compile(pattern)) for group, pattern in groups.items()]
        return {n: next((g for g, regex in compiled if regex.search(n)), "other") for n in names}
    if isinstance(groups, int):
        return _groups_by_depth(names, groups)
    block_list = _find_block_list(module, blocks)
    if block_list is None:
        rank_zero_warn("GradNormMonitor found no block list (ModuleList named blocks/layers/h); "
                       "grouping by top-level module. Set `blocks` to name it.")
        return _groups_by_depth(names, 1)
    assigned, seen_block = {}, False
    for name in names:
        if name.startswith(block_list + "."):
            assigned[name], seen_block = "block." + name[len(block_list) + 1:].split(".")[0], True
        else:
            assigned[name] = "head" if seen_block else "embeddings"
    return assigned


def _groups_by_depth(names: list[str], depth: int) -> dict[str, str]:
    parts = [name.split(".") for name in names]
    common = 0  # leading name parts shared by all parameters (e.g. "model."), left out of the groups
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return {name: ".".join(p[common:common + depth]) for name, p in zip(names, parts, strict=True)}


def _find_block_list(module: nn.Module, blocks: str | None) -> str | None:
    if blocks is not None:
        try:
            found = module.get_submodule(blocks)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList):
            raise UserInputError(f"GradNormMonitor blocks={blocks!r} is not an nn.ModuleList in the module; "
                                 "give the dotted name of the block list, e.g. 'model.blocks'")
        return blocks
    return next(
        (name for name, m in module.named_modules()
         if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES),
        None,
    )
