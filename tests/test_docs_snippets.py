"""Every ```python snippet of README.md and docs/*.md runs, as written, in its own subprocess and
temporary folder, so that none can rot (the CLI runs that set one up run in the test's process).
(```bash snippets are not run here; the CLI tests run the commands.)

Shortening: ``max_steps=<n>`` in a snippet is replaced by ``max_steps=$LIGHTNING_TRAIN_DOCS_MAX_STEPS``
(default 4) so that a 600-step example takes seconds; ``LIGHTNING_TRAIN_DOCS_MAX_STEPS=0`` runs every
snippet exactly as the docs show it. Nothing else in a snippet is changed.

What a snippet's surrounding text presumes (a run folder it reads, a ``model`` it loads into, the
snippet above it) is set up first by ``GIVEN`` below, in the same temporary folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli_in_process

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MAX_STEPS = int(os.environ.get("LIGHTNING_TRAIN_DOCS_MAX_STEPS", "4"))
TINY_GPT = "GPTConfig(vocab_size=258, block_size=128, n_layer=4, n_head=4, n_embd=128)"  # pretrain-tiny's


@dataclass
class Given:
    """What the docs around a snippet presume: a snippet that makes the CLI runs' inputs (run first, in a
    process of its own), CLI runs to make first, code to run before it, the number of devices it needs."""

    cli: list[list[str]] = field(default_factory=list)
    prelude: str = ""
    cuda_devices: int = 0
    inputs: str = ""


GIVEN: dict[str, Given] = {
    "README.md#2": Given(inputs="docs/finetune.md#3", cli=[  # the open-model section: a 2-step LoRA fine-tune
        ["fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"), "--run_name", "qwen",
         "--model.init_from", "qwen2-tiny", "--model.lora.rank", "8", "--data.init_args.train_file",
         "chats.jsonl", "--trainer.max_steps=2", "--trainer.limit_val_batches=0"],
        ["export", "--checkpoint", "runs/qwen/checkpoints/last.ckpt", "--output", "exports/qwen"],
    ]),
    "docs/finetune.md#2": Given(cli=[  # the adapters section: a 2-step LoRA fine-tune, its base and adapters
        ["fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.max_steps=2",
         "--trainer.limit_val_batches=0"],
        ["fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"), "--trainer.max_steps=2",
         "--trainer.limit_val_batches=0", "--model.lora.rank=8"],
        ["export", "--checkpoint", "runs/pretrain-tiny/checkpoints/last.ckpt", "--output", "exports/base"],
        ["export", "--checkpoint", "runs/finetune-tiny/checkpoints/last.ckpt", "--output", "exports/adapter",
         "--format", "peft", "--base_model", "exports/base"],
    ]),
    "docs/precision.md#2": Given(prelude="docs/precision.md#1"),
    "docs/strategies.md#1": Given(cuda_devices=8),  # its first line is a 2-node x 8-GPU Trainer
    "docs/strategies.md#2": Given(
        cli=[["fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.strategy=lt_fsdp",
              "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.default_root_dir=runs/x"]],
        prelude=f"from lightning_train import GPT, GPTConfig\nmodel = GPT({TINY_GPT})",
    ),
}


def python_snippets() -> dict[str, str]:
    """``{"<file>#<n>": code}`` for the n-th ```python block of each file (n from 1)."""
    snippets = {}
    for path in DOCS:
        blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)
        for number, code in enumerate(blocks, 1):
            snippets[f"{path.relative_to(REPO)}#{number}"] = code
    return snippets


SNIPPETS = python_snippets()


def shortened(code: str) -> str:
    return code if MAX_STEPS == 0 else re.sub(r"\bmax_steps=\d+", f"max_steps={MAX_STEPS}", code)


def test_every_snippet_is_found() -> None:
    """The collection itself: a renamed key in GIVEN or a lost ```python fence would hide a snippet."""
    assert set(GIVEN) <= set(SNIPPETS), set(GIVEN) - set(SNIPPETS)
    assert "README.md#2" in SNIPPETS and len(SNIPPETS) >= 10


@pytest.mark.parametrize("name", list(SNIPPETS))
def test_snippet_runs(name: str, tmp_path: Path) -> None:
    given = GIVEN.get(name, Given())
    if torch.cuda.device_count() < given.cuda_devices:
        pytest.skip(f"needs {given.cuda_devices} CUDA devices, this machine has {torch.cuda.device_count()}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    if given.inputs:
        (tmp_path / "inputs.py").write_text(SNIPPETS[given.inputs])
        made = subprocess.run([sys.executable, "inputs.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert made.returncode == 0, f"setting up {name}: {given.inputs}\n{made.stdout}{made.stderr}"
    for args in given.cli:  # in this process: what the snippet reads, not how a process starts
        setup = run_cli_in_process(*args, cwd=tmp_path)
        assert setup.returncode == 0, f"setting up {name}: {args}\n{setup.stdout}{setup.stderr}"
    prelude = SNIPPETS.get(given.prelude, given.prelude)
    script = tmp_path / "snippet.py"
    script.write_text(shortened(prelude + "\n" + SNIPPETS[name]))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    output = f"{name}:\n{script.read_text()}\n{result.stdout}{result.stderr}"
    assert result.returncode == 0, f"failed: {output}"
