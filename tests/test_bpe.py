"""Byte-level BPE: `prepare --train_tokenizer bpe` trains it deterministically in the byte tokenizer's id
layout, the dataset folder keeps it, the model's vocabulary is the data's padded to 64, `generate` never
draws a padded id, `export` hands it to transformers, and configs/pretrain-small-bpe.yaml runs end to end."""

from __future__ import annotations

import csv
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_train import GPTConfig, PretrainModule, TextDataModule
from lightning_train.checkpoint import open_pretrained, save_safetensors
from lightning_train.cli.generate import generate
from lightning_train.data import ByteTokenizer, load_tokenizer, prepare, read_meta
from lightning_train.data.bpe import train_bpe
from lightning_train.data.sources import stdlib_sources
from lightning_train.errors import UserInputError
from lightning_train.models.generate import generate_batched
from lightning_train.models.gpt import GPT
from tests.conftest import REPO, cli_env, run_cli
from tests.conftest import run_main as cli

pytest.importorskip("tokenizers")

CONFIG = str(REPO / "configs" / "pretrain-small-bpe.yaml")
TEXT = [str(path) for path in stdlib_sources(max_bytes=150_000)]  # 12 files, enough for 512 tokens
TRICKY = ["naïve café ✓ 中文 🙂", "a <|endoftext|> and <|pad|> in a text", "  \t\n\r\n  x", "", "\x00\x7f"]


def small_bpe(tmp_path: Path, name: str = "data", vocab_size: int = 512, **kwargs) -> Path:
    return prepare(TEXT, tmp_path / name, train_tokenizer="bpe", vocab_size=vocab_size, num_workers=0,
                   **kwargs).output_dir


def test_training_twice_gives_the_same_tokenizer_and_shards(tmp_path):
    a = small_bpe(tmp_path, "a")
    b = prepare(TEXT, tmp_path / "b", train_tokenizer="bpe", vocab_size=512, num_workers=2).output_dir  # pool
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    for shard in read_meta(a)["shards"]:
        assert (a / shard["file"]).read_bytes() == (b / shard["file"]).read_bytes(), shard["file"]
    # The trainer's threads do not change the merges: the same on one thread (tokenizers' serial path).
    script = (f"from lightning_train.data.bpe import train_bpe\n"
              f"train_bpe([open(p).read() for p in {TEXT!r}], 512, {str(tmp_path / 'serial.json')!r})")
    serial = subprocess.run([sys.executable, "-c", script], env=cli_env(TOKENIZERS_PARALLELISM="false"),
                            capture_output=True, text=True, timeout=120)
    assert serial.returncode == 0, serial.stderr
    parallel = train_bpe([Path(path).read_text() for path in TEXT], 512, tmp_path / "parallel.json")
    assert parallel.read_bytes() == (tmp_path / "serial.json").read_bytes()


def test_bpe_has_the_byte_layout_and_round_trips_text(tmp_path):
    folder = small_bpe(tmp_path)
    meta, tok = read_meta(folder), TextDataModule(str(folder)).tokenizer
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"], meta["pad_id"]) == (
        "tokenizer.json", 512, 256, 257)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (512, 256, 257)
    byte = ByteTokenizer()
    assert all(tok.encode(chr(b)) == byte.encode(chr(b)) for b in range(128))  # single bytes: the same ids
    assert tok.decode([256, 257]) == "<|endoftext|><|pad|>"
    code = Path(TEXT[6]).read_text(encoding="utf-8")
    rng = random.Random(0)
    samples = [*TRICKY, code, *("".join(chr(rng.randrange(1, 0x3000)) for _ in range(40)) for _ in range(50))]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and 256 not in ids and 257 not in ids, text  # special names: text
    assert len(tok.encode(code)) < len(code.encode()) / 2  # it compresses what it was trained on
    tokens = np.fromfile(folder / "train_00000.bin", dtype=meta["dtype"]).tolist()
    assert tok.decode(tokens[: tokens.index(256)]) == Path(TEXT[0]).read_text(encoding="utf-8")


def test_a_moved_dataset_uses_its_own_tokenizer_without_training_again(tmp_path):
    folder = small_bpe(tmp_path)
    trained = (folder / "tokenizer.json").read_bytes()
    moved = tmp_path / "elsewhere" / "data"
    shutil.move(folder, moved)
    data = TextDataModule(str(moved), seq_len=16)
    assert data.tokenizer.name == str((moved / "tokenizer.json").resolve()) and data.vocab_size == 512
    assert (moved / "tokenizer.json").read_bytes() == trained
    assert data.tokenizer.encode("def f(self):") == load_tokenizer(str(moved)).encode("def f(self):")


def fit_one_step(config: GPTConfig, data_dir: Path) -> PretrainModule:
    module = PretrainModule(config, warmup_steps=1)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, TextDataModule(str(data_dir), seq_len=16, batch_size=2))
    return module


