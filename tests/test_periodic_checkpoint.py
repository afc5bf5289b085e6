"""PeriodicCheckpoint: saves by minutes beside steps, keeps the newest K, never leaves no valid checkpoint
(with asynchronous writes too)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_train.callbacks import PeriodicCheckpoint
from lightning_train.checkpoint import AtomicCheckpointIO, find_resume_checkpoint, verify_checkpoint
from lightning_train.errors import UserInputError

QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


class SlowSteps(L.Callback):
    """Each optimizer step takes at least ``seconds``; records (step, time) of every checkpoint."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.saves = seconds, []

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self.saves.append((trainer.global_step, time.monotonic()))


def test_every_n_minutes_saves_on_wall_time(tmp_path: Path) -> None:
    slow = SlowSteps(0.2)
    checkpoint = PeriodicCheckpoint(tmp_path, every_n_minutes=0.5 / 60, keep_last=-1, check_every_n_steps=1,
                                    save_last=False)
    L.Trainer(max_steps=14, callbacks=[slow, checkpoint], **QUIET).fit(BoringModel())
    steps = [step for step, _ in slow.saves]
    assert len(steps) >= 2, steps  # 14 steps of >= 0.2 s: at least 2.8 s, a save every >= 0.5 s
    for (step, at), (next_step, next_at) in zip(slow.saves, slow.saves[1:], strict=False):
        assert next_at - at >= 0.5 - 0.05 and next_step - step >= 3, slow.saves  # 2 steps < 0.5 s
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == sorted(f"epoch=0-step={s}.ckpt" for s in steps)


def test_steps_and_minutes_together_whichever_comes_first(tmp_path: Path) -> None:
    slow = SlowSteps(0.0)
    checkpoint = PeriodicCheckpoint(tmp_path, every_n_train_steps=4, every_n_minutes=60, keep_last=-1)
    L.Trainer(max_steps=9, callbacks=[slow, checkpoint], **QUIET).fit(BoringModel())
    assert [step for step, _ in slow.saves] == [4, 4, 8, 8]  # step=N.ckpt and last.ckpt; the hour never came


class SlowAsyncIO(AtomicCheckpointIO):
    """Background writes that take 0.3 s each."""

    def __init__(self) -> None:
        super().__init__(async_save=True)

    def _serialize(self, checkpoint: dict[str, Any], file: Any) -> None:
        time.sleep(0.3)
        super()._serialize(checkpoint, file)


class ValidCheckpoints(L.Callback):
    """Before every step after the first save has landed: the newest valid checkpoint of the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.newest = folder, []

    def on_train_batch_start(self, *args: Any) -> None:
        found = find_resume_checkpoint(self.folder)
        if found is not None or self.newest:
            self.newest.append(found)


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_last_one_never_leaves_no_valid_checkpoint(tmp_path: Path, async_save: bool) -> None:
    watch = ValidCheckpoints(tmp_path)
    checkpoint = PeriodicCheckpoint(tmp_path, every_n_train_steps=2, keep_last=1, save_last=False)
    plugins = [SlowAsyncIO()] if async_save else [AtomicCheckpointIO()]
    trainer = L.Trainer(max_steps=10, callbacks=[watch, checkpoint], plugins=plugins, **QUIET)
    if async_save:  # a write (0.3 s) outlasts two steps: the next checkpoint waits, and says so
        with pytest.warns(UserWarning, match=r"checkpoint at step 4 waited 0\.\d s for the previous"):
            trainer.fit(BoringModel())
    else:
        trainer.fit(BoringModel())
    assert watch.newest and None not in watch.newest  # the older one went only once the newer was complete
    assert [p.name for p in tmp_path.glob("*.ckpt")] == ["epoch=0-step=10.ckpt"]
    assert verify_checkpoint(tmp_path / "epoch=0-step=10.ckpt")["global_step"] == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs every_n_train_steps, every_n_minutes or both"),
        ({"every_n_minutes": 0}, "every_n_minutes=0: use a time > 0"),
        ({"every_n_train_steps": 0}, "every_n_train_steps=0: use >= 1"),
        ({"every_n_train_steps": 5, "keep_last": 0}, "keep_last=0: keep >= 1 (or -1 for all)"),
    ],
)
def test_bad_settings_are_one_clear_error(kwargs: dict, message: str) -> None:
    with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PeriodicCheckpoint(**kwargs)
