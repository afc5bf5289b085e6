"""DataParallelStrategy: one Lightning strategy for DDP and FSDP2 data parallelism, on CPUs (gloo) and GPUs.

    trainer = L.Trainer(strategy=DataParallelStrategy(sharding="fsdp"), devices=8, num_nodes=2)
    trainer = L.Trainer(strategy="lt_fsdp", devices=2, accelerator="cpu")   # registry names, YAML too

``sharding="ddp"`` replicates the model (torch ``DistributedDataParallel``); ``"fsdp"`` shards
parameters, gradients and optimizer state with ``fully_shard`` (each transformer block, then the
root); ``"auto"`` estimates the per-device memory of DDP and takes it when it fits with margin.

The model is built by the LightningModule's ``configure_model`` on the root device exactly as in a
single-process run (same seed, same initial weights), then parallelised from outside
(``parallelize.py``). Built on Lightning's ``ModelParallelStrategy`` for process groups, the launcher
and sharded checkpoints (``torch.distributed.checkpoint`` folders that load at any world size).
"""

from __future__ import annotations

import atexit
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_train._compat import (
    PathLike,
    optimizers_to_device,
    set_device_mesh,
    setup_distributed,
    sync_module_states,
)
from lightning_train.checkpoint.format import is_sharded_checkpoint
from lightning_train.errors import UserInputError
from lightning_train.plugins.step import step_control
from lightning_train.storage import as_path
from lightning_train.strategies.memory import (
    GiB,
    choose_sharding,
    device_memory_bytes,
    estimate_memory,
    format_bytes,
)
from lightning_train.strategies.parallelize import (
    CommHook,
    apply_activation_checkpointing,
    apply_fsdp,
    build_mesh,
    check_comm_hook,
    check_replicate_size,
    register_comm_hook,
)

