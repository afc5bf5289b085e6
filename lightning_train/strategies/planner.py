"""``auto`` planning of a layout: which of data, tensor and pipeline parallelism a model needs to fit.

``plan_layout`` tries, in this order, the first layout whose per-device estimate (``memory.estimate_layout``)
fits in ``margin`` (80%) of a device's memory, the rest being headroom for the allocator, temporary
buffers and communication:

1. DDP: everything replicated (the least communication);
2. FSDP over all ranks (model states sharded, layers whole);
3. FSDP x tensor parallelism inside a node: ``tp`` a divisor of the devices per node that divides
   ``n_head``, ``n_kv_head`` and the sequence length, the smallest that fits (its all-gathers and
   reduce-scatters on every layer need a node's fast links);
4. FSDP x pipeline parallelism across nodes: ``pp`` dividing ``world_size / tp`` and at most ``n_layer``,
   the smallest that fits, each with the smallest ``tp`` (1 first) that fits beside it.

``ParallelStrategy(tensor_parallel="auto")`` calls it before the mesh is built and logs the choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig, padded_vocab_size
from lightning_train.strategies.memory import LayoutEstimate, estimate_layout, format_bytes
from lightning_train.strategies.parallelize import find_transformer
from lightning_train.strategies.tensor_parallel import check_tensor_parallel

# precision: (activation dtype, model-state dtype; None: the parameters' own, fp32 master weights)
PRECISION_DTYPES = {
    "bf16-mixed": (torch.bfloat16, None),
    "16-mixed": (torch.float16, None),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
}


@dataclass(frozen=True)
class LayoutPlan:
    """A layout ``plan_layout`` chose: ``ParallelStrategy``'s sizes, and what one device will hold."""

    sharding: str  # "ddp" or "fsdp" (FSDP2 over the data-parallel ranks; always with model parallelism)
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    microbatches: int | None  # pipeline microbatches per batch; None without pipelining
    estimate: LayoutEstimate
    budget_bytes: int  # one device's memory
    margin: float

    @property
    def per_device_bytes(self) -> int:
        return self.estimate.total_bytes

    @property
    def layout(self) -> str:
        """``ddp over 2``, ``fsdp over 4 x tp 2``, ``tp 2 x pp 2 (4 microbatches)``."""
        parts = []
        if self.data_parallel > 1 or self.tensor_parallel * self.pipeline_parallel == 1:
            parts.append(f"{self.sharding} over {self.data_parallel}")
        if self.tensor_parallel > 1:
            parts.append(f"tp {self.tensor_parallel}")
        if self.pipeline_parallel > 1:
            parts.append(f"pp {self.pipeline_parallel} ({self.microbatches} microbatches)")
        return " x ".join(parts)

    def describe(self) -> str:
        return (
            f"{self.layout}: {format_bytes(self.per_device_bytes)} per device ({self.estimate.describe()}) "
            f"of {format_bytes(self.budget_bytes)}, {self.margin:.0%} of it usable"
        )


def plan_layout(
    model: GPTConfig | nn.Module,
    world_size: int,
    devices_per_node: int,
    batch_size: int | None,
    seq_len: int | None,
    memory_bytes: int,
    precision: str = "32-true",
    activation_checkpointing: bool = False,
    replicate_size: int = 1,
    microbatches: int | None = None,
    pipeline_schedule: str = "1F1B",
    virtual_stages: int = 1,
    margin: float = 0.8,
    loss_parallel: bool = True,
) -> LayoutPlan:
    """The first layout (module doc) whose per-device estimate fits ``margin`` of ``memory_bytes``.

    Args:
        model: a ``GPTConfig`` (built on the meta device: nothing is allocated), or a built model
            (meta device too); a model that is not a GPT gets DDP or FSDP only.
        world_size, devices_per_node: all processes, and those of one node (tensor parallelism stays
            inside a node).
        batch_size, seq_len: the sequences each data-parallel rank reads per step, and their length
            (None: activations are not estimated).
        memory_bytes: one device's memory.
        precision: the Trainer's (``"bf16-mixed"``: 16-bit activations, fp32 model states).
        activation_checkpointing: each block's activations are recomputed in backward.
        replicate_size: HSDP replica groups; FSDP shards over ``data_parallel / replicate_size``.
        microbatches: pipeline microbatches (None: ``2 x stages``, or ``stages`` where that does not
            divide ``batch_size``).
        pipeline_schedule, virtual_stages, loss_parallel: as ``ParallelStrategy``'s.

    Raises ``UserInputError`` (one line naming the sizes and the fix) when ``world_size`` is not a
    multiple of ``devices_per_node`` or no layout fits.

    Example (a Llama-2-7B shape on 2 nodes of 8 80 GiB GPUs, 4 x 4096 tokens per rank):

        >>> from lightning_train.models.gpt import GPTConfig
        >>> from lightning_train.strategies.memory import GiB
        >>> from lightning_train.strategies.planner import plan_layout
        >>> llama = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
        ...                   intermediate_size=11008, tie_embeddings=False)
        >>> sizes = dict(world_size=16, devices_per_node=8, seq_len=4096, memory_bytes=80 * GiB,
        ...              precision="bf16-mixed")
        >>> print(plan_layout(llama, batch_size=1, activation_checkpointing=True, **sizes).layout)
        fsdp over 16
        >>> plan = plan_layout(llama, batch_size=4, **sizes)  # no checkpointing: split the activations
        >>> plan.sharding, plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel
        ('fsdp', 8, 1, 2)
        >>> print(plan.describe())  # doctest: +ELLIPSIS
        fsdp over 2 x tp 8: 55.5 GiB per device (states 6.3 GiB + ...) of 80.0 GiB, 80% of it usable
    """
    if devices_per_node < 1 or world_size < 1 or world_size % devices_per_node:
        raise UserInputError(
            f"world size {world_size} is not a whole number of nodes of {devices_per_node} devices; use a "
            "world size that is num_nodes x devices"
        )
    model = _meta_model(model) if isinstance(model, GPTConfig) else model
    config = getattr(find_transformer(model), "config", None)
    activation_dtype, state_dtype = PRECISION_DTYPES.get(precision, (torch.float32, None))
    smallest: LayoutPlan | None = None
    for sharding, tp, pp, micro in _candidates(
        config, world_size, devices_per_node, batch_size, seq_len, replicate_size, microbatches,
        virtual_stages,
    ):
        data_parallel = world_size // (tp * pp)
        shard_size = data_parallel // replicate_size if sharding == "fsdp" else 1
        estimate = estimate_layout(
            model, tp, pp, shard_size, batch_size, seq_len, micro or 1, pipeline_schedule, virtual_stages,
            activation_checkpointing, activation_dtype, state_dtype, loss_parallel,
        )
        plan = LayoutPlan(sharding, tp, pp, data_parallel, micro, estimate, memory_bytes, margin)
        if plan.per_device_bytes <= margin * memory_bytes:
            return plan
        if smallest is None or plan.per_device_bytes < smallest.per_device_bytes:
            smallest = plan
    raise UserInputError(
        _no_fit_message(
            smallest, config, world_size, devices_per_node, batch_size, seq_len, activation_checkpointing
        )
    )


