"""Tensor parallelism (Megatron-style, with sequence parallelism) applied to the GPT from outside.

``apply_tensor_parallel(model, tp_mesh)`` shards every block over the ``tp`` mesh with
``torch.distributed.tensor.parallel.parallelize_module`` (torchtitan style); ``gpt.py`` stays plain and
its state-dict names do not change:

- token embedding row-wise (the vocabulary split), its output sharded along the sequence; learned
  positions (GPT-2) looked up for each rank's own positions (``OwnPositions``);
- norms and the residual stream between blocks sequence-parallel (each rank holds ``T / tp`` positions;
  all-gathered before attention and the MLP, reduce-scattered after them), norms after a sublayer
  (OLMo-2, Gemma 2/3) too;
- q/k norms on each rank's heads: of each head (Qwen3, Gemma 3) as they are, over the whole projection
  (OLMo-2) with the mean of squares summed over the ranks (``ProjectionNorm``);
- attention split by heads: the fused ``qkv`` projection column-wise per head group (below), the
  output projection row-wise; the MLP column-wise (gate, up) then row-wise (down);
- the output head column-wise (vocabulary split). With ``loss_parallel`` (the default) its logits stay
  sharded by vocabulary, a ``Shard(-1)`` DTensor, and ``cross_entropy`` runs vocab-parallel inside
  ``vocab_parallel_loss()`` (torch's ``loss_parallel``: a max, a sum and the target's logit are
  all-reduced instead of the logits being gathered), which ``ParallelStrategy`` enters around each
  step and each backward; without it they are all-gathered and the loss is a single process's.

The fused ``qkv`` weight stacks all query heads, then all key heads, then all value heads, so a plain
column split would hand rank 0 the queries and rank 1 the keys and values. Its parameter stays an
ordinary ``Shard(0)`` DTensor of the canonical layout (checkpoints, the optimizer and the gradient norm
see the same tensor as without TP); in forward each rank all-gathers it and takes the rows of its own
heads, and backward reduce-scatters the gradient (one weight all-gather per block and step, as FSDP).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

from lightning_train.errors import UserInputError
from lightning_train.models.layers import OffsetRMSNorm


def check_tensor_parallel(tensor_parallel: int, config: Any) -> None:
    """Refuse a ``tensor_parallel`` size the model cannot be split by: it must divide the query heads and
    the key/value heads (each rank computes whole heads), and a q/k norm over the whole projection must be
    an RMSNorm (``ProjectionNorm``)."""
    if tensor_parallel == 1:
        return
    n_head, n_kv_head = getattr(config, "n_head", None), getattr(config, "n_kv_head", None)
    if n_head is None or n_kv_head is None:
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} needs a GPTConfig model (n_head, n_kv_head); "
            f"got {type(config).__name__}"
        )
    if n_head % tensor_parallel or n_kv_head % tensor_parallel:
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} does not divide the model's heads (n_head={n_head}, "
            f"n_kv_head={n_kv_head}); use a common divisor of both"
        )
    if getattr(config, "qk_norm", "none") == "projection" and config.norm == "layernorm":
        # ProjectionNorm sums squares over the ranks' heads: an RMSNorm's statistic, not a LayerNorm's two
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} splits a q/k norm over the whole projection "
            "(qk_norm='projection') only as an RMSNorm, not with norm='layernorm'; use norm='rmsnorm' or "
            "qk_norm='head', or tensor_parallel=1"
        )


class HeadParallelQKV(ParallelStyle):
    """The fused ``qkv`` Linear split by heads: the weight (and bias) an ordinary ``Shard(0)`` DTensor
    of the canonical ``[q; k; v]`` layout; forward takes this rank's query, key and value heads."""

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int) -> None:
        super().__init__()
        self.sizes = (n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]), param.requires_grad)
            module.register_parameter(name, sharded)
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        rows, start = [], 0
        for width in self.sizes:  # this rank's slice of each of q, k and v
            rows.append(slice(start + rank * width // size, start + (rank + 1) * width // size))
            start += width

        def own_heads(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            # all-gathered in forward; in backward each rank's rows-only gradient is summed and scattered
            full = tensor.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            return torch.cat([full[part] for part in rows])

        def forward(x: torch.Tensor) -> torch.Tensor:
            # x is replicated; each rank's gradient of it covers only its own heads: a partial sum
            x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
            return F.linear(x, own_heads(module.weight), own_heads(module.bias))

        module.forward = forward  # an instance attribute: parameter names and the class stay as they are
        return module


class OwnPositions(ParallelStyle):
    """Learned position embeddings (GPT-2) under sequence parallelism: each rank looks up the positions of
    its own part of the sequence, the part the token embedding's output holds (``Shard(1)``); the table
    stays replicated, its gradient a partial sum over the ranks' positions (``reduce_partial_grads``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def own_positions(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[DTensor]:
            own = inputs[0].chunk(mesh.size())[mesh.get_local_rank()]  # as the reduce-scatter splits them
            return (DTensor.from_local(own, mesh, [Shard(0)], run_check=False),)

        def local(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=own_positions, output_fn=local)


class ProjectionNorm(ParallelStyle):
    """An RMSNorm over the whole q or k projection (OLMo-2's ``qk_norm="projection"``) on a rank that holds
    some of its heads: its weight sharded as the heads are (``Shard(0)``: each rank's gains only, whose
    gradients need no sum), its input taken as the ``Shard(-1)`` DTensor it is. The mean of squares over
    the whole width is then a partial sum that DTensor all-reduces, one value a position (backward: one
    reduce-scatter), where keeping the input replicated would all-gather the projection. Written out, not
    ``F.rms_norm``: DTensor cannot split its fused in-place reduction over a sharded width."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sharded = distribute_tensor(module.weight, device_mesh, [Shard(0)])
        module.register_parameter("weight", nn.Parameter(sharded, module.weight.requires_grad))
        offset = isinstance(module, OffsetRMSNorm)  # Gemma's (1 + weight), in fp32

        def forward(x: torch.Tensor) -> torch.Tensor:
            whole = DTensor.from_local(x, device_mesh, [Shard(-1)], run_check=False)
            eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
            normed = whole.float() * torch.rsqrt(whole.float().pow(2).mean(-1, keepdim=True) + eps)
            if offset:
                return (normed * (1.0 + module.weight.float())).type_as(x).to_local()
            return (normed.type_as(x) * module.weight).to_local()

        module.forward = forward  # an instance attribute, as HeadParallelQKV's
        return module


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> None:
    """Shard ``model`` (a ``GPT``) over ``tp_mesh`` in place, with sequence parallelism (module doc).
    ``loss_parallel`` (``ParallelStrategy``'s): the model returns its logits as a DTensor sharded by
    vocabulary (for ``vocab_parallel_loss``), else gathered whole. The caller has checked the size
    (``check_tensor_parallel``)."""
    config, size = model.config, tp_mesh.size()
    head = (
        ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    )
    outer = {  # a pipeline stage holds some of these only (pipeline.stage_model)
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_embed": OwnPositions(),
        "norm": SequenceParallel(),
        "lm_head": head,
    }
    held = {name: style for name, style in outer.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, held)
    if config.tie_embeddings and model.lm_head is not None:  # each style made a Parameter of its own
        model.lm_head.weight = model.embed.weight
    for block in model.blocks:
        attention = block.attn
        plan: dict[str, ParallelStyle] = {
            "attn_norm": SequenceParallel(),
            # (x, rope, cache): x all-gathered along the sequence
            "attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attn.qkv": HeadParallelQKV(attention.n_head, attention.n_kv_head, attention.head_dim),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
        if block.mlp.gate is not None:
            plan["mlp.gate"] = ColwiseParallel()
        plan |= _norm_styles(block)
        parallelize_module(block, tp_mesh, plan)
        # the heads this rank computes (module attributes, not state): reshapes see local widths
        attention.n_head, attention.n_kv_head = attention.n_head // size, attention.n_kv_head // size

    def check_length(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args[0].dim() == 2 and args[0].shape[1] % size:  # token ids (a later stage gets shards)
            raise UserInputError(
                f"sequences of {args[0].shape[1]} tokens do not split over tensor_parallel={size} ranks "
                f"(sequence parallelism); use a sequence length divisible by {size}"
            )

    model.register_forward_pre_hook(check_length)


def _norm_styles(block: nn.Module) -> dict[str, ParallelStyle]:
    """The styles of a block's optional norms. Norms after a sublayer (OLMo-2, Gemma 2/3) take its
    sequence-sharded output and hand the residual sum a plain tensor; a q/k norm of each head (Qwen3,
    Gemma 3) runs on this rank's heads (dimension 1 of ``(B, heads, T, head_dim)``), its replicated weight's
    gradient a partial sum (``reduce_partial_grads``); a q/k norm over the whole projection
    (OLMo-2) is ``ProjectionNorm``."""
    styles: dict[str, ParallelStyle] = {
        name: SequenceParallel(use_local_output=True)
        for name in ("attn_post_norm", "mlp_post_norm") if not isinstance(getattr(block, name), nn.Identity)
    }
    qk_norm = block.attn.config.qk_norm
    if qk_norm != "none":
        for name in ("attn.q_norm", "attn.k_norm"):
            styles[name] = ProjectionNorm() if qk_norm == "projection" else SequenceParallel(
                sequence_dim=1, use_local_output=True
            )
    return styles


def reduce_partial_grads(model: nn.Module) -> None:
    """Give every gradient the placement of its parameter (call after each backward). A sequence-parallel
    norm's weight is replicated but each rank's gradient covers only its positions (a ``Partial`` sum):
    all-reduced here, so the optimizer, gradient clipping and GradNormMonitor all see the whole gradient.
    Not a gradient hook on the parameters: moving the module (``.to``) swaps each DTensor parameter for
    a new one and silently drops such hooks (``ParallelStrategy`` moves it after this plan).

    The norms' ``Partial`` gradients (``2 * n_layer + 1`` tensors of ``n_embd`` values in a pre-norm block;
    post-norms, per-head q/k norms and a learned position table add theirs) are summed in one
    bucket: concatenated and all-reduced once per mesh and dtype (in practice once per backward) instead
    of once each, as such small all-reduces cost a collective's latency, not bandwidth. Any other
    gradient whose placement differs from its parameter's is redistributed by itself, as before."""
    buckets: dict[tuple[DeviceMesh, torch.dtype], list[nn.Parameter]] = {}
    for param in model.parameters():
        if _is_partial_sum_of_replicated(param):
            buckets.setdefault((param.device_mesh, param.grad.dtype), []).append(param)
        else:
            match_grad_placement(param)
    with torch.no_grad():
        for (mesh, _), params in buckets.items():
            locals_ = [param.grad.to_local() for param in params]
            flat = torch.cat([local.reshape(-1) for local in locals_])
            dist.all_reduce(flat, group=mesh.get_group())  # a sum: what Partial -> Replicate does
            chunks = flat.split([local.numel() for local in locals_])
            for param, local, chunk in zip(params, locals_, chunks, strict=True):
                param.grad = DTensor.from_local(chunk.view_as(local), mesh, param.placements, run_check=False)


def _is_partial_sum_of_replicated(param: nn.Parameter) -> bool:
    """Whether ``param`` is replicated over a 1-D mesh and its gradient a ``Partial`` sum on that mesh."""
    grad = param.grad
    return (
        isinstance(param, DTensor) and isinstance(grad, DTensor) and param.device_mesh.ndim == 1
        and grad.device_mesh == param.device_mesh
        and param.placements == (Replicate(),) and grad.placements == (Partial(),)
    )


def match_grad_placement(param: nn.Parameter) -> None:
    """Redistribute ``param``'s gradient to the parameter's own placements (a ``Partial`` sum reduced)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


_loss_parallel_depth = 0  # vocab_parallel_loss contexts open (a manual backward runs inside the step's)


@contextmanager
def vocab_parallel_loss() -> Iterator[None]:
    """``cross_entropy`` of logits sharded by vocabulary (a ``Shard`` DTensor) computed without gathering
    them, in forward and in backward (torch's ``loss_parallel``, which must be active for both). Unlike
    torch's context it nests (``ParallelStrategy.backward`` inside its ``training_step`` under manual
    optimization; the inner exit would switch it off for the rest of the step) and is left on an exception
    too, so a failed step does not leave DTensor's loss handlers installed for the next one."""
    global _loss_parallel_depth
    context = torch_loss_parallel() if _loss_parallel_depth == 0 else None
    if context is not None:
        context.__enter__()
    _loss_parallel_depth += 1
    try:
        yield
    finally:
        _loss_parallel_depth -= 1
        if context is not None:
            context.__exit__(None, None, None)
