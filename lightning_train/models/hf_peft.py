"""LoRA adapters of our GPT as peft adapters of its Hugging Face export (``hf.hf_config``'s model)."""

from __future__ import annotations

import torch

from lightning_train.errors import UserInputError
from lightning_train.models.config import GPTConfig
from lightning_train.models.hf import hf_flavour

Adapters = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer -> (A, B)
_LLAMA_LAYERS = {"attn.proj": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
                 "mlp.down": "mlp.down_proj"}
_GPT2_LAYERS = {"attn.proj": "attn.c_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}


def adapters_to_hf(adapters: Adapters, config: GPTConfig) -> Adapters:
    """Our LoRA adapters ``{layer: (A, B)}`` (layers named as ``lora.adapters`` names them) as adapters
    of the same function on ``hf_config(config)``'s model, keyed by its module names.

    Exact in every case: a fused ``qkv`` adapter on Llama's separate q/k/v_proj gives each projection
    the shared A and its rows of B; per-projection q/k/v adapters on GPT-2's fused ``c_attn`` become
    one adapter of their summed rank, A stacked and B block-diagonal, so ``B @ A`` is theirs side by side.
    """
    if hf_flavour(config) == "gpt_neox" or config.family == "phi3":
        raise UserInputError(
            "export --format peft does not map LoRA adapters onto the fused projections of GPT-NeoX "
            "(query_key_value) and Phi-3 (qkv_proj, gate_up_proj) yet; export the merged model: --format hf"
        )
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    rows = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
    llama = hf_flavour(config) == "llama"
    out: Adapters = {}
    joined: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # c_attn -> (first row, A, B)
    for name, (a, b) in adapters.items():
        if name == "lm_head":
            out["lm_head"] = (a, b)
            continue
        _, index, layer = name.split(".", 2)
        prefix = f"model.layers.{index}." if llama else f"transformer.h.{index}."
        if layer == "attn.qkv" and not llama:  # GPT-2's c_attn is fused too: one to one
            out[prefix + "attn.c_attn"] = (a, b)
        elif layer == "attn.qkv":  # Llama's projections: each the shared A and its rows of B
            for part, (start, size) in rows.items():
                out[f"{prefix}self_attn.{part}_proj"] = (a, b[start : start + size])
        elif layer.startswith("attn.qkv.") and llama:  # the adapter of one projection
            out[f"{prefix}self_attn.{layer[-1]}_proj"] = (a, b)
        elif layer.startswith("attn.qkv."):
            joined.setdefault(prefix + "attn.c_attn", []).append((rows[layer[-1]][0], a, b))
        else:
            out[prefix + (_LLAMA_LAYERS if llama else _GPT2_LAYERS)[layer]] = (a, b)
    for module, parts in joined.items():
        a = torch.cat([part_a for _, part_a, _ in parts])
        b = a.new_zeros(q + 2 * kv, a.shape[0])
        column = 0
        for first_row, part_a, part_b in parts:
            b[first_row : first_row + part_b.shape[0], column : column + part_a.shape[0]] = part_b
            column += part_a.shape[0]
        out[module] = (a, b)
    return out
