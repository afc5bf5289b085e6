"""TimeToQuality: stops at the validation target, logs the time and step, writes the run's JSON file."""

from __future__ import annotations

import json
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_train.callbacks import TimeToQuality
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPTConfig
from lightning_train.modules import PretrainModule
from tests.helpers.tiny_runs import TINY, MemoryLogger


class CountingRows(L.LightningDataModule):
    """Rows counting up from random starts (token t+1 = token t + 1): learnt within a few dozen steps."""

    def __init__(self) -> None:
        super().__init__()
        starts = torch.randint(0, 200, (32, 1), generator=torch.Generator().manual_seed(0))
        rows = starts + torch.arange(17)
        self.rows = [{"input_ids": row[:-1], "labels": row[1:]} for row in rows]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=16)


def fit(tmp_path, callback: TimeToQuality, max_steps: int) -> tuple[L.Trainer, MemoryLogger, float]:
    L.seed_everything(0)
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, val_check_interval=5, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, logger=logger, callbacks=[callback], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    module = PretrainModule(GPTConfig(**TINY), learning_rate=1e-2, warmup_steps=1)
    start = time.perf_counter()
    trainer.fit(module, CountingRows())
    return trainer, logger, time.perf_counter() - start


def test_stops_at_the_target_and_writes_time_and_step(tmp_path):
    stopper = TimeToQuality(target=3.0, monitor="val/loss")
    trainer, logger, wall = fit(tmp_path, stopper, max_steps=300)

    assert 5 <= trainer.global_step < 300 and trainer.global_step % 5 == 0  # stopped at a validation
    assert trainer.callback_metrics["val/loss"].item() <= 3.0
    result = json.loads((tmp_path / "time_to_quality.json").read_text())  # trainer.log_dir: no file logger
    assert result["reached"] is True and result["step"] == trainer.global_step
    assert result["value"] <= 3.0 and result["target"] == 3.0
    assert 0 < result["seconds"] <= wall
    assert logger.series("perf/time_to_target_sec") == [result["seconds"]]
    assert logger.series("perf/time_to_target_step") == [trainer.global_step]
    assert stopper.result == result


def test_a_run_that_ends_before_the_target_says_so(tmp_path):
    trainer, _, _ = fit(tmp_path, TimeToQuality(target=0.0), max_steps=10)
    assert trainer.global_step == 10
    result = json.loads((tmp_path / "time_to_quality.json").read_text())
    assert result["reached"] is False and result["step"] == 10 and result["best"] > 0.0


def test_elapsed_time_continues_after_a_resume(tmp_path):
    before = TimeToQuality(target=0.0)
    before.load_state_dict({"seconds": 100.0, "best": None, "result": None})  # as restored from a checkpoint
    fit(tmp_path, before, max_steps=5)
    assert before.result["seconds"] > 100.0
    assert before.state_dict()["seconds"] >= before.result["seconds"]


def test_max_mode_and_an_unknown_metric(tmp_path):
    with pytest.raises(UserInputError, match="monitor='val/acc' was not logged in validation"):
        fit(tmp_path, TimeToQuality(target=0.9, monitor="val/acc", mode="max"), max_steps=5)
    with pytest.raises(UserInputError, match="mode='lowest'"):
        TimeToQuality(target=1.0, mode="lowest")


def test_continuing_past_the_target_keeps_the_first_result_and_never_stops(tmp_path):
    first = TimeToQuality(target=100.0)  # reached at the first validation
    trainer, _, _ = fit(tmp_path / "first", first, max_steps=20)
    assert trainer.global_step == 5 and first.result["reached"] is True

    going_on = TimeToQuality(target=100.0)
    going_on.continue_past_target(first.result)
    # as a resume from a checkpoint taken before the validation that reached the target restores it
    going_on.load_state_dict({"seconds": 1.0, "best": None, "result": None})
    trainer, logger, _ = fit(tmp_path / "past", going_on, max_steps=20)
    assert trainer.global_step == 20  # the target no longer stops the run
    assert going_on.result == first.result and going_on.state_dict()["result"] == first.result
    assert not (tmp_path / "past" / "time_to_quality.json").exists()  # the first launch's record stands
    assert logger.series("perf/time_to_target_step") == []