Sharding = Literal["ddp", "fsdp", "auto"]
SHARDINGS = ("ddp", "fsdp", "auto")
_LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def leave_process_group() -> None:
    """Destroy the default process group while Python is still alive. Left to interpreter shutdown, Gloo's
    worker threads can still hold tensors whose release then aborts the finished process (SIGABRT,
    "terminate called without an active exception"), which a scheduler reads as a failed job."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class DataParallelStrategy(ModelParallelStrategy):
    """Data parallelism with DDP or FSDP2, chosen by ``sharding``.

    Args:
        sharding: ``"ddp"`` (replicate), ``"fsdp"`` (shard) or ``"auto"`` (ddp if it fits in memory).
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
        replicate_size: FSDP over a 2-D mesh (HSDP): ``replicate_size`` groups, each sharding over
            ``world_size / replicate_size`` ranks. 1 is plain FSDP. ``"nodes"``: one group per node of
            this launch, so an elastic group that comes back with fewer or more nodes keeps sharding
            inside each node.
        reduce_dtype: FSDP gradient reduce-scatter dtype under mixed precision (``"float32"`` default).
        memory_budget_gb: per-device memory ``"auto"`` plans with (default: the device's memory).
        process_group_backend, timeout: passed to ``torch.distributed.init_process_group``.

    Example (one CPU process here; ``devices=N`` starts N, each with its share of every global batch):

        >>> import lightning as L
        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.strategies import DataParallelStrategy
        >>> from lightning_train.strategies.data_parallel import leave_process_group
        >>> sorted(name for name in StrategyRegistry if name.startswith("lt_"))
        ['lt_auto', 'lt_ddp', 'lt_fsdp', 'lt_parallel']
        >>> strategy = DataParallelStrategy(sharding="auto")  # ddp when a replica fits in memory
        >>> trainer = L.Trainer(
        ...     max_steps=2, accelerator="cpu", devices=1, strategy=strategy, limit_val_batches=0,
        ...     logger=False, enable_progress_bar=False, enable_checkpointing=False,
        ...     enable_model_summary=False,
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> strategy.sharding, trainer.world_size, trainer.global_step
        ('ddp', 1, 2)
        >>> leave_process_group()  # a script's process group is left at exit; here, in a test run, now
    """

    def __init__(
        self,
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
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if sharding not in SHARDINGS:
            raise UserInputError(f"sharding={sharding!r} is not one of {', '.join(SHARDINGS)}")
        check_comm_hook(comm_hook)
        if reduce_dtype not in ("float32", "bfloat16"):
            raise UserInputError(f"reduce_dtype={reduce_dtype!r} is not 'float32' or 'bfloat16'")
        self.sharding = sharding
        self.ddp_kwargs = dict(
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        self.comm_hook = comm_hook
        self.registered_comm_hook: str | None = None  # torch's name for the hook once registered
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.replicate_option = replicate_size  # read through the replicate_size property
        self.reduce_dtype = getattr(torch, reduce_dtype)
        self.memory_budget_gb = memory_budget_gb
        self._restored_by_strategy = (
            False  # True once load_checkpoint has put model + optimizer states in place
        )
        self._checkpoint_group: Any = None  # the gloo group of background sharded saves
        # the whole LightningModule's state (name -> shape) when this rank holds part of it (a pipeline
        # stage): checkpoints are checked against the whole model
        self.whole_model_shapes: dict[str, tuple[int, ...]] | None = None

    # ---- process groups and mesh ---------------------------------------------------------------------
    @property
    def replicate_size(self) -> int:
        """HSDP replica groups of this launch: the node count for ``replicate_size="nodes"``."""
        return self.num_nodes if self.replicate_option == "nodes" else self.replicate_option

    def _configure_launcher(self) -> None:
        # fail before any process starts
        check_replicate_size(self.replicate_size, self.num_nodes, self.num_processes)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        Strategy.setup_environment(self)  # accelerator setup; skips ModelParallelStrategy's 2-D (dp, tp) mesh
        setup_distributed(self)
        atexit.register(leave_process_group)
        set_device_mesh(self, self._build_mesh())

    def _build_mesh(self) -> DeviceMesh:
        return build_mesh(self.root_device.type, self.num_nodes, self.num_processes, self.replicate_size)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # every rank is data-parallel

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Build on the root device like a single-device run, so the same seed gives the same weights.
        with Strategy.tensor_init_context(self, empty_init):
            yield

    # ---- wrapping ---------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.sharding == "auto":
            self.sharding = self._choose_sharding(trainer, module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = self.precision_plugin.convert_module(module)
        self.apply_model_parallel(module)
        if self.activation_checkpointing and fitting:
            apply_activation_checkpointing(module)
        if self.sharding == "fsdp" and self.fsdp_mesh is not None:
            for root in self.fsdp_roots(module):
                apply_fsdp(
                    root,
                    self.fsdp_mesh,
                    param_dtype=_LOW_PRECISION.get(self._precision_name),
                    reduce_dtype=self.reduce_dtype,
                    reshard_after_forward=self.reshard_after_forward,
                    cpu_offload=self.cpu_offload,
                )
        self.model_to_device()  # FSDP placed its shards; this moves the rest (e.g. metric states)
        self.after_sharding(module)
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

    def apply_model_parallel(self, module: pl.LightningModule) -> None:
        """Split layers across devices before activation checkpointing and FSDP wrap them (none here)."""

    def fsdp_roots(self, module: pl.LightningModule) -> list[nn.Module]:
        """The modules FSDP shards each as one root (with its blocks): the whole module here."""
        return [module]

    def after_sharding(self, module: pl.LightningModule) -> None:
        """Finish model parallelism once the model is sharded and on its device (nothing here)."""

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards over: 2-D (replicate, shard) for HSDP, else the 1-D shard mesh (None:
        nothing to shard over)."""
        mesh = self.device_mesh
        return mesh if mesh["replicate"].size() > 1 else mesh["shard"]

    @property
    def _precision_name(self) -> str:
        return getattr(self.precision_plugin, "precision", "32-true")

    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded shards must stay in host memory
            self.lightning_module.to(self.root_device)

    def _wrap_ddp(self, module: pl.LightningModule) -> DistributedDataParallel:
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
        model = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        if self.comm_hook is not None:
            self.registered_comm_hook = register_comm_hook(model, self.comm_hook, self.process_group_backend)
        return model

    def _choose_sharding(self, trainer: pl.Trainer, module: nn.Module) -> str:
        datamodule = getattr(trainer, "datamodule", None)
        estimate = estimate_memory(
            module,
            shard_size=self.world_size // self.replicate_size,
            batch_size=getattr(datamodule, "batch_size", None),
            seq_len=getattr(datamodule, "seq_len", None),
            activation_checkpointing=self.activation_checkpointing,
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

    def teardown(self) -> None:
        # Lightning's ModelParallelStrategy.teardown never tears the CheckpointIO down: without this, a
        # background (--async_checkpoint) write still in flight is cut off when the process exits
        self.checkpoint_io.teardown()
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of all parameters to a total ``norm_type`` norm of ``max_norm`` and return
        the norm before clipping, the same on every rank: the norm over every shard and pipeline stage,
        the step's one measurement (``lightning_train.plugins.step``), which ``gradient_clip_val`` uses."""
        return step_control(self.lightning_module.trainer).clip_grad_norm_(max_norm, norm_type)

    # ---- checkpoints --------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.sharding == "ddp":
            return Strategy.lightning_module_state_dict(self)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.sharding == "ddp":
            return Strategy.optimizer_state(self, optimizer)
        # checkpoint.sharded imports torch.distributed.checkpoint (~0.1 s): only runs that shard pay it
        from lightning_train.checkpoint.sharded import sharded_optimizer_state

        return sharded_optimizer_state(self.model, optimizer)  # trainer.optimizers: plain torch ones

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None
    ) -> None:
        if self.sharding == "ddp":  # one ordinary file from rank 0, through the Trainer's CheckpointIO
            Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)
        else:
            self.save_sharded_checkpoint(checkpoint, as_path(filepath))

    def save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` as a sharded folder at ``path``, atomically and verifiably (see
        ``checkpoint.sharded.save_sharded_checkpoint``); in the background when the checkpoint plugin is
        ``AtomicCheckpointIO(async_save=True)``."""
        from lightning_train.checkpoint.sharded import save_sharded_checkpoint

        path = as_path(self.broadcast(str(path)))  # an s3:// URL stays one
        writer = getattr(self.checkpoint_io, "writer", None)
        if writer is not None and self._checkpoint_group is None:
            # the writer thread's collectives get a group of their own, never interleaved with training's
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")
        save_sharded_checkpoint(
            checkpoint, path, is_writer=self.global_rank == 0, barrier=self.barrier,
            writer=writer, process_group=self._checkpoint_group,
        )

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        flush = getattr(self.checkpoint_io, "flush", None)
        if flush is not None:
            flush()  # a checkpoint being written in the background is complete before anything is read
        path = as_path(self.broadcast(str(checkpoint_path)))  # an s3:// URL stays one
        if is_sharded_checkpoint(path):
            metadata = self.load_sharded_checkpoint(path, weights_only)
        elif self.sharding == "fsdp":  # a single file (one process, ddp) into sharded parameters
            from lightning_train.checkpoint.sharded import load_full_checkpoint

            metadata = Strategy.load_checkpoint(self, path, weights_only)
            module = self.lightning_module
            load_full_checkpoint(
                metadata, path, module, self.optimizers, strict=module.strict_loading,
                whole_model=self.whole_model_shapes,
            )
        else:
            return Strategy.load_checkpoint(self, path, weights_only)
        self._restored_by_strategy = True
        return metadata

    def load_sharded_checkpoint(self, path: Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizer states from a sharded folder written at any world size (DCP
        re-shards on load); returns the rest of the checkpoint for Lightning to restore."""
        from lightning_train.checkpoint.sharded import load_sharded_checkpoint

        module = self.lightning_module
        return load_sharded_checkpoint(
            path, module, self.optimizers, strict=module.strict_loading, is_verifier=self.global_rank == 0,
            broadcast=self.broadcast, weights_only=weights_only is not False,
            whole_model=self.whole_model_shapes,
        )

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._restored_by_strategy

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._restored_by_strategy:
            Strategy.load_model_state_dict(self, checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._restored_by_strategy:
            Strategy.load_optimizer_state_dict(self, checkpoint)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for sharding in SHARDINGS:
            strategy_registry.register(
                f"lt_{sharding}",
                cls,
                description=f"lightning_train DataParallelStrategy(sharding={sharding!r})",
                sharding=sharding,
                override=True,
            )
