"""Lay a plain model out over the device mesh from outside (torchtitan style): the model file stays plain.
``ParallelStrategy`` calls these, in this order; they call ``pipeline.py`` and ``tensor_parallel.py``:

- ``check_layout_options`` and ``check_layout``: options that cannot work together, sizes that do not
  divide the world (before any process starts); ``check_model_layout``: a model or batch the layout cannot
  split (the strategy's one check of the model);
- ``build_mesh``: the one mesh every layout uses, ``MESH_DIMS`` = ``(pp, dp_replicate, dp_shard, tp)``,
  outermost first; ``sharding_mesh``: the part of it FSDP shards over;
- ``keep_own_stages``: this rank's pipeline stages in place of the GPT; ``parallelize_model``: tensor
  parallelism, activation checkpointing, then FSDP2 (``apply_fsdp``: each block, then the root);
  ``tied_embedding_group``: the group whose gradients a tied embedding sums; ``register_comm_hook``: a DDP
  communication-hook preset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from lightning_train._compat import checkpoint_activations, ddp_comm_hook_name, is_compiled
from lightning_train.errors import UserInputError
from lightning_train.strategies.layer_stages import CausalLMStage, base_model, split_layers
from lightning_train.strategies.layers import decoder_layers, find_transformer, model_root
from lightning_train.strategies.pipeline import (
    check_microbatches,
    check_pipeline,
    check_stages,
    check_zero_bubble,
    last_stage_rank,
    pipeline_stage_ids,
    split_blocks,
    stage_model,
)
from lightning_train.strategies.plans import apply_plan, builtin_plan, check_plan
from lightning_train.strategies.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

CommHook = Literal["fp16_compress", "bf16_compress", "powersgd"]
COMM_HOOKS: tuple[str, ...] = get_args(CommHook)
# tensor parallelism, the most communication-hungry, innermost (neighbouring ranks, inside a node);
# pipeline stages, which exchange one activation per microbatch, outermost (across nodes)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def check_comm_hook(preset: str | None) -> None:
    """Refuse a DDP communication-hook preset that is not one of ``COMM_HOOKS`` (None: no hook)."""
    if preset is not None and preset not in COMM_HOOKS:
        raise UserInputError(f"comm_hook={preset!r} is not one of {', '.join(COMM_HOOKS)} (or null)")


def check_layout(
    tensor_parallel: int, replicate_size: Any, num_nodes: int, devices: int, pipeline_parallel: int = 1
) -> None:
    """Refuse a mesh that does not divide the world size ``num_nodes * devices``: ``tensor_parallel`` x
    ``pipeline_parallel`` must divide it, and HSDP's ``replicate_size`` the data-parallel size left."""
    world_size = num_nodes * devices
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} does not divide the world size {world_size} "
            f"(num_nodes={num_nodes} x devices={devices}); use a divisor of the devices of one node"
        )
    if world_size % (tensor_parallel * pipeline_parallel):
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} does not divide the "
            f"world size {world_size} (num_nodes={num_nodes} x devices={devices}); use sizes whose product "
            "divides it"
        )
    if not isinstance(replicate_size, int) or replicate_size < 1 or world_size % replicate_size:
        raise UserInputError(
            f"replicate_size={replicate_size!r} does not divide the world size {world_size} "
            f"(num_nodes={num_nodes} x devices={devices}); use a divisor, or 'nodes' (one replica per node, "
            "whatever the node count of a launch)"
        )
    data_parallel = world_size // (tensor_parallel * pipeline_parallel)
    if data_parallel % replicate_size:
        raise UserInputError(
            f"replicate_size={replicate_size} does not divide the data-parallel size {data_parallel} "
            f"(world size {world_size} / tensor_parallel={tensor_parallel} / pipeline_parallel="
            f"{pipeline_parallel}); use a divisor, or 'nodes' (one replica per node)"
        )


