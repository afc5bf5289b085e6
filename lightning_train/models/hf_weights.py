"""Hugging Face state dicts to and from our GPT's: renames and reshapes only (torchtitan's rule), for
the configs ``hf.config_from_hf`` maps and ``hf.hf_config`` writes."""

from __future__ import annotations

import torch

from lightning_train.errors import UserInputError
from lightning_train.models.config import GPTConfig
from lightning_train.models.hf import hf_flavour

StateDict = dict[str, torch.Tensor]


def state_dict_from_hf(weights: StateDict, config: GPTConfig, source: str) -> StateDict:
    """An HF state dict renamed (GPT-2's Conv1D weights transposed, Llama's q/k/v fused) into our key
    names; refuses missing and unmapped tensors with one error naming ``source``."""
    weights = {k.removeprefix("transformer.").removeprefix("model.").removeprefix("gpt_neox."): v
               for k, v in weights.items()}
    convert = {"gpt2": _convert_gpt2, "gpt_neox": _convert_neox}.get(hf_flavour(config), _convert_llama)
    try:
        return convert(weights, config, source)
    except KeyError as err:
        raise UserInputError(f"{source!r} lacks the weight {err.args[0]!r} of its config.json") from err

def _convert_gpt2(w: StateDict, config: GPTConfig, source: str) -> StateDict:
    out = {"embed.weight": w.pop("wte.weight"), "pos_embed.weight": w.pop("wpe.weight")}
    out |= {"norm.weight": w.pop("ln_f.weight"), "norm.bias": w.pop("ln_f.bias")}
    names = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
             "mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
    for i in range(config.n_layer):
        for theirs, ours in names.items():
            weight = w.pop(f"h.{i}.{theirs}.weight")
            out[f"blocks.{i}.{ours}.weight"] = weight if theirs.startswith("ln") else weight.t().contiguous()
            out[f"blocks.{i}.{ours}.bias"] = w.pop(f"h.{i}.{theirs}.bias")
        w.pop(f"h.{i}.attn.bias", None), w.pop(f"h.{i}.attn.masked_bias", None)  # old causal-mask buffers
    return _finish(out, w, config, source)


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


def _regroup(parts: list[torch.Tensor], names: list[str], config: GPTConfig) -> list[torch.Tensor]:
    """``parts`` concatenated, then split into the rows of the modules ``names``."""
    tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
    if len(names) == 1:
        return [tensor]
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate": config.intermediate_size, "mlp.up": config.intermediate_size}
    return [part.contiguous() for part in tensor.split([rows[name] for name in names])]


def _convert_llama(w: StateDict, config: GPTConfig, source: str) -> StateDict:
    out = {"embed.weight": w.pop("embed_tokens.weight"), "norm.weight": w.pop("norm.weight")}
    for i in range(config.n_layer):
        for ours, theirs, kinds in _llama_layout(config):
            for kind in kinds:
                parts = _regroup([w.pop(f"layers.{i}.{name}.{kind}") for name in theirs], ours, config)
                out |= {f"blocks.{i}.{name}.{kind}": part for name, part in zip(ours, parts, strict=True)}
    return _finish(out, w, config, source)


# GPT-NeoX's layer names; its query_key_value holds each head's q, k and v together
NEOX_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
              "attention.query_key_value": "attn.qkv", "attention.dense": "attn.proj",
              "mlp.dense_h_to_4h": "mlp.up", "mlp.dense_4h_to_h": "mlp.down"}


def _neox_qkv(tensor: torch.Tensor, n_head: int, to_ours: bool) -> torch.Tensor:
    """Rows grouped by head (q, k, v of head 0, then of head 1, ...: GPT-NeoX) to ours (all q, all k,
    all v), or back."""
    groups = (n_head, 3) if to_ours else (3, n_head)
    return tensor.unflatten(0, (*groups, -1)).transpose(0, 1).flatten(0, 2).contiguous()


def _convert_neox(w: StateDict, config: GPTConfig, source: str) -> StateDict:
    out = {"embed.weight": w.pop("embed_in.weight"), "norm.weight": w.pop("final_layer_norm.weight"),
           "norm.bias": w.pop("final_layer_norm.bias")}
    for i in range(config.n_layer):
        for theirs, ours in NEOX_NAMES.items():
            for kind in ("weight", "bias"):
                tensor = w.pop(f"layers.{i}.{theirs}.{kind}")
                qkv = ours == "attn.qkv"
                out[f"blocks.{i}.{ours}.{kind}"] = _neox_qkv(tensor, config.n_head, True) if qkv else tensor
        for buffer in ("attention.bias", "attention.masked_bias"):  # causal-mask buffers of older versions
            w.pop(f"layers.{i}.{buffer}", None)
    if "embed_out.weight" in w:
        w["lm_head.weight"] = w.pop("embed_out.weight")
    return _finish(out, w, config, source)


def _neox_from_ours(w: StateDict, config: GPTConfig) -> StateDict:
    out = {"gpt_neox.embed_in.weight": w["embed.weight"], "gpt_neox.final_layer_norm.bias": w["norm.bias"],
           "gpt_neox.final_layer_norm.weight": w["norm.weight"]}
    for i in range(config.n_layer):
        for theirs, ours in NEOX_NAMES.items():
            for kind in ("weight", "bias"):
                tensor = w[f"blocks.{i}.{ours}.{kind}"]
                qkv = ours == "attn.qkv"
                tensor = _neox_qkv(tensor, config.n_head, False) if qkv else tensor
                out[f"gpt_neox.layers.{i}.{theirs}.{kind}"] = tensor
    return out


def _finish(out: StateDict, rest: StateDict, config: GPTConfig, source: str) -> StateDict:
    """Add the untied ``lm_head`` and refuse tensors we did not map (they would be silently dropped)."""
    head = rest.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        if head is None:
            raise UserInputError(f"{source!r} lacks lm_head.weight, yet tie_word_embeddings is false")
        out["lm_head.weight"] = head
    rest = {k: v for k, v in rest.items() if not k.endswith("rotary_emb.inv_freq")}  # derived buffers
    if rest:
        raise UserInputError(f"{source!r} holds weights with no place in our GPT: {sorted(rest)[:6]}")
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
