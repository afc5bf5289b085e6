"""Hugging Face causal LMs mapped onto our GPT: the config here, the state-dict names and shapes in
``hf_weights``; nothing else (like torchtitan's per-model state-dict adapters; reading the files is
``lightning_train.checkpoint.open_pretrained``'s job).

Mapping rather than wrapping: the weights become a plain ``GPT``, so every part of this package
(FSDP wrapping, LoRA, KV-cache generation, export) works the same on them, and loading needs no
``transformers`` at all. The two flavours (docs/models.md lists the families of the second):

- GPT-2: LayerNorm with bias, learned positions, tanh-GELU MLP. Its ``Conv1D`` layers store
  weights as (in, out), so they are transposed; ``c_attn`` is already a fused q|k|v like ours.
- Llama, Mistral, Qwen2/3, OLMo-2, Gemma 1/2/3, Phi-3: RMSNorm, rotary embeddings in the rotate-half layout
  (as ours), SwiGLU (``gate_proj``/``up_proj`` are our ``mlp.gate``/``mlp.up``), grouped-query
  attention, and the options of each family. q, k and v are concatenated into our fused ``qkv``.

    >>> hf = {"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_layer": 1, "n_head": 2,
    ...       "n_embd": 8}
    >>> config = config_from_hf(hf, "gpt2-tiny")
    >>> config.position, config.tie_embeddings
    ('learned', True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_train.errors import UserInputError
from lightning_train.models.config import GPTConfig
from lightning_train.models.rope import SCALINGS

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma", "gemma2", "gemma3_text", "phi3",
             "gpt_neox")
# Families still refused, and the supported one nearest to each (what a user may load instead)
NEAREST = {"gemma3": "gemma3_text", "phimoe": "phi3",
           "stablelm": "llama", "granite": "llama", "smollm3": "llama",
           "phi": "gpt2", "falcon": "llama", "olmo": "llama", "cohere": "llama", "starcoder2": "mistral"}
# why a refused config value matters: the model would compute something else than the checkpoint's
ROPE_WHY = {"dynamic": "its frequencies change with each sequence's length",
            "partial": "only part of each head is rotated (partial_rotary_factor)"}


def config_from_hf(hf: dict[str, Any], source: str) -> GPTConfig:
    """Our ``GPTConfig`` for the values of an HF ``config.json`` (``source`` names it in errors)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        nearest = NEAREST.get(model_type)
        hint = f"; the nearest supported family is {nearest!r}" if nearest else ""
        raise UserInputError(
            f"{source!r} holds a {model_type!r} model ({hf.get('architectures')}); supported Hugging Face "
            f"architectures are {list(SUPPORTED)}{hint}"
        )
    readers = {"gpt2": gpt2_config, "gpt_neox": neox_config}
    return readers.get(model_type, llama_config)(hf, source)


def _reject(source: str, setting: str, value: Any, why: str = "") -> None:
    why = f": {why}" if why else ""
    raise UserInputError(f"{source!r}: {setting}={value!r} is not supported by lightning_train's GPT{why}")


def gpt2_config(hf: dict[str, Any], source: str) -> GPTConfig:
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        _reject(source, "activation_function", hf["activation_function"])
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag):
            _reject(source, flag, hf[flag])
    if hf.get("scale_attn_weights") is False:
        _reject(source, "scale_attn_weights", False)
    return GPTConfig(
        vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"], n_head=hf["n_head"],
        n_embd=hf["n_embd"], intermediate_size=hf.get("n_inner") or 4 * hf["n_embd"], norm="layernorm",
        position="learned", mlp="gelu", bias=True, tie_embeddings=hf.get("tie_word_embeddings", True),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), **_training_settings(hf, "resid_pdrop"),
    )


def neox_config(hf: dict[str, Any], source: str) -> GPTConfig:
    """GPT-NeoX / Pythia: LayerNorm with biases, rope on a fraction of each head, a parallel residual."""
    activation = hf.get("hidden_act", "gelu")
    if activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        _reject(source, "hidden_act", activation)
    if not hf.get("attention_bias", True):
        _reject(source, "attention_bias", False, "its MLP keeps biases; our bias is every layer's or none")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        _reject(source, "rope_type", rope["rope_type"], "GPT-NeoX's rope is read unscaled here")
    return GPTConfig(
        vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        norm="layernorm", position="rope", mlp="gelu_exact" if activation == "gelu" else "gelu", bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        rope_theta=rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0)),
        rope_fraction=rope.get("partial_rotary_factor", hf.get("rotary_pct", 1.0)),
        parallel_residual=hf.get("use_parallel_residual", True), norm_eps=hf.get("layer_norm_eps", 1e-5),
        **_training_settings(hf, "hidden_dropout"),
    )


