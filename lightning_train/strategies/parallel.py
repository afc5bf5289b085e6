"""ParallelStrategy, the package's one strategy: data parallelism (DDP or FSDP2) composed with tensor and
pipeline parallelism on one named device mesh, on CPUs (gloo) and GPUs.

    trainer = L.Trainer(strategy=ParallelStrategy(tensor_parallel=2), devices=2, accelerator="cpu")
    # CLI: --trainer.strategy=lightning_train.strategies.ParallelStrategy --trainer.strategy.tensor_parallel=2

``DataParallelStrategy`` (``data_parallel.py``; ``lt_ddp``, ``lt_fsdp``, ``lt_auto``) is this class without
model parallelism. The mesh is ``parallelize.MESH_DIMS``, ``(pp, dp_replicate, dp_shard, tp)``, outermost
first; data parallelism gets ``world_size / (tensor_parallel * pipeline_parallel)`` ranks. All ranks of
one tensor-parallel group, and all stages of one pipeline, read the same batch.

``configure_model`` runs under ``tensor_init_context``: on the meta device where a layout may shard,
else on the root device. ``setup`` checks the model (``check_model``), lays it out from outside
(``parallelize.py``: this rank's pipeline stages, TP, activation checkpointing, FSDP2), materialises and
initialises this rank's shards only (``initialize.materialize``), then runs the pipeline schedule or DDP.
Its bases: ``processes.py`` (launcher, process group), ``checkpoints.py``, ``steps.py``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_train._compat import optimizers_to_device, set_device_mesh, sync_module_states
from lightning_train.errors import UserInputError
from lightning_train.strategies.checkpoints import ShardedCheckpoints
from lightning_train.strategies.generation import ShardedGenerator
from lightning_train.strategies.initialize import materialize
from lightning_train.strategies.memory import (
    GiB,
    choose_sharding,
    device_memory_bytes,
    estimate_memory,
    format_bytes,
)
from lightning_train.strategies.parallelize import (
    CommHook,
    build_mesh,
    check_comm_hook,
    check_layout,
    check_layout_options,
    check_model_layout,
    find_transformer,
    keep_own_stages,
    parallelize_model,
    register_comm_hook,
    sharding_mesh,
    tied_embedding_group,
)
from lightning_train.strategies.pipeline import Pipeline
from lightning_train.strategies.planner import LayoutPlan, plan_layout, planning_model
from lightning_train.strategies.processes import ProcessGroup
from lightning_train.strategies.steps import ModelParallelStep

Sharding = Literal["ddp", "fsdp", "auto"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)  # one list: the type and the check agree
_LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ParallelStrategy(ProcessGroup, ShardedCheckpoints, ModelParallelStep, pl.strategies.ParallelStrategy):
    """Data parallelism (DDP or FSDP2, chosen by ``sharding``) x tensor parallelism (``tensor_parallel``
    ranks split every layer) x pipeline parallelism (``pipeline_parallel`` stages each run some layers).

    Args:
        tensor_parallel: ranks that split each layer (heads, MLP width, vocabulary) and the sequence
            between layers; must divide the world size, ``n_head``, ``n_kv_head`` and the sequence length.
            ``"auto"``: ``planner.plan_layout`` picks ``tensor_parallel``, ``pipeline_parallel`` and
            ``sharding`` from the memory estimate (leave those two at 1 and ``"auto"``), before the mesh
            is built; until then ``tensor_parallel`` reads 1 and ``layout_plan`` None.
        pipeline_parallel: stages the sequence of blocks is cut into (the embedding on the first, the
            final norm, head and loss on the last).
        microbatches: microbatches per batch in the pipeline (None: 2 x stages); must divide the
            per-device batch size.
        pipeline_schedule: ``"1F1B"`` (one forward, one backward: the least activation memory),
            ``"GPipe"`` (all forwards, then all backwards), ``"Interleaved1F1B"`` (``virtual_stages``
            stages per rank: a smaller bubble for more communication), or the zero-bubble ones (weight
            gradients fill the bubble): ``"InterleavedZeroBubble"`` (the interleaved loop),
            ``"ZBVZeroBubble"`` and ``"DualPipeV"`` (2 stages a rank in a V: rank 0 runs the first and the
            last); docs/strategies.md says what they refuse.
        virtual_stages: stages per rank: >= 2 for the interleaved schedules, 2 for the V-shaped ones, else 1.
        pipeline_split_points: the block indices where stages 2, 3, ... start; None: balanced by
            parameters.
        loss_parallel: with ``tensor_parallel`` > 1, keep the logits sharded by vocabulary and compute the
            cross-entropy vocab-parallel (no rank holds the whole ``batch x seq x vocab`` logits or their
            gradient); the model's forward then returns a ``Shard(-1)`` DTensor, which the modules'
            ``compute_loss`` takes as it is (``F.cross_entropy``). False: the logits are gathered whole on
            every rank, for a ``compute_loss`` that needs plain tensors.
        sharding: ``"ddp"`` (replicate), ``"fsdp"`` (shard) or ``"auto"`` (ddp if it fits in memory). With
            model parallelism ``"auto"`` is ``"fsdp"`` (over the data-parallel ranks, when there are
            several; checkpoints are sharded folders) and ``"ddp"`` is refused.
        bucket_cap_mb: DDP gradient bucket size; larger buckets mean fewer, bigger all-reduces.
        gradient_as_bucket_view: DDP gradients alias the communication buckets (saves one copy).
        static_graph: DDP may assume the same parameters are used every step (enables extra overlap).
        find_unused_parameters: DDP tolerates parameters that get no gradient (slower; off by default).
        comm_hook: DDP gradient compression: ``"fp16_compress"``, ``"bf16_compress"`` (NCCL only) or
            ``"powersgd"``; registered where torch supports it on the backend, else a warning says so.
        reshard_after_forward: FSDP frees gathered parameters after forward (ZeRO-3); ``False`` keeps
            them until backward (ZeRO-2 style: less communication, more memory).
        activation_checkpointing: recompute each block's activations in backward (ddp and fsdp).
        cpu_offload: FSDP keeps sharded parameters, gradients and optimizer state in host memory.
        replicate_size: FSDP over a 2-D mesh (HSDP): ``replicate_size`` groups, each sharding over the
            data-parallel ranks / ``replicate_size``. 1 is plain FSDP. ``"nodes"``: one group per node of
            this launch, so an elastic group that comes back with fewer or more nodes keeps sharding
            inside each node.
        reduce_dtype: FSDP gradient reduce-scatter dtype under mixed precision (``"float32"`` default).
        memory_budget_gb: per-device memory ``"auto"`` plans with (default: the device's memory).
        tensor_parallel_plan: a model of one's own: module-name patterns to ``colwise``, ``rowwise`` or
            ``head`` (``plans.py``); None: the built-in plan of a transformers Llama-like model.
        layer_classes: class names of the model's decoder layers (FSDP units, checkpointed, split by a
            pipeline); None: found from the model (``layers.decoder_layers``).
        process_group_backend, timeout: passed to ``torch.distributed.init_process_group``.

    Example (one CPU process: tensor_parallel=1 is DataParallelStrategy under another name):

        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> from lightning_train.strategies import ParallelStrategy
        >>> "lt_parallel" in StrategyRegistry
        True
        >>> ParallelStrategy(tensor_parallel=2).sharding
        'fsdp'
    """

    def __init__(
        self,
        tensor_parallel: int | Literal["auto"] = 1,
        pipeline_parallel: int = 1,
        microbatches: int | None = None,
        pipeline_schedule: Literal[
            "1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
        ] = "1F1B",
        virtual_stages: int = 1,
        pipeline_split_points: Sequence[int] | None = None,
        loss_parallel: bool = True,
        sharding: Sharding = "auto",
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        replicate_size: int | Literal["nodes"] = 1,
        reduce_dtype: Literal["float32", "bfloat16"] = "float32",
        memory_budget_gb: float | None = None,
        tensor_parallel_plan: dict[str, str] | None = None,
        layer_classes: list[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        if sharding not in SHARDINGS:
            raise UserInputError(f"sharding={sharding!r} is not one of {', '.join(SHARDINGS)}")
        check_comm_hook(comm_hook)
        if reduce_dtype not in ("float32", "bfloat16"):
            raise UserInputError(f"reduce_dtype={reduce_dtype!r} is not 'float32' or 'bfloat16'")
        self._device_mesh: DeviceMesh | None = None  # built in setup_environment
        self.ddp_kwargs = dict(
            bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, find_unused_parameters=find_unused_parameters,
        )
        self.comm_hook = comm_hook
        self.registered_comm_hook: str | None = None  # torch's name for the hook once registered
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.activation_checkpointing = activation_checkpointing
        self.replicate_option = replicate_size  # read through the replicate_size property
        self.reduce_dtype = getattr(torch, reduce_dtype)
        self.memory_budget_gb = memory_budget_gb
        self.tensor_parallel_plan, self.layer_classes = tensor_parallel_plan, layer_classes
        self.layout_plan: LayoutPlan | None = None  # tensor_parallel="auto": set by _plan_layout
        self.auto_layout = tensor_parallel == "auto"
        self._given = (tensor_parallel, pipeline_parallel, sharding)  # checked in _configure_launcher
        if self.auto_layout:
            tensor_parallel = 1  # until planned
        numbers = isinstance(tensor_parallel, int) and isinstance(pipeline_parallel, int)
        model_parallel = numbers and tensor_parallel * pipeline_parallel > 1
        self.sharding = "fsdp" if model_parallel and sharding != "ddp" else sharding
        self.tensor_parallel, self.pipeline_parallel = tensor_parallel, pipeline_parallel
        self.microbatches = 2 * pipeline_parallel * virtual_stages if microbatches is None else microbatches
        self.pipeline_schedule, self.virtual_stages = pipeline_schedule, virtual_stages
        self.pipeline_split_points = None if pipeline_split_points is None else list(pipeline_split_points)
        self._given_microbatches = microbatches
        self.loss_parallel = loss_parallel
        self.pipeline: Pipeline | None = None  # built in setup when pipeline_parallel > 1
        self._stage_ids: list[int] = []  # this rank's pipeline stages
        self._stage_views: list[torch.nn.Module] = []  # the model each of them runs
        self._generator: ShardedGenerator | None = None  # built on first use (generator())

    # ---- the mesh ------------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(pp, dp_replicate, dp_shard, tp)`` mesh (``parallelize.MESH_DIMS``)."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh is built in setup_environment, once the processes started")
        return self._device_mesh

    @property
    def replicate_size(self) -> int:
        """HSDP replica groups of this launch: the node count for ``replicate_size="nodes"``."""
        return self.num_nodes if self.replicate_option == "nodes" else self.replicate_option

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def data_parallel_rank(self) -> int:
        # rank = ((pp * dp) + dp_rank) * tp + tp_rank: tp innermost, pp outermost
        return self.global_rank // self.tensor_parallel % self.data_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards over (``parallelize.sharding_mesh``)."""
        return sharding_mesh(self.device_mesh, self.tensor_parallel * self.pipeline_parallel > 1)

    # ---- the layout: checked, planned ----------------------------------------------------------------
    def _configure_launcher(self) -> None:
        # options and sizes: checked here, before any process starts, not in __init__ (the CLI's parser would
        # turn an error raised there into a generic message of its own)
        tensor_parallel, pipeline_parallel, sharding = self._given
        check_layout_options(
            tensor_parallel, pipeline_parallel, sharding, self.pipeline_schedule, self.microbatches,
            self.virtual_stages, self.pipeline_split_points,
        )
        check_layout(
            self.tensor_parallel, self.replicate_size, self.num_nodes, self.num_processes,
            self.pipeline_parallel,
        )
        super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()  # the process group
        module = self.lightning_module  # the Trainer API calls no check_model: plan before the mesh
        self._plan_layout(module, getattr(module.trainer, "datamodule", None))
        mesh = build_mesh(
            self.root_device.type, self.world_size, self.tensor_parallel, self.pipeline_parallel,
            self.replicate_size,
        )
        set_device_mesh(self, mesh)

    def check_model(self, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Refuse a model (or batch) the layout cannot split: the one check of the model, made by ``setup``
        before it lays the model out, and by the CLI before any process starts (the model unbuilt yet)."""
        self._plan_layout(module, datamodule)
        if self.tensor_parallel * self.pipeline_parallel > 1:
            check_model_layout(
                module, getattr(datamodule, "batch_size", None), self.tensor_parallel, self.pipeline_parallel,
                self.virtual_stages, self.pipeline_schedule, self.pipeline_split_points, self.microbatches,
                self.data_parallel_size, self.activation_checkpointing, self.tensor_parallel_plan,
                self.layer_classes,
            )

    def _plan_layout(self, module: pl.LightningModule, datamodule: Any) -> None:
        """tensor_parallel='auto': settle the sizes and sharding from ``plan_layout``, once (every rank plans
        from the same sizes; set ``memory_budget_gb`` where devices differ)."""
        if not self.auto_layout or self.layout_plan is not None:
            return
        plan = plan_layout(
            planning_model(getattr(module, "config", None), datamodule),
            self.num_nodes * self.num_processes, self.num_processes, getattr(datamodule, "batch_size", None),
            getattr(datamodule, "seq_len", None), self.memory_budget_bytes(), self._precision_name,
            self.activation_checkpointing, self.replicate_size, self._given_microbatches,
            self.pipeline_schedule, self.virtual_stages, loss_parallel=self.loss_parallel,
        )
        rank_zero_info(f"ParallelStrategy(tensor_parallel='auto') chose {plan.describe()}")
        self.sharding, self.tensor_parallel, self.pipeline_parallel = (
            plan.sharding, plan.tensor_parallel, plan.pipeline_parallel
        )
        self.microbatches = plan.microbatches or self.microbatches
        self.layout_plan = plan

    def _choose_sharding(self, trainer: pl.Trainer, module: torch.nn.Module) -> str:
        """sharding='auto' without model parallelism: ddp when a replica fits (``memory.choose_sharding``)."""
        datamodule = getattr(trainer, "datamodule", None)
        estimate = estimate_memory(
            module, self.world_size // self.replicate_size, getattr(datamodule, "batch_size", None),
            getattr(datamodule, "seq_len", None), activation_checkpointing=self.activation_checkpointing,
            activation_dtype=_LOW_PRECISION.get(self._precision_name, torch.float32),
        )
        budget = self.memory_budget_bytes()
        choice = choose_sharding(estimate, budget)
        rank_zero_info(
            f"DataParallelStrategy(sharding='auto') chose {choice!r}: {estimate.describe()}; "
            f"budget {format_bytes(budget)} per device (ddp when it needs <= 80% of it)"
        )
        return choice

    def memory_budget_bytes(self) -> int:
        """The per-device memory ``auto`` plans with: ``memory_budget_gb``, or the device's."""
        if self.memory_budget_gb is not None:
            return int(self.memory_budget_gb * GiB)
        return device_memory_bytes(self.root_device, self.num_processes)

    @property
    def _precision_name(self) -> str:
        return getattr(self.precision_plugin, "precision", "32-true")

    # ---- the model, laid out -------------------------------------------------------------------------
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """On the meta device wherever a layout may shard (fsdp, hsdp, tp, pp, ``"auto"`` over several ranks)
        and the LightningModule says its model initialises the same under any layout (``builds_on_meta``:
        ours do): no rank holds the whole model; ``setup`` materialises its shards. Else on the device."""
        module = self.lightning_module
        on_meta = self.world_size > 1 and self.sharding != "ddp" and getattr(module, "builds_on_meta", False)
        with super().tensor_init_context(empty_init), torch.device("meta") if on_meta else nullcontext():
            yield  # meta innermost: it wins over the root device

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.check_model(module, trainer.datamodule)
        if self.sharding == "auto":
            self.sharding = self._choose_sharding(trainer, module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = self.precision_plugin.convert_module(module)
        mesh = self.device_mesh
        if self.pipeline_parallel > 1:  # checkpoints are checked against the whole model's state
            self.whole_model_shapes = {key: tuple(value.shape) for key, value in module.state_dict().items()}
            self._stage_ids, self._stage_views = keep_own_stages(
                module, mesh["pp"].get_local_rank(), self.pipeline_parallel, self.virtual_stages,
                self.pipeline_schedule, self.pipeline_split_points, self.layer_classes,
            )
        parallelize_model(
            module, self._stage_views, mesh["tp"], self.loss_parallel,
            self.activation_checkpointing and fitting, self.fsdp_mesh if self.sharding == "fsdp" else None,
            self.tensor_parallel_plan, self.layer_classes,
            param_dtype=_LOW_PRECISION.get(self._precision_name), reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward, cpu_offload=self.cpu_offload,
        )
        # built on meta (builds_on_meta): this rank's shards only, allocated and initialised now
        materialize(module, torch.device("cpu") if self.cpu_offload else self.root_device)
        self.model_to_device()  # FSDP placed its shards; this moves the rest (e.g. metric states)
        if self.pipeline_parallel > 1:
            self.pipeline = Pipeline(
                self._stage_views, self._stage_ids, self.pipeline_parallel * self.virtual_stages,
                self.pipeline_schedule, self.microbatches, group=mesh.get_group("pp"),
                tied_group=tied_embedding_group(  # a transformers model's config has no tie_embeddings
                    mesh, self.pipeline_schedule, getattr(self._stage_views[0].config, "tie_embeddings", 0)
                ),
                device=self.root_device,
            )
        if self.sharding == "ddp" and fitting:
            self.model = self._wrap_ddp(module)
        elif self.sharding == "ddp":
            sync_module_states(module)
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting and not self.cpu_offload:
            optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded shards must stay in host memory
            self.lightning_module.to(self.root_device)

    def _wrap_ddp(self, module: pl.LightningModule) -> DistributedDataParallel:
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
        model = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        if self.comm_hook is not None:
            self.registered_comm_hook = register_comm_hook(model, self.comm_hook, self.process_group_backend)
        return model

    def generator(self) -> ShardedGenerator | None:
        """What generates on the model as laid out here (``generation.ShardedGenerator``: call its
        ``generate`` on every rank with the same prompts); None without tensor or pipeline parallelism,
        where the model generates by itself."""
        if self.tensor_parallel * self.pipeline_parallel == 1:
            return None
        if self._generator is None:
            stages = dict(zip(self._stage_ids, self._stage_views, strict=True))
            self._generator = ShardedGenerator(
                stages or {0: find_transformer(self.lightning_module)}, self.device_mesh,
                self.pipeline_schedule, self.virtual_stages,
            )
        return self._generator

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "lt_parallel", cls, description="lightning_train ParallelStrategy (data x tensor x pipeline)",
            override=True,
        )
