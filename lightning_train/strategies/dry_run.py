"""The dry run behind ``python -m lightning_train plan``: one rank of a full layout, laid out in this process.

``dry_run`` joins a process group of ``world_size`` ranks that do not exist, as rank ``rank``
(``_compat.fake_process_group``: torch's "fake" backend, whose collectives return at once), builds the
LightningModule's model on the meta device, and lays it out with the strategy's own code
(``parallelize.py``: this rank's pipeline stages, tensor parallelism, activation checkpointing, FSDP2).
The bytes it reports are those of the rank's real shards; an AdamW step on them makes the optimizer's
state. Nothing is allocated, so a 405B model's rank out of 2,048 is laid out in seconds on a laptop.
Beside them stands the planner's estimate of the same pipeline rank (``memory.estimate_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_train._compat import fake_process_group
from lightning_train.errors import UserInputError
from lightning_train.strategies.layers import decoder_layers, find_transformer, model_root
from lightning_train.strategies.memory import LayoutEstimate, estimate_layout, measured_state_bytes
from lightning_train.strategies.parallel import ParallelStrategy
from lightning_train.strategies.parallelize import (
    MESH_DIMS,
    build_mesh,
    check_layout,
    check_layout_options,
    check_model_layout,
    keep_own_stages,
    parallelize_model,
    sharding_mesh,
    transformer_blocks,
)
from lightning_train.strategies.planner import PRECISION_DTYPES


@dataclass(frozen=True)
class DryRun:
    """What one rank holds under a layout (``dry_run`` makes one), beside the planner's estimate."""

    world_size: int
    rank: int
    coordinates: dict[str, int]  # the rank's place in the mesh, by ``MESH_DIMS`` name
    layout: str  # "fsdp over 16 x tp 8 x pp 16 (1F1B, 32 microbatches)"
    num_params: int  # the whole model's
    held: str  # what this rank holds: "blocks 118-125 of 126, norm, lm_head"
    param_bytes: int  # this rank's shards of the parameters, as laid out
    grad_bytes: int  # their gradients (sharded as the parameters)
    optimizer_bytes: int  # AdamW's state after a step on them
    fsdp_buffer_bytes: int  # FSDP2's unsharded buffers at a unit's backward (``_fsdp_buffer_bytes``)
    estimate: LayoutEstimate | None  # the same pipeline rank's; None where the planner has none

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        """The planner's activation estimate of this pipeline rank (activations are not laid out)."""
        return self.estimate.activation_bytes if self.estimate is not None else 0

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.fsdp_buffer_bytes + self.activation_bytes

    def difference(self) -> float | None:
        """The planner's total relative to this rank's (0.02: the planner counts 2% more)."""
        return None if self.estimate is None else self.estimate.total_bytes / self.total_bytes - 1