def llama_config(hf: dict[str, Any], source: str) -> GPTConfig:
    """Llama, Mistral, Qwen2/3, OLMo-2 and Gemma 1/2/3: one block, with q/k/v biases (Qwen2), q/k norms
    (per head: Qwen3, Gemma 3; of the projections: OLMo-2), norms after the sublayers (OLMo-2; before
    and after: Gemma 2/3), a sliding window (Mistral, Qwen2/3 from ``max_window_layers`` on, Gemma
    2/3's local layers) and Gemma's (1 + w) norms, GeGLU, scaled embeddings and soft-capping."""
    family = hf["model_type"]
    gemma = family.startswith("gemma")
    theta, scaling, local_theta, fraction = _rope(hf, source)
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if activation != ("gelu_pytorch_tanh" if gemma else "silu"):
        _reject(source, "hidden_act", activation)
    bias = bool(hf.get("attention_bias", False))
    if family in ("llama", "mistral") and bias != hf.get("mlp_bias", False):
        _reject(source, "attention_bias != mlp_bias", (bias, hf.get("mlp_bias")),
                "our bias option puts biases on every layer or none")
    if (family in ("qwen3", "olmo2") or gemma) and bias:
        _reject(source, "attention_bias", True, "an o_proj bias without MLP biases has no GPTConfig option")
    if hf.get("use_bidirectional_attention"):
        _reject(source, "use_bidirectional_attention", True, "a token would see the tokens after it")
    window, layers = _sliding_window(hf)
    config = GPTConfig(
        vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
        n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
        n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"], n_embd=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], norm="offset_rmsnorm" if gemma else "rmsnorm",
        position="rope", mlp="geglu" if gemma else "swiglu", bias=bias and family != "qwen2",
        qkv_bias=family == "qwen2", head_size=_head_size(hf),
        qk_norm={"qwen3": "head", "gemma3_text": "head", "olmo2": "projection"}.get(family, "none"),
        block_norms={"olmo2": "post", "gemma2": "both", "gemma3_text": "both"}.get(family, "pre"),
        tie_embeddings=hf.get("tie_word_embeddings", gemma), rope_theta=theta, rope_scaling=scaling,
        local_rope_theta=local_theta, rope_fraction=fraction, sliding_window=window,
        sliding_window_layers=layers, embed_scale=gemma, query_scale_dim=_query_scale_dim(hf),
        attn_softcap=hf.get("attn_logit_softcapping"), logit_softcap=hf.get("final_logit_softcapping"),
        norm_eps=hf.get("rms_norm_eps", 1e-6), **_training_settings(hf, "attention_dropout"),
    )
    # the family is recorded only where the block does not name it (a Mistral without a window)
    return config if family == derived_family(config) else dataclasses.replace(config, family=family)


def _head_size(hf: dict[str, Any]) -> int | None:
    """``head_dim`` where it is not hidden_size / num_attention_heads (Qwen3, Gemma), else None."""
    default = hf["hidden_size"] // hf["num_attention_heads"]
    return None if hf.get("head_dim", default) == default else hf["head_dim"]


