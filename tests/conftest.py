"""Shared fixtures: a tiny model config, and running the CLI as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_train.models.gpt import GPTConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_config() -> GPTConfig:
    return GPTConfig(vocab_size=258, block_size=32, n_layer=2, n_head=2, n_embd=32)


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: this checkout importable, one thread a process, W&B offline with
    a W&B service of its own, and one shared cache for the default corpus."""
    env = dict(os.environ)
    env.pop("WANDB_SERVICE", None)  # exported by an in-process wandb.init; a subprocess starts its own
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        LIGHTNING_TRAIN_CACHE=os.environ.get(
            "LIGHTNING_TRAIN_CACHE", str(REPO / ".pytest_cache" / "lt-cache")
        ),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m lightning_train ARGS`` in ``cwd``; the finished process (never raises on exit code)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_train", *args],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
