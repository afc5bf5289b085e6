"""Hugging Face state dicts to and from our GPT's: renames and reshapes only (torchtitan's rule), for
the configs ``hf.config_from_hf`` maps and ``hf.hf_config`` writes.

From HF, the mapping is a plan (``hf_pieces``): each of our tensors is a list of ``Piece``s, runs of rows
taken from HF tensors (Llama's q, k, v one after another; GPT-NeoX's qkv a run per head and projection;
GPT-2's Conv1D weights transposed). ``read_box`` reads any box of one of our tensors through it, so a
whole state dict (``state_dict_from_hf``) and a rank's slices of a sharded model (``checkpoint/slices.py``,
safetensors' ``get_slice``) come from one mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from lightning_train.errors import UserInputError
from lightning_train.models.config import GPTConfig
from lightning_train.models.hf import hf_flavour

StateDict = dict[str, torch.Tensor]
Shapes = Mapping[str, Sequence[int]]
Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``start .. start + rows`` of one of our tensors are rows ``source_start ..`` of the HF tensor
    ``key`` (its columns where ``transposed``: GPT-2's Conv1D keeps (in, out))."""

    key: str
    start: int
    rows: int
    source_start: int = 0
    transposed: bool = False


Plan = dict[str, list[Piece]]


def read_box(
    pieces: list[Piece], offsets: Sequence[int], sizes: Sequence[int],
    read: Callable[[str, Index], torch.Tensor],
) -> torch.Tensor:
    """The box ``offsets .. offsets + sizes`` of the tensor that ``pieces`` make up, each part read with
    ``read(key, index)`` (a safetensors slice, or a tensor in memory): only the rows the box needs."""
    first, last = offsets[0], offsets[0] + sizes[0]
    rest = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
    parts = []
    for piece in pieces:
        low, high = max(first, piece.start), min(last, piece.start + piece.rows)
        if low >= high:
            continue
        rows = slice(piece.source_start + low - piece.start, piece.source_start + high - piece.start)
        part = read(piece.key, (*rest, rows)).t() if piece.transposed else read(piece.key, (rows, *rest))
        parts.append(part)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def state_dict_from_hf(weights: StateDict, config: GPTConfig, source: str) -> StateDict:
    """An HF state dict renamed (GPT-2's Conv1D weights transposed, Llama's q/k/v fused) into our key
    names; refuses missing and unmapped tensors with one error naming ``source``."""
    plan = hf_pieces({key: tensor.shape for key, tensor in weights.items()}, config, source)
    return {  # a renamed tensor comes back as itself (a view of all its rows), not a copy
        name: read_box(pieces, *_whole(pieces, weights), lambda key, index: weights[key][index])
        for name, pieces in plan.items()
    }


def _whole(pieces: list[Piece], weights: StateDict) -> tuple[list[int], list[int]]:
    """The offsets and sizes of the whole tensor ``pieces`` make up."""
    shape = weights[pieces[0].key].shape
    other = list(shape[:-1] if pieces[0].transposed else shape[1:])
    return [0] * (1 + len(other)), [sum(piece.rows for piece in pieces), *other]


def hf_pieces(shapes: Shapes, config: GPTConfig, source: str) -> Plan:
    """Our tensors, each from the HF tensors (named as in the files, ``shapes``: name -> shape) it is
    made of; refuses missing and unmapped tensors with one error naming ``source``."""
    keys = {_strip(key): key for key in shapes}
    short_shapes = {short: tuple(shapes[key]) for short, key in keys.items()}
    plan_of = {"gpt2": _gpt2_plan, "gpt_neox": _neox_plan}.get(hf_flavour(config), _llama_plan)
    try:
        plan = plan_of(short_shapes, config)
        used = {piece.key for pieces in plan.values() for piece in pieces}
        plan = {name: [dataclasses.replace(p, key=keys[p.key]) for p in pieces]
                for name, pieces in plan.items()}
    except KeyError as err:
        raise UserInputError(f"{source!r} lacks the weight {err.args[0]!r} of its config.json") from err
    head = "embed_out.weight" if "embed_out.weight" in keys else "lm_head.weight"
    if not config.tie_embeddings:
        if head not in keys:
            raise UserInputError(f"{source!r} lacks lm_head.weight, yet tie_word_embeddings is false")
        plan["lm_head.weight"] = [Piece(keys[head], 0, short_shapes[head][0])]
    rest = sorted(short for short in keys if short not in used | {head} and not _derived(short))
    if rest:
        raise UserInputError(f"{source!r} holds weights with no place in our GPT: {rest[:6]}")
    return plan


def _strip(key: str) -> str:
    return key.removeprefix("transformer.").removeprefix("model.").removeprefix("gpt_neox.")


