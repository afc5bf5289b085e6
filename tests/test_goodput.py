"""Goodput: every second of a launch in one part, summed over the launches of a run.

The CLI runs are real processes (``tests.helpers.ft_runs``: 12 steps, checkpoints every 3, validation
every 4), timed from outside: from just before the process is spawned to its last record (the final
``goodput.json``), or to its death for a launch killed with SIGKILL.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import pytest

from lightning_train import GPTConfig, PretrainModule, TextDataModule
from lightning_train.callbacks import GoodputMonitor, NaNRecovery, PreemptionCheckpoint
from lightning_train.checkpoint import AtomicCheckpointIO, read_checkpoint
from lightning_train.cli.run_defaults import run_defaults
from lightning_train.loggers.goodput import (
    GOODPUT_FILE,
    PARTS,
    LiveRecord,
    earlier_launches,
    launch_record,
    read_goodput,
    read_live,
)
from lightning_train.loggers.report import report
from tests.helpers.ft_runs import MAX_STEPS, fault, fit, write_config


def record(name: str, started: float, productive: float, steps: int, state: str = "training") -> dict:
    seconds = {**dict.fromkeys(PARTS, 0.0), "startup": 5.0, "productive": productive, "other": 0.5}
    return launch_record(name, started, state, 0, steps, None, seconds,
                         {"productive": steps, "recovery": 0, "lost": 0})


def write_live_record(folder: Path, run_id: int, launch: dict) -> None:
    live = LiveRecord(folder)
    live.write(run_id, launch["state"], launch["started"], launch["seconds"], 0.0, launch["first_step"],
               launch["last_step"], launch["steps"], launch["resumed_from_step"])
    live.close()


def test_live_record_round_trip(tmp_path: Path) -> None:
    launch = record("version_0", 1_700_000_000.25, productive=12.5, steps=10)
    write_live_record(tmp_path / "version_0", 7, launch)
    assert read_live(tmp_path / "version_0") == (7, launch)
    assert read_live(tmp_path / "missing") is None


def test_history_counts_the_steps_after_the_checkpoint_as_lost(tmp_path: Path) -> None:
    # version_0 saved at 6 steps (6.0 s productive), trained on to 8 steps (8.0 s), then was killed;
    # version_1 (same run, unknown to the checkpoint) died before any checkpoint of its own;
    # version_2 belongs to another run.
    at_checkpoint = record("version_0", 100.0, productive=6.0, steps=6)
    write_live_record(tmp_path / "version_0", 1, record("version_0", 100.0, productive=8.0, steps=8))
    write_live_record(tmp_path / "version_1", 1, record("version_1", 200.0, productive=3.0, steps=3))
    write_live_record(tmp_path / "version_2", 2, record("version_2", 250.0, productive=9.0, steps=9))
    earlier = earlier_launches(tmp_path, 1, [], at_checkpoint, before=300.0)

    assert [launch["name"] for launch in earlier] == ["version_0", "version_1"]
    killed, unknown = earlier
    assert killed["state"] == unknown["state"] == "killed"
    assert killed["seconds"]["productive"] == 6.0 and killed["seconds"]["lost"] == 2.0
    assert killed["steps"] == {"productive": 6, "recovery": 0, "lost": 2}
    assert unknown["seconds"]["productive"] == 0.0 and unknown["seconds"]["lost"] == 3.0
    assert killed["wall_sec"] == pytest.approx(8.0 + 5.5)  # the parts still add up to the launch's time
    # without a live record the writer counts as of its checkpoint
    assert earlier_launches(tmp_path / "elsewhere", 1, [], at_checkpoint, 300.0)[0]["seconds"]["lost"] == 0


class NaNAtSteps(PretrainModule):
    def compute_loss(self, logits, labels):
        loss = super().compute_loss(logits, labels)
        return loss * float("nan") if self.global_step in (3, 4) else loss


def test_skipped_and_rolled_back_steps_are_recovery(tmp_path: Path) -> None:
    # steps 3 and 4 are NaN (skipped); two in a row roll back to the snapshot of step 2, undoing step 2
    goodput = GoodputMonitor(start="created")
    trainer = L.Trainer(
        max_steps=7, accelerator="cpu", limit_val_batches=0, logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[goodput, NaNRecovery(snapshot_every=2, max_consecutive_skips=2, skip_batches=1)],
    )
    trainer.fit(NaNAtSteps(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)),
                TextDataModule(seq_len=16, batch_size=4))
    assert goodput.steps == {"productive": 4, "recovery": 3, "lost": 0}
    run = read_goodput(Path(trainer.log_dir))
    assert run["steps"] == goodput.steps and run["seconds"]["recovery"] > 0
    assert run["seconds"] == pytest.approx(goodput.seconds)


def test_the_cli_adds_goodput_to_fit_unless_the_config_has_one(tmp_path: Path) -> None:
    def goodputs(callbacks: list, subcommand: str = "fit") -> list:
        config = {"default_root_dir": str(tmp_path), "callbacks": callbacks}
        return [c for c in run_defaults(config, subcommand, [])["callbacks"] if isinstance(c, GoodputMonitor)]

    assert len(goodputs([])) == 1 and goodputs([])[0].start == "process"
    own = GoodputMonitor(start="created")
    assert goodputs([own]) == [own]
    assert goodputs([], "validate") == []


def timed_fit(config: Path) -> tuple[float, float]:
    """(unix time just before the process was spawned, the time it died)."""
    spawned = time.time()
    result = fit(config)
    assert result.returncode in (0, -signal.SIGKILL), result.stdout[-3000:]
    return spawned, time.time()


def test_a_cli_run_with_validation_and_checkpoints_adds_up_to_its_wall_time(tmp_path: Path,
                                                                           data_dir: Path) -> None:
    spawned, _ = timed_fit(write_config(tmp_path, data_dir))
    folder = tmp_path / "run" / "version_0"
    wall = (folder / GOODPUT_FILE).stat().st_mtime - spawned  # to its last record, from outside
    run = json.loads((folder / GOODPUT_FILE).read_text())

    assert run["wall_sec"] == pytest.approx(wall, rel=0.02)  # the sum of the parts
    (launch,) = run["launches"]
    assert launch["state"] == "finished" and launch["resumed_from_step"] is None
    assert run["steps"] == {"productive": MAX_STEPS, "recovery": 0, "lost": 0}
    seconds = run["seconds"]
    assert seconds["startup"] > 0 and seconds["productive"] > 0 and seconds["lost"] == 0
    assert seconds["validation"] > 0 and seconds["checkpoint"] > 0  # 2 validations, 5 saves
    assert run["productive_fraction"] == pytest.approx(seconds["productive"] / run["wall_sec"])
    with (folder / "metrics.csv").open() as file:
        logged = [row for row in csv.DictReader(file) if row["goodput/productive_fraction"]]
    assert len(logged) == MAX_STEPS // 5  # logging steps (every 5)
    assert all(float(row["goodput/startup_sec"]) == seconds["startup"] for row in logged)


def test_a_launch_killed_after_its_checkpoint_counts_as_lost_work(tmp_path: Path, data_dir: Path) -> None:
    # SIGKILL before step 9: the checkpoint of step 6 is resumed, steps 7 and 8 are trained again
    config = write_config(tmp_path, data_dir, callbacks=(fault(["train:8"], tmp_path),))
    killed = timed_fit(config)
    resumed = timed_fit(config)
    folders = [tmp_path / "run" / f"version_{index}" for index in (0, 1)]
    wall = (killed[1] - killed[0]) + (folders[1] / GOODPUT_FILE).stat().st_mtime - resumed[0]
    run = json.loads((folders[1] / GOODPUT_FILE).read_text())

    assert run["wall_sec"] == pytest.approx(wall, rel=0.02)  # the sum of the parts of both launches
    # from the killed launch's last record (just before its death) to the resumed process's start
    assert resumed[0] - killed[1] - 0.1 < run["between_launches_sec"] < resumed[0] - killed[1] + 2.0
    first, second = run["launches"]
    assert (first["name"], first["state"], second["state"]) == ("version_0", "killed", "finished")
    assert first["steps"] == {"productive": 6, "recovery": 0, "lost": 2} and first["last_step"] == 8
    assert second["resumed_from_step"] == 6 and second["steps"]["productive"] == MAX_STEPS - 6
    assert run["steps"] == {"productive": MAX_STEPS, "recovery": 0, "lost": 2}
    # the two lost steps took about what two steps take
    per_step = first["seconds"]["productive"] / 6
    assert 0.3 * 2 * per_step < run["seconds"]["lost"] < 3 * 2 * per_step
    assert run["seconds"]["productive"] == pytest.approx(first["seconds"]["productive"]
                                                          + second["seconds"]["productive"])

    result = report(str(tmp_path / "run"))
    assert result["plots"]["goodput"]["file"] == "goodput.png"
    assert "2 steps recomputed" in result["plots"]["goodput"]["note"]
    assert (tmp_path / "run" / "report" / "goodput.png").stat().st_size > 10_000


class SigtermDuringStep3(L.Callback):
    def on_before_optimizer_step(self, trainer, *args):
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preempted_launch_resumes_without_lost_work(tmp_path: Path) -> None:
    # PreemptionCheckpoint saves from inside the batch, before Goodput's hook: the save must hold the
    # step it saves, or the resumed launch would count it as lost
    def trainer(*callbacks: L.Callback) -> L.Trainer:
        return L.Trainer(
            max_steps=5, accelerator="cpu", limit_val_batches=0, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
            logger=L.pytorch.loggers.CSVLogger(tmp_path, name=""),
            callbacks=[*callbacks, PreemptionCheckpoint(), GoodputMonitor(start="created")],
        )

    module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(SystemExit):
        trainer(SigtermDuringStep3()).fit(module, TextDataModule(seq_len=16, batch_size=4))
    checkpoint = tmp_path / "checkpoints" / "preempted.ckpt"
    saved = read_checkpoint(checkpoint)["callbacks"]["GoodputMonitor"]["current"]
    assert saved["steps"]["productive"] == 3 and saved["last_step"] == 3

    module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    trainer().fit(module, TextDataModule(seq_len=16, batch_size=4), ckpt_path=checkpoint)
    run = read_goodput(tmp_path / "version_1")
    first, second = run["launches"]
    assert first["state"] == "stopped" and first["seconds"]["checkpoint"] > 0
    assert run["steps"] == {"productive": 5, "recovery": 0, "lost": 0} and second["resumed_from_step"] == 3
