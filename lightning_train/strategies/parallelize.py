"""Apply data parallelism to a plain model from outside (torchtitan style): the model file stays plain.

``apply_fsdp`` shards each transformer block, then the root, with FSDP2's ``fully_shard``;
``apply_activation_checkpointing`` recomputes each block's activations in backward;
``register_comm_hook`` installs a DDP communication-hook preset. ``build_mesh`` makes the 1-D (FSDP)
or 2-D (replicate x shard, HSDP) device mesh.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from lightning_train._compat import checkpoint_activations, ddp_comm_hook_name
from lightning_train.errors import UserInputError

CommHook = Literal["fp16_compress", "bf16_compress", "powersgd"]
COMM_HOOKS = ("fp16_compress", "bf16_compress", "powersgd")


def check_comm_hook(preset: str | None) -> None:
    """Refuse a DDP communication-hook preset that is not one of ``COMM_HOOKS`` (None: no hook)."""
    if preset is not None and preset not in COMM_HOOKS:
        raise UserInputError(f"comm_hook={preset!r} is not one of {', '.join(COMM_HOOKS)} (or null)")


def check_replicate_size(replicate_size: int, num_nodes: int, devices: int) -> None:
    """Refuse an HSDP ``replicate_size`` that does not divide the world size ``num_nodes * devices``."""
    world_size = num_nodes * devices
    if not isinstance(replicate_size, int) or replicate_size < 1 or world_size % replicate_size:
        raise UserInputError(
            f"replicate_size={replicate_size!r} does not divide the world size {world_size} "
            f"(num_nodes={num_nodes} x devices={devices}); use a divisor, or 'nodes' (one replica per node, "
            "whatever the node count of a launch)"
        )


def build_mesh(device_type: str, num_nodes: int, devices: int, replicate_size: int) -> DeviceMesh:
    """A ``("replicate", "shard")`` mesh over ``num_nodes * devices`` ranks: ``replicate_size`` groups
    (usually nodes) that each shard the model over ``world_size // replicate_size`` ranks.
    ``replicate_size=1`` is plain FSDP."""
    check_replicate_size(replicate_size, num_nodes, devices)
    world_size = num_nodes * devices
    return init_device_mesh(
        device_type, (replicate_size, world_size // replicate_size), mesh_dim_names=("replicate", "shard")
    )


def find_transformer(model: nn.Module) -> nn.Module | None:
    """The first submodule holding its layers in an ``nn.ModuleList`` named ``blocks`` (our GPT)."""
    for module in model.modules():
        if isinstance(getattr(module, "blocks", None), nn.ModuleList):
            return module
    return None


def transformer_blocks(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """(root, blocks): the module with a ``blocks`` ModuleList and its blocks; for other models the
    model itself and its direct children that hold parameters."""
    transformer = find_transformer(model)
    if transformer is not None:
        return transformer, list(transformer.blocks)
    rank_zero_warn(
        f"{type(model).__name__} has no `blocks` ModuleList: sharding each of its direct children instead "
        "of each transformer block"
    )
    return model, [child for child in model.children() if any(True for _ in child.parameters())]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them (same gradients, less
    memory, ~1/3 more compute). The composable API keeps parameter names (and checkpoints) unchanged."""
    for block in transformer_blocks(model)[1]:
        checkpoint_activations(block)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> None:
    """Shard each block, then the root (embeddings, final norm and head stay in the root's group), over
    ``mesh``: 1-D (FSDP) or 2-D (replicate, shard: HSDP).

    ``param_dtype`` is the compute dtype of the all-gathered parameters (None: the stored dtype); the
    sharded fp32 parameters stay the optimizer's master weights. Gradients are reduce-scattered in
    ``reduce_dtype``. ``reshard_after_forward=False`` keeps the gathered parameters until backward
    (ZeRO-2 style: less communication, more memory).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    options = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=offload,
    )
    root, blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        # the last block's parameters are needed again right away in backward: keep them gathered
        fully_shard(block, reshard_after_forward=reshard_after_forward and index < len(blocks) - 1, **options)
    fully_shard(root, reshard_after_forward=reshard_after_forward, **options)


def register_comm_hook(model: DistributedDataParallel, preset: CommHook, backend: str) -> str | None:
    """Register a DDP communication-hook ``preset`` for real; returns the hook's name as torch records
    it, or None (with a warning naming torch's reason) where torch refuses it on this backend."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    check_comm_hook(preset)
    if preset == "powersgd":
        # rank-1 approximations after 10 exact steps: the PowerSGD paper's defaults for warm starts
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10
        )
        hook = powerSGD_hook.powerSGD_hook
    else:
        state, hook = None, getattr(default_hooks, f"{preset}_hook")
    try:
        model.register_comm_hook(state, hook)
    except (TypeError, RuntimeError, ValueError) as error:
        rank_zero_warn(
            f"comm_hook={preset!r} is not supported on the {backend} backend ({error}); gradients are "
            "all-reduced uncompressed. Use it on GPUs with NCCL, or pick another preset"
        )
        return None
    registered = ddp_comm_hook_name(model)
    rank_zero_info(
        f"DataParallelStrategy: DDP comm hook {preset!r} registered (torch: comm_hook={registered})"
    )
    return registered