def _derived(short: str) -> bool:
    """Buffers some versions save that our model derives: rotary frequencies, old causal masks."""
    return short.endswith((".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", ".attention.bias",
                           ".attention.masked_bias"))


def _renamed(shapes: Shapes, key: str) -> list[Piece]:
    return [Piece(key, 0, shapes[key][0])]


def _gpt2_plan(shapes: Shapes, config: GPTConfig) -> Plan:
    plan = {ours: _renamed(shapes, theirs) for ours, theirs in
            (("embed.weight", "wte.weight"), ("pos_embed.weight", "wpe.weight"),
             ("norm.weight", "ln_f.weight"), ("norm.bias", "ln_f.bias"))}
    names = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
             "mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
    for i in range(config.n_layer):
        for theirs, ours in names.items():
            weight = f"h.{i}.{theirs}.weight"
            norm = theirs.startswith("ln")
            plan[f"blocks.{i}.{ours}.weight"] = (  # Conv1D keeps (in, out): transposed
                _renamed(shapes, weight) if norm else [Piece(weight, 0, shapes[weight][1], transposed=True)]
            )
            plan[f"blocks.{i}.{ours}.bias"] = _renamed(shapes, f"h.{i}.{theirs}.bias")
    return plan


# our norms and HF's, by ``block_norms`` (Llama's "post_attention_layernorm" is before the MLP)
BLOCK_NORMS = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "post": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
    "both": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
}


def _llama_layout(config: GPTConfig) -> list[tuple[list[str], list[str], tuple[str, ...]]]:
    """Each layer's tensors: our modules, the HF modules holding the same rows (q, k, v concatenated
    into our ``qkv``; Phi-3's fused ``gate_up_proj`` split into our gate and up) and which of
    weight/bias they have. One table for both directions."""
    kinds = ("weight", "bias") if config.bias else ("weight",)
    qkv_kinds = ("weight", "bias") if config.bias or config.qkv_bias else kinds
    norm = ("weight",)
    layout = [([ours], [theirs], norm) for ours, theirs in BLOCK_NORMS[config.block_norms].items()]
    if config.family == "phi3":
        layout += [(["attn.qkv"], ["self_attn.qkv_proj"], kinds),
                   (["mlp.gate", "mlp.up"], ["mlp.gate_up_proj"], kinds)]
    else:
        layout += [(["attn.qkv"], ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], qkv_kinds),
                   (["mlp.gate"], ["mlp.gate_proj"], kinds), (["mlp.up"], ["mlp.up_proj"], kinds)]
    layout += [(["attn.proj"], ["self_attn.o_proj"], kinds), (["mlp.down"], ["mlp.down_proj"], kinds)]
    if config.qk_norm != "none":
        layout += [([f"attn.{qk}_norm"], [f"self_attn.{qk}_norm"], norm) for qk in "qk"]
    return layout


def _llama_plan(shapes: Shapes, config: GPTConfig) -> Plan:
    plan = {"embed.weight": _renamed(shapes, "embed_tokens.weight"),
            "norm.weight": _renamed(shapes, "norm.weight")}
    for i in range(config.n_layer):
        for ours, theirs, kinds in _llama_layout(config):
            for kind in kinds:
                keys = [f"layers.{i}.{name}.{kind}" for name in theirs]
                sizes = [_rows_of(name, config) for name in ours] if len(ours) > 1 else [None]
                for name, pieces in zip(ours, _split_rows(keys, shapes, sizes), strict=True):
                    plan[f"blocks.{i}.{name}.{kind}"] = pieces
    return plan


def _rows_of(name: str, config: GPTConfig) -> int:
    """The rows of one of the modules a fused HF tensor holds (Phi-3's gate_up: our gate and up)."""
    return {"mlp.gate": config.intermediate_size, "mlp.up": config.intermediate_size}[name]


def _split_rows(keys: list[str], shapes: Shapes, sizes: list[int | None]) -> list[list[Piece]]:
    """The HF tensors ``keys`` concatenated by rows, then cut into tensors of ``sizes`` rows (None: all
    of them): the pieces of each."""
    runs, at = [], 0  # (key, first row in the concatenation, rows)
    for key in keys:
        runs.append((key, at, shapes[key][0]))
        at += shapes[key][0]
    out, start = [], 0
    for size in sizes:
        end = at if size is None else start + size
        out.append([Piece(key, max(first, start) - start, min(first + n, end) - max(first, start),
                          max(first, start) - first)
                    for key, first, n in runs if first < end and first + n > start])
        start = end
    return out