def check_layout_options(
    tensor_parallel: Any,
    pipeline_parallel: int,
    sharding: str,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    split_points: Sequence[int] | None,
) -> None:
    """Refuse layout options that cannot work together, whatever the model (``tensor_parallel="auto"``
    plans the other sizes)."""
    auto = tensor_parallel == "auto"
    if auto and (pipeline_parallel != 1 or sharding != "auto"):
        raise UserInputError(
            f"tensor_parallel='auto' plans pipeline_parallel and sharding too; leave them at 1 and "
            f"'auto' (got {pipeline_parallel} and {sharding!r}), or give tensor_parallel as a number"
        )
    if not auto and (not isinstance(tensor_parallel, int) or tensor_parallel < 1):
        raise UserInputError(f"tensor_parallel={tensor_parallel!r}: use an int >= 1 or 'auto'")
    check_pipeline(pipeline_parallel, schedule, microbatches, virtual_stages, split_points)
    tensor_parallel = 1 if auto else tensor_parallel
    if tensor_parallel * pipeline_parallel > 1 and sharding == "ddp":
        raise UserInputError(
            f"sharding='ddp' does not combine with tensor_parallel={tensor_parallel} x "
            f"pipeline_parallel={pipeline_parallel} yet; use sharding='fsdp' (or 'auto')"
        )


def check_model_layout(
    module: nn.Module,
    batch_size: int | None,
    tensor_parallel: int,
    pipeline_parallel: int,
    virtual_stages: int,
    schedule: str,
    split_points: Sequence[int] | None,
    microbatches: int,
    data_parallel: int,
    activation_checkpointing: bool,
    plan: dict[str, str] | None = None,
    layer_classes: Sequence[str] | None = None,
) -> None:
    """Refuse a model (a LightningModule holding a GPT or a model of its own, built or not yet), or a
    per-device batch of ``batch_size`` sequences, that the layout cannot split. Before the model is built
    only the config ``PretrainModule.build_model`` builds the GPT from can be checked (a subclass's
    ``build_model`` may build another model); a model of one's own is checked once built."""
    model = find_transformer(module)
    built = any(True for _ in module.parameters())
    own = built and model is None  # a model of one's own: its layers and plan are checked, not a config
    build = getattr(type(module), "build_model", None)
    described = built or getattr(build, "__qualname__", "") == "PretrainModule.build_model"
    config = model.config if model is not None else getattr(module, "config", None) if described else None
    if not own and plan is not None and built:
        raise UserInputError(
            "tensor_parallel_plan is for a model of one's own; the GPT has its own plan: remove the option"
        )
    if not own and described:
        check_tensor_parallel(tensor_parallel, config)
    n_layer = getattr(config, "n_layer", 0)
    if own:
        root = model_root(module, decoder_layers(module, layer_classes))
        if tensor_parallel > 1:
            check_plan(root, tensor_parallel_plan(root, plan, tensor_parallel), tensor_parallel)
        if pipeline_parallel > 1:
            n_layer = len(base_model(root)[1].layers)  # refuses a model CausalLMStage cannot split
    if pipeline_parallel > 1:
        compiled = bool(getattr(module, "hparams", {}).get("compile")) or (
            built and is_compiled(model_root(module, decoder_layers(module, layer_classes)))
        )
        check_zero_bubble(
            schedule, data_parallel, tensor_parallel, not own and bool(getattr(config, "tie_embeddings", 0)),
            activation_checkpointing, compiled,
        )
        if built or described:
            check_stages(pipeline_parallel * virtual_stages, n_layer, split_points)
        check_microbatches(batch_size, microbatches)
    if not built:
        return  # not built yet (configure_model builds it)
    root = model if model is not None else model_root(module, decoder_layers(module, layer_classes))
    if root is module and (tensor_parallel > 1 or pipeline_parallel > 1):
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} needs the model as "
            f"an attribute of {type(module).__name__} (e.g. self.model) with repeated decoder layers; none "
            "found (name their class with the strategy's layer_classes)"
        )
    if pipeline_parallel > 1 and all(child is not root for child in module.children()):
        raise UserInputError(
            f"pipeline_parallel needs the model as a direct attribute of {type(module).__name__} (e.g. "
            "self.model)"
        )


