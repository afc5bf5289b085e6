"""ParallelStrategy: data parallelism (FSDP2, as ``DataParallelStrategy``) composed with tensor
parallelism on one named device mesh.

    trainer = L.Trainer(strategy=ParallelStrategy(tensor_parallel=2), devices=2, accelerator="cpu")
    # CLI: --trainer.strategy=lightning_train.strategies.ParallelStrategy --trainer.strategy.tensor_parallel=2

The mesh is ``(dp_replicate, dp_shard, tp)``, outermost first: tensor parallelism, the most
communication-hungry, on neighbouring ranks (inside a node); data parallelism gets the rest,
``world_size / tensor_parallel`` replicas. All ranks of one tensor-parallel group read the same batch.
The plan for the GPT lives in ``tensor_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_train.errors import UserInputError
from lightning_train.strategies.data_parallel import DataParallelStrategy
from lightning_train.strategies.parallelize import find_transformer
from lightning_train.strategies.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    reduce_partial_grads,
)


def check_layout(tensor_parallel: int, replicate_size: int, num_nodes: int, devices: int) -> None:
    """Refuse a mesh that does not divide the world size ``num_nodes * devices``."""
    world_size = num_nodes * devices
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} does not divide the world size {world_size} "
            f"(num_nodes={num_nodes} x devices={devices}); use a divisor of the devices of one node"
        )
    data_parallel = world_size // tensor_parallel
    if replicate_size < 1 or data_parallel % replicate_size:
        raise UserInputError(
            f"replicate_size={replicate_size} does not divide the data-parallel size {data_parallel} "
            f"(world size {world_size} / tensor_parallel={tensor_parallel}); use a divisor, e.g. num_nodes"
        )


class ParallelStrategy(DataParallelStrategy):
    """``DataParallelStrategy`` with tensor parallelism (``tensor_parallel`` ranks split every layer).

    Args:
        tensor_parallel: ranks that split each layer (heads, MLP width, vocabulary) and the sequence
            between layers; must divide the world size, ``n_head``, ``n_kv_head`` and the sequence length.
            1 is plain data parallelism.
        **kwargs: the options of ``DataParallelStrategy``. With ``tensor_parallel > 1``, ``sharding``
            ``"auto"`` is ``"fsdp"`` (FSDP2 over the data-parallel ranks, when there are several;
            checkpoints are sharded folders); ``"ddp"`` is refused.

    Example (one CPU process: tensor_parallel=1 is DataParallelStrategy under another name):

        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> from lightning_train.strategies import ParallelStrategy
        >>> "lt_parallel" in StrategyRegistry
        True
        >>> ParallelStrategy(tensor_parallel=2).sharding
        'fsdp'
    """

    def __init__(self, tensor_parallel: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if tensor_parallel < 1:
            raise UserInputError(f"tensor_parallel={tensor_parallel}: use an int >= 1")
        if tensor_parallel > 1 and self.sharding == "ddp":
            raise UserInputError(
                f"sharding='ddp' does not combine with tensor_parallel={tensor_parallel} yet; use "
                "sharding='fsdp' (or 'auto')"
            )
        if tensor_parallel > 1:
            self.sharding = "fsdp"
        self.tensor_parallel = tensor_parallel

    # ---- the mesh -------------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        check_layout(self.tensor_parallel, self.replicate_size, self.num_nodes, self.num_processes)
        super()._configure_launcher()

    def _build_mesh(self) -> DeviceMesh:
        tp, replicate = self.tensor_parallel, self.replicate_size
        data_parallel = self.world_size // tp
        return init_device_mesh(
            self.root_device.type,
            (replicate, data_parallel // replicate, tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.tensor_parallel  # tp is the innermost mesh dimension

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        mesh = self.device_mesh
        if mesh["dp_replicate"].size() > 1:
            return mesh["dp_replicate", "dp_shard"]
        if mesh["dp_shard"].size() > 1 or self.tensor_parallel == 1:
            return mesh["dp_shard"]
        return None  # tensor parallelism only: nothing to shard over

    # ---- the model ----------------------------------------------------------------------------------
    def check_model(self, module: pl.LightningModule) -> None:
        """Refuse a model ``tensor_parallel`` cannot split (the CLI calls this before any process starts)."""
        check_tensor_parallel(self.tensor_parallel, getattr(module, "config", None))

    def apply_model_parallel(self, module: pl.LightningModule) -> None:
        if self.tensor_parallel == 1:
            return
        self.check_model(module)
        model = find_transformer(module)
        if model is None:
            raise UserInputError(
                f"tensor_parallel={self.tensor_parallel} needs a GPT (a module with `blocks`); "
                f"{type(module).__name__} has none"
            )
        apply_tensor_parallel(model, self.device_mesh["tp"])

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self.tensor_parallel > 1:  # before on_before_optimizer_step: every callback sees whole gradients
            reduce_partial_grads(self.lightning_module)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "lt_parallel", cls, description="lightning_train ParallelStrategy (data x tensor parallel)",
            override=True,
        )
