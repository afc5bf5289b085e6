"""Per-device memory estimate behind ``DataParallelStrategy(sharding="auto")``.

The model states are exact byte counts: fp32 (or the parameters' own dtype) master weights, gradients
of the same dtype, and AdamW's two state tensors per parameter. Activations are an estimate for
GPT-style models (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2: ``s*b*h*(34 + 5*a*s/h)`` bytes per layer in 16-bit; twice that in fp32), counted only
when the model exposes a ``config`` with ``n_layer``/``n_embd``/``n_head`` and the batch shape is known.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from lightning_train.strategies.parallelize import find_transformer

ADAMW_STATES_PER_PARAM = 2  # exp_avg, exp_avg_sq: the optimizer every module here uses
GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds under DDP (everything replicated) and FSDP (model states sharded).

    Example:

        >>> from lightning_train.models.gpt import GPT, GPTConfig
        >>> from lightning_train.strategies import estimate_memory
        >>> model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=2))
        >>> estimate = estimate_memory(model, shard_size=8, batch_size=8, seq_len=256)
        >>> n_params = sum(p.numel() for p in model.parameters())
        >>> estimate.model_state_bytes == 4 * 4 * n_params  # fp32 weights, grads, AdamW's two moments
        True
        >>> estimate.activation_bytes > 0, estimate.fsdp_bytes < estimate.ddp_bytes
        (True, True)
        >>> print(estimate.describe().split("; ")[1])  # doctest: +ELLIPSIS
        per device: ddp ... MiB, fsdp over 8 shards ... MiB
    """

    param_bytes: int  # the full model, once
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # 0 when unknown
    largest_block_bytes: int  # FSDP all-gathers one block's parameters at a time
    shard_size: int

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def ddp_bytes(self) -> int:
        return self.model_state_bytes + self.activation_bytes

    @property
    def fsdp_bytes(self) -> int:
        # +2 blocks: the one computing and the next one being prefetched
        return (
            self.model_state_bytes // self.shard_size + 2 * self.largest_block_bytes + self.activation_bytes
        )

    def describe(self) -> str:
        ddp, fsdp = format_bytes(self.ddp_bytes), format_bytes(self.fsdp_bytes)
        activations = format_bytes(self.activation_bytes) if self.activation_bytes else "not estimated"
        return (
            f"params {format_bytes(self.param_bytes)} + grads {format_bytes(self.grad_bytes)} + optimizer "
            f"state {format_bytes(self.optimizer_bytes)}, activations {activations}; per device: "
            f"ddp {ddp}, fsdp over {self.shard_size} shards {fsdp}"
        )


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``104.9 KiB``."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def estimate_memory(
    model: nn.Module,
    shard_size: int,
    batch_size: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    activation_dtype: torch.dtype = torch.float32,
) -> MemoryEstimate:
    """Per-device bytes of ``model`` trained with AdamW, replicated vs. sharded ``shard_size`` ways."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights count once
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    trainable_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    blocks = getattr(find_transformer(model), "blocks", None) or [model]
    largest_block = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks)
    return MemoryEstimate(
        param_bytes=param_bytes,
        grad_bytes=trainable_bytes,
        optimizer_bytes=ADAMW_STATES_PER_PARAM * trainable_bytes,
        activation_bytes=_activation_bytes(
            model, batch_size, seq_len, activation_checkpointing, activation_dtype
        ),
        largest_block_bytes=largest_block,
        shard_size=shard_size,
    )


def _activation_bytes(
    model: nn.Module, batch_size: int | None, seq_len: int | None, checkpointing: bool, dtype: torch.dtype
) -> int:
    transformer = find_transformer(model)
    config = getattr(transformer, "config", None)
    if config is None or batch_size is None or seq_len is None:
        return 0
    s, b, h, a, layers = seq_len, batch_size, config.n_embd, config.n_head, config.n_layer
    scale = torch.finfo(dtype).bits / 16
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    logits = 2 * s * b * config.vocab_size * 4  # fp32 logits and their gradient
    if checkpointing:  # keep each block's input, recompute one block at a time
        return int(layers * s * b * h * 2 * scale + per_layer + logits)
    return int(layers * per_layer + logits)


def device_memory_bytes(device: torch.device, local_processes: int) -> int:
    """Memory one process may use: the GPU's total memory, or this host's RAM split between its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_processes)


def choose_sharding(estimate: MemoryEstimate, budget_bytes: int, margin: float = 0.8) -> str:
    """ "ddp" when everything replicated fits in ``margin`` of the budget (headroom for the allocator,
    temporary buffers and communication), else "fsdp"."""
    return "ddp" if estimate.ddp_bytes <= margin * budget_bytes else "fsdp"


def measured_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank really holds of parameters, gradients and optimizer state, in bytes: the local
    shards of DTensors under FSDP2, whole tensors otherwise (tied parameters once). The measured
    counterpart of ``estimate_memory``."""

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    params = list({id(p): p for p in module.parameters()}.values())
    return {
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(
            local_bytes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0  # not the scalar step counts
        ),
    }
