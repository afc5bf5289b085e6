"""Per-device memory estimate behind ``DataParallelStrategy(sharding="auto")``.

The model states are exact byte counts: fp32 (or the parameters' own dtype) master weights, gradients
of the same dtype, and AdamW's two state tensors per parameter. Activations are an estimate for
GPT-style models (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2: ``s*b*h*(34 + 5*a*s/h)`` bytes per layer in 16-bit; twice that in fp32), counted only
when the model exposes a ``config`` with ``n_layer``/``n_embd``/``n_head`` and the batch shape is known.

``estimate_layout`` is the same count under model parallelism, for ``planner.plan_layout``: each pipeline
rank holds its own stage(s) (the split of ``pipeline.split_blocks``), tensor parallelism splits every
matrix, FSDP shards what remains, and activations follow Korthikanti et al. with sequence parallelism
and the pipeline schedule's microbatches in flight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_train.errors import UserInputError
from lightning_train.strategies.parallelize import find_transformer
from lightning_train.strategies.pipeline import ZERO_BUBBLE, pipeline_stage_ids, split_blocks, stage_model

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
    return int(_stage_activation_bytes(config, config.n_layer, batch_size, seq_len, checkpointing, dtype))


def layer_activation_bytes(
    config: Any, batch_size: float, seq_len: int, dtype: torch.dtype = torch.float32, tensor_parallel: int = 1
) -> float:
    """One block's saved activations (Korthikanti et al. 2022): ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit,
    twice that in fp32; with tensor and sequence parallelism over ``t`` ranks each holds ``1/t`` of it
    (the paper's sequence-parallel count: the norms' and residuals' split along the sequence, attention's
    and the MLP's by heads and width). The ``5*a*s/h`` term is the materialised attention scores: an upper
    bound where ``scaled_dot_product_attention`` runs a fused kernel that stores none."""
    s, b, h, a = seq_len, batch_size, config.n_embd, config.n_head
    return s * b * h * (34 + 5 * a * s / h) * torch.finfo(dtype).bits / 16 / tensor_parallel


def _stage_activation_bytes(
    config: Any,
    layers: int,
    micro_batch: float,
    seq_len: int,
    checkpointing: bool,
    dtype: torch.dtype,
    tensor_parallel: int = 1,
    in_flight: float = 1.0,
    last: bool = True,
    loss_parallel: bool = True,
) -> float:
    """Activations of ``layers`` blocks for ``in_flight`` microbatches of ``micro_batch`` sequences held at
    once, plus the logits on the stage that computes the head (``last``): split by vocabulary over the
    tensor-parallel ranks with ``loss_parallel``, else whole on each."""
    per_layer = layer_activation_bytes(config, micro_batch, seq_len, dtype, tensor_parallel)
    if checkpointing:  # keep each block's input (sequence-parallel: 1/t of it), recompute one block at a time
        bits = torch.finfo(dtype).bits
        block_input = 2 * seq_len * micro_batch * config.n_embd * bits / 16 / tensor_parallel
        held = layers * in_flight * block_input + per_layer
    else:
        held = layers * in_flight * per_layer
    # fp32 logits and their gradient
    vocab = config.vocab_size / tensor_parallel if loss_parallel else config.vocab_size
    logits = 2 * seq_len * micro_batch * vocab * 4 * in_flight if last else 0
    return held + logits


@dataclass(frozen=True)
class LayoutEstimate:
    """Bytes the fullest device holds with the model split over ``tensor_parallel`` x
    ``pipeline_parallel`` ranks and each stage's states sharded over ``shard_size`` data-parallel ranks
    by FSDP (1: not sharded). ``estimate_layout`` makes one.

    Example (tensor parallelism over 2 halves the matrices; 2 pipeline stages hold a block each):

        >>> from lightning_train.models.gpt import GPT, GPTConfig
        >>> from lightning_train.strategies.memory import estimate_layout
        >>> model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=2))
        >>> whole = estimate_layout(model, batch_size=8, seq_len=256)
        >>> tp2 = estimate_layout(model, tensor_parallel=2, batch_size=8, seq_len=256)
        >>> pp2 = estimate_layout(model, pipeline_parallel=2, batch_size=8, seq_len=256, microbatches=4)
        >>> round(tp2.state_bytes / whole.state_bytes, 2), tp2.activation_bytes < whole.activation_bytes
        (0.5, True)
        >>> pp2.state_bytes < whole.state_bytes, pp2.total_bytes < whole.total_bytes
        (True, True)
    """

    tensor_parallel: int
    pipeline_parallel: int
    shard_size: int
    state_bytes: int  # parameters, gradients and AdamW state of the rank's stage(s): its TP and FSDP shard
    gathered_bytes: int  # FSDP all-gathers one block at a time: the one computing and the one prefetched
    activation_bytes: int  # 0 when unknown; the microbatches in flight, and the logits on the last stage
    pipeline_rank: int  # the pipeline rank these bytes are of (the fullest; 0 without pipelining)

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.gathered_bytes + self.activation_bytes

    def describe(self) -> str:
        activations = format_bytes(self.activation_bytes) if self.activation_bytes else "not estimated"
        stage = f" (pipeline rank {self.pipeline_rank})" if self.pipeline_parallel > 1 else ""
        return (
            f"states {format_bytes(self.state_bytes)} + gathered blocks "
            f"{format_bytes(self.gathered_bytes)} + activations {activations}{stage}"
        )


def estimate_layout(
    model: nn.Module,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    shard_size: int = 1,
    batch_size: int | None = None,
    seq_len: int | None = None,
    microbatches: int = 1,
    schedule: str = "1F1B",
    virtual_stages: int = 1,
    activation_checkpointing: bool = False,
    activation_dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype | None = None,
    loss_parallel: bool = True,
    pipeline_rank: int | None = None,
) -> LayoutEstimate:
    """Per-device bytes of ``model`` (a ``GPT`` for ``tensor_parallel`` or ``pipeline_parallel`` > 1; the
    meta device will do) trained with AdamW under one layout: the pipeline rank that holds the most, or
    ``pipeline_rank``'s (the dry run's rank: ``dry_run.py``).

    Model states: what the rank's stage(s) hold (``split_blocks``' balanced split; a tied embedding on
    the first and the last stage), every matrix divided by ``tensor_parallel`` (norm weights and biases
    counted whole), all of it by ``shard_size``; in ``state_dtype``, or the parameters' own. Activations:
    ``layer_activation_bytes`` of ``batch_size / microbatches`` sequences per block and microbatch in
    flight (``_in_flight``), divided by ``tensor_parallel`` (sequence parallelism); the last stage's fp32
    logits and their gradient too, split by vocabulary with ``loss_parallel`` (``ParallelStrategy``'s)."""
    t, p = tensor_parallel, pipeline_parallel
    transformer = find_transformer(model)
    config = getattr(transformer, "config", None)
    if t * p > 1 and config is None:
        raise UserInputError(
            f"tensor_parallel={t} x pipeline_parallel={p} needs a GPT (a module with `blocks` and a "
            f"`config`); {type(model).__name__} has none"
        )
    known = config is not None and batch_size is not None and seq_len is not None
    fullest = None
    ranks = _pipeline_ranks(model, transformer, p, virtual_stages, schedule)
    for rank, (part, blocks, last) in enumerate(ranks):
        if pipeline_rank is not None and rank != pipeline_rank:
            continue
        params = {id(param): param for param in part.parameters()}.values()  # tied weights count once
        state = sum(_state_bytes(param, state_dtype, t) for param in params) / shard_size
        gathered = 0.0
        if shard_size > 1:
            gathered = 2 * max(
                sum(_state_bytes(param, state_dtype, t, states=1) for param in block.parameters())
                for block in blocks
            )
        activations = 0.0
        if known:
            activations = _stage_activation_bytes(
                config, len(blocks), batch_size / microbatches, seq_len, activation_checkpointing,
                activation_dtype, t, _in_flight(schedule, rank, p, virtual_stages, microbatches), last,
                loss_parallel,
            )
        estimate = LayoutEstimate(t, p, shard_size, int(state), int(gathered), int(activations), rank)
        if fullest is None or estimate.total_bytes > fullest.total_bytes:
            fullest = estimate
    return fullest


def _pipeline_ranks(
    model: nn.Module,
    transformer: nn.Module | None,
    pipeline_parallel: int,
    virtual_stages: int,
    schedule: str,
) -> list[tuple[nn.Module, list[nn.Module], bool]]:
    """Per pipeline rank: the module holding its parameters, its blocks, and whether it computes the head
    (the V-shaped schedules: rank 0 holds the embedding and the head)."""
    if pipeline_parallel == 1:
        return [(model, list(getattr(transformer, "blocks", None) or [model]), True)]
    num_stages = pipeline_parallel * virtual_stages
    splits = split_blocks(transformer, num_stages)
    ranks = []
    for rank in range(pipeline_parallel):
        stages = pipeline_stage_ids(rank, pipeline_parallel, virtual_stages, schedule)
        owned = [index for stage in stages for index in splits[stage]]
        first, last = 0 in stages, num_stages - 1 in stages
        blocks = [transformer.blocks[index] for index in owned]
        ranks.append((stage_model(transformer, owned, first, last), blocks, last))
    return ranks


def _state_bytes(
    param: nn.Parameter, dtype: torch.dtype | None, tensor_parallel: int, states: int = 0
) -> float:
    """Bytes of ``param``'s shard under tensor parallelism, times ``states`` (0: the parameter, plus its
    gradient and AdamW's two moments when it trains). Matrices are split (heads, MLP width, vocabulary);
    norm weights and biases are counted whole (row-parallel biases are whole, column-parallel ones are
    split: counting them whole errs on the safe side)."""
    size = param.element_size() if dtype is None else dtype.itemsize
    share = param.numel() / (tensor_parallel if param.dim() >= 2 else 1)
    copies = states or (1 + (1 + ADAMW_STATES_PER_PARAM) * param.requires_grad)
    return share * size * copies


def _in_flight(
    schedule: str, rank: int, pipeline_parallel: int, virtual_stages: int, microbatches: int
) -> float:
    """Microbatches whose activations pipeline rank ``rank`` holds at once. GPipe: all of them (every
    forward before any backward). 1F1B: rank r runs ``p - r`` forwards before its first backward (torch's
    ``Schedule1F1B`` warm-up), so the first stage holds up to ``p`` microbatches of its ``n_layer / p``
    layers, as many layers' worth as one microbatch of the whole model (Korthikanti et al. 2022, on
    pipeline parallelism); interleaving over ``v`` virtual stages multiplies the first stage's by
    ``1 + (p - 1) / (p * v)``. The zero-bubble schedules keep a microbatch's activations until its
    deferred weight gradient: every rank ``p`` microbatches' worth, DualPipeV half a one more (counted
    from torch 2.13's orders)."""
    p = pipeline_parallel
    if p == 1:
        return 1.0
    if schedule == "GPipe":
        return float(microbatches)
    if schedule in ZERO_BUBBLE:
        return min(float(microbatches), p + (0.5 if schedule == "DualPipeV" else 0.0))
    extra = (p - 1) / virtual_stages if schedule == "Interleaved1F1B" else 0.0
    return min(float(microbatches), p - rank + extra)


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
