"""ParallelStrategy: data parallelism (FSDP2, as ``DataParallelStrategy``) composed with tensor and
pipeline parallelism on one named device mesh.

    trainer = L.Trainer(strategy=ParallelStrategy(tensor_parallel=2), devices=2, accelerator="cpu")
    # CLI: --trainer.strategy=lightning_train.strategies.ParallelStrategy --trainer.strategy.tensor_parallel=2

The mesh is ``(pp, dp_replicate, dp_shard, tp)``, outermost first: tensor parallelism, the most
communication-hungry, on neighbouring ranks (inside a node); pipeline stages, which exchange only one
activation per microbatch, farthest apart (across nodes); data parallelism gets the rest,
``world_size / (tensor_parallel * pipeline_parallel)`` replicas. All ranks of one tensor-parallel group,
and all stages of one pipeline, read the same batch. The plans for the GPT live in
``tensor_parallel.py`` and ``pipeline.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_train._compat import is_compiled
from lightning_train.errors import UserInputError
from lightning_train.strategies.data_parallel import DataParallelStrategy
from lightning_train.strategies.generation import ShardedGenerator
from lightning_train.strategies.parallelize import find_transformer
from lightning_train.strategies.pipeline import (
    Pipeline,
    check_microbatches,
    check_pipeline,
    check_stages,
    check_zero_bubble,
    last_stage_rank,
    pipeline_stage_ids,
    split_blocks,
    stage_model,
)
from lightning_train.strategies.planner import LayoutPlan, plan_layout, planning_model
from lightning_train.strategies.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    reduce_partial_grads,
    vocab_parallel_loss,
)


def check_layout(
    tensor_parallel: int, replicate_size: int, num_nodes: int, devices: int, pipeline_parallel: int = 1
) -> None:
    """Refuse a mesh that does not divide the world size ``num_nodes * devices``."""
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
    data_parallel = world_size // (tensor_parallel * pipeline_parallel)
    if replicate_size < 1 or data_parallel % replicate_size:
        raise UserInputError(
            f"replicate_size={replicate_size} does not divide the data-parallel size {data_parallel} "
            f"(world size {world_size} / tensor_parallel={tensor_parallel} / pipeline_parallel="
            f"{pipeline_parallel}); use a divisor, or 'nodes' (one replica per node)"
        )


class ParallelStrategy(DataParallelStrategy):
    """``DataParallelStrategy`` with tensor parallelism (``tensor_parallel`` ranks split every layer) and
    pipeline parallelism (``pipeline_parallel`` stages each run some of the layers).

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
        **kwargs: the options of ``DataParallelStrategy``. With model parallelism, ``sharding`` ``"auto"``
            is ``"fsdp"`` (FSDP2 over the data-parallel ranks, when there are several; checkpoints are
            sharded folders); ``"ddp"`` is refused.

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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.layout_plan: LayoutPlan | None = None  # tensor_parallel="auto": set by _plan_layout
        self.auto_layout = tensor_parallel == "auto"
        self._given = (tensor_parallel, pipeline_parallel, self.sharding)  # checked in _check_options
        if self.auto_layout:
            tensor_parallel = 1  # until planned
        numbers = isinstance(tensor_parallel, int) and isinstance(pipeline_parallel, int)
        if numbers and tensor_parallel * pipeline_parallel > 1 and self.sharding != "ddp":
            self.sharding = "fsdp"
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

    # ---- the mesh -------------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self._check_options()
        check_layout(
            self.tensor_parallel, self.replicate_size, self.num_nodes, self.num_processes,
            self.pipeline_parallel,
        )
        super()._configure_launcher()

    def _check_options(self) -> None:
        """Refuse options that cannot work together. Here, not in ``__init__``: the CLI's parser would turn
        an error raised there into a generic message of its own."""
        tensor_parallel, pipeline_parallel, sharding = self._given
        if self.auto_layout and (pipeline_parallel != 1 or sharding != "auto"):
            raise UserInputError(
                f"tensor_parallel='auto' plans pipeline_parallel and sharding too; leave them at 1 and "
                f"'auto' (got {pipeline_parallel} and {sharding!r}), or give tensor_parallel as a number"
            )
        if not self.auto_layout and (not isinstance(tensor_parallel, int) or tensor_parallel < 1):
            raise UserInputError(f"tensor_parallel={tensor_parallel!r}: use an int >= 1 or 'auto'")
        check_pipeline(
            pipeline_parallel, self.pipeline_schedule, self.microbatches, self.virtual_stages,
            self.pipeline_split_points,
        )
        if self.tensor_parallel * pipeline_parallel > 1 and sharding == "ddp":
            raise UserInputError(
                f"sharding='ddp' does not combine with tensor_parallel={self.tensor_parallel} x "
                f"pipeline_parallel={pipeline_parallel} yet; use sharding='fsdp' (or 'auto')"
            )

    def setup_environment(self) -> None:
        module = self.lightning_module  # the Trainer API calls no check_model: plan before the mesh
        self._plan_layout(module, getattr(module.trainer, "datamodule", None))
        super().setup_environment()

    def _build_mesh(self) -> DeviceMesh:
        tp, pp, replicate = self.tensor_parallel, self.pipeline_parallel, self.replicate_size
        data_parallel = self.world_size // (tp * pp)
        return init_device_mesh(
            self.root_device.type,
            (pp, replicate, data_parallel // replicate, tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )

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
        mesh = self.device_mesh
        if mesh["dp_replicate"].size() > 1:
            return mesh["dp_replicate", "dp_shard"]
        if mesh["dp_shard"].size() > 1 or self.tensor_parallel * self.pipeline_parallel == 1:
            return mesh["dp_shard"]
        return None  # model parallelism only: nothing to shard over

    # ---- the model ----------------------------------------------------------------------------------
    def check_model(self, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Refuse a model (or batch) the layout cannot split (the CLI calls this before any process
        starts)."""
        self._plan_layout(module, datamodule)
        config = getattr(module, "config", None)
        check_tensor_parallel(self.tensor_parallel, config)
        if self.pipeline_parallel > 1:
            model = find_transformer(module)
            compiled = bool(getattr(module, "hparams", {}).get("compile")) or (
                model is not None and is_compiled(model)
            )
            check_zero_bubble(
                self.pipeline_schedule, self.data_parallel_size, self.tensor_parallel,
                bool(getattr(config, "tie_embeddings", False)), self.activation_checkpointing, compiled,
            )
            num_stages = self.pipeline_parallel * self.virtual_stages
            check_stages(num_stages, getattr(config, "n_layer", 0), self.pipeline_split_points)
            check_microbatches(getattr(datamodule, "batch_size", None), self.microbatches)

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

    def apply_model_parallel(self, module: pl.LightningModule) -> None:
        if self.tensor_parallel * self.pipeline_parallel == 1:
            return
        self.check_model(module)
        model = find_transformer(module)
        if model is None:
            raise UserInputError(
                f"tensor_parallel={self.tensor_parallel} x pipeline_parallel={self.pipeline_parallel} needs "
                f"a GPT (a module with `blocks`); {type(module).__name__} has none"
            )
        if self.pipeline_parallel > 1:
            model = self._keep_own_stages(module, model)
        if self.tensor_parallel > 1:
            for part in self._stage_views or [model]:
                apply_tensor_parallel(part, self.device_mesh["tp"], self.loss_parallel)

    def _keep_own_stages(self, module: pl.LightningModule, model: torch.nn.Module) -> torch.nn.Module:
        """Replace the GPT by what this rank's stages hold (``pipeline.stage_model``); the rest is freed."""
        num_stages = self.pipeline_parallel * self.virtual_stages
        splits = split_blocks(model, num_stages, self.pipeline_split_points)
        pp_rank = self.device_mesh["pp"].get_local_rank()
        self._stage_ids = pipeline_stage_ids(
            pp_rank, self.pipeline_parallel, self.virtual_stages, self.pipeline_schedule
        )
        self._stage_views = [
            stage_model(model, splits[i], i == 0, i == num_stages - 1) for i in self._stage_ids
        ]
        if is_compiled(model):  # a stage is a new module: compile it as the whole model was
            for view in self._stage_views:
                view.compile()
        held = self._stage_views[0]
        if self.virtual_stages > 1:  # the module holds all of this rank's stages (state dict, optimizer)
            owned = [index for i in self._stage_ids for index in splits[i]]
            held = stage_model(model, owned, 0 in self._stage_ids, num_stages - 1 in self._stage_ids)
        self.whole_model_shapes = {key: tuple(value.shape) for key, value in module.state_dict().items()}
        name = next((name for name, child in module.named_children() if child is model), None)
        if name is None:
            raise UserInputError(
                f"pipeline_parallel needs the GPT as a direct attribute of {type(module).__name__} (e.g. "
                "self.model)"
            )
        setattr(module, name, held)
        return held

    def fsdp_roots(self, module: pl.LightningModule) -> list[torch.nn.Module]:
        # each stage is an FSDP root of its own: a schedule runs stages, never the whole module
        return self._stage_views or [module]

    def after_sharding(self, module: pl.LightningModule) -> None:
        if self.pipeline_parallel == 1:
            return
        mesh = self.device_mesh
        num_stages = self.pipeline_parallel * self.virtual_stages
        self.pipeline = Pipeline(
            self._stage_views, self._stage_ids, num_stages, self.pipeline_schedule, self.microbatches,
            group=mesh.get_group("pp"), tied_group=self._tied_embedding_group(module),
            device=self.root_device,
        )

    def _tied_embedding_group(self, module: pl.LightningModule) -> dist.ProcessGroup | None:
        """The group of the first and the last stage's ranks of this rank's pipeline (a tied embedding's
        two copies), created on every rank as ``new_subgroups_by_enumeration`` requires; None if untied, or
        if one rank runs both (the V-shaped schedules: one embedding, its gradients summed by autograd)."""
        last = last_stage_rank(self.pipeline_parallel, self.pipeline_schedule)
        if not getattr(module.config, "tie_embeddings", False) or last == 0:
            return None
        ranks = self.device_mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
        pairs = [[int(a), int(b)] for a, b in zip(ranks[0].flatten(), ranks[last].flatten(), strict=True)]
        group, _ = dist.new_subgroups_by_enumeration(pairs, backend=dist.get_backend())
        return group  # None on the ranks of the middle stages

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

    # ---- the step -----------------------------------------------------------------------------------
    def _loss_context(self) -> AbstractContextManager:
        """Around every step and backward: the vocab-parallel cross-entropy where the logits are sharded."""
        return vocab_parallel_loss() if self.tensor_parallel > 1 and self.loss_parallel else nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():  # a pipeline schedule runs backward in here too
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return super().test_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            with self._loss_context():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the pipeline schedule ran every microbatch's backward in training_step; the hooks still run once
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        # before on_before_optimizer_step: every callback sees whole gradients
        if self.tensor_parallel > 1:
            reduce_partial_grads(self.lightning_module)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "lt_parallel", cls, description="lightning_train ParallelStrategy (data x tensor parallel)",
            override=True,
        )
