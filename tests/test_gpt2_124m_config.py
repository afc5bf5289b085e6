"""configs/gpt2-124m.yaml: parses to the GPT-2 124M shape, and trains on CPU once shrunk."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from tests.conftest import REPO, run_cli

CONFIG = str(REPO / "configs" / "gpt2-124m.yaml")


def test_print_config_is_gpt2_small_in_bf16_compiled(tmp_path: Path) -> None:
    done = run_cli("fit", "--config", CONFIG, "--print_config", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("vocab_size: 50304", "block_size: 1024", "n_layer: 12", "n_head: 12", "n_embd: 768",
                 "precision: bf16-mixed", "compile: true", "num_nodes: 1", "seq_len: 1024"):
        assert line in done.stdout, line


def test_shrunk_two_step_run_on_cpu(tmp_path: Path) -> None:
    # A tiny model (byte-sized vocabulary) on the config's own data geometry (32 x 1024 tokens a batch,
    # default corpus), so the Trainer checks val_check_interval against the epoch length as on a GPU.
    # compile=false keeps this test quick; tests/test_compile.py covers compiling on CPU.
    done = run_cli(
        "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true",
        "--trainer.max_steps=2", "--trainer.log_every_n_steps=1", "--model.init_args.compile=false",
        "--model.init_args.config.vocab_size=320", "--model.init_args.config.n_layer=1",
        "--model.init_args.config.n_head=2", "--model.init_args.config.n_embd=32",
        "--data.init_args.num_workers=0",
        cwd=tmp_path, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert abs(losses[0] - math.log(320)) < 1.0  # untrained: about uniform over the vocabulary
