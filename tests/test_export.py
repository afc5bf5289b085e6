"""``export``: checkpoints of this package as Hugging Face folders that transformers loads with no custom
code (same logits, same greedy generations, same tokenization), and back again without a bit lost."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_train import FinetuneModule
from lightning_train.checkpoint import export, open_pretrained
from lightning_train.data.bpe import train_bpe
from lightning_train.data.sources import stdlib_sources
from lightning_train.data.tokenizers import ByteTokenizer, HFTokenizer
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.lora import LoRAConfig, apply_lora, lora_layers
from tests.conftest import run_cli, run_main
from tests.helpers.ft_runs import sharded_two_rank_checkpoint

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 258, "block_size": 32, "n_layer": 2, "n_embd": 32}
LLAMA_MHA = GPTConfig(**SMALL, n_head=4, rope_theta=5000.0, norm_eps=1e-6)
LLAMA_GQA = GPTConfig(**SMALL, n_head=4, n_kv_head=2, intermediate_size=48)
GPT2_BLOCK = dict(norm="layernorm", position="learned", mlp="gelu", bias=True)
EXPORTED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"]
MODELS = {
    "llama-mha-tied": LLAMA_MHA,
    "llama-mha-untied": dataclasses.replace(LLAMA_MHA, tie_embeddings=False),
    "llama-gqa-tied": LLAMA_GQA,
    "llama-gqa-untied-bias": dataclasses.replace(LLAMA_GQA, tie_embeddings=False, bias=True),
    "gpt2-tied": GPTConfig(**SMALL, n_head=2, **GPT2_BLOCK),
    "gpt2-untied": GPTConfig(**SMALL, n_head=2, tie_embeddings=False, dropout=0.1, **GPT2_BLOCK),
}


def trained_like(config: GPTConfig, seed: int = 0) -> GPT:
    """A model whose weights are far from their initialisation (norm gains, biases and all)."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def save_ckpt(model: torch.nn.Module, path: Path, config: GPTConfig, **hparams) -> Path:
    """The checkpoint file a PretrainModule/FinetuneModule writes (its network under ``model.``)."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    hyper_parameters = {"config": config, "tokenizer": "byte", **hparams}
    torch.save({"state_dict": state, "hyper_parameters": hyper_parameters}, path)
    return path


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_same_model(ours: torch.nn.Module, folder: Path) -> None:
    """transformers' model of ``folder``: logits to 1e-5 in fp32, greedy generations token for token."""
    theirs = hf_model(folder)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=1e-5, rtol=0)
        prompt = tokens[:1, :6]
        expected = ours.generate(prompt, max_new_tokens=16, temperature=0, eos_id=ByteTokenizer.eos_id)
        generated = theirs.generate(prompt, max_new_tokens=16, do_sample=False)
    assert generated.tolist() == expected.tolist()


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_in_transformers_with_our_logits_and_generations(tmp_path, name):
    config = MODELS[name]
    model = trained_like(config)
    written = export(str(save_ckpt(model, tmp_path / "m.ckpt", config)), str(tmp_path / "hf"))
    assert [p.name for p in written] == EXPORTED
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    llama = config.position == "rope"
    assert hf["architectures"] == ["LlamaForCausalLM" if llama else "GPT2LMHeadModel"]
    assert hf["tie_word_embeddings"] == config.tie_embeddings and hf["eos_token_id"] == 256
    if llama:
        assert (hf["num_key_value_heads"], hf["rope_theta"], hf["rms_norm_eps"], hf["intermediate_size"]) == (
            config.n_kv_head, config.rope_theta, config.norm_eps, config.intermediate_size)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["pad_token_id"] == 257
    assert_same_model(model, tmp_path / "hf")
    assert open_pretrained(tmp_path / "hf").config == config  # and it reads back as what it was


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_hf_to_ours_to_hf_is_bitwise_lossless(tmp_path, architecture):
    torch.manual_seed(0)
    if architecture == "llama":
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )
        original = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        original = transformers.GPT2LMHeadModel(config)
    original.save_pretrained(tmp_path / "original")
    export(str(tmp_path / "original"), str(tmp_path / "again"))
    before = load_file(tmp_path / "original" / "model.safetensors")
    after = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


