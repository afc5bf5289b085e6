"""Fine-tuning runs: exact match rises, the default config runs, a 2-rank sharded checkpoint loads on 1."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_train.checkpoint import save_safetensors
from lightning_train.data.sft import SFTDataModule
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules.finetune import FinetuneModule
from tests.conftest import REPO, run_cli
from tests.helpers.ft_runs import sharded_two_rank_checkpoint

PAIRS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow"}


def trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0) | kwargs
    return L.Trainer(**kwargs)


def test_short_finetune_raises_exact_match(tmp_path):
    torch.manual_seed(0)
    start = save_safetensors(GPT(GPTConfig(vocab_size=258, block_size=32, n_layer=2, n_head=2, n_embd=64)),
                             tmp_path / "start")
    rows = [{"prompt": f"color of {k}: ", "response": v} for k, v in PAIRS.items()]
    jsonl = tmp_path / "colors.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = SFTDataModule(str(jsonl), str(jsonl), seq_len=32, batch_size=6, eval_prompts=6)
    module = FinetuneModule(str(start), learning_rate=1e-2, min_lr=1e-3, warmup_steps=5)

    before = trainer(tmp_path).validate(module, data, verbose=False)[0]
    trainer(tmp_path, max_steps=80, limit_val_batches=0).fit(module, data)
    after = trainer(tmp_path).validate(module, data, verbose=False)[0]
    assert before["val/exact_match"] == 0.0
    assert after["val/exact_match"] > before["val/exact_match"] and after["val/exact_match"] >= 0.5
    assert after["val/token_accuracy"] > before["val/token_accuracy"]
    assert after["val/loss"] < before["val/loss"]


@pytest.mark.slow
def test_default_config_runs_and_logs_exact_match(tmp_path):
    """configs/finetune-tiny.yaml for a few steps, from a checkpoint made here (not the pretraining run)."""
    torch.manual_seed(0)
    start = save_safetensors(GPT(GPTConfig(vocab_size=258, block_size=64, n_layer=1, n_head=2, n_embd=32)),
                             tmp_path / "start")
    result = run_cli(
        "fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"), "--model.init_from", str(start),
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--model.lora.rank", "4", "--data.eval_prompts", "4", cwd=tmp_path, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = (tmp_path / "runs/finetune-tiny/version_0/metrics.csv").read_text().splitlines()
    assert "val/exact_match" in metrics[0] and "val/token_accuracy" in metrics[0]
    checkpoint = tmp_path / "runs/finetune-tiny/checkpoints/last.ckpt"
    generated = run_cli("generate", "--checkpoint", str(checkpoint), "--prompt", "get_name in CamelCase: ",
                        "--max_new_tokens", "4", cwd=tmp_path, timeout=120)
    assert generated.returncode == 0 and generated.stdout.startswith("get_name in CamelCase: ")


@pytest.mark.slow
def test_two_rank_sharded_checkpoint_loads_on_one_rank(tmp_path):
    from lightning_train.checkpoint import consolidate

    # every field the config file sets too (init_std): --model.config merges into the file's config
    config = {"vocab_size": 258, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "init_std": 0.02}
    folder = sharded_two_rank_checkpoint(tmp_path, config, max_steps=2)

    module = FinetuneModule(str(folder))
    assert module.config == GPTConfig(**config) and module.tokenizer_spec == "byte"
    module.configure_model()
    reference = FinetuneModule(str(consolidate(str(folder), str(tmp_path / "export")).parent))
    reference.configure_model()
    tokens = torch.arange(24).view(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(module.model(tokens), reference.model(tokens), atol=1e-4, rtol=0)


def test_progress_bar_counts_steps_across_epochs_and_shows_exact_match(tmp_path, capsys):
    """Fine-tuning runs several short epochs: one bar of optimizer steps for the whole run, with
    val/exact_match once validation has measured it."""
    import re

    from lightning_train.callbacks.progress import TokenProgressBar

    torch.manual_seed(0)
    start = save_safetensors(GPT(GPTConfig(vocab_size=258, block_size=32, n_layer=1, n_head=2, n_embd=32)),
                             tmp_path / "start")
    jsonl = tmp_path / "colors.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"color of {k}: ", "response": v}) + "\n"
                             for k, v in PAIRS.items()))
    data = SFTDataModule(str(jsonl), str(jsonl), seq_len=32, batch_size=2, eval_prompts=2)  # 3 steps an epoch
    L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
              default_root_dir=tmp_path, num_sanity_val_steps=0, max_steps=7, val_check_interval=3,
              check_val_every_n_epoch=None, limit_val_batches=1,
              callbacks=[TokenProgressBar()]).fit(FinetuneModule(str(start)), data)
    screens = [s for s in re.split(r"[\r\n]", capsys.readouterr().out) if s.startswith("Epoch ")]
    assert [re.search(r"\| (\d+/\d+) \[", s).group(1) for s in screens][-1] == "7/7"
    assert {re.search(r"\|\s*\d+/(\S+) \[", s).group(1) for s in screens} == {"7"}
    assert screens[-1].startswith("Epoch 2:") and "val/exact_match=" in screens[-1]
