"""Packed SFT batches under fsdp, tp=2 and pp=2 (2 gloo ranks each) give one process's losses, step by
step, and its val/loss: the packed rows' position_ids reach every shard, sequence-parallel rank and
pipeline stage, in training and in evaluation."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_strategy_multiprocess import _assert_losses_equal, _fit

pytestmark = pytest.mark.slow
PARALLEL = "--trainer.strategy=lightning_train.strategies.ParallelStrategy"
LAYOUTS = {
    "fsdp": ["--trainer.strategy=lt_fsdp", "--data.init_args.batch_size=4"],  # 2 ranks x 4 rows
    "tp2": [PARALLEL, "--trainer.strategy.tensor_parallel=2"],
    "pp2": [PARALLEL, "--trainer.strategy.pipeline_parallel=2"],
}


def _config(tmp_path: Path) -> str:
    """Examples of one length (two a row of 32 tokens, 5 trained tokens each), so that every rank's rows
    weigh the same in a data-parallel mean, as in one process's token-weighted loss."""
    rows = [{"prompt": f"{n:03d}+{n * 7 % 100:02d}=", "response": f"{n + n * 7 % 100:04d}"}
            for n in range(136)]
    # val: one batch of 8 rows, the training batch's shape (pipeline stages keep their first shapes)
    for name, part in (("train", rows[:120]), ("val", rows[120:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    config = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "precision": "32-true", "val_check_interval": 3, "max_steps": 6,
            "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1,
        },
        "model": {
            "class_path": "lightning_train.PretrainModule",
            "init_args": {
                "config": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
                "learning_rate": 3e-3, "warmup_steps": 2, "decay_steps": 100,
            },
        },
        "data": {
            "class_path": "lightning_train.SFTDataModule",
            "init_args": {"train_file": str(tmp_path / "train.jsonl"), "tokenizer": "byte", "seq_len": 32,
                          "val_file": str(tmp_path / "val.jsonl"), "batch_size": 8, "packing": True},
        },
    }
    (tmp_path / "packing.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "packing.yaml")


def _val_losses(root: Path) -> list[float]:
    with open(root / "version_0" / "metrics.csv") as f:
        return [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("single")
    [report], _ = _fit(tmp_path, "single", "--config", _config(tmp_path), "--trainer.devices=1")
    return {**report, "val_losses": _val_losses(tmp_path / "single")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_losses_under_a_layout_are_one_process(tmp_path, single, layout):
    config = _config(tmp_path)
    reports, _ = _fit(tmp_path, layout, "--config", config, "--trainer.devices=2", *LAYOUTS[layout])
    assert [report["world_size"] for report in reports] == [2, 2]
    for report in reports:
        if layout != "pp2":  # a pipeline rank holds its stage's weights only
            assert report["initial_weights"] == single["initial_weights"]
        _assert_losses_equal(report["losses"], single["losses"])
    assert single["losses"][-1] < single["losses"][0] - 0.1  # it trains: the steps differ
    assert len(single["val_losses"]) == 2
    assert _val_losses(tmp_path / layout) == pytest.approx(single["val_losses"], rel=1e-5)
    assert torch.tensor(single["losses"]).isfinite().all()
