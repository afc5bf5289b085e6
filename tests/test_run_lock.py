"""One run folder, one writer: a second ``fit`` into a folder a running ``fit`` holds is refused in one
line naming the holder and leaves the folder as it was; a lock left by a killed process is taken over
with a warning; a restart of the same launcher job takes its own lock at once. Real processes for the
runs; the lock's rules on their own below."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_train.cli.run_lock import LOCK_FILE, STALE_AFTER_S, RunLock
from lightning_train.errors import UserInputError
from tests.conftest import REPO, cli_env, run_cli, run_cli_in_process
from tests.helpers.ft_runs import MAX_STEPS, write_config
from tests.helpers.hold import wait_for

HOLD = {"class_path": "tests.helpers.hold.HoldAfterStep", "init_args": {"step": 2, "marker_dir": "{markers}"}}


def start_held_fit(tmp_path: Path, data_dir: Path) -> tuple[Path, subprocess.Popen, Path]:
    """A ``fit`` in its own process, held after step 2: (its config, the process, its marker folder)."""
    markers = tmp_path / "markers"
    hold = {**HOLD, "init_args": {**HOLD["init_args"], "marker_dir": str(markers)}}
    config = write_config(tmp_path, data_dir, callbacks=(hold,))
    process = subprocess.Popen([sys.executable, "-m", "lightning_train", "fit", "--config", str(config)],
                               cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    wait_for(markers / "holding")
    return config, process, markers


def test_a_second_fit_into_a_folder_in_use_is_refused_and_changes_nothing(tmp_path: Path,
                                                                         data_dir: Path) -> None:
    config, first, markers = start_held_fit(tmp_path, data_dir)
    run = tmp_path / "run"
    try:
        lock = json.loads((run / LOCK_FILE).read_text())
        assert (lock["host"], lock["pid"]) == (socket.gethostname(), first.pid)
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        for how in ((), ("--resume", "auto")):  # a new run, or "continue it": both would be a second writer
            second = run_cli_in_process("fit", "--config", str(config), *how, cwd=tmp_path)
            errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
            assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
            assert errors[0].startswith(f"error: {run} is in use by another fit (pid {first.pid} on "
                                        f"{socket.gethostname()} since {lock['since']}, {run / LOCK_FILE}); "
                                        "wait for it to end, or start this run in its own folder")
            assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    finally:
        (markers / "release").touch()
        output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output[-3000:]
    assert not (run / LOCK_FILE).exists()  # released when the run ended
    assert sorted(p.name for p in run.glob("version_*")) == ["version_0"]
    assert not list(run.rglob("last-v*"))
    again = run_cli_in_process("fit", "--config", str(config), "--resume", "auto", cwd=tmp_path)
    assert again.returncode == 0 and "is finished" in again.stdout, again.stderr[-3000:]


def test_the_lock_of_a_killed_fit_is_taken_over_with_a_warning(tmp_path: Path, data_dir: Path) -> None:
    config, first, _ = start_held_fit(tmp_path, data_dir)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    run = tmp_path / "run"
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == first.pid  # left behind

    resumed = run_cli("fit", "--config", str(config), "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"{run / LOCK_FILE}: taking over the lock of pid {first.pid} on {socket.gethostname()}"
            in resumed.stderr)
    assert "which is no longer running" in resumed.stderr
    assert f"Run finished: max_steps={MAX_STEPS} reached" in resumed.stdout
    assert not (run / LOCK_FILE).exists()


# ---- the lock's rules ---------------------------------------------------------------------------------
def write_lock(folder: Path, **record: object) -> Path:
    path = folder / LOCK_FILE
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": None,
                                "since": "then", "launch": {}, **record}))
    return path


def a_finished_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.parametrize("holder, age, taken", [
    ({}, 0, False),  # this host, a running process
    ({"pid": "finished"}, 0, True),  # this host, a process that ended without releasing it
    ({"started": -1}, 0, True),  # this pid, but a process that started later than the holder (pid reused)
    ({"host": "elsewhere", "pid": 1}, 0, False),  # another host, heartbeat fresh: may be running
    ({"host": "elsewhere", "pid": 1}, STALE_AFTER_S + 60, True),  # another host, heartbeat stopped
    ({"host": "elsewhere", "pid": 1, "launch": {"slurm_job_id": "77"}}, 0, True),  # this job, requeued
], ids=["running-here", "gone-here", "pid-reused", "elsewhere-fresh", "elsewhere-stale", "same-job"])
def test_which_locks_are_taken_over(holder: dict, age: float, taken: bool, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    if holder.get("pid") == "finished":
        holder = {**holder, "pid": a_finished_pid()}
    path = write_lock(tmp_path, **holder)
    os.utime(path, (time.time() - age, time.time() - age))
    lock = RunLock(tmp_path)
    if not taken:
        with pytest.raises(UserInputError, match="is in use by another fit"):
            lock.acquire()
        assert json.loads(path.read_text())["pid"] == holder.get("pid", os.getpid())  # untouched
        return
    lock.acquire()
    assert json.loads(path.read_text()) == lock.record
    lock.release()
    assert not path.exists()


def test_a_lock_another_launch_took_over_first_is_not_taken_again(tmp_path: Path) -> None:
    stale = write_lock(tmp_path, host="elsewhere", pid=1)
    old = time.time() - STALE_AFTER_S - 60
    os.utime(stale, (old, old))
    holder = json.loads(stale.read_text())
    winner = RunLock(tmp_path)
    winner.acquire()  # took the stale lock over
    loser = RunLock(tmp_path)
    assert not loser._take_over(holder)  # it had read the stale lock before the winner replaced it
    assert json.loads(stale.read_text()) == winner.record
    winner.release()
