"""FinetuneModule: loading our checkpoints and safetensors exactly, LoRA, freezing, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from lightning_train.checkpoint import consolidate, open_pretrained, save_safetensors
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.lora import LoRAConfig, lora_layers
from lightning_train.modules.finetune import FinetuneModule
from lightning_train.modules.pretrain import PretrainModule

CONFIG = dict(vocab_size=258, block_size=64, n_layer=2, n_head=2, n_embd=32)


class RandomTokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x[:-1], "labels": x[1:]}


def quiet_trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    kwargs = dict(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path) | kwargs
    return L.Trainer(**kwargs)


def make_checkpoint(tmp_path: Path, module: L.LightningModule | None = None) -> tuple[Path, torch.nn.Module]:
    """A real Lightning checkpoint after two optimizer steps; returns its path and the trained network."""
    module = module or PretrainModule(GPTConfig(**CONFIG), warmup_steps=1)
    trainer = quiet_trainer(tmp_path)
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=4))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    return path, module.model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(40).remainder(256).view(2, 20))


def loaded(init_from: str | Path, **kwargs) -> GPT:
    module = FinetuneModule(str(init_from), **kwargs)
    module.configure_model()
    return module.model.eval()


def test_our_checkpoint_loads_exactly(tmp_path):
    path, trained = make_checkpoint(tmp_path)
    module = FinetuneModule(str(path))
    assert module.config == trained.config and module.tokenizer_spec == "byte"
    module.configure_model()
    torch.testing.assert_close(logits(module.model.eval()), logits(trained), atol=1e-4, rtol=0)


def test_safetensors_export_loads_exactly(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG, n_kv_head=1, tie_embeddings=False)).eval()
    folder = save_safetensors(model, tmp_path / "export")
    assert json.loads((folder / "config.json").read_text())["n_kv_head"] == 1
    for source in (folder, folder / "model.safetensors"):
        torch.testing.assert_close(logits(loaded(source)), logits(model), atol=1e-4, rtol=0)
    # A safetensors file anywhere, its config given explicitly instead of a config.json beside it.
    lone = tmp_path / "lone"
    lone.mkdir()
    (folder / "model.safetensors").rename(lone / "weights.safetensors")
    module = FinetuneModule(str(lone / "weights.safetensors"), config=model.config)
    module.configure_model()
    torch.testing.assert_close(logits(module.model.eval()), logits(model), atol=1e-4, rtol=0)


def test_lora_trains_only_adapters_and_merge_keeps_outputs(tmp_path):
    path, _ = make_checkpoint(tmp_path)
    module = FinetuneModule(str(path), lora=LoRAConfig(rank=4, alpha=8, target_modules=["qkv", "up"]))
    module.configure_model()
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(lora_layers(module.model)) == 2 * CONFIG["n_layer"]
    batch = RandomTokens()[0]
    loss = module.compute_loss(module(batch["input_ids"][None]), batch["labels"][None])
    loss.backward()
    for name, param in module.model.named_parameters():
        assert (param.grad is not None) == (name in trainable), name
    grouped = [p for group in module.configure_param_groups() for p in group["params"]]
    assert len(grouped) == len(trainable)

    for _, layer in lora_layers(module.model):  # a trained adapter: B != 0
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    before = logits(module.model.eval())
    merged = module.merged_model()
    assert not lora_layers(merged) and lora_layers(module.model)  # the module keeps its adapters
    torch.testing.assert_close(logits(merged), before, atol=1e-4, rtol=0)
    exported = loaded(module.export(tmp_path / "merged"))
    torch.testing.assert_close(logits(exported), before, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("mlp", "expected"),
    [("swiglu", {"q", "k", "v", "proj", "gate", "up", "down"}),
     ("gelu", {"q", "k", "v", "proj", "up", "down"})],
)
def test_lora_default_targets_every_block_linear_the_model_has(mlp, expected):
    from lightning_train.models.lora import apply_lora

    model = apply_lora(GPT(GPTConfig(**CONFIG, mlp=mlp)), LoRAConfig(rank=2))
    assert {name.rsplit(".", 1)[-1] for name, _ in lora_layers(model)} == expected
    with pytest.raises(UserInputError, match="gate"):  # a GELU MLP has no gate to adapt
        apply_lora(GPT(GPTConfig(**CONFIG, mlp="gelu")), LoRAConfig(rank=2, target_modules=["gate"]))


def test_lora_checkpoint_is_a_source_with_adapters_merged(tmp_path):
    base, _ = make_checkpoint(tmp_path / "base")
    module = FinetuneModule(str(base), lora=LoRAConfig(rank=2), learning_rate=1e-2, warmup_steps=1)
    path, tuned = make_checkpoint(tmp_path / "tuned", module)
    assert any(layer.lora_B["default"].weight.abs().sum() > 0 for _, layer in lora_layers(tuned))
    source = open_pretrained(path)
    assert source.config == module.config
    torch.testing.assert_close(logits(source.build()), logits(tuned), atol=1e-4, rtol=0)

    # `consolidate` exports the merged model: plain GPT keys, loadable strictly, same outputs
    consolidate(str(path), str(tmp_path / "export"))
    exported = GPT(module.config)
    exported.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"))
    torch.testing.assert_close(logits(exported), logits(tuned), atol=1e-4, rtol=0)


def test_freezing_keeps_embeddings_and_first_blocks_fixed(tmp_path):
    path, _ = make_checkpoint(tmp_path / "base")
    module = FinetuneModule(str(path), freeze_embeddings=True, freeze_blocks=1, learning_rate=1e-2,
                            warmup_steps=1)
    module.configure_model()
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    quiet_trainer(tmp_path).fit(module, DataLoader(RandomTokens(), batch_size=4))
    after = module.model.state_dict()
    for key, value in before.items():
        frozen = key.startswith(("embed.", "lm_head.", "blocks.0."))  # lm_head is tied to embed
        assert torch.equal(after[key], value) == frozen, key


def test_finetune_defaults_are_gentler_than_pretraining():
    module = FinetuneModule(config=GPTConfig(**CONFIG))
    pretrain = PretrainModule(GPTConfig(**CONFIG))
    assert module.hparams.learning_rate < pretrain.hparams.learning_rate
    assert module.hparams.warmup_steps < pretrain.hparams.warmup_steps


def test_missing_source_is_one_clear_error(tmp_path):
    with pytest.raises(UserInputError, match=r"weights source .*nope\.ckpt.* does not exist"):
        FinetuneModule(str(tmp_path / "nope.ckpt"))


def test_pickle_checkpoint_refused_when_not_allowed(tmp_path):
    path, _ = make_checkpoint(tmp_path)
    with pytest.raises(UserInputError, match=r"pickle-format checkpoint and allow_pickle is false"):
        FinetuneModule(str(path), allow_pickle=False)


class Payload:  # stands for arbitrary code in a pickle
    pass


def test_pickle_with_objects_is_never_unpickled(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {}, "payload": Payload()}, path)
    with pytest.raises(UserInputError, match=r"holds Python objects beyond tensors \(.*Payload\)"):
        FinetuneModule(str(path))


def test_key_and_shape_mismatch_names_the_keys(tmp_path):
    model = GPT(GPTConfig(**CONFIG))
    folder = save_safetensors(model, tmp_path / "export")
    wrong = GPTConfig(**(CONFIG | {"n_embd": 64}))
    with pytest.raises(UserInputError, match=r"wrong shape: embed\.weight \(258, 32\) vs model \(258, 64\)"):
        loaded(folder / "model.safetensors", config=wrong)
    deeper = GPTConfig(**(CONFIG | {"n_layer": 3}))
    with pytest.raises(UserInputError, match=r"missing: blocks\.2\.attn_norm\.weight"):
        loaded(folder / "model.safetensors", config=deeper)


def test_meta_device_model_gets_its_weights_after_materialisation(tmp_path):
    """What a strategy that builds on the meta device does: configure_model under meta, materialise
    with each module's reset_parameters, then on_fit_start loads init_from (LoRA B back to zero)."""
    path, trained = make_checkpoint(tmp_path)
    module = FinetuneModule(str(path), lora=LoRAConfig(rank=2))
    with torch.device("meta"):
        module.configure_model()
    assert all(p.is_meta for p in module.model.parameters())
    module.model.to_empty(device="cpu")
    for submodule in module.model.modules():
        if hasattr(submodule, "reset_parameters"):
            submodule.reset_parameters()
    module.on_fit_start()
    assert all(layer.lora_B["default"].weight.abs().sum() == 0 for _, layer in lora_layers(module.model))
    torch.testing.assert_close(logits(module.model.eval()), logits(trained), atol=1e-4, rtol=0)