def dry_run(
    module: pl.LightningModule,
    strategy: ParallelStrategy,
    world_size: int,
    devices_per_node: int,
    rank: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "32-true",
) -> DryRun:
    """Lay ``module``'s model (not built yet: ``configure_model`` builds it, here on the meta device) out as
    rank ``rank`` of ``world_size`` would under ``strategy``'s layout, and measure what that rank holds.

    Args:
        module, strategy: as ``fit`` would get them from a config (``strategy`` not attached to a Trainer).
        world_size, devices_per_node: the whole cluster's processes, and one node's.
        rank: the global rank to lay out; None: the first rank of the pipeline stage the planner counts
            fullest (rank 0 where it has no estimate).
        batch_size, seq_len: sequences per data-parallel rank and step, and their length (None:
            activations are not estimated).
        precision: the Trainer's (``"bf16-mixed"``: FSDP all-gathers bf16, the states stay fp32).

    Raises ``UserInputError`` (one line naming the value and the fix) for a layout that does not divide
    the world or the model, ``"auto"`` sizes (they are chosen from the devices' memory when fit starts),
    or a rank outside the world.

    Example (rank 5 of 16 ranks, fsdp 2 x tp 4 x pp 2; 2 nodes of 8):

        >>> from lightning_train import GPTConfig, PretrainModule
        >>> from lightning_train.strategies import ParallelStrategy
        >>> from lightning_train.strategies.dry_run import dry_run
        >>> module = PretrainModule(GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=64))
        >>> strategy = ParallelStrategy(tensor_parallel=4, pipeline_parallel=2, sharding="fsdp")
        >>> run = dry_run(module, strategy, world_size=16, devices_per_node=8, rank=5, batch_size=4,
        ...               seq_len=64, precision="bf16-mixed")
        >>> run.coordinates, run.held
        ({'pp': 0, 'dp_replicate': 0, 'dp_shard': 1, 'tp': 1}, 'embed, blocks 0-1 of 4')
        >>> run.state_bytes == run.estimate.state_bytes, f"{run.difference():+.1%}"  # FSDP buffers differ
        (True, '-4.5%')
        >>> next(module.parameters()).device  # nothing was allocated
        device(type='meta')
    """
    tp, pp, sharding = strategy.tensor_parallel, strategy.pipeline_parallel, strategy.sharding
    given_tp = "auto" if strategy.auto_layout else tp
    check_layout_options(
        given_tp, pp, sharding, strategy.pipeline_schedule, strategy.microbatches, strategy.virtual_stages,
        strategy.pipeline_split_points,
    )
    if strategy.auto_layout or (sharding == "auto" and world_size > 1):
        raise UserInputError(
            f"tensor_parallel={given_tp!r}, sharding={sharding!r}: 'auto' is chosen from the devices' memory "
            "when fit starts; give tensor_parallel, pipeline_parallel and sharding ('fsdp' or 'ddp') to plan "
            "a layout (fit's log line of 'auto' names the ones it chose)"
        )
    if devices_per_node < 1 or world_size < 1 or world_size % devices_per_node:
        raise UserInputError(
            f"world_size={world_size} is not a whole number of nodes of devices_per_node={devices_per_node}; "
            "give a multiple of the devices of one node"
        )
    num_nodes = world_size // devices_per_node
    replicate = num_nodes if strategy.replicate_option == "nodes" else strategy.replicate_option
    check_layout(tp, replicate, num_nodes, devices_per_node, pp)
    data_parallel = world_size // (tp * pp)
    checks = dict(
        batch_size=batch_size, tensor_parallel=tp, pipeline_parallel=pp,
        virtual_stages=strategy.virtual_stages, schedule=strategy.pipeline_schedule,
        split_points=strategy.pipeline_split_points, microbatches=strategy.microbatches,
        data_parallel=data_parallel,
        activation_checkpointing=strategy.activation_checkpointing, plan=strategy.tensor_parallel_plan,
        layer_classes=strategy.layer_classes,
    )
    if tp * pp > 1:
        check_model_layout(module, **checks)  # the config, before anything is built
    activation_dtype, state_dtype = PRECISION_DTYPES.get(precision, (torch.float32, None))
    with torch.device("meta"):
        module.configure_model()
        if state_dtype is not None:  # "bf16-true": the precision plugin converts the module
            module.to(state_dtype)
    if tp * pp > 1:
        check_model_layout(module, **checks)  # the model as built
    whole = find_transformer(module) or model_root(module, decoder_layers(module, strategy.layer_classes))
    num_params = sum(p.numel() for p in {id(p): p for p in whole.parameters()}.values())
    num_layers = len(transformer_blocks(whole, strategy.layer_classes)[1])
    shard_size = data_parallel // replicate if sharding == "fsdp" else 1

    def estimate(pipeline_rank: int | None) -> LayoutEstimate | None:
        if tp * pp > 1 and find_transformer(whole) is None:
            return None  # the planner estimates the GPT only under model parallelism
        return estimate_layout(
            whole, tp, pp, shard_size, batch_size, seq_len, strategy.microbatches if pp > 1 else 1,
            strategy.pipeline_schedule, strategy.virtual_stages, strategy.activation_checkpointing,
            activation_dtype, state_dtype, strategy.loss_parallel, pipeline_rank,
        )

    ranks_per_stage = world_size // pp
    if rank is None:
        fullest = estimate(None)
        rank = fullest.pipeline_rank * ranks_per_stage if fullest is not None else 0
    if not 0 <= rank < world_size:
        raise UserInputError(
            f"rank={rank} is not a rank of world_size={world_size}; give one from 0 to {world_size - 1}"
        )
    planned = estimate(rank // ranks_per_stage)
    # FSDP all-gathers in the compute dtype under mixed precision, else in the stored one
    param_dtype = activation_dtype if state_dtype is None and activation_dtype != torch.float32 else None
    with fake_process_group(rank, world_size):
        mesh = build_mesh("cpu", world_size, tp, pp, replicate)
        stages: list[nn.Module] = []
        if pp > 1:
            stages = keep_own_stages(
                module, mesh["pp"].get_local_rank(), pp, strategy.virtual_stages, strategy.pipeline_schedule,
                strategy.pipeline_split_points, strategy.layer_classes,
            )[1]
        fsdp_mesh = sharding_mesh(mesh, tp * pp > 1) if sharding == "fsdp" else None
        parallelize_model(
            module, stages, mesh["tp"], strategy.loss_parallel, strategy.activation_checkpointing, fsdp_mesh,
            strategy.tensor_parallel_plan, strategy.layer_classes, param_dtype=param_dtype,
            reduce_dtype=strategy.reduce_dtype, reshard_after_forward=strategy.reshard_after_forward,
            cpu_offload=strategy.cpu_offload,
        )
        coordinates = dict(zip(MESH_DIMS, (int(i) for i in mesh.get_coordinate()), strict=True))
        states = _states_after_a_step(module)
        buffers = 0
        if fsdp_mesh is not None and shard_size > 1:
            units = transformer_blocks(module, strategy.layer_classes)[1]
            # at the largest unit's backward FSDP2 holds unsharded: its parameters and the next unit's
            # (prefetched) in the compute dtype, its gradients in that dtype, and their copy in reduce_dtype
            # that is reduce-scattered
            largest = max(_unsharded_numel(unit, mesh["dp_shard"].size()) for unit in units)
            compute = param_dtype or next(module.parameters()).dtype
            buffers = largest * (3 * compute.itemsize + strategy.reduce_dtype.itemsize)
    return DryRun(
        world_size, rank, coordinates, _layout(strategy, sharding, data_parallel, replicate), num_params,
        _held(module, num_layers), states["param_bytes"], states["grad_bytes"], states["optimizer_bytes"],
        buffers, planned,
    )


def _states_after_a_step(module: nn.Module) -> dict[str, int]:
    """``measured_state_bytes`` of ``module``'s (meta-device) parameters after one AdamW step on
    gradients shaped as they are: what a rank holds from its first step on."""
    trainable = [p for p in {id(p): p for p in module.parameters()}.values() if p.requires_grad]
    for param in trainable:
        param.grad = torch.zeros_like(param)
    optimizer = torch.optim.AdamW(trainable)
    optimizer.step()
    return measured_state_bytes(module, optimizer)


def _unsharded_numel(unit: nn.Module, shards: int) -> int:
    """Elements of ``unit``'s parameters once FSDP all-gathers them over ``shards`` ranks (padding
    included; tensor-parallel shards stay split)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * shards for p in unit.parameters())


def _layout(strategy: ParallelStrategy, sharding: str, data_parallel: int, replicate: int) -> str:
    """``fsdp over 16 x tp 8 x pp 16 (1F1B, 32 microbatches)``, as ``LayoutPlan.layout`` writes it."""
    data = f"{sharding} over {data_parallel}"
    if replicate > 1:
        data = f"hsdp over {replicate} x {data_parallel // replicate}"
    parts = [data]
    if strategy.tensor_parallel > 1:
        parts.append(f"tp {strategy.tensor_parallel}")
    if strategy.pipeline_parallel > 1:
        stages = f", {strategy.virtual_stages} stages a rank" if strategy.virtual_stages > 1 else ""
        parts.append(
            f"pp {strategy.pipeline_parallel} ({strategy.pipeline_schedule}, {strategy.microbatches} "
            f"microbatches{stages})"
        )
    return " x ".join(parts)


def _held(module: nn.Module, num_layers: int) -> str:
    """What ``module``'s parameters are, by name, in order: ``embed, blocks 0-15 of 32`` (of the layers:
    those this rank holds, by index in the whole model)."""
    held: dict[str, set[int]] = {}  # module name -> the layer indices under it (none: not a layer list)
    for name, _ in module.named_parameters():
        parts = name.split(".")
        numbered = next((i for i, part in enumerate(parts) if i and part.isdigit()), None)
        if numbered is not None:
            held.setdefault(parts[numbered - 1], set()).add(int(parts[numbered]))
        else:
            held.setdefault(parts[-2] if len(parts) > 1 else parts[0], set())
    return ", ".join(
        f"{key} {min(found)}-{max(found)} of {num_layers}" if found else key for key, found in held.items()
    )
