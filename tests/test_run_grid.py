"""The CLI's yardstick on a user's own data: ``--time_to_quality.target``, and validation and checkpoints on
the optimizer-step grid whatever the epoch length."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli_in_process

# conftest's data_dir: 16 batches of 4 an epoch, so 8 optimizer steps with global_batch_size=8.
TINY = [
    "--model", "PretrainModule", "--data", "TextDataModule",
    "--model.config", '{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}',
    "--data.seq_len", "16", "--data.batch_size", "4",
    "--trainer.accelerator", "cpu", "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]


def fit(tmp_path: Path, data_dir: Path, *args: str) -> Path:
    root = tmp_path / "run"
    result = run_cli_in_process("fit", *TINY, "--data.data_dir", str(data_dir),
                                f"--trainer.default_root_dir={root}", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_validation_and_its_checkpoints_fall_on_the_step_grid_across_epochs(tmp_path, data_dir):
    # global_batch_size 8 = 2 batches of 4 a step: 8 steps an epoch, which 5 does not divide.
    after_each_validation = json.dumps([{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                         "init_args": {"save_top_k": -1, "filename": "{step}"}}])
    root = fit(tmp_path, data_dir, "--trainer.max_steps", "20", "--trainer.val_check_interval", "5",
               "--data.global_batch_size", "8", "--trainer.callbacks", after_each_validation)
    saved = sorted(int(path.stem[len("step="):]) for path in (root / "checkpoints").glob("step=*.ckpt"))
    assert saved == [5, 10, 15, 20]


def test_an_interval_longer_than_an_epoch_counts_steps_across_epochs(tmp_path, data_dir):
    # Lightning's per-epoch count refuses an interval above the epoch's 16 batches; across epochs: steps.
    root = fit(tmp_path, data_dir, "--trainer.max_steps", "40", "--trainer.val_check_interval", "20",
               "--time_to_quality.target", "100")
    result = json.loads((root / "version_0" / "time_to_quality.json").read_text())
    assert (result["reached"], result["step"], result["target"]) == (True, 20, 100.0)


def test_the_target_flag_replaces_the_target_of_the_configs_time_to_quality(tmp_path, data_dir):
    never_reached = json.dumps([{"class_path": "lightning_train.callbacks.TimeToQuality",
                                 "init_args": {"target": 0.0}}])
    root = fit(tmp_path, data_dir, "--trainer.max_steps", "8", "--trainer.val_check_interval", "4",
               "--trainer.callbacks", never_reached, "--time_to_quality.target", "100")
    result = json.loads((root / "version_0" / "time_to_quality.json").read_text())
    assert (result["reached"], result["step"], result["target"]) == (True, 4, 100.0)