def tensor_parallel_plan(
    model: nn.Module, plan: dict[str, str] | None, tensor_parallel: int
) -> dict[str, str]:
    """The plan of a model of one's own: the one given, else ``plans.builtin_plan``'s; one error without."""
    plan = plan if plan is not None else builtin_plan(model)
    if plan is None:
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} has no built-in plan for {type(model).__name__}; give the "
            "strategy a tensor_parallel_plan (module-name patterns to colwise, rowwise or head: "
            "docs/strategies.md)"
        )
    return plan


def build_mesh(
    device_type: str, world_size: int, tensor_parallel: int, pipeline_parallel: int, replicate_size: int = 1
) -> DeviceMesh:
    """The ``MESH_DIMS`` mesh over ``world_size`` ranks: ``pipeline_parallel`` stages, each of
    ``replicate_size`` HSDP replica groups that shard over the data-parallel ranks left, each of those
    ``tensor_parallel`` ranks that split every layer."""
    data_parallel = world_size // (tensor_parallel * pipeline_parallel)
    shape = (pipeline_parallel, replicate_size, data_parallel // replicate_size, tensor_parallel)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def sharding_mesh(mesh: DeviceMesh, model_parallel: bool) -> DeviceMesh | None:
    """The part of a ``build_mesh`` mesh FSDP shards over: 2-D (dp_replicate, dp_shard) for HSDP, else
    dp_shard (None: model parallelism with no data-parallel ranks left to shard over)."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    if mesh["dp_shard"].size() > 1 or not model_parallel:
        return mesh["dp_shard"]
    return None


def transformer_blocks(
    model: nn.Module, layer_classes: Sequence[str] | None = None
) -> tuple[nn.Module, list[nn.Module]]:
    """(root, blocks): the network and its decoder layers (``layers.decoder_layers``: the GPT's blocks, a
    transformers model's ``_no_split_modules``, repeated layers, or ``layer_classes``); for a model with
    none, the model itself and its direct children that hold parameters."""
    layers = decoder_layers(model, layer_classes)
    if layers:
        return model_root(model, layers), layers
    rank_zero_warn(
        f"{type(model).__name__} has no repeated decoder layers: sharding each of its direct children "
        "instead (name the layers' class with the strategy's layer_classes)"
    )
    return model, [child for child in model.children() if any(True for _ in child.parameters())]


def apply_activation_checkpointing(model: nn.Module, layer_classes: Sequence[str] | None = None) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them (same gradients, less
    memory, ~1/3 more compute). The composable API keeps parameter names (and checkpoints) unchanged."""
    for block in transformer_blocks(model, layer_classes)[1]:
        checkpoint_activations(block)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
    layer_classes: Sequence[str] | None = None,
) -> None:
    """Shard each decoder layer (``transformer_blocks``), then the root (embeddings, final norm and head
    stay in the root's group), over ``mesh``: 1-D (FSDP) or 2-D (replicate, shard: HSDP).

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
    root, blocks = transformer_blocks(model, layer_classes)
    for index, block in enumerate(blocks):
        # the last block's parameters are needed again right away in backward: keep them gathered
        fully_shard(block, reshard_after_forward=reshard_after_forward and index < len(blocks) - 1, **options)
    fully_shard(root, reshard_after_forward=reshard_after_forward, **options)


def keep_own_stages(
    module: nn.Module,
    pp_rank: int,
    pipeline_parallel: int,
    virtual_stages: int,
    schedule: str,
    split_points: Sequence[int] | None,
    layer_classes: Sequence[str] | None = None,
) -> tuple[list[int], list[nn.Module]]:
    """Replace the model of ``module`` (a direct child: the GPT, or a transformers causal LM) by what
    pipeline rank ``pp_rank``'s stages hold (``pipeline.stage_model``, ``layer_stages.CausalLMStage``; the
    rest is freed); returns those stages' ids and models, in schedule order."""
    model = find_transformer(module)
    if model is None:
        model = model_root(module, decoder_layers(module, layer_classes))
        split, make_stage = split_layers, CausalLMStage
    else:
        split, make_stage = split_blocks, stage_model
    num_stages = pipeline_parallel * virtual_stages
    splits = split(model, num_stages, split_points)
    stage_ids = pipeline_stage_ids(pp_rank, pipeline_parallel, virtual_stages, schedule)
    stages = [make_stage(model, splits[i], i == 0, i == num_stages - 1) for i in stage_ids]
    if is_compiled(model):  # a stage is a new module: compile it as the whole model was
        for stage in stages:
            stage.compile()
    held = stages[0]
    if virtual_stages > 1:  # the module holds all of this rank's stages (state dict, optimizer)
        owned = [index for i in stage_ids for index in splits[i]]
        held = make_stage(model, owned, 0 in stage_ids, num_stages - 1 in stage_ids)
    name = next(name for name, child in module.named_children() if child is model)
    setattr(module, name, held)
    return stage_ids, stages


