"""Resuming through the CLI: a fine-tune continues exactly, every metric of a step keeps that step's
row, a sharded checkpoint needs its strategy, and resuming a run's own folder prints no false warning."""

from __future__ import annotations

import csv
import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_train._warnings import silence_resumed_checkpoint_dir
from tests.conftest import REPO, run_cli

CONFIGS = REPO / "configs"
NOT_EMPTY = "exists and is not empty"  # Lightning's ModelCheckpoint warning
QUIET = ("--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false")
SMALL = ("--model.config.n_layer=1", "--model.config.n_embd=32", "--data.batch_size=2", "--data.seq_len=32")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The starting checkpoint of configs/finetune-tiny.yaml, made as its comment says (2 steps of a
    smaller model)."""
    folder = tmp_path_factory.mktemp("pretrain")
    result = run_cli("fit", "--config", str(CONFIGS / "pretrain-tiny.yaml"), "--trainer.max_steps=2",
                     "--trainer.limit_val_batches=0", *SMALL, *QUIET, cwd=folder)
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
    assert NOT_EMPTY not in resumed.stderr  # its own checkpoints: no warning

    whole = torch.load(tmp_path / "runs/whole/checkpoints/last.ckpt", weights_only=True)
    halves = torch.load(last, weights_only=True)
    assert halves["global_step"] == whole["global_step"] == 6
    for name, weight in whole["state_dict"].items():
        assert torch.equal(halves["state_dict"][name], weight), name
    assert train_losses(tmp_path / "runs/halves") == train_losses(tmp_path / "runs/whole")
    assert sorted(train_losses(tmp_path / "runs/whole")) == [0, 1, 2, 3, 4, 5]


def pretrain(folder: Path, run_name: str, max_steps: int, *args: str):
    return run_cli(
        "fit", "--config", str(CONFIGS / "pretrain-tiny.yaml"), f"--run_name={run_name}",
        f"--trainer.max_steps={max_steps}", "--trainer.log_every_n_steps=2", "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=1", *SMALL, *QUIET, *args, cwd=folder,
    )


def steps_of_each_metric(run: Path) -> dict[str, list[int]]:
    """Metric name -> the steps it was logged at, over every launch of the run."""
    steps: dict[str, set[int]] = {}
    for metrics in sorted(run.glob("version_*/metrics.csv")):
        with metrics.open() as rows:
            for row in csv.DictReader(rows):
                for name, value in row.items():
                    if value and name not in ("step", "epoch"):
                        steps.setdefault(name, set()).add(int(row["step"]))
    return {name: sorted(found) for name, found in steps.items()}


def test_every_metric_keeps_its_step_across_a_resume(tmp_path: Path) -> None:
    """The resumed launch starts from the last.ckpt written when training ended after a validation
    (step 8 of 8), where Lightning's restart counted the last batch twice."""
    whole = pretrain(tmp_path, "whole", 12)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = pretrain(tmp_path, "halves", 8)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = pretrain(tmp_path, "halves", 12, "--resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert NOT_EMPTY not in resumed.stderr

    expected = steps_of_each_metric(tmp_path / "runs/whole")
    assert expected["train/loss"] == expected["health/grad_norm"] == [1, 3, 5, 7, 9, 11]
    assert expected["val/loss"] == [3, 7, 11]
    assert steps_of_each_metric(tmp_path / "runs/halves") == expected


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding runs/sharded, whose last.ckpt is the folder lt_fsdp writes (step 2), and
    runs/uninterrupted, the same run trained by lt_fsdp to step 4 in one go."""
    folder = tmp_path_factory.mktemp("sharded")
    for name, steps in (("sharded", 2), ("uninterrupted", 4)):
        result = pretrain(folder, name, steps, "--trainer.strategy=lt_fsdp")
        assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / "runs/sharded/checkpoints/last.ckpt").is_dir()
    return folder


@pytest.mark.parametrize("how", [("--resume=auto",), ("--ckpt_path={last}", "--weights_only=false")],
                         ids=["resume-auto", "ckpt-path-full-load"])
def test_a_sharded_checkpoint_resumes_with_the_default_strategy(
    sharded_run: Path, tmp_path: Path, how: tuple[str, ...]
) -> None:
    """The lt_fsdp folder of step 2, resumed without naming a strategy (one process reads it whole), trains
    on to step 4 as the uninterrupted lt_fsdp run did: the same losses after the resume."""
    shutil.copytree(sharded_run / "runs/sharded", tmp_path / "runs/sharded")  # this case's own run
    last = tmp_path / "runs/sharded/checkpoints/last.ckpt"
    resumed = pretrain(tmp_path, "sharded", 4, *(arg.format(last=last) for arg in how))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    after_resume, expected = (
        {step: float(loss) for step, loss in train_losses(run).items() if step >= 2}
        for run in (tmp_path / "runs/sharded", sharded_run / "runs/uninterrupted")
    )
    assert after_resume and after_resume == pytest.approx(expected, rel=1e-5), (after_resume, expected)


def test_the_not_empty_warning_stays_for_every_folder_but_the_resumed_one(tmp_path: Path) -> None:
    own, other = tmp_path / "own", tmp_path / "other"
    for folder in (own, other):
        folder.mkdir()
        (folder / "last.ckpt").write_bytes(b"a checkpoint")
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        silence_resumed_checkpoint_dir(str(own))
        warnings.filterwarnings("always", message="Checkpoint directory", append=True)
        for folder in (own, other):
            ModelCheckpoint(dirpath=folder).setup(trainer, L.LightningModule(), "fit")
    shown = [str(w.message) for w in caught if NOT_EMPTY in str(w.message)]
    assert shown == [f"Checkpoint directory {other} exists and is not empty."]


@pytest.mark.parametrize("how", ["--resume=auto", "--ckpt_path", "sharded"])
def test_a_resume_reads_each_manifest_once_and_hashes_each_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Picking the checkpoint (``--resume``, or Lightning's ``--ckpt_path`` check), the run folder's and
    the restart's checks and the strategy's load all ask about the checkpoint: each file of it is hashed
    once and each manifest read once in the process (counted per file version: the resumed run writes a
    new ``last.ckpt`` under the same name)."""
    import time

    from lightning_train.checkpoint import format as checkpoint_format
    from tests.conftest import run_cli_in_process

    strategy = ("--trainer.strategy=lt_fsdp",) if how == "sharded" else ()
    args = ("fit", "--config", str(CONFIGS / "pretrain-tiny.yaml"), "--trainer.limit_val_batches=0",
            "--run_name=counted", *SMALL, *QUIET, *strategy)
    first = run_cli_in_process(*args, "--trainer.max_steps=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    time.sleep(2.1)  # files changed within the last seconds are checked every time (format._identities)
    counts: dict[tuple[str, int], int] = {}

    def counting(function):
        def counted(path: Path, *rest):
            key = (str(path), Path(path).stat().st_ino)
            counts[key] = counts.get(key, 0) + 1
            return function(path, *rest)
        return counted

    monkeypatch.setattr(checkpoint_format, "sha256_file", counting(checkpoint_format.sha256_file))
    monkeypatch.setattr(checkpoint_format, "_load_manifest_file",
                        counting(checkpoint_format._load_manifest_file))
    last = tmp_path / "runs/counted/checkpoints/last.ckpt"
    resume = ("--resume=auto",) if how != "--ckpt_path" else (f"--ckpt_path={last}",)
    resumed = run_cli_in_process(*args, "--trainer.max_steps=4", *resume, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert any("last.ckpt" in path for path, _ in counts), counts  # the control: the counter sees them
    assert {key: count for key, count in counts.items() if count > 1} == {}
