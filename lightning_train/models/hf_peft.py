"""LoRA adapters of our GPT as peft adapters of its Hugging Face export (``hf.hf_config``'s model)."""

from __future__ import annotations

from importlib.metadata import version

import torch

from lightning_train.models.config import GPTConfig
from lightning_train.models.gpt import GPT
from lightning_train.models.hf_weights import hf_pieces, state_dict_to_hf
from lightning_train.models.lora import PROJECTIONS

Adapters = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer -> (A, B)
Run = tuple[int, int, int]  # rows of an adapter's B: (its first row, first row in the HF module, count)


def hf_weight_shapes(config: GPTConfig) -> dict[str, torch.Size]:
    """The tensors of ``hf_config(config)``'s model, by name, with their shapes (nothing allocated)."""
    with torch.device("meta"):
        return {key: value.shape for key, value in state_dict_to_hf(GPT(config).state_dict(), config).items()}


def adapters_to_hf(adapters: Adapters, config: GPTConfig) -> Adapters:
    """Our LoRA adapters ``{layer: (A, B)}`` (layers named as ``lora.adapters`` names them) as adapters
    of the same function on ``hf_config(config)``'s model, keyed by its module names.

    Exact in every case. B's rows follow the weights' own mapping (``hf_pieces``: the rows of each of our
    tensors in the HF tensors), so a module that holds rows of several adapters gets one adapter of their
    summed rank, A stacked and B block-diagonal (q/k/v on GPT-2's ``c_attn``, Phi-3's ``qkv_proj``, gate
    and up on Phi-3's ``gate_up_proj``), B's rows in the module's order (GPT-NeoX's per-head
    ``query_key_value``); an adapter spread over several modules gives each the shared A and its rows of
    B (a fused ``qkv`` adapter on Llama's q/k/v_proj).
    """
    shapes = hf_weight_shapes(config)
    plan = hf_pieces(shapes, config, "the exported model")
    on_module: dict[str, list[tuple[torch.Tensor, torch.Tensor, list[Run]]]] = {}
    out_rows: dict[str, int] = {}
    for name, (a, b) in adapters.items():
        layer, first = _rows_in_weight(name, config)
        runs: dict[str, list[Run]] = {}
        for piece in plan[f"{layer}.weight"]:
            low, high = max(first, piece.start), min(first + b.shape[0], piece.start + piece.rows)
            if low < high:
                module = _loaded_name(piece.key.removesuffix(".weight"))
                out_rows[module] = shapes[piece.key][1 if piece.transposed else 0]  # Conv1D keeps (in, out)
                run = (low - first, piece.source_start + low - piece.start, high - low)
                runs.setdefault(module, []).append(run)
        for module, module_runs in runs.items():
            on_module.setdefault(module, []).append((a, b, module_runs))
    out: Adapters = {}
    for module, parts in on_module.items():
        a = torch.cat([part_a for part_a, _, _ in parts])
        b = a.new_zeros(out_rows[module], a.shape[0])
        column = 0
        for part_a, part_b, runs in parts:
            columns = slice(column, column + part_a.shape[0])
            for row, module_row, count in runs:
                b[module_row : module_row + count, columns] = part_b[row : row + count]
            column = columns.stop
        out[module] = (a, b)
    return out


def _rows_in_weight(name: str, config: GPTConfig) -> tuple[str, int]:
    """The layer whose weight an adapter's B adds rows to, and the first of them: a per-projection
    adapter (``blocks.0.attn.qkv.k``) adds to its rows of the fused ``qkv``."""
    fused, _, part = name.rpartition(".")
    if part not in PROJECTIONS or not fused.endswith(".attn.qkv"):
        return name, 0
    sizes = [config.n_head * config.head_dim] + [config.n_kv_head * config.head_dim] * 2
    return fused, sum(sizes[: PROJECTIONS.index(part)])


def _loaded_name(module: str) -> str:
    """The name of ``module`` in the model transformers builds, which peft's adapter keys must use:
    transformers 5 loads GPT-NeoX's ``embed_out`` as ``lm_head`` (it renames the weight; peft does not
    rename adapters)."""
    if module == "embed_out" and int(version("transformers").split(".")[0]) >= 5:
        return "lm_head"
    return module
