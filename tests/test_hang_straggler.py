"""Hang watchdog and straggler detection with real processes: a rank blocked forever, a rank slowed down.

The tiny deterministic run of test_fault_tolerance (12 steps, checkpoints every 3, validation every 4),
through the CLI on CPU with the lt_ddp strategy and real gloo process groups.
"""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_train.callbacks import HangWatchdog, StragglerMonitor
from lightning_train.callbacks.hang_watchdog import HANG_EXIT_CODE
from lightning_train.errors import UserInputError
from tests.conftest import REPO, cli_env
from tests.helpers.ft_runs import fit, write_config
from tests.helpers.hang_faults import SlowRank

TIMEOUT = 6.0
TWO_RANKS = ("--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.strategy=lt_ddp")


def watchdog(**init_args: object) -> dict:
    return {"class_path": "lightning_train.callbacks.HangWatchdog", "init_args": init_args}


def block_forever(rank: int, step: int, folder: Path) -> dict:
    return {"class_path": "tests.helpers.hang_faults.BlockForever",
            "init_args": {"rank": rank, "step": step, "marker": str(folder / "blocked-at")}}


def slow_rank(rank: int, seconds: float) -> dict:
    return {"class_path": "tests.helpers.hang_faults.SlowRank",
            "init_args": {"rank": rank, "seconds": seconds}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(config: Path, world_size: int = 2) -> list[subprocess.Popen]:
    """One CLI process per rank, as torchrun or SLURM start them, so each rank's exit code is seen."""
    port, ranks = free_port(), []
    for rank in range(world_size):
        env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      NODE_RANK="0", LOCAL_RANK=str(rank))
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "lightning_train", "fit", "--config", str(config), "--resume", "auto",
             *TWO_RANKS], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return ranks


def test_a_rank_blocked_forever_ends_both_ranks_with_76_and_its_stack(tmp_path: Path, data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(
        watchdog(timeout=TIMEOUT, grace_steps=2), block_forever(rank=1, step=6, folder=tmp_path)))
    ranks = launch_ranks(config)
    try:
        outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    ended = time.time()
    codes = [rank.returncode for rank in ranks]
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], f"exit codes {codes}:\n" + "\n---\n".join(
        output[-3000:] for output in outputs)
    assert ended - float((tmp_path / "blocked-at").read_text()) < TIMEOUT + 30

    hangs = tmp_path / "run" / "hangs"
    blocked = (hangs / "rank1.txt").read_text()
    assert blocked.startswith("rank 1 (pid ") and "at step 6, in training batch 6 of step 7" in blocked
    assert "in block_forever_in_training_step" in blocked  # the stack names the blocked function
    waiting = (hangs / "rank0.txt").read_text()  # rank 0 waits for rank 1 in a collective of DDP's
    assert waiting.startswith("rank 0 (pid ") and "at step 6, in training batch 6 of step 7" in waiting
    assert "block_forever_in_training_step" not in waiting
    assert "torch/nn/parallel/distributed.py" in waiting
    assert "exiting with code 76" in outputs[1] and f"stacks in {hangs / 'rank1.txt'}" in outputs[1]

    # The job script requeues the job (the fault is gone; here on one rank): --resume auto continues.
    config = write_config(tmp_path, data_dir, callbacks=(watchdog(timeout=TIMEOUT, grace_steps=2),))
    resumed = fit(config)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"--resume auto: resuming from {tmp_path / 'run' / 'checkpoints'}" in resumed.stdout
    metrics = tmp_path / "run" / "version_1" / "metrics.csv"
    steps = [int(row["step"]) for row in csv.DictReader(metrics.open())]
    assert min(steps) > 6, steps  # the requeued launch started after step 6, not from scratch
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12


def test_a_derived_timeout_follows_the_median_batch_time_and_fires(tmp_path: Path, data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(
        watchdog(factor=10.0, floor_s=1.0, grace_steps=2), slow_rank(rank=0, seconds=0.1),
        block_forever(rank=0, step=8, folder=tmp_path)))
    result = fit(config)
    assert result.returncode == HANG_EXIT_CODE, result.stdout[-3000:]
    report = (tmp_path / "run" / "hangs" / "rank0.txt").read_text()
    timeout = float(report.split("(timeout ")[1].split(" s)")[0])
    assert 1.0 <= timeout < 5.0  # 10 x about 0.1 s, not the 300 s default floor
    assert "in block_forever_in_training_step" in report


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_no_false_alarm_with_validation_checkpoints_and_compile(tmp_path: Path, data_dir: Path,
                                                                compile: bool) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(watchdog(timeout=5.0, grace_steps=1),))
    result = fit(config, f"--model.init_args.compile={str(compile).lower()}", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:]
    assert not (tmp_path / "run" / "hangs").exists()
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


def test_a_slow_rank_is_named_and_alerted(tmp_path: Path, data_dir: Path) -> None:
    monitor = {"class_path": "lightning_train.callbacks.StragglerMonitor",
               "init_args": {"threshold": 1.5, "patience": 3}}
    config = write_config(tmp_path, data_dir, callbacks=(monitor, slow_rank(rank=1, seconds=0.3)))
    result = fit(config, *TWO_RANKS, "--trainer.log_every_n_steps=2")
    assert result.returncode == 0, result.stdout[-3000:]
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    logged = [(int(row["step"]), float(row["perf/straggler_ratio"]), row["perf/slowest_rank"])
              for row in rows if row.get("perf/straggler_ratio")]
    loss_steps = [int(row["step"]) for row in rows if row.get("train/loss")]
    assert [step for step, _, _ in logged] == loss_steps and len(logged) == 6  # every 2nd of 12 steps
    assert all(ratio > 1.5 and slowest == "1.0" for _, ratio, slowest in logged), logged
    alerts = [json.loads(line) for line in (tmp_path / "run" / "version_0" / "alerts.jsonl").open()]
    assert [(a["title"], a["step"]) for a in alerts] == [("Straggler rank", 6)]  # once, at the 3rd in a row
    assert alerts[0]["text"].startswith("rank 1 took ")


def test_one_rank_is_its_own_median_and_the_streak_is_checkpointed() -> None:
    monitor = StragglerMonitor(patience=2)
    trainer = L.Trainer(max_steps=4, log_every_n_steps=2, callbacks=[monitor, SlowRank(0, 0.01)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(BoringModel())
    assert monitor.last_ratio == 1.0 and monitor.state_dict() == {"streak": 0, "alerted": False}
    restored = StragglerMonitor()
    restored.load_state_dict({"streak": 2, "alerted": True})
    assert (restored.streak, restored.alerted) == (2, True)


def test_bad_settings_are_one_clear_error() -> None:
    for make, text in ((lambda: HangWatchdog(timeout=0), "HangWatchdog timeout=0"),
                       (lambda: HangWatchdog(factor=0.5), "HangWatchdog factor=0.5"),
                       (lambda: StragglerMonitor(threshold=1.0), "StragglerMonitor threshold=1.0"),
                       (lambda: StragglerMonitor(patience=0), "StragglerMonitor patience=0")):
        with pytest.raises(UserInputError, match=text):
            make()
