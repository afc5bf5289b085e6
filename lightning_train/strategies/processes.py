"""The processes of ``ParallelStrategy``: what Lightning's plain ``ParallelStrategy`` leaves to a strategy
(its devices, the launcher, the process group, the collectives and the teardown), as Lightning's own DDP
and model-parallel strategies do it, without their model handling: ``parallel.py`` lays the model out."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_train._compat import reduce_tensor, setup_distributed, subprocess_launcher


def leave_process_group() -> None:
    """Destroy the default process group while Python is still alive. Left to interpreter shutdown, Gloo's
    worker threads can still hold tensors whose release then aborts the finished process (SIGABRT,
    "terminate called without an active exception"), which a scheduler reads as a failed job."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroup:
    """``ParallelStrategy``'s processes (module doc); a base of it, before Lightning's ``ParallelStrategy``.

    Args:
        process_group_backend, timeout: passed to ``torch.distributed.init_process_group``.
    """

    def __init__(self, process_group_backend: str | None, timeout: timedelta | None) -> None:
        super().__init__()
        self.num_nodes = 1  # the Trainer sets it
        self._process_group_backend, self.timeout = process_group_backend, timeout

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        """The one given, else torch's default for the device type (NCCL on GPUs, Gloo on CPUs)."""
        if self._process_group_backend is not None:
            return self._process_group_backend
        return dist.Backend.default_device_backend_map.get(self.root_device.type, "gloo")

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning gives the dataloaders a DistributedSampler (distributed_sampler_kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = subprocess_launcher(self)

    def setup_environment(self) -> None:
        super().setup_environment()  # the accelerator
        reset_seed()
        self.set_world_ranks()
        setup_distributed(self)
        atexit.register(leave_process_group)

    def barrier(self, name: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src)
        return objects[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return reduce_tensor(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

    def teardown(self) -> None:
        # the CheckpointIO first: a background (--async_checkpoint) write still in flight would be cut off
        # when the process exits. Unlike Lightning's own teardown, the model stays on its devices.
        self.checkpoint_io.teardown()
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
