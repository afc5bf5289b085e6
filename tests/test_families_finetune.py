"""Every open model family fine-tunes from its Hugging Face folder, in full and with LoRA, and its LoRA
adapters export as a peft folder that peft loads on the exported base with our logits (the fused
projections of Phi-3 and GPT-NeoX included). Each family is a row of docs/models.md."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_train.checkpoint import export, open_pretrained
from lightning_train.models.lora import LoRAConfig, lora_layers
from lightning_train.modules.finetune import FinetuneModule
from tests.conftest import run_main
from tests.helpers.lora_names import to_adapted_names
from tests.test_finetune import RandomTokens
from tests.test_hf_families import FAMILIES, hf_folder, load_hf, relative_difference, tokens

peft = pytest.importorskip("peft")

LORA = LoRAConfig(rank=4, alpha=8.0)
# by the HF model_type: the modules peft adapts for our default targets, and the ranks that are not
# LORA.rank (the adapters of q, k, v or of gate, up joined on a fused module)
DEFAULT_TARGETS = {
    "phi3": (["down_proj", "gate_up_proj", "o_proj", "qkv_proj"], {"qkv_proj": 12, "gate_up_proj": 8}),
    "gpt_neox": (["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"], {"query_key_value": 12}),
}
LLAMA_TARGETS = (["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], {})
# GPT-NeoX's output layer: transformers 5 names it lm_head (and renames the saved embed_out weight)
NEOX_HEAD = "lm_head" if int(version("transformers").split(".")[0]) >= 5 else "embed_out"


def fine_tune(folder: Path, lora: LoRAConfig | None, learning_rate: float) -> tuple[FinetuneModule, Path]:
    """3 steps from ``folder``: the module and its checkpoint (``ft.ckpt`` beside the folder)."""
    module = FinetuneModule(
        str(folder), tokenizer="byte", lora=lora, learning_rate=learning_rate, warmup_steps=1
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder.parent,
    )
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    trainer.save_checkpoint(folder.parent / "ft.ckpt")
    return module, folder.parent / "ft.ckpt"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_full_finetune_moves_every_weight(tmp_path, name):
    hf_folder(name, tmp_path / "hf")
    module, _ = fine_tune(tmp_path / "hf", lora=None, learning_rate=1e-4)
    start = open_pretrained(tmp_path / "hf").build()
    unmoved = [
        key for key, value in module.model.named_parameters() if torch.equal(value, start.get_parameter(key))
    ]
    assert not unmoved  # no weight decay: each one moved by its own gradient


def export_adapter(tmp_path: Path, name: str, lora: LoRAConfig) -> tuple[FinetuneModule, dict]:
    """A LoRA fine-tune of the family's folder, its adapters exported for the exported base (checked
    to have trained only the adapters): the module and the adapter_config.json written."""
    hf_folder(name, tmp_path / "hf")
    module, checkpoint = fine_tune(tmp_path / "hf", lora, learning_rate=3e-2)
    start = to_adapted_names(open_pretrained(tmp_path / "hf").build().state_dict(), module.model)
    trained = module.model.state_dict()
    assert start and all(torch.equal(trained[key], value) for key, value in start.items())  # base frozen
    assert all(".lora_" in key for key, p in module.model.named_parameters() if p.requires_grad)
    assert all(layer.lora_B["default"].weight.abs().sum() > 0 for _, layer in lora_layers(module.model))

    export(str(tmp_path / "hf"), str(tmp_path / "base-hf"))
    code, _, err = run_main(
        "export",
        "--checkpoint",
        str(checkpoint),
        "--output",
        str(tmp_path / "adapter"),
        "--format",
        "peft",
        "--base_model",
        str(tmp_path / "base-hf"),
    )
    assert code == 0, err
    return module, json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())


def assert_peft_gives_our_logits(tmp_path: Path, module: FinetuneModule, label: str) -> None:
    theirs = peft.PeftModel.from_pretrained(load_hf(tmp_path / "base-hf"), tmp_path / "adapter").eval()
    written = {
        key.removeprefix("base_model.model.").rpartition(".lora_")[0]
        for key in load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    }
    adapted = {name.removeprefix("base_model.model.") for name, _ in lora_layers(theirs)}
    assert adapted == written  # peft put an adapter on exactly the modules the file has weights for
    with torch.no_grad():
        ours, base = module.model.eval()(tokens()), open_pretrained(tmp_path / "hf").build()(tokens())
        peft_logits = theirs(tokens()).logits
    assert relative_difference(ours, base) > 0.01  # the adapters changed the model
    difference = relative_difference(peft_logits, ours)
    print(f"{label}: peft logits relative difference {difference:.1e}")
    assert difference <= 1e-5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lora_finetune_exports_adapters_peft_loads_with_our_logits(tmp_path, name):
    module, written = export_adapter(tmp_path, name, LORA)
    model_type = json.loads((tmp_path / "base-hf" / "config.json").read_text())["model_type"]
    targets, ranks = DEFAULT_TARGETS.get(model_type, LLAMA_TARGETS)
    assert (sorted(written["target_modules"]), written["rank_pattern"]) == (targets, ranks)
    assert written["alpha_pattern"] == {target: rank * 2.0 for target, rank in ranks.items()}  # alpha/r kept
    assert_peft_gives_our_logits(tmp_path, module, name)


@pytest.mark.parametrize(
    ("name", "ours", "targets", "ranks"),
    [
        # q and v joined on qkv_proj (k's rows of B zero), up alone on gate_up_proj (gate's rows zero)
        ("phi3", ["q", "v", "up", "lm_head"], ["gate_up_proj", "lm_head", "qkv_proj"], {"qkv_proj": 8}),
        ("phi3", ["qkv", "gate"], ["gate_up_proj", "qkv_proj"], {}),  # one fused qkv adapter: rank 4
        ("gpt-neox", ["qkv", "lm_head"], sorted([NEOX_HEAD, "query_key_value"]), {}),  # B's rows per head
        ("gpt-neox", ["k", "down"], ["dense_4h_to_h", "query_key_value"], {}),
    ],
    ids=["phi3-q-v-up-lm_head", "phi3-qkv-gate", "neox-qkv-lm_head", "neox-k-down"],
)
def test_adapters_on_part_of_a_fused_projection_export_exactly(tmp_path, name, ours, targets, ranks):
    module, written = export_adapter(tmp_path, name, LoRAConfig(rank=4, alpha=8.0, target_modules=ours))
    assert (sorted(written["target_modules"]), written["rank_pattern"]) == (targets, ranks)
    assert_peft_gives_our_logits(tmp_path, module, f"{name} {ours}")