def test_token_accuracy_is_the_share_of_response_tokens_predicted_right(tmp_path):
    """Two batches of 27 and 12 response tokens (the prompt's labels are -100); in each, the labels of the
    first 9 response tokens are set to the model's own predictions, so 18 of 39 are right."""
    torch.manual_seed(0)
    module = FinetuneModule(config=GPTConfig(**CONFIG))
    module.configure_model()
    batches = []
    for prompt_length in (5, 20):
        example = RandomTokens()[prompt_length]
        input_ids, labels = example["input_ids"][None], example["labels"][None].clone()
        with torch.no_grad():
            predicted = module(input_ids).argmax(-1)
        labels[:, :prompt_length] = -100
        labels[:, prompt_length : prompt_length + 9] = predicted[:, prompt_length : prompt_length + 9]
        labels[:, prompt_length + 9 :] = (predicted[:, prompt_length + 9 :] + 1) % CONFIG["vocab_size"]
        batches.append({"input_ids": input_ids, "labels": labels})
    metrics = quiet_trainer(tmp_path).validate(module, DataLoader(batches, batch_size=None), verbose=False)[0]
    assert metrics["val/token_accuracy"] == pytest.approx(18 / 39, abs=1e-6)


def test_finetune_module_builds_its_model_like_pretrain_module(tmp_path):
    """The one shared build: FinetuneModule gets float8 (and TF32, compile) from PretrainModule's."""
    module = FinetuneModule(config=GPTConfig(**CONFIG), float8=True)
    with pytest.raises(UserInputError, match="float8 training needs a CUDA GPU.*this run is on 'cpu'"):
        quiet_trainer(tmp_path).fit(module, DataLoader(RandomTokens(), batch_size=4))


def test_checkpoint_hyperparameters_are_plain_data(tmp_path):
    """`fit --ckpt_path` reads a checkpoint's hyper-parameters with torch.load(weights_only=True) and no
    allow-list (LightningCLI does): FinetuneModule's resolved config and LoRA settings are plain dicts."""
    base, _ = make_checkpoint(tmp_path / "base")
    module = FinetuneModule(str(base), lora=LoRAConfig(rank=2), warmup_steps=1)
    path, _ = make_checkpoint(tmp_path / "tuned", module)
    hparams = torch.load(path, weights_only=True)["hyper_parameters"]
    assert hparams["config"] == {**CONFIG, **{k: v for k, v in hparams["config"].items() if k not in CONFIG}}
    assert hparams["lora"]["rank"] == 2 and hparams["tokenizer"] == "byte"
    assert FinetuneModule(str(path)).config == module.config  # still a complete source