def _regroup(parts: list[torch.Tensor], names: list[str], config: GPTConfig) -> list[torch.Tensor]:
    """``parts`` concatenated, then split into the rows of the modules ``names``."""
    tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
    if len(names) == 1:
        return [tensor]
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv}
    return [part.contiguous() for part in tensor.split([rows[name] for name in names])]


# GPT-NeoX's layer names; its query_key_value holds each head's q, k and v together
NEOX_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
              "attention.query_key_value": "attn.qkv", "attention.dense": "attn.proj",
              "mlp.dense_h_to_4h": "mlp.up", "mlp.dense_4h_to_h": "mlp.down"}


def _neox_plan(shapes: Shapes, config: GPTConfig) -> Plan:
    plan = {"embed.weight": _renamed(shapes, "embed_in.weight"),
            "norm.weight": _renamed(shapes, "final_layer_norm.weight"),
            "norm.bias": _renamed(shapes, "final_layer_norm.bias")}
    n_head, head_dim = config.n_head, config.head_dim
    for i in range(config.n_layer):
        for theirs, ours in NEOX_NAMES.items():
            for kind in ("weight", "bias"):
                key = f"layers.{i}.{theirs}.{kind}"
                plan[f"blocks.{i}.{ours}.{kind}"] = (  # heads' (q, k, v) rows to all q, all k, all v
                    [Piece(key, (part * n_head + head) * head_dim, head_dim, (head * 3 + part) * head_dim)
                     for part in range(3) for head in range(n_head)]
                    if ours == "attn.qkv" else _renamed(shapes, key)
                )
    return plan


def _neox_qkv(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Our qkv rows (all q, all k, all v) grouped by head, as GPT-NeoX keeps them (q, k, v of head 0, then
    of head 1, ...)."""
    return tensor.unflatten(0, (3, n_head, -1)).transpose(0, 1).flatten(0, 2).contiguous()


def _neox_from_ours(w: StateDict, config: GPTConfig) -> StateDict:
    out = {"gpt_neox.embed_in.weight": w["embed.weight"], "gpt_neox.final_layer_norm.bias": w["norm.bias"],
           "gpt_neox.final_layer_norm.weight": w["norm.weight"]}
    for i in range(config.n_layer):
        for theirs, ours in NEOX_NAMES.items():
            for kind in ("weight", "bias"):
                tensor = w[f"blocks.{i}.{ours}.{kind}"]
                qkv = ours == "attn.qkv"
                tensor = _neox_qkv(tensor, config.n_head) if qkv else tensor
                out[f"gpt_neox.layers.{i}.{theirs}.{kind}"] = tensor
    return out


def state_dict_to_hf(weights: StateDict, config: GPTConfig) -> StateDict:
    """Our state dict in the key names and layouts of ``hf_config(config)``'s architecture (the inverse
    of ``state_dict_from_hf``; a tied ``lm_head.weight`` is left out, as transformers saves it)."""
    weights = dict(weights)
    head = weights.pop("lm_head.weight", None)
    flavour = hf_flavour(config)
    write = {"gpt2": _gpt2_from_ours, "gpt_neox": _neox_from_ours}.get(flavour, _llama_from_ours)
    out = write(weights, config)
    if not config.tie_embeddings:
        out["embed_out.weight" if flavour == "gpt_neox" else "lm_head.weight"] = head
    return out


def _gpt2_from_ours(w: StateDict, config: GPTConfig) -> StateDict:
    out = {"transformer.wte.weight": w["embed.weight"], "transformer.wpe.weight": w["pos_embed.weight"],
           "transformer.ln_f.weight": w["norm.weight"], "transformer.ln_f.bias": w["norm.bias"]}
    names = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
             "mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
    for i in range(config.n_layer):
        for theirs, ours in names.items():
            weight = w[f"blocks.{i}.{ours}.weight"]  # Conv1D keeps (in, out): transposed
            weight = weight if theirs.startswith("ln") else weight.t().contiguous()
            out[f"transformer.h.{i}.{theirs}.weight"] = weight
            out[f"transformer.h.{i}.{theirs}.bias"] = w[f"blocks.{i}.{ours}.bias"]
    return out


def _llama_from_ours(w: StateDict, config: GPTConfig) -> StateDict:
    out = {"model.embed_tokens.weight": w["embed.weight"], "model.norm.weight": w["norm.weight"]}
    for i in range(config.n_layer):
        for ours, theirs, kinds in _llama_layout(config):
            for kind in kinds:
                parts = _regroup([w[f"blocks.{i}.{name}.{kind}"] for name in ours], theirs, config)
                prefix = f"model.layers.{i}."
                out |= {f"{prefix}{name}.{kind}": part for name, part in zip(theirs, parts, strict=True)}
    return out
