"""Private names of torch and torch.distributed (see the package docstring)."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch and Lightning are imported inside the functions that use them, never here: the CLI's help and
# its tools (prepare, report, ...) import this module and must not pay those imports (Lightning's alone
# takes seconds; tests/test_startup.py).

# What a pickled ``torch.layout`` calls to rebuild itself (torch registers ``torch.serialization._get_layout``
# with copyreg; torch 2.5-2.13), for the restricted unpickler of sharded checkpoints.
TORCH_LAYOUT_GLOBAL = ("torch.serialization", "_get_layout")


# ---- torch: GradScaler and optimizers ---------------------------------------------------------------------
def loss_scale_async(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scale as a device tensor without a host sync (``GradScaler._get_scale_async``, torch 2.5-2.13;
    the public ``get_scale()`` returns a float, a sync); None before the first ``scale()``."""
    return scaler._get_scale_async()


def found_inf_per_device(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """The 0/1 found-inf tensors ``unscale_`` left for ``optimizer``, one per device, [] before it
    (``GradScaler._per_optimizer_states[id(opt)]["found_inf_per_device"]``, torch 2.5-2.13; no public one)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    return list(state["found_inf_per_device"].values()) if state else []


def handles_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's ``step`` unscales by itself, as fused AdamW does (``Optimizer.
    _step_supports_amp_scaling``, torch 2.5-2.13; no public one)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float) -> tuple[torch.Tensor, ...]:
    """The ``ord``-norm of each tensor in one fused kernel (``torch._foreach_norm``, torch 2.5-2.13;
    public alternative, one kernel per tensor: ``torch.linalg.vector_norm``)."""
    import torch

    return torch._foreach_norm(tensors, ord)


def foreach_copy(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """New copies of ``tensors`` in one fused kernel (``torch._foreach_mul(tensors, 1.0)``, torch 2.5-2.13;
    public alternative, one kernel per tensor: ``tensor.clone()``)."""
    import torch

    return torch._foreach_mul(tensors, 1.0)


def foreach_sub_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> None:
    """``tensors[i] -= others[i]`` in place, fused (``torch._foreach_sub_``, torch 2.5-2.13; public
    alternative, one kernel per tensor: ``tensor.sub_(other)``)."""
    import torch

    torch._foreach_sub_(tensors, others)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called (``nn.Module._compiled_call_impl``, torch 2.2-2.13; no
    public accessor)."""
    return getattr(module, "_compiled_call_impl", None) is not None


# ---- torch.distributed -------------------------------------------------------------------------------------
def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward, keeping its parameter names (torch's composable
    ``torch.distributed._composable.checkpoint``, torch 2.5-2.13; ``torch.utils.checkpoint`` needs a
    wrapper module, which renames the parameters)."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def ddp_comm_hook_name(model: nn.parallel.DistributedDataParallel) -> str | None:
    """The communication hook's name as torch records it (``DistributedDataParallel.
    _get_ddp_logging_data()["comm_hook"]``, torch 2.5-2.13; no public one)."""
    return model._get_ddp_logging_data().get("comm_hook")


def end_distributed_process(code: int) -> NoReturn:
    """Leave a process that ran a process group: destroy the group, run Python's exit handlers (W&B,
    multiprocessing, atexit), flush, then ``os._exit(code)``, skipping interpreter finalisation. At
    finalisation Gloo's C++ threads (kept alive by FSDP2's references to the group) can still be torn
    down and abort a finished process with SIGABRT ("terminate called without an active exception";
    pytorch/pytorch#179291, #190489), which a scheduler or torchrun reads as a failed rank. Uses
    ``atexit._run_exitfuncs`` (CPython 3.10-3.13); the public alternative is a plain ``sys.exit``."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_group_store() -> Any | None:
    """The key-value store every rank of the default process group reaches (``_get_default_store``,
    torch 2.x), or None outside a process group: torch has no public accessor for it."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.distributed_c10d._get_default_store()


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of a default process group of ``world_size`` ranks that do not exist:
    torch's ``"fake"`` backend over ``torch.testing._internal.distributed.fake_pg.FakeStore`` (private,
    torch 2.1-2.13; no public alternative), whose collectives return at once without data. Meshes,
    DTensors and FSDP2 on the meta device lay a model out as that rank would (the dry run:
    ``strategies/dry_run.py``); the group is destroyed on leaving."""
    import torch
    from torch.testing._internal.distributed.fake_pg import FakeStore  # its import registers "fake"

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The part of the whole tensor a DTensor's local shard holds, as (offsets, sizes), each per
    dimension: ``compute_local_shape_and_global_offset`` of ``torch.distributed.tensor._utils`` (torch
    2.4-2.13; what DCP's ``__create_chunk_list__`` uses), which knows every placement, FSDP2 over tensor
    parallelism's ``_StridedShard`` included. A plain tensor is its own whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    mesh, placements = tensor.device_mesh, tensor.placements
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return tuple(offsets), tuple(sizes)


def forward_only_v_schedule(stages: Sequence[Any], microbatches: int) -> Any:
    """A schedule whose ``eval`` runs ``stages`` placed in a V (rank r: stages r and 2 x pp - 1 - r):
    ``ScheduleZBVZeroBubble`` with its input-gradient action skipped. torch's own V-shaped ``eval`` fails
    on the rank holding two adjacent stages: that action hands a gradient between them without backward.
    The skip drops the action's (empty) backward receive, ``bwd_recv_ops`` of ``_PipelineScheduleRuntime``
    (torch 2.6-2.13), as the action would have."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, ScheduleZBVZeroBubble

    def skip_input_gradient(action: Any, context: Any) -> None:
        context.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)

    schedule = ScheduleZBVZeroBubble(list(stages), microbatches, loss_fn=None, scale_grads=False)
    schedule.register_custom_function(BACKWARD_INPUT, skip_input_gradient)
    return schedule




def muon_orthogonalise(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """``torch.optim.Muon``'s Newton-Schulz orthogonalisation of a whole matrix, with ``group``'s
    coefficients, steps and eps (``torch.optim._muon._zeropower_via_newtonschulz``, torch 2.9-2.13)."""
    from torch.optim import _muon

    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    return _muon._zeropower_via_newtonschulz(update, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s learning rate for a matrix of ``shape`` (``torch.optim._muon._adjust_lr``)."""
    from torch.optim import _muon

    return _muon._adjust_lr(lr, adjust_lr_fn, shape)
