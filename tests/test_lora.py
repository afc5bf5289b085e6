"""LoRA with peft's semantics: q, k and v adapted each on its own, the trainable-parameter count of peft
on the same model in transformers, merging as W + scale * B @ A, adapters exported as a peft folder
that ``PeftModel.from_pretrained`` loads on the exported base with our logits; older fused-qkv
fine-tunes still load."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_train.checkpoint import export, open_pretrained, save_safetensors
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.hf import hf_config
from lightning_train.models.lora import LoRAConfig, apply_lora, lora_layers, merge_lora
from lightning_train.modules.finetune import FinetuneModule
from tests.conftest import run_main
from tests.helpers.tiny_runs import TINY, FixedBatches

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = GPTConfig(**TINY)
LLAMA_GQA = GPTConfig(**{**TINY, "n_head": 4}, n_kv_head=2, tie_embeddings=False)
GPT2 = GPTConfig(**TINY, norm="layernorm", position="learned", mlp="gelu", bias=True)
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED_DEFAULT = ["qkv", "proj", "gate", "up", "down"]  # what older versions adapted by default


def trained_like(config: GPTConfig) -> GPT:
    """A model whose weights are far from their initialisation."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def transformers_model(config: GPTConfig) -> torch.nn.Module:
    """The transformers model that ``export`` writes for ``config``, built locally from its config.json."""
    values = {k: v for k, v in hf_config(config).items() if k != "architectures"}
    hf = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    return transformers.AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize(
    ("config", "ours", "theirs"),
    [
        (LLAMA, None, LLAMA_LINEARS),  # the default: every linear layer of the blocks
        (LLAMA_GQA, ["q", "v", "down", "lm_head"], ["q_proj", "v_proj", "down_proj", "lm_head"]),
        (GPT2, ["qkv", "proj", "up", "down"], ["c_attn", "c_proj", "c_fc"]),  # GPT-2's fused c_attn
    ],
    ids=["llama-default", "llama-gqa-some", "gpt2-fused-qkv"],
)
def test_trainable_parameters_equal_peft_on_the_transformers_model(config, ours, theirs):
    model = apply_lora(GPT(config), LoRAConfig(rank=4, target_modules=ours))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hf = peft.get_peft_model(transformers_model(config), peft.LoraConfig(r=4, target_modules=theirs))
    assert trainable == hf.get_nb_trainable_parameters()[0]
    if ours is None:  # one joint adapter on the fused qkv: two rank x n_embd A matrices fewer a block
        fused = apply_lora(GPT(config), LoRAConfig(rank=4, target_modules=FUSED_DEFAULT))
        fewer = trainable - sum(p.numel() for p in fused.parameters() if p.requires_grad)
        assert fewer == config.n_layer * 2 * 4 * config.n_embd


def test_merged_weights_are_w_plus_scaled_b_a_per_projection():
    plain = trained_like(LLAMA_GQA)
    model = apply_lora(copy.deepcopy(plain), LoRAConfig(rank=2, alpha=6.0))  # scale 3
    with torch.no_grad():
        for _, layer in lora_layers(model):
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens)
    adapted = {name: layer for name, layer in lora_layers(model)}
    merged = merge_lora(copy.deepcopy(model))
    assert not lora_layers(merged) and list(merged.state_dict()) == list(plain.state_dict())
    q, kv = 4 * 8, 2 * 8  # n_head * head_dim, n_kv_head * head_dim
    for i in range(LLAMA_GQA.n_layer):
        rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        layers = {f"attn.qkv.{p}": ("attn.qkv", rows[p]) for p in rows}
        layers |= {name: (name, slice(None)) for name in ("attn.proj", "mlp.gate", "mlp.up", "mlp.down")}
        for adapter, (fused, part) in layers.items():
            layer = adapted[f"blocks.{i}.{adapter}"]
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            base = plain.get_parameter(f"blocks.{i}.{fused}.weight")[part]
            expected = base + 3.0 * b @ a
            torch.testing.assert_close(merged.get_parameter(f"blocks.{i}.{fused}.weight")[part], expected)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), before, atol=1e-5, rtol=0)


def quiet_trainer(tmp_path: Path, max_steps: int) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)


def fine_tune(tmp_path: Path, config: GPTConfig, lora: LoRAConfig) -> tuple[Path, Path, FinetuneModule]:
    """A LoRA fine-tune of 3 steps from a base model in our format: (base folder, checkpoint, module)."""
    base = save_safetensors(trained_like(config), tmp_path / "base")
    module = FinetuneModule(str(base), lora=lora, learning_rate=3e-2, warmup_steps=1)
    trainer = quiet_trainer(tmp_path, max_steps=3)
    trainer.fit(module, FixedBatches(seq_len=16))
    trainer.save_checkpoint(tmp_path / "ft.ckpt")
    return base, tmp_path / "ft.ckpt", module


