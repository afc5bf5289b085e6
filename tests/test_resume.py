"""Resuming through the CLI: a fine-tune continues exactly, every metric of a step keeps that step's
row, a sharded checkpoint needs its strategy, and resuming a run's own folder prints no false warning."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli

CONFIGS = REPO / "configs"
QUIET = ("--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The starting checkpoint of configs/finetune-tiny.yaml, made as its comment says (2 steps)."""
    folder = tmp_path_factory.mktemp("pretrain")
    result = run_cli("fit", "--config", str(CONFIGS / "pretrain-tiny.yaml"), "--trainer.max_steps=2",
                     "--trainer.limit_val_batches=0", *QUIET, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "runs/pretrain-tiny/checkpoints/last.ckpt"


def finetune(folder: Path, start: Path, run_name: str, max_steps: int, *args: str):
    # decay_steps fixed: the schedule of a launch stopped at step 3 is that of the whole 6-step run
    return run_cli(
        "fit", "--config", str(CONFIGS / "finetune-tiny.yaml"), f"--model.init_from={start}",
        f"--run_name={run_name}", f"--trainer.max_steps={max_steps}", "--model.decay_steps=6",
        "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1", "--data.eval_prompts=2",
        "--trainer.log_every_n_steps=1", *QUIET, *args, cwd=folder,
    )


def train_losses(run: Path) -> dict[int, str]:
    losses = {}
    for metrics in sorted(run.glob("version_*/metrics.csv")):
        with metrics.open() as rows:
            losses |= {int(r["step"]): r["train/loss"] for r in csv.DictReader(rows) if r.get("train/loss")}
    return losses


def test_a_finetune_resumed_with_ckpt_path_continues_exactly(tmp_path: Path, pretrained: Path) -> None:
    reference = finetune(tmp_path, pretrained, "whole", 6)
    assert reference.returncode == 0, reference.stderr[-3000:]
    first = finetune(tmp_path, pretrained, "halves", 3)
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "runs/halves/checkpoints/last.ckpt"
    resumed = finetune(tmp_path, pretrained, "halves", 6, f"--ckpt_path={last}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    whole = torch.load(tmp_path / "runs/whole/checkpoints/last.ckpt", weights_only=True)
    halves = torch.load(last, weights_only=True)
    assert halves["global_step"] == whole["global_step"] == 6
    for name, weight in whole["state_dict"].items():
        assert torch.equal(halves["state_dict"][name], weight), name
    assert train_losses(tmp_path / "runs/halves") == train_losses(tmp_path / "runs/whole")
    assert sorted(train_losses(tmp_path / "runs/whole")) == [0, 1, 2, 3, 4, 5]