def _query_scale_dim(hf: dict[str, Any]) -> float | None:
    """Gemma 2/3's ``query_pre_attn_scalar``, None where it is the head size (the default scale)."""
    head_dim = _head_size(hf) or hf["hidden_size"] // hf["num_attention_heads"]
    scalar = hf.get("query_pre_attn_scalar") if hf["model_type"] != "gemma" else None
    return None if scalar == head_dim else scalar


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """``rope_theta``, the scaling (``rope_parameters`` of transformers 5, ``rope_scaling`` of 4), the
    local layers' own base (Gemma 3: parameters by layer type) and the share of each head rotated."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = None
    if "full_attention" in rope:
        local = rope.get("sliding_attention", {})
        if local.get("rope_type", "default") != "default":
            _reject(source, "sliding_attention rope_type", local["rope_type"], "local layers scale no rope")
        local_theta, rope = local.get("rope_theta"), dict(rope["full_attention"])
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and hf["model_type"] != "phi3":  # Phi-3's attention rotates the first part, as ours
        _reject(source, "partial_rotary_factor", partial, ROPE_WHY["partial"])
    kind = rope.setdefault("rope_type", rope.pop("type", "default"))
    if hf["model_type"] == "phi3" and kind in ("su", "yarn"):  # Phi3Config's names for LongRoPE
        kind = rope["rope_type"] = "longrope"
    if kind == "default":
        return theta, None, local_theta, partial
    if kind not in SCALINGS:
        why = ROPE_WHY.get(kind, f"supported are 'default', {', '.join(SCALINGS)}")
        _reject(source, "rope_type", kind, why)
    if "original_max_position_embeddings" in SCALINGS[kind]:  # a top-level value wins, as in transformers
        rope["original_max_position_embeddings"] = (
            hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
            or hf["max_position_embeddings"])
    return theta, rope, local_theta, partial


def _sliding_window(hf: dict[str, Any]) -> tuple[int | None, list[int] | None]:
    """The window and the layers it applies to (None: all): those ``layer_types`` names, else every
    layer (Mistral), from ``max_window_layers`` on (Qwen2/3), every other (Gemma 2)."""
    window, n_layer, family = hf.get("sliding_window"), hf["num_hidden_layers"], hf["model_type"]
    if not window or family == "gemma" or (family in ("qwen2", "qwen3") and not hf.get("use_sliding_window")):
        return None, None
    types = hf.get("layer_types")
    if types:
        layers = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    elif family == "gemma2":
        layers = list(range(0, n_layer, 2))
    else:
        layers = list(range(hf.get("max_window_layers", 0), n_layer))
    return (window, None) if len(layers) == n_layer else (window, layers)


def derived_family(config: GPTConfig) -> str:
    """The HF family that describes ``config`` by its block alone (export writes it unless
    ``config.family`` says otherwise)."""
    if config.position == "learned":
        return "gpt2"
    if config.norm == "layernorm":
        return "gpt_neox"
    if config.norm == "offset_rmsnorm":
        return {"pre": "gemma", "both": "gemma3_text" if config.qk_norm == "head" else "gemma2"}.get(
            config.block_norms, "gemma")
    if config.qk_norm == "projection" or config.block_norms == "post":
        return "olmo2"
    if config.qk_norm == "head":
        return "qwen3"
    if config.qkv_bias or config.sliding_window_layers is not None:
        return "qwen2"
    return "mistral" if config.sliding_window else "llama"


def _training_settings(hf: dict[str, Any], dropout_key: str) -> dict[str, Any]:
    """Dropout and init scale, where the config.json records them (so an export reads back as the
    GPTConfig it came from); otherwise our defaults."""
    values = {"dropout": hf.get(dropout_key), "init_std": hf.get("initializer_range")}
    return {key: value for key, value in values.items() if value is not None}


# ---- the way out: our GPT as an HF GPT2LMHeadModel, or Llama, Mistral, Qwen2 or Qwen3 ------------------
LLAMA_BLOCK = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu"}
GEMMA_BLOCK = {"norm": "offset_rmsnorm", "position": "rope", "mlp": "geglu"}  # Llama's layer names
NEOX_BLOCK = {"norm": "layernorm", "position": "rope", "bias": True}
GPT2_BLOCK = {"norm": "layernorm", "position": "learned", "mlp": "gelu", "bias": True}


def hf_config(config: GPTConfig) -> dict[str, Any]:
    """The HF ``config.json`` values of a model with ``config`` (the inverse of ``config_from_hf``);
    refuses a config neither HF architecture describes with one error naming the settings."""
    flavour = hf_flavour(config)
    common = {"vocab_size": config.vocab_size, "initializer_range": config.init_std,
              "tie_word_embeddings": config.tie_embeddings}
    if flavour == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_layer": config.n_layer,
            "n_head": config.n_head, "n_embd": config.n_embd, "n_inner": config.intermediate_size,
            "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": config.norm_eps,
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        }
    if flavour == "gpt_neox":
        return _same_config(config, {
            "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **common,
            "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "hidden_act": "gelu" if config.mlp == "gelu_exact" else "gelu_new",
            "max_position_embeddings": config.block_size, "layer_norm_eps": config.norm_eps,
            "use_parallel_residual": config.parallel_residual, "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                                "partial_rotary_factor": config.rope_fraction},
            "attention_dropout": config.dropout, "hidden_dropout": config.dropout,
        })
    family = config.family or derived_family(config)
    values = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, **common,
        "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "attention_dropout": config.dropout,
        "rope_parameters": {"rope_type": "default", **(config.rope_scaling or {}),
                            "rope_theta": config.rope_theta},
        "attention_bias": config.bias, "mlp_bias": config.bias, "sliding_window": config.sliding_window,
    }
    layer_types = [("sliding" if config.window(i) else "full") + "_attention" for i in range(config.n_layer)]
    if family in ("qwen2", "qwen3"):
        values |= {"use_sliding_window": config.sliding_window is not None, "layer_types": layer_types,
                   "max_window_layers": config.n_layer}  # layer_types names the windowed layers
    if family == "phi3":  # no pad id of its own: Phi3Config's default would lie outside a small vocabulary
        # Phi3Config takes this over the rope parameters' own: a LongRoPE's switch
        original = (config.rope_scaling or {}).get("original_max_position_embeddings", config.block_size)
        values |= {"original_max_position_embeddings": original, "pad_token_id": None,
                   "resid_pdrop": config.dropout, "embd_pdrop": config.dropout}
        values["rope_parameters"]["partial_rotary_factor"] = config.rope_fraction  # Phi-4-mini: 0.75
    if family.startswith("gemma"):
        values |= {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "use_bidirectional_attention": False}
    if family in ("gemma2", "gemma3_text"):
        values |= {"layer_types": layer_types, "attn_logit_softcapping": config.attn_softcap,
                   "query_pre_attn_scalar": config.query_scale_dim or config.head_dim,
                   "final_logit_softcapping": config.logit_softcap}
    if family == "gemma3_text":  # rope parameters by layer type
        local = {"rope_type": "default", "rope_theta": config.local_rope_theta or config.rope_theta}
        values["rope_parameters"] = {"full_attention": values["rope_parameters"], "sliding_attention": local}
    return _same_config(config, values)


def _same_config(config: GPTConfig, values: dict[str, Any]) -> dict[str, Any]:
    """``values``, once they are seen to read back as ``config``: else one error naming what is lost."""
    back = dataclasses.asdict(config_from_hf(values, "export"))
    kept = {"family", "packed_attention"}  # what export writes, and a kernel choice: no weights' meaning
    lost = [f"{k}={v!r}" for k, v in dataclasses.asdict(config).items() if k not in kept and back[k] != v]
    if lost:
        raise UserInputError(
            f"cannot export to Hugging Face as {values['architectures'][0]}: {', '.join(lost)} has no place "
            "in its config.json; export it with --format safetensors"
        )
    return values


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def hf_flavour(config: GPTConfig) -> str:
    ours = dataclasses.asdict(config)
    blocks = ("llama", LLAMA_BLOCK), ("llama", GEMMA_BLOCK), ("gpt_neox", NEOX_BLOCK), ("gpt2", GPT2_BLOCK)
    for flavour, block in blocks:
        if all(ours[k] == v for k, v in block.items()):
            if flavour == "gpt2" and config.n_kv_head != config.n_head:
                raise UserInputError(
                    f"cannot export to Hugging Face: n_kv_head={config.n_kv_head} != n_head={config.n_head} "
                    "(grouped-query attention) does not map onto GPT2LMHeadModel; export it with "
                    "--format safetensors"
                )
            return flavour
    settings = ", ".join(f"{k}={ours[k]!r}" for k in ("norm", "position", "mlp", "bias"))
    raise UserInputError(
        f"cannot export to Hugging Face: {settings} maps onto neither LlamaForCausalLM "
        "(norm='rmsnorm', position='rope', mlp='swiglu') nor GPT2LMHeadModel (norm='layernorm', "
        "position='learned', mlp='gelu', bias=True); export it with --format safetensors"
    )