def test_weights_above_the_shard_size_are_sharded_with_an_index(tmp_path):
    model = trained_like(LLAMA_GQA)
    checkpoint = save_ckpt(model, tmp_path / "m.ckpt", LLAMA_GQA)
    written = export(str(checkpoint), str(tmp_path / "hf"), max_shard_size="20KB")
    shards = sorted(p.name for p in written if p.name.startswith("model-"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    contents = [load_file(tmp_path / "hf" / shard) for shard in shards]
    sizes = [sum(t.numel() * t.element_size() for t in shard.values()) for shard in contents]
    assert index["metadata"]["total_size"] == sum(sizes)
    # each shard stays under the limit, or holds one tensor larger than it (the 33 KB embedding)
    assert all(size <= 20_000 or len(shard) == 1 for size, shard in zip(sizes, contents, strict=True))
    assert_same_model(model, tmp_path / "hf")
    assert_same_model(open_pretrained(tmp_path / "hf").build(), tmp_path / "hf")  # ours reads the shards too


def test_lora_fine_tune_is_exported_merged(tmp_path):
    lora = LoRAConfig(rank=2, alpha=4.0)
    model = apply_lora(trained_like(LLAMA_GQA), lora)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)  # B = 0 would be no fine-tune
    checkpoint = save_ckpt(model, tmp_path / "ft.ckpt", LLAMA_GQA, lora=dataclasses.asdict(lora))
    export(str(checkpoint), str(tmp_path / "hf"))
    assert not any("lora" in key for key in load_file(tmp_path / "hf" / "model.safetensors"))
    assert_same_model(model, tmp_path / "hf")


def test_fine_tune_starts_from_an_export_as_from_its_checkpoint(tmp_path):
    model = trained_like(LLAMA_GQA)
    checkpoint = save_ckpt(model, tmp_path / "m.ckpt", LLAMA_GQA)
    export(str(checkpoint), str(tmp_path / "hf"))
    from_checkpoint, from_export = FinetuneModule(str(checkpoint)), FinetuneModule(str(tmp_path / "hf"))
    assert (from_export.config, from_export.tokenizer_spec) == (from_checkpoint.config, "byte")
    from_checkpoint.configure_model(), from_export.configure_model()
    expected, actual = from_checkpoint.model.state_dict(), from_export.model.state_dict()
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def byte_tokenizers(tmp_path: Path) -> tuple[ByteTokenizer, object, HFTokenizer]:
    model = trained_like(GPTConfig(**{**SMALL, "n_layer": 1}, n_head=2))
    export(str(save_ckpt(model, tmp_path / "m.ckpt", model.config)), str(tmp_path / "hf"))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    return ByteTokenizer(), auto, HFTokenizer(tmp_path / "hf" / "tokenizer.json")


def test_byte_tokenizer_round_trips_random_bytes_exactly_as_ours(tmp_path):
    ours, auto, raw = byte_tokenizers(tmp_path)
    assert (auto.eos_token_id, auto.pad_token_id, len(auto)) == (256, 257, 258)
    rng = random.Random(0)
    for _ in range(200):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        text = data.decode("utf-8", errors="replace")  # every byte string, valid UTF-8 or not
        ids = list(data)
        ids[rng.randrange(len(ids)):rng.randrange(len(ids) + 1)] = [256, 257][: rng.randrange(3)]
        assert auto.decode(ids) == raw.decode(ids) == ours.decode(ids), ids
        assert auto(text)["input_ids"] == raw.encode(text) == ours.encode(text), text
    text = "a document<|endoftext|> is text here; <|pad|> too"  # as ours: only prepare inserts the token
    assert auto(text)["input_ids"] == ours.encode(text) == list(text.encode())


def test_byte_tokenizer_round_trips_the_default_corpus(tmp_path):
    ours, auto, _ = byte_tokenizers(tmp_path)
    for path in stdlib_sources()[::40]:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = auto(text)["input_ids"]
        assert ids == ours.encode(text), path
        assert auto.decode(ids + [256]) == ours.decode(ids + [256]) == text + "<|endoftext|>", path


def test_an_hf_tokenizer_is_copied(tmp_path):
    ours, _, _ = byte_tokenizers(tmp_path)  # its tokenizer.json stands in for any HF tokenizer
    source = tmp_path / "tok"
    source.mkdir()
    (source / "tokenizer.json").write_bytes((tmp_path / "hf" / "tokenizer.json").read_bytes())
    model = trained_like(GPTConfig(**{**SMALL, "n_layer": 1}, n_head=2))
    checkpoint = save_ckpt(model, tmp_path / "t.ckpt", model.config, tokenizer=str(source / "tokenizer.json"))
    export(str(checkpoint), str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert (auto.eos_token_id, auto.pad_token_id) == (256, 257)
    assert auto("héllo")["input_ids"] == ours.encode("héllo")


def test_consolidate_is_export_format_safetensors(tmp_path):
    config = MODELS["llama-gqa-tied"]
    checkpoint = str(save_ckpt(trained_like(config), tmp_path / "m.ckpt", config))
    for args in (["consolidate"], ["export", "--format", "safetensors"]):
        code, _, err = run_main(*args, "--checkpoint", checkpoint, "--output", str(tmp_path / args[0]))
        assert code == 0, err
    written = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == written
    for name in written:
        assert (tmp_path / "export" / name).read_bytes() == (tmp_path / "consolidate" / name).read_bytes()


def test_safetensors_export_writes_the_runs_tokenizer(tmp_path):
    """A run trained with a BPE tokenizer exports with it beside the weights: transformers loads the
    folder's tokenizer and encodes as ours, and the folder reads back with that tokenizer."""
    text = " ".join(path.read_text(encoding="utf-8") for path in stdlib_sources()[:3])
    tokenizer_json = train_bpe([text], 320, tmp_path / "tokenizer.json")
    model = trained_like(GPTConfig(**{**SMALL, "vocab_size": 320, "n_layer": 1}, n_head=2))
    checkpoint = save_ckpt(model, tmp_path / "t.ckpt", model.config, tokenizer=str(tokenizer_json))
    code, _, err = run_main("export", "--format", "safetensors", "--checkpoint", str(checkpoint),
                            "--output", str(tmp_path / "export"))
    assert code == 0, err
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = HFTokenizer(tokenizer_json)
    sample = "def héllo(world):\n    return world + 1  # <|endoftext|>\n"
    assert auto(sample)["input_ids"] == ours.encode(sample)
    assert (auto.eos_token_id, auto.pad_token_id) == (ours.eos_id, ours.pad_id)
    assert open_pretrained(tmp_path / "export").tokenizer == str(tmp_path / "export" / "tokenizer.json")


def refusal_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    rmsnorm_learned = GPTConfig(**SMALL, n_head=2, position="learned")
    gpt2_gqa = GPTConfig(**SMALL, n_head=4, n_kv_head=2, **GPT2_BLOCK)
    good = str(save_ckpt(trained_like(LLAMA_MHA), tmp_path / "good.ckpt", LLAMA_MHA))
    lora = LoRAConfig(rank=2)
    tuned = apply_lora(trained_like(LLAMA_MHA), lora)
    tuned = str(save_ckpt(tuned, tmp_path / "lora.ckpt", LLAMA_MHA, lora=dataclasses.asdict(lora)))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    return {
        "no HF architecture": (
            [str(save_ckpt(trained_like(rmsnorm_learned), tmp_path / "a.ckpt", rmsnorm_learned))],
            "norm='rmsnorm', position='learned', mlp='swiglu', bias=False maps onto neither LlamaForCausalLM",
        ),
        "GPT-2 block with GQA": (
            [str(save_ckpt(trained_like(gpt2_gqa), tmp_path / "b.ckpt", gpt2_gqa))],
            "n_kv_head=2 != n_head=4 (grouped-query attention) does not map onto GPT2LMHeadModel",
        ),
        "non-empty output": ([good, "--output", str(tmp_path / "full")], "already exists and is not empty"),
        "adapters into a non-empty output": (
            [tuned, "--format", "peft", "--output", str(tmp_path / "full")],
            "already exists and is not empty",
        ),
        "adapters of a model without LoRA": (
            [good, "--format", "peft"],
            f"--format peft: checkpoint {good} holds no LoRA adapters (it is not a fine-tune with "
            "model.lora); export the whole model with --format hf",
        ),
        "base model of a whole-model export": (
            [tuned, "--base_model", "exports/base"], "--base_model is recorded in peft adapters only",
        ),
        "missing checkpoint": ([str(tmp_path / "nope.ckpt")], "does not exist"),
        "output is the checkpoint": (
            [str(tmp_path / "full"), "--output", str(tmp_path / "full"), "--overwrite", "true"],
            "is the checkpoint being exported",
        ),
        "bad shard size": ([good, "--max_shard_size", "lots"], "--max_shard_size 'lots' is not a size"),
    }


def test_every_refusal_is_one_error_line_and_exit_2(tmp_path):
    for case, (args, message) in refusal_cases(tmp_path).items():
        output = [] if "--output" in args else ["--output", str(tmp_path / "out")]
        code, _, err = run_main("export", "--checkpoint", *args, *output)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (case, err[-2000:])
        assert lines[0].startswith("error: ") and message in lines[0], (case, lines)
        assert not (tmp_path / "out").exists(), case  # nothing written
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["notes.txt"]
    good = str(tmp_path / "good.ckpt")
    args = ["--checkpoint", good, "--output", str(tmp_path / "o"), "--format", "onnx"]
    code, _, err = run_main("export", *args)
    assert code == 2 and err.startswith("error: ") and "onnx" in err.splitlines()[0]


def test_overwrite_replaces_an_earlier_export_and_nothing_else(tmp_path):
    model = trained_like(LLAMA_GQA)
    checkpoint = str(save_ckpt(model, tmp_path / "m.ckpt", LLAMA_GQA))
    export(checkpoint, str(tmp_path / "hf"), max_shard_size="20KB")
    (tmp_path / "hf" / "README.md").write_text("model card")
    args = ["--checkpoint", checkpoint, "--output", str(tmp_path / "hf"), "--overwrite", "true"]
    result = run_cli("export", *args, cwd=tmp_path)  # a real process: what a user sees
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'hf'}: {', '.join(EXPORTED)}"
    # the stale shards and index are gone (transformers would read the index), the model card stays
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["README.md", *EXPORTED]
    assert_same_model(model, tmp_path / "hf")


def test_two_rank_sharded_checkpoint_exports(tmp_path):
    config = {"vocab_size": 258, "block_size": 32, "n_layer": 2, "n_head": 2, "n_kv_head": 1, "n_embd": 32}
    folder = sharded_two_rank_checkpoint(tmp_path, config, max_steps=3)
    exported = run_cli("export", "--checkpoint", str(folder), "--output", str(tmp_path / "hf"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert_same_model(open_pretrained(folder).build(), tmp_path / "hf")
