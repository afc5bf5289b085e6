"""The tiny deterministic CLI run of the fault-tolerance and run-lifecycle tests (12 steps, checkpoints
every 3, validation every 4, dropout on, shuffled TextDataModule over conftest's ``data_dir``), launched
as a real process, with faults injected by ``ft_callbacks``, and the checks of an interrupted run
against an uninterrupted one (``final_state``, ``assert_same``, ``batches``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from tests.conftest import REPO, cli_env, run_cli

MAX_STEPS = 12


def write_config(folder: Path, data_dir: Path, devices: int = 1, callbacks: tuple[dict, ...] = (),
                 plugins: tuple[dict, ...] = (), n_embd: int = 16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "seed_everything": 1234,
        "trainer": {
            "default_root_dir": str(folder / "run"), "accelerator": "cpu", "devices": devices,
            "strategy": "ddp" if devices > 1 else "auto", "max_steps": MAX_STEPS, "val_check_interval": 4,
            "limit_val_batches": 3, "log_every_n_steps": 5, "gradient_clip_val": 0.05, "deterministic": True,
            "enable_progress_bar": False, "enable_model_summary": False,
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                    "every_n_train_steps": 3, "save_last": True, "monitor": "step", "mode": "max",
                    "save_top_k": 3}},
                # counts clipped steps over the whole run (one log interval): a state that must survive
                {"class_path": "lightning_train.callbacks.GradNormMonitor",
                 "init_args": {"log_every_n_steps": 100}},
                {"class_path": "tests.helpers.ft_callbacks.BatchLog",
                 "init_args": {"folder": str(folder / "log")}},
                *callbacks,
            ],
            "plugins": list(plugins) or None,
        },
        "model": {"class_path": "lightning_train.PretrainModule", "init_args": {
            "config": {"vocab_size": 258, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": n_embd,
                       "dropout": 0.1},
            "warmup_steps": 2, "learning_rate": 0.01}},
        "data": {"class_path": "lightning_train.TextDataModule",
                 "init_args": {"data_dir": str(data_dir), "seq_len": 16, "batch_size": 4}},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit(config: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m lightning_train fit --config CONFIG --resume auto ARGS`` in its own process group (so a
    fault can SIGKILL every rank of the launch at once); stderr is merged into ``stdout``."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_train", "fit", "--config", str(config), "--resume", "auto", *args],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        start_new_session=True,
    )


def fault(points: list[str], folder: Path, signal_name: str = "SIGKILL", rank: int | None = None,
          repeat: int = 1) -> dict:
    return {"class_path": "tests.helpers.ft_callbacks.Fault", "init_args": {
        "points": points, "marker_dir": str(folder / "markers"), "signal_name": signal_name, "rank": rank,
        "repeat": repeat}}


def final_state(folder: Path) -> dict[str, Any]:
    checkpoint = torch.load(folder / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == MAX_STEPS
    callbacks = {key.split("{")[0]: value for key, value in checkpoint["callbacks"].items()}
    assert callbacks["GradNormMonitor"] == {"clipped_steps": MAX_STEPS, "steps_in_interval": MAX_STEPS}
    return {
        "weights": checkpoint["state_dict"], "optimizer": checkpoint["optimizer_states"],
        "scheduler": checkpoint["lr_schedulers"], "rng": callbacks["RNGStateKeeper"],
        "grad_norm_monitor": callbacks["GradNormMonitor"],
    }


def sharded_two_rank_checkpoint(folder: Path, model: dict[str, int], max_steps: int) -> Path:
    """``last.ckpt`` of a real 2-rank lt_fsdp CLI fit of ``model`` (a GPTConfig dict) in ``folder``:
    a sharded (DCP) checkpoint folder."""
    result = run_cli(
        "fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.accelerator", "cpu",
        "--trainer.devices", "2", "--trainer.strategy", "lt_fsdp", "--trainer.max_steps", str(max_steps),
        "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
        "--model.config", json.dumps(model), "--data.seq_len", "32", "--data.batch_size", "2",
        cwd=folder, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = folder / "runs/pretrain-tiny/checkpoints/last.ckpt"
    assert checkpoint.is_dir() and (checkpoint / ".metadata").is_file()
    return checkpoint


def batches(folder: Path, rank: int = 0) -> dict[int, str]:
    """Step -> fingerprint of the batch trained on; a re-run step must have seen the same batch."""
    seen: dict[int, str] = {}
    for line in (folder / "log" / f"batches-rank{rank}.txt").read_text().splitlines():
        step, digest = line.split()
        assert seen.setdefault(int(step), digest) == digest, f"step {step} saw another batch after resume"
    return seen


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
