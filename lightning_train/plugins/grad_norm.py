"""The gradient norm's one home: ``GradNorms`` measures the norms of a module's gradients per layer group and
in total, in one fused pass, correct over every shard, pipeline stage and tied weight.

The Trainer's ``StepControl`` (``lightning_train.plugins.step``) measures them once per optimizer step and
hands the same values to gradient clipping, ``GradNormMonitor`` and ``NaNRecovery``.

One pass: ``torch._foreach_norm`` per device/dtype/sharding bucket, one ``index_add_`` into the per-group
sums, all on the device. FSDP2/tensor-parallel DTensors: the local shards' sums are all-reduced over the
mesh dimensions they are sharded on (replicated ones hold copies). Pipeline parallelism: each stage's sums
are added over the stages, and the last stage's copy of a tied embedding is left out. Parameters shared
inside a module (tied weights) count once, in the group where they first appear.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_train._compat import foreach_norm
from lightning_train.errors import UserInputError

BLOCK_LIST_NAMES = ("blocks", "layers", "h")  # nanoGPT/this package, Llama/Mistral, GPT-2


@dataclass
class _Bucket:
    """Parameters that share a device, a dtype and a sharding: one ``_foreach_norm`` call."""

    params: list[nn.Parameter]
    group_index: torch.Tensor  # group of each parameter, on the parameters' device
    shard_groups: tuple[dist.ProcessGroup, ...]  # process groups to sum local shards over (FSDP2)


class GradNorms:
    """Norms of a module's gradients (or of any tensors laid out like its parameters) per group and in total.

    Args:
        groups: None: ``embeddings`` (everything before the block list), ``block.<i>`` per transformer block
            and ``head`` (everything after it). An int: the first N parts of the parameter names below their
            common prefix (1 gives ``embed``, ``blocks``, ``norm``, ...). A dict ``{group: regex}``: the first
            regex found in a parameter's name names its group; the rest fall into ``other``.
        blocks: dotted name of the ``nn.ModuleList`` of blocks for the default groups; None: the first
            ModuleList named ``blocks``, ``layers`` or ``h``.
        norm_type: the p of the p-norm (``inf`` allowed).

    Example:

        >>> import torch
        >>> from lightning_train import GPT, GPTConfig
        >>> model = GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> model(torch.randint(0, 100, (2, 16))).float().mean().backward()
        >>> norms = GradNorms(groups=1).measure(model)
        >>> list(norms)
        ['embed', 'blocks', 'norm', 'total']
        >>> total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])  # tied: once
        >>> bool(torch.isclose(norms["total"], total))
        True
    """

    def __init__(
        self, groups: int | dict[str, str] | None = 1, blocks: str | None = None, norm_type: float = 2.0
    ) -> None:
        self.groups, self.blocks, self.norm_type = groups, blocks, float(norm_type)
        self.group_names: list[str] = []
        self.buckets: list[_Bucket] = []
        self.device = torch.device("cpu")
        self._module: nn.Module | None = None
        self._pipeline: Any = None

    def measure(self, module: nn.Module, pipeline: Any = None) -> dict[str, torch.Tensor]:
        """The gradient norms of ``module`` now: ``{"<group>": ..., "total": ...}``, 0-d tensors on the
        device, without a host synchronisation (sharded or pipelined: a collective every rank must join)."""
        self.bind(module, pipeline)
        return self.named(self.of_grads())

    def bind(self, module: nn.Module, pipeline: Any = None) -> None:
        """Group and bucket ``module``'s trainable parameters (once per module). ``pipeline``: the strategy's
        pipeline schedule, whose stages' norms are added up."""
        if module is self._module:
            return
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
            local = local_tensor(param)
            by_key.setdefault((local.device, local.dtype, _shard_groups(param)), []).append(
                (param, index[group_of[name]])
            )
        self.buckets = [
            _Bucket([p for p, _ in members], torch.tensor([i for _, i in members], device=key[0]), key[2])
            for key, members in by_key.items()
        ]
        self.device = self.buckets[0].group_index.device
        self._module, self._pipeline = module, pipeline

    def of_grads(self) -> torch.Tensor:
        """The bound module's gradient norms as one vector: one per group, then the total."""
        return self.of([[p.grad for p in bucket.params] for bucket in self.buckets])

    def named(self, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip([*self.group_names, "total"], norms.unbind(), strict=True))

    @torch.no_grad()  # norms of weights that require grad must not record an autograd graph
    def of(self, tensors: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor:
        """Norms per group plus the total, as one vector of length ``len(group_names) + 1``, from one list of
        (possibly sharded or missing) tensors per bucket."""
        p, n_groups = self.norm_type, len(self.group_names)
        by_shard_groups: dict[tuple, torch.Tensor] = {}
        for bucket, bucket_tensors in zip(self.buckets, tensors, strict=True):
            present = [i for i, t in enumerate(bucket_tensors) if t is not None]
            acc = by_shard_groups.setdefault(
                bucket.shard_groups, torch.zeros(n_groups, device=self.device, dtype=torch.float32)
            )
            if not present:
                continue
            local = [local_tensor(bucket_tensors[i]) for i in present]
            index = bucket.group_index if len(present) == len(bucket_tensors) else bucket.group_index[present]
            norms = torch.stack(foreach_norm(local, p)).float()
            if math.isinf(p):
                partial = norms.new_zeros(n_groups).scatter_reduce_(0, index, norms, "amax")
                torch.maximum(acc, partial.to(self.device), out=acc)
            else:
                acc += norms.new_zeros(n_groups).index_add_(0, index, norms.pow(p)).to(self.device)
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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor (FSDP2), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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


def _assign_groups(
    module: nn.Module, names: list[str], groups: int | dict[str, str] | None, blocks: str | None
) -> dict[str, str]:
    """Parameter name -> group name (see ``GradNorms``'s ``groups``)."""
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