ADAPTER_CASES = {  # our config and LoRA -> the peft target_modules (and rank_pattern) exported
    "llama-gqa-default": (
        LLAMA_GQA, LoRAConfig(rank=4, alpha=8.0, dropout=0.1), sorted(LLAMA_LINEARS), {},
    ),
    "llama-fused-qkv-lm_head": (
        dataclasses.replace(LLAMA, tie_embeddings=False),
        LoRAConfig(rank=2, alpha=2.0, target_modules=["qkv", "down", "lm_head"]),
        ["down_proj", "k_proj", "lm_head", "q_proj", "v_proj"], {},
    ),
    "gpt2-q-v-proj-up": (  # q and v side by side in one rank-4 adapter on c_attn; the MLP's c_proj not
        GPT2, LoRAConfig(rank=2, alpha=4.0, target_modules=["q", "v", "proj", "up"]),
        ["attn.c_proj", "c_attn", "c_fc"], {"c_attn": 4},
    ),
}


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_peft_loads_the_exported_adapter_on_the_exported_base_with_our_logits(tmp_path, case):
    config, lora, targets, ranks = ADAPTER_CASES[case]
    base, checkpoint, module = fine_tune(tmp_path, config, lora)
    export(str(base), str(tmp_path / "base-hf"))
    args = ["--checkpoint", str(checkpoint), "--output", str(tmp_path / "adapter"), "--format", "peft",
            "--base_model", str(tmp_path / "base-hf")]
    code, out, err = run_main("export", *args)
    assert code == 0, err
    assert out.strip() == f"wrote {tmp_path / 'adapter'}: adapter_config.json, adapter_model.safetensors"
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (written["peft_type"], written["r"], written["lora_alpha"]) == ("LORA", lora.rank, lora.alpha)
    assert written["lora_dropout"] == lora.dropout
    assert written["base_model_name_or_path"] == str(tmp_path / "base-hf")
    assert sorted(written["target_modules"]) == targets and written["rank_pattern"] == ranks

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours, without_adapter = module.model.eval()(tokens), open_pretrained(base).build()(tokens)
        peft_logits = theirs(tokens).logits
    assert (ours - without_adapter).abs().max() > 0.05  # the 3 steps moved B away from zero
    torch.testing.assert_close(peft_logits, ours, atol=1e-5, rtol=0)

    # the same checkpoint exported whole (merged, the default) gives the same logits too
    export(str(checkpoint), str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(tokens).logits, ours, atol=1e-5, rtol=0)

    (tmp_path / "adapter" / "README.md").write_text("adapter card")  # --overwrite replaces ours only
    code, _, err = run_main("export", *args[:-2], "--overwrite", "true")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]
    rewritten = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert rewritten["base_model_name_or_path"] is None


def test_a_fine_tune_with_one_adapter_on_the_fused_qkv_loads_as_it_was_trained(tmp_path):
    """A fine-tune with one adapter on the fused qkv: as a source (init_from, export, generate) the
    checkpoint loads exactly; resuming it into the default per-projection layout is refused with the
    setting that resumes it."""
    base, checkpoint, module = fine_tune(tmp_path, LLAMA, LoRAConfig(rank=2, target_modules=FUSED_DEFAULT))

    source = open_pretrained(checkpoint)
    assert source.lora.target_modules == FUSED_DEFAULT
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(source.build()(tokens), module.model.eval()(tokens), atol=1e-5, rtol=0)
    written = export(str(checkpoint), str(tmp_path / "adapter"), format="peft")
    assert [p.name for p in written] == ["adapter_config.json", "adapter_model.safetensors"]

    resumed = FinetuneModule(str(base), lora=LoRAConfig(rank=2), warmup_steps=1)
    with pytest.raises(UserInputError, match=(
        r"the checkpoint has LoRA adapters on \['qkv', 'proj', 'gate', 'up', 'down'\], this model on "
        r"\['q', 'k', 'v', 'proj', 'gate', 'up', 'down'\]; resume it with "
        r"model.lora.target_modules: \[qkv, proj, gate, up, down\]")):
        quiet_trainer(tmp_path, max_steps=4).fit(resumed, FixedBatches(seq_len=16), ckpt_path=checkpoint)
    resumed = FinetuneModule(str(base), lora=LoRAConfig(rank=2, target_modules=FUSED_DEFAULT), warmup_steps=1)
    trainer = quiet_trainer(tmp_path, max_steps=4)
    trainer.fit(resumed, FixedBatches(seq_len=16), ckpt_path=checkpoint)
    assert trainer.global_step == 4


def test_qkv_and_its_projections_are_one_or_the_other():
    with pytest.raises(UserInputError, match=r"both 'qkv' .* and \['k'\] \(an adapter each\)"):
        apply_lora(GPT(LLAMA), LoRAConfig(rank=2, target_modules=["qkv", "k"]))


def test_a_sharded_lora_checkpoint_exports_merged_and_as_adapters(tmp_path):
    """The folder a sharded fine-tune writes (here from one process, as the doctest of sharded.py does)."""
    from lightning_train.checkpoint.sharded import save_sharded_checkpoint

    lora = LoRAConfig(rank=2)
    model = apply_lora(trained_like(LLAMA), lora)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    hparams = {"config": dataclasses.asdict(LLAMA), "tokenizer": "byte", "lora": dataclasses.asdict(lora)}
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    checkpoint = {"state_dict": state, "hyper_parameters": hparams}
    save_sharded_checkpoint(checkpoint, tmp_path / "step=2", is_writer=True, barrier=lambda: None)
    export(str(save_safetensors(trained_like(LLAMA), tmp_path / "base")), str(tmp_path / "base-hf"))
    export(str(tmp_path / "step=2"), str(tmp_path / "adapter"), format="peft")
    export(str(tmp_path / "step=2"), str(tmp_path / "merged"))

    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        ours = model.eval()(tokens)
        torch.testing.assert_close(theirs(tokens).logits, ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged.eval()(tokens).logits, ours, atol=1e-5, rtol=0)