def test_the_model_takes_the_data_vocabulary_padded_to_64_or_refuses_a_smaller_one(tmp_path, dataset):
    shape = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}
    bpe = small_bpe(tmp_path, vocab_size=300)
    assert fit_one_step(GPTConfig(**shape), bpe).config.vocab_size == 320
    assert fit_one_step(GPTConfig(**shape), dataset).config.vocab_size == 320  # the byte tokenizer's 258
    assert fit_one_step(GPTConfig(**shape, vocab_size=300), bpe).model.lm_head.out_features == 300
    with pytest.raises(UserInputError) as refused:
        fit_one_step(GPTConfig(**shape, vocab_size=299), bpe)
    message = str(refused.value)
    assert "vocab_size=299" in message and "(300 tokens)" in message and "null" in message


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    (tmp_path / "doc.txt").write_text("def f(x):\n    return x\n" * 100)
    return prepare([str(tmp_path / "doc.txt")], tmp_path / "bytes", num_workers=0).output_dir


def padded_byte_model() -> GPT:
    """A 320-token model whose padded rows (258..319) win every logit, and whose eos never does: the
    blocks add nothing, every token embeds as ones, so the final hidden state is ones."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=16, tie_embeddings=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_()
            block.mlp.down.weight.zero_()
        model.embed.weight.fill_(1.0)
        model.lm_head.weight[258:] = 10.0
        model.lm_head.weight[256] = -10.0
    return model


def test_generate_never_draws_a_padded_id(tmp_path):
    model = padded_byte_model()
    prompt = torch.tensor([[100, 101, 102]])
    assert model.generate(prompt, 8, temperature=0.0)[0, 3:].min() >= 258  # unmasked: padded ids win
    torch.manual_seed(0)
    for temperature in (0.0, 1.0, 5.0):
        out = model.generate(prompt, 8, temperature=temperature, tokenizer_vocab_size=258)[0, 3:]
        assert out.max() < 258 and len(out) == 8, temperature
    save_safetensors(model, tmp_path / "model")
    (completion,) = generate(str(tmp_path / "model"), "ab", 8, temperature=2.0, tokenizer="byte")
    assert len(completion.encode()) >= 2 + 8  # each new token a byte or <|pad|>; a padded id decodes to ""


def test_prepare_bpe_then_fit_the_config_then_generate_and_export(tmp_path, monkeypatch):
    """The commands at the top of configs/pretrain-small-bpe.yaml on a small input with a tiny model."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("prepare", "--inputs", f"[{', '.join(TEXT)}]", "--output_dir", "data/stdlib-bpe",
                         "--train_tokenizer", "bpe", "--vocab_size", "512", "--num_workers", "0")
    assert code == 0, err
    assert "bpe tokenizer trained on the inputs, vocab_size 512" in out and "pretrain-small-bpe.yaml" in out
    fit = run_cli(
        "fit", "--config", CONFIG, "--trainer.accelerator=cpu", "--trainer.max_steps=20",
        "--trainer.val_check_interval=10", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1",
        "--trainer.default_root_dir=run", "--model.init_args.config.block_size=32",
        "--model.init_args.config.n_layer=1", "--model.init_args.config.n_head=2",
        "--model.init_args.config.n_embd=32", "--model.init_args.warmup_steps=2",
        "--model.init_args.learning_rate=1e-2", "--model.init_args.min_lr=1e-3",
        "--data.init_args.seq_len=32", "--data.init_args.batch_size=4",
        cwd=tmp_path, timeout=300,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert len(losses) == 20 and abs(losses[0] - math.log(512)) < 0.5 and losses[-1] < losses[0] - 0.3
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    pretrained = open_pretrained(checkpoint)
    assert pretrained.config.vocab_size == 512
    assert pretrained.tokenizer == str(tmp_path / "data" / "stdlib-bpe" / "tokenizer.json")

    code, out, err = cli("generate", f"--checkpoint={checkpoint}", "--prompt", "def ", "--max_new_tokens=8")
    tok = load_tokenizer(pretrained.tokenizer)
    model, prompt = pretrained.build(), tok.encode("def ")
    (ids,) = generate_batched(model, [prompt], 8, tok.eos_id, tokenizer_vocab_size=tok.vocab_size)
    assert code == 0 and out == "def " + tok.decode(ids) + "\n" and len(ids) > 0, err  # decoded with the BPE

    transformers = pytest.importorskip("transformers")
    code, _, err = cli("export", "--checkpoint", str(checkpoint), "--output", "exports/bpe")
    assert code == 0, err
    exported = tmp_path / "exports" / "bpe"
    assert (exported / "tokenizer.json").read_bytes() == Path(pretrained.tokenizer).read_bytes()
    auto, ours = transformers.AutoTokenizer.from_pretrained(exported), load_tokenizer(str(exported))
    assert (len(auto), auto.eos_token_id, auto.pad_token_id) == (512, 256, 257)
    for text in [*TRICKY, Path(TEXT[3]).read_text(encoding="utf-8")]:
        ids = auto(text)["input_ids"]
        assert ids == ours.encode(text), text
        assert auto.decode(ids + [256]) == ours.decode(ids + [256]) == text + "<|endoftext|>", text
