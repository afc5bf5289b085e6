"""Tensor parallelism for a model of one's own, from a plan: module-name patterns mapped to styles, as
torchtitan's and transformers' plans are written (``*`` stands for one part of a dotted name)::

    {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise", ...}

Styles (``STYLES``), each a ``torch.distributed.tensor.parallel`` style:

- ``colwise``: a Linear's output features split (its input whole, its output this rank's slice);
- ``rowwise``: a Linear's input features split, its output summed whole; an Embedding's vocabulary split;
- ``head``: the output head, split by vocabulary: its logits stay sharded for the vocab-parallel loss
  (``ParallelStrategy(loss_parallel=True)``, the default), or are gathered whole.

Between a ``rowwise`` module and the next ``colwise`` one the activations are whole plain tensors, so
the model's own code (reshapes to ``-1`` heads, rotary embeddings, masks) runs unchanged on each rank's
heads. ``builtin_plan`` gives that plan for transformers' Llama-like models (Llama, Mistral, Qwen2); a
plan passed to the strategy (``tensor_parallel_plan``, from Python or YAML) replaces it. The GPT keeps
its own plan (``tensor_parallel.py``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from lightning_train.errors import UserInputError

# no sequence-parallel style: it holds activations sharded along the sequence between modules, which the
# model's own code between them (residuals, rotary positions, masks) would have to take as DTensors
STYLES = ("colwise", "rowwise", "head")
LLAMA_LIKE = ("llama", "mistral", "qwen2")  # transformers' model_type of the families builtin_plan covers


def builtin_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan of a transformers Llama-like model (``LlamaForCausalLM``, or its ``LlamaModel``): attention
    and MLP split Megatron-style (q, k, v, gate, up column-wise; o, down row-wise), the embedding by
    vocabulary, the head by vocabulary; None for another model."""
    if getattr(getattr(model, "config", None), "model_type", None) not in LLAMA_LIKE:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    layer = f"{prefix}layers.*"
    plan = {f"{prefix}embed_tokens": "rowwise"}
    plan |= {f"{layer}.self_attn.{name}_proj": "colwise" for name in ("q", "k", "v")}
    plan[f"{layer}.self_attn.o_proj"] = "rowwise"
    plan |= {f"{layer}.mlp.{name}_proj": "colwise" for name in ("gate", "up")}
    plan[f"{layer}.mlp.down_proj"] = "rowwise"
    if hasattr(model, "lm_head"):
        plan["lm_head"] = "head"
    return plan


def resolve_plan(model: nn.Module, plan: dict[str, str], strict: bool = True) -> dict[str, str]:
    """The plan as ``{module name: style}`` for ``model``'s modules. ``strict``: a pattern that matches no
    module, or a style not in ``STYLES``, is one error naming it (a pipeline stage, checked whole first,
    holds some of the modules only)."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UserInputError(
                f"tensor_parallel_plan[{pattern!r}]={style!r} is not one of {', '.join(STYLES)}"
            )
        matched = [name for name in names if _matches(name, pattern)]
        if strict and not matched:
            raise UserInputError(
                f"tensor_parallel_plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"patterns are dotted module names with * for one part, e.g. {_example(model)!r}"
            )
        resolved |= dict.fromkeys(matched, style)
    return resolved


def check_plan(model: nn.Module, plan: dict[str, str], tensor_parallel: int) -> None:
    """Refuse a plan ``model`` cannot be split by over ``tensor_parallel`` ranks: a pattern matching
    nothing, a split dimension that does not divide, attention heads that do not (each rank computes
    whole heads: a projection of a module with ``head_dim`` splits by heads)."""
    modules = dict(model.named_modules())
    for name, style in resolve_plan(model, plan).items():
        module = modules[name]
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        dim = 1 if style == "rowwise" and not isinstance(module, nn.Embedding) else 0
        size = weight.shape[dim]
        parent = modules[name.rpartition(".")[0]]
        head_dim = getattr(parent, "head_dim", None)
        if style == "colwise" and isinstance(head_dim, int) and (size // head_dim) % tensor_parallel:
            raise UserInputError(
                f"tensor_parallel={tensor_parallel} does not divide the {size // head_dim} attention heads "
                f"of {name} ({size} features / head_dim {head_dim}); use a divisor of the model's query "
                "and key/value head counts"
            )
        if size % tensor_parallel:
            raise UserInputError(
                f"tensor_parallel={tensor_parallel} does not divide {name}'s {size} "
                f"{'input' if dim == 1 else 'output'} features ({style}); use a divisor of {size}"
            )


def apply_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str], loss_parallel: bool) -> None:
    """Shard ``model`` (the whole model or a pipeline stage of it) over ``tp_mesh`` by ``plan``, checked
    before by ``check_plan``. Weights tied before (an embedding and its head) are tied again after."""
    modules = dict(model.named_modules())
    ties = _ties(model)
    styles = {
        name: _style(style, modules[name], loss_parallel)
        for name, style in resolve_plan(model, plan, strict=False).items()
    }
    parallelize_module(model, tp_mesh, styles)
    _replicate_the_rest(model, tp_mesh)
    for owner, attribute, source in ties:  # after both: each made a Parameter of its own
        setattr(owner, attribute, source())


def _replicate_the_rest(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the parameters no style split replicated DTensors too, each such module taking and returning
    plain tensors: every parameter is then a DTensor, as one optimizer step over all of them (foreach,
    fused) and FSDP2 over ``(dp, tp)`` need. Their values and gradients are every rank's same ones."""
    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=_replicated, output_fn=_local)


def _replicated(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
        for x in inputs
    )


def _local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    if isinstance(outputs, tuple):
        return tuple(x.to_local() if isinstance(x, DTensor) else x for x in outputs)
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _style(style: str, module: nn.Module, loss_parallel: bool) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":  # token ids come whole to an embedding
        embedding = isinstance(module, nn.Embedding)
        return RowwiseParallel(input_layouts=Replicate()) if embedding else RowwiseParallel()
    if loss_parallel:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Replicate())


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """(module, parameter name, the first holder's parameter, read later) of each parameter another
    module holds too (an embedding and its tied head), to be tied again once laid out."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holder = first.setdefault(id(param), (module, name))
            if holder[0] is not module:
                ties.append((module, name, lambda holder=holder: getattr(*holder)))
    return ties


def _matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatchcase(a, b) for a, b in zip(parts, wanted, strict=True))


def _example(model: nn.Module) -> str:
    """A pattern from the model's own names: its first Linear's, with a ``*`` for a layer index."""
    linear = next((name for name, module in model.named_modules() if isinstance(module, nn.Linear)), "")
    return ".".join("*" if part.isdigit() else part for part in linear.split("."))
