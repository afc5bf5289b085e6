"""A run from its first launch to its end, as a person and a job script see it: the summary at the end,
one folder per run that no other launch mixes into, and a finished run that stays finished.

Real subprocesses of the CLI (in this process where only what a command answers and writes is checked)
on the tiny deterministic run of tests/helpers/ft_runs.py (12 steps, checkpoints every 3, validation
every 4)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_train.callbacks.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import REPO, cli_env, run_cli_in_process
from tests.helpers.ft_runs import fault, final_state, fit, write_config

TARGET = {"class_path": "lightning_train.callbacks.TimeToQuality", "init_args": {"target": 100.0}}


def launch(*args: str) -> subprocess.CompletedProcess:
    """``python -m lightning_train ARGS`` in this process (what the command answers and writes, without an
    interpreter's start-up); stdout, then stderr, in ``stdout``."""
    done = run_cli_in_process(*args, cwd=REPO)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr)


def screen(output: str) -> list[str]:
    """The lines a terminal shows: of each line, what is left after its last carriage return (a progress
    bar redraws itself with ``\\r``; text glued onto a bar's line would show on the bar's line)."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in output.split("\n")]


def files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_summary_says_why_each_launch_ended_on_lines_of_its_own(tmp_path: Path, data_dir: Path) -> None:
    throughput = {"class_path": "lightning_train.callbacks.ThroughputMonitor"}
    config = write_config(tmp_path, data_dir, callbacks=(throughput, fault(["train:4"], tmp_path, "SIGTERM")))
    run = tmp_path / "run"
    preempted = fit(config, "--trainer.enable_progress_bar=true")
    assert preempted.returncode == PREEMPTED_EXIT_CODE, preempted.stdout[-3000:]
    shown = screen(preempted.stdout)
    assert f"Preempted (SIGTERM) after step 5: saving {run}/checkpoints/preempted.ckpt" in shown
    assert "Saved at step 5; exiting with code 75" in shown
    end = shown.index("Run preempted (SIGTERM) at step 5: checkpoint saved")
    assert shown[end - 1] == ""  # a blank line between the bar and the summary
    assert shown[end + 1].startswith("  val/loss    best ") and "(step 4), last " in shown[end + 1]
    assert shown[end + 2].startswith("  throughput  ") and shown[end + 2].endswith(" tokens/s")
    assert shown[end + 3] == f"  checkpoint  {run}/checkpoints/preempted.ckpt (step 5)"
    assert shown[end + 4] == f"  metrics     {run}/version_0/metrics.csv"
    assert shown[end + 5] == (f"  next        python -m lightning_train fit --config {config} "
                              "--trainer.enable_progress_bar=true --resume auto")

    finished = fit(config, "--trainer.enable_progress_bar=true")
    assert finished.returncode == 0, finished.stdout[-3000:]
    shown = screen(finished.stdout)
    end = shown.index("Run finished: max_steps=12 reached")
    assert not any("Trainer.fit` stopped" in line for line in shown)  # Lightning's own line, said better
    best = json.loads((run / "version_1" / "summary.json").read_text())["best"]
    assert best["step"] in (4, 8, 12)  # over both launches: the validation of step 4 ran in the first
    assert shown[end + 3] == f"  checkpoint  {run}/checkpoints/last.ckpt (step 12)"
    assert shown[end + 4] == f"  metrics     {run}/version_1/metrics.csv"
    assert shown[end + 5] == (f"  next        python -m lightning_train report {run}   "
                              f"# plots: {run}/report/report.html")
    assert shown[end + 6].startswith(f"              python -m lightning_train generate --checkpoint {run}/")


def test_a_run_that_reached_its_target_stays_finished_when_started_again(tmp_path: Path,
                                                                         data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(TARGET,))
    run = tmp_path / "run"
    first = fit(config)
    assert first.returncode == 0, first.stdout[-3000:]
    headline = next(line for line in first.stdout.splitlines() if line.startswith("Run finished: "))
    assert "reached the target (<= 100) at step 4 after " in headline
    assert headline.endswith(" s (TimeToQuality)")
    reached = (run / "version_0" / "time_to_quality.json").read_text()
    before = files(run)

    # a job script runs the same command again: nothing is trained, nothing is written, exit 0
    again = fit(config)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (f"{run} is finished: {headline.removeprefix('Run finished: ')}; nothing to train "
            "(--continue_past_target trains on)") in again.stdout.splitlines()
    assert files(run) == before

    # going on past the target is explicit; the launch that reached it keeps its record
    past = fit(config, "--continue_past_target=true")
    assert past.returncode == 0, past.stdout[-3000:]
    assert "Run finished: max_steps=12 reached" in past.stdout.splitlines()
    final_state(tmp_path)  # last.ckpt is at step 12
    assert (run / "version_0" / "time_to_quality.json").read_text() == reached
    assert not (run / "version_1" / "time_to_quality.json").exists()

    done = fit(config)
    assert done.returncode == 0, done.stdout[-3000:]
    assert (f"{run} is finished: its checkpoint last.ckpt is at step 12, max_steps=12; nothing to train "
            "(a higher --trainer.max_steps trains on)") in done.stdout.splitlines()
    assert not (run / "version_2").exists()


def test_a_new_fit_never_mixes_into_a_folder_that_holds_a_run(tmp_path: Path, data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir)
    run, short = tmp_path / "run", "--trainer.max_steps=3"
    assert launch("fit", "--config", str(config), short).returncode == 0
    before = files(run)

    refused = launch("fit", "--config", str(config), short)
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert refused.stdout.splitlines()[-1] == (
        f"error: {run} already holds a run; a new fit would mix with it. Continue that run with "
        "--resume auto, or start a new one in its own folder with --run_name NAME")
    assert files(run) == before

    # another run: its own folder next to the first, the first untouched
    other = launch("fit", "--config", str(config), short, "--run_name", "other",
                   "--trainer.log_every_n_steps=1")
    assert other.returncode == 0, other.stdout[-3000:]
    assert (tmp_path / "other" / "checkpoints" / "last.ckpt").is_file()
    assert files(run) == before

    # an evaluation is not a launch of the training run
    checkpoint = run / "checkpoints" / "last.ckpt"
    validated = launch("validate", "--config", str(config), "--ckpt_path", str(checkpoint))
    assert validated.returncode == 0, validated.stdout[-3000:]
    assert (run / "validate" / "version_0" / "metrics.csv").is_file()
    assert sorted(p.name for p in run.glob("version_*")) == ["version_0"]

    # a launch that fails before it runs leaves no folder holding only a config
    wider = write_config(tmp_path / "wider", data_dir, n_embd=32)
    failed = launch("fit", "--config", str(wider), "--resume", str(checkpoint))
    assert failed.returncode == 2 and "does not fit this model" in failed.stdout, failed.stdout[-3000:]
    assert not (tmp_path / "wider" / "run").exists()

    bad = launch("fit", "--config", str(config), "--run_name", "../elsewhere")
    assert bad.returncode == 2
    assert bad.stdout.splitlines()[-1] == (
        "error: --run_name '../elsewhere': use a plain folder name (letters, digits, '.', '_', '-')")
    assert not any(p.name.startswith("last-v") for p in tmp_path.rglob("*.ckpt"))

    # a launch killed before its first checkpoint left metrics only: --resume auto starts afresh
    shutil.rmtree(tmp_path / "other" / "checkpoints")
    again = launch("fit", "--config", str(config), short, "--run_name", "other", "--resume", "auto")
    assert (tmp_path / "other" / "version_0" / "metrics.csv").is_file()
    assert again.returncode == 0 and "starting fresh" in again.stdout, again.stdout[-3000:]
    assert "Run finished: max_steps=3 reached" in again.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_train_works_the_first_and_the_second_time(tmp_path: Path) -> None:
    recipe = subprocess.run(["make", "-n", "-s", "train"], cwd=REPO, capture_output=True, text=True,
                            check=True)
    command = shlex.split(recipe.stdout.strip().splitlines()[-1])
    assert command[1:] == ["-m", "lightning_train", "fit", "--config", "configs/pretrain-tiny.yaml",
                           "--resume", "auto"]
    # the same command, run here with the model and the run shrunk (the config's path made absolute)
    small = ["--model.init_args.config.n_layer=1", "--model.init_args.config.n_embd=32",
             "--model.init_args.config.n_head=2", "--trainer.max_steps=10", "--trainer.val_check_interval=5",
             "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false"]
    args = [sys.executable, *command[1:5], str(REPO / command[5]), *command[6:], *small]
    results = [subprocess.run(args, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
               for _ in range(2)]
    assert [r.returncode for r in results] == [0, 0], results[-1].stderr[-3000:]
    assert "Run finished: max_steps=10 reached" in results[0].stdout.splitlines()
    assert results[1].stdout.splitlines()[-1] == (
        "runs/pretrain-tiny is finished: its checkpoint last.ckpt is at step 10, max_steps=10; nothing to "
        "train (a higher --trainer.max_steps trains on)")
