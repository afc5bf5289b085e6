"""DataParallelStrategy: ``ParallelStrategy`` without model parallelism, DDP or FSDP2 data parallelism on
CPUs (gloo) and GPUs, registered with Lightning as ``lt_ddp``, ``lt_fsdp`` and ``lt_auto``.

    trainer = L.Trainer(strategy=DataParallelStrategy(sharding="fsdp"), devices=8, num_nodes=2)
    trainer = L.Trainer(strategy="lt_fsdp", devices=2, accelerator="cpu")   # registry names, YAML too

``sharding="ddp"`` replicates the model (torch ``DistributedDataParallel``); ``"fsdp"`` shards
parameters, gradients and optimizer state with ``fully_shard`` (each transformer block, then the
root); ``"auto"`` estimates the per-device memory of DDP and takes it when it fits with margin.
"""

from __future__ import annotations

from typing import Any

from lightning_train.strategies.parallel import SHARDINGS, ParallelStrategy, Sharding


class DataParallelStrategy(ParallelStrategy):
    """Data parallelism, DDP or FSDP2 (chosen by ``sharding``): a preset of ``ParallelStrategy``, with
    ``tensor_parallel=1`` and ``pipeline_parallel=1``. ``**kwargs`` are its data-parallel options
    (``bucket_cap_mb``, ``comm_hook``, ``reshard_after_forward``, ``activation_checkpointing``,
    ``cpu_offload``, ``replicate_size``, ``reduce_dtype``, ``memory_budget_gb``, ``process_group_backend``,
    ``timeout``), documented there.

    Example (one CPU process here; ``devices=N`` starts N, each with its share of every global batch):

        >>> import lightning as L
        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.strategies import DataParallelStrategy
        >>> from lightning_train.strategies.processes import leave_process_group
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

    def __init__(self, sharding: Sharding = "auto", **kwargs: Any) -> None:
        super().__init__(
            tensor_parallel=1, pipeline_parallel=1, microbatches=None, pipeline_schedule="1F1B",
            virtual_stages=1, pipeline_split_points=None, loss_parallel=True, sharding=sharding, **kwargs,
        )

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