def planning_model(config: Any, datamodule: Any = None) -> GPTConfig:
    """The ``GPTConfig`` to plan with: ``config``, with the data module's vocabulary (padded) where it has
    none, as PretrainModule fills it in later."""
    if not isinstance(config, GPTConfig):
        raise UserInputError(
            f"tensor_parallel='auto' plans a GPT from its GPTConfig; got {type(config).__name__}: give "
            "tensor_parallel and pipeline_parallel as numbers"
        )
    if config.vocab_size is None:
        data_vocab_size = getattr(datamodule, "vocab_size", None)  # reads the dataset's meta.json
        if data_vocab_size is None:
            raise UserInputError(
                "tensor_parallel='auto' needs the model's vocabulary size: set model.config.vocab_size"
            )
        config = dataclasses.replace(config, vocab_size=padded_vocab_size(data_vocab_size))
    return config


def _meta_model(config: GPTConfig) -> nn.Module:
    with torch.device("meta"):  # shapes only: an 8B model costs nothing to build
        return GPT(config)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(
    config: Any,
    world_size: int,
    devices_per_node: int,
    batch_size: int | None,
    seq_len: int | None,
    replicate_size: int,
    microbatches: int | None,
    virtual_stages: int,
) -> list[tuple[str, int, int, int | None]]:
    """(sharding, tp, pp, microbatches) in the order ``plan_layout`` tries them."""
    layouts: list[tuple[str, int, int, int | None]] = [("ddp", 1, 1, None)]

    def divides(tp: int, pp: int) -> bool:  # the data-parallel size left splits into the HSDP replicas
        return world_size % (tp * pp) == 0 and world_size // (tp * pp) % replicate_size == 0

    if world_size > 1 and divides(1, 1):
        layouts.append(("fsdp", 1, 1, None))
    if config is None:
        return layouts
    tps = [
        tp for tp in _divisors(devices_per_node)[1:]
        if _splits_heads(tp, config) and (seq_len is None or seq_len % tp == 0)
    ]
    layouts += [("fsdp", tp, 1, None) for tp in tps if divides(tp, 1)]
    for pp in _divisors(world_size)[1:]:
        micro = _microbatches(pp * virtual_stages, batch_size, microbatches)
        if pp * virtual_stages > config.n_layer or micro is None:
            continue
        layouts += [("fsdp", tp, pp, micro) for tp in [1, *tps] if divides(tp, pp)]
    return layouts


def _microbatches(stages: int, batch_size: int | None, given: int | None) -> int | None:
    """The pipeline's microbatches: ``given``, or 2 x stages, or stages; None if none splits the batch
    (and 1F1B's at least one per stage)."""
    for count in [given] if given is not None else [2 * stages, stages]:
        if batch_size is None or batch_size % count == 0:
            return count
    return None


def _no_fit_message(
    smallest: LayoutPlan,
    config: Any,
    world_size: int,
    devices_per_node: int,
    batch_size: int | None,
    seq_len: int | None,
    activation_checkpointing: bool,
) -> str:
    sizes = f"world size {world_size} ({devices_per_node} per node)"
    if config is not None:
        sizes += (
            f"; tp divides {devices_per_node}, n_head={config.n_head}, n_kv_head={config.n_kv_head} and "
            f"seq_len={seq_len}, pp the world size / tp and pp <= n_layer={config.n_layer}"
        )
    checkpointing = "" if activation_checkpointing else "set activation_checkpointing=true, "
    return (
        f"tensor_parallel='auto': no layout fits for batch_size={batch_size}, seq_len={seq_len} on {sizes}: "
        f"the smallest, {smallest.layout}, needs {format_bytes(smallest.per_device_bytes)} per device, more "
        f"than {smallest.margin:.0%} of {format_bytes(smallest.budget_bytes)}; lower batch_size or seq_len, "
        f"{checkpointing}or use more devices"
    )


def _splits_heads(tensor_parallel: int, config: GPTConfig) -> bool:
    """Whether tensor parallelism of this size can split the model (``check_tensor_parallel``'s rule)."""
    try:
        check_tensor_parallel(tensor_parallel, config)
    except UserInputError:
        return False
    return True