def tied_embedding_group(
    mesh: DeviceMesh, schedule: str, tied: bool
) -> torch.distributed.ProcessGroup | None:
    """The group of the first and the last stage's ranks of this rank's pipeline (a tied embedding's
    two copies), created on every rank as ``new_subgroups_by_enumeration`` requires; None if untied, or
    if one rank runs both (the V-shaped schedules: one embedding, its gradients summed by autograd)."""
    last = last_stage_rank(mesh["pp"].size(), schedule)
    if not tied or last == 0:
        return None
    ranks = mesh.mesh  # MESH_DIMS: global ranks by (pp, dp_replicate, dp_shard, tp)
    pairs = [[int(a), int(b)] for a, b in zip(ranks[0].flatten(), ranks[last].flatten(), strict=True)]
    group, _ = torch.distributed.new_subgroups_by_enumeration(
        pairs, backend=torch.distributed.get_backend()
    )
    return group  # None on the ranks of the middle stages


def parallelize_model(
    module: nn.Module,
    stages: Sequence[nn.Module],
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    activation_checkpointing: bool,
    fsdp_mesh: DeviceMesh | None,
    plan: dict[str, str] | None = None,
    layer_classes: Sequence[str] | None = None,
    **fsdp_options: Any,
) -> None:
    """Lay ``module`` out in place, in torchtitan's order: tensor parallelism over ``tp_mesh`` (when it has
    more than one rank) on each pipeline stage of this rank (``stages``; none: the whole GPT), then
    activation checkpointing on every block, then FSDP2 over ``fsdp_mesh`` (None: nothing to shard over)
    with each stage, or the whole module, a root of its own (a schedule runs stages, never the whole
    module). A model of one's own (not the GPT) is split by ``plan`` (else ``plans.builtin_plan``'s) and
    its decoder layers found by ``layers.decoder_layers`` (``layer_classes``). ``fsdp_options``:
    ``apply_fsdp``'s."""
    gpt = find_transformer(module)
    if tp_mesh.size() > 1:
        whole = gpt or model_root(module, decoder_layers(module, layer_classes))
        for part in stages or [whole]:
            if gpt is not None:
                apply_tensor_parallel(part, tp_mesh, loss_parallel)
            else:
                apply_plan(part, tp_mesh, tensor_parallel_plan(part, plan, tp_mesh.size()), loss_parallel)
    if activation_checkpointing:
        apply_activation_checkpointing(module, layer_classes)
    if fsdp_mesh is not None:
        for root in stages or [module]:
            apply_fsdp(root, fsdp_mesh, layer_classes=layer_classes, **fsdp_options)


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
