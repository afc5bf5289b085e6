"""Crash, preemption and resume with real processes, real signals and real files.

One tiny deterministic run (12 steps, checkpoints every 3, validation every 4, dropout on, shuffled
TextDataModule over a small prepared dataset) is the reference. Interrupted copies of it are killed
(SIGKILL) or preempted (SIGTERM/SIGUSR1) at exact points and restarted with ``--resume auto`` until
they finish; their final weights, optimizer state, RNG states and callback state must equal the
reference bit for bit, and they must have trained on exactly the same batches.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_train.callbacks.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from lightning_train.checkpoint import find_resume_checkpoint
from tests.helpers.ft_runs import assert_same, batches, fault, final_state, fit, write_config


def run_until_done(config: Path, expected_codes: list[int]) -> list[subprocess.CompletedProcess]:
    """Relaunch like a job script would until the run finishes; the exit codes must be as expected."""
    results = [fit(config) for _ in expected_codes]
    codes = [r.returncode for r in results]
    outputs = "\n---\n".join(r.stdout[-3000:] for r in results)
    assert codes == expected_codes, f"exit codes {codes}:\n{outputs}"
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("reference")
    result = fit(write_config(folder, data_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "--resume auto: no checkpoint in" in result.stdout and "starting fresh" in result.stdout
    return {"folder": folder, "state": final_state(folder), "batches": batches(folder)}


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(tmp_path: Path, reference: dict[str, Any],
                                                          data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(fault(["train:4"], tmp_path, "SIGTERM"),))
    preempted, finished = run_until_done(config, [PREEMPTED_EXIT_CODE, 0])

    # the step in progress (the 5th) was finished, then saved atomically with its manifest
    assert "exiting with code 75" in preempted.stdout
    checkpoints = tmp_path / "run" / "checkpoints"
    manifest = yaml.safe_load((checkpoints / "preempted.ckpt.manifest.json").read_text())
    assert manifest["global_step"] == 5 and manifest["files"]["preempted.ckpt"]["size"] > 0
    assert "resuming from" in finished.stdout and "preempted.ckpt" in finished.stdout
    assert_same(final_state(tmp_path), reference["state"])
    assert batches(tmp_path) == reference["batches"]


def test_ctrl_c_finishes_the_step_checkpoints_exits_130_and_resumes_exactly(
        tmp_path: Path, reference: dict[str, Any], data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(fault(["train:4"], tmp_path, "SIGINT"),))
    interrupted, finished = run_until_done(config, [INTERRUPTED_EXIT_CODE, 0])

    # what a person sees: at once what will happen, then the save, then the summary with the way back
    lines = interrupted.stdout.splitlines()
    assert "Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)" in lines
    checkpoint = tmp_path / "run" / "checkpoints" / "interrupted.ckpt"
    assert f"Interrupted (SIGINT) after step 5: saving {checkpoint}" in lines
    assert "Saved at step 5; exiting with code 130" in lines
    assert "Run interrupted by Ctrl-C at step 5: checkpoint saved" in lines
    assert f"  checkpoint  {checkpoint} (step 5)" in lines
    assert any(line.strip().endswith(f"fit --config {config} --resume auto") for line in lines), lines[-12:]
    assert "Detected KeyboardInterrupt" not in interrupted.stdout and "Traceback" not in interrupted.stdout

    manifest = yaml.safe_load((checkpoint.parent / "interrupted.ckpt.manifest.json").read_text())
    assert manifest["global_step"] == 5
    assert f"resuming from {checkpoint}" in finished.stdout
    assert_same(final_state(tmp_path), reference["state"])
    assert batches(tmp_path) == reference["batches"]


def test_a_second_ctrl_c_stops_at_once_with_130(tmp_path: Path, reference: dict[str, Any],
                                                data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(fault(["train:4"], tmp_path, "SIGINT", repeat=2),))
    stopped, finished = run_until_done(config, [INTERRUPTED_EXIT_CODE, 0])

    checkpoints = tmp_path / "run" / "checkpoints"
    assert not (checkpoints / "interrupted.ckpt").exists()  # nothing saved: it stopped at once
    assert ("Run stopped at once by a second Ctrl-C during step 5: nothing saved since the last checkpoint"
            in stopped.stdout.splitlines())
    assert f"  checkpoint  {checkpoints / 'last.ckpt'} (step 3)" in stopped.stdout.splitlines()
    assert "Traceback" not in stopped.stdout
    assert f"resuming from {checkpoints}/" in finished.stdout
    assert_same(final_state(tmp_path), reference["state"])


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bitwise_exact(tmp_path: Path, reference: dict[str, Any],
                                                       data_dir: Path) -> None:
    # killed mid-interval (last checkpoint: step 3), right after the checkpoint of step 6, in the middle
    # of the validation after step 8, and half-way through writing the checkpoint of step 9
    points = ["train:4", "train:6", "val:8"]
    config = write_config(
        tmp_path, data_dir, callbacks=(fault(points, tmp_path),),
        plugins=({"class_path": "tests.helpers.ft_callbacks.KillDuringWriteIO",
                  "init_args": {"step": 9, "marker_dir": str(tmp_path / "markers")}},),
    )
    run_until_done(config, [-signal.SIGKILL] * 4)
    checkpoints = tmp_path / "run" / "checkpoints"
    torn = checkpoints / ".epoch=0-step=9.ckpt.partial"
    assert torn.stat().st_size > 0 and not (checkpoints / "epoch=0-step=9.ckpt").exists()

    finished = fit(config)
    assert finished.returncode == 0, finished.stdout[-3000:]
    assert "resuming from" in finished.stdout and not torn.exists()  # the torn write was cleaned up
    assert_same(final_state(tmp_path), reference["state"])
    assert batches(tmp_path) == reference["batches"]


def test_async_checkpoint_killed_mid_write_resumes_from_the_previous_one_exactly(
        tmp_path: Path, reference: dict[str, Any], data_dir: Path) -> None:
    # the background write of step 9 is half on disk when SIGKILL hits the launch
    config = write_config(tmp_path, data_dir, plugins=(
        {"class_path": "tests.helpers.ft_callbacks.KillDuringWriteIO",
         "init_args": {"step": 9, "marker_dir": str(tmp_path / "markers"), "async_save": True}},))
    run_until_done(config, [-signal.SIGKILL])
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / ".epoch=0-step=9.ckpt.partial").stat().st_size > 0
    assert not (checkpoints / "epoch=0-step=9.ckpt").exists()
    assert (checkpoints / "epoch=0-step=3.ckpt").exists()  # retention waits for the newer write
    newest = find_resume_checkpoint(checkpoints)  # what --resume auto picks: a checkpoint of step 6
    assert yaml.safe_load(Path(f"{newest}.manifest.json").read_text())["global_step"] == 6

    finished = fit(config)
    assert finished.returncode == 0, finished.stdout[-3000:]
    assert f"resuming from {newest}" in finished.stdout
    assert_same(final_state(tmp_path), reference["state"])
    assert batches(tmp_path) == reference["batches"]


def test_async_checkpoint_does_not_hold_up_the_next_step(tmp_path: Path, data_dir: Path) -> None:
    log = tmp_path / "log"
    config = write_config(
        tmp_path, data_dir,
        callbacks=({"class_path": "tests.helpers.ft_callbacks.StepStarts",
                    "init_args": {"folder": str(log)}},),
        plugins=({"class_path": "tests.helpers.ft_callbacks.SlowWriteIO",
                  "init_args": {"folder": str(log), "delay": 1.0}},),
    )
    result = fit(config)
    assert result.returncode == 0, result.stdout[-3000:]
    starts = dict(line.split() for line in (log / "step-starts.txt").read_text().splitlines())
    write_ends = [line.split() for line in (log / "write-ends.txt").read_text().splitlines()]
    step, ended = write_ends[0]  # step=3.ckpt, written in a second by the background thread
    assert step == "3" and float(starts["3"]) < float(ended), "step 4 waited for the checkpoint of step 3"
    # each checkpoint is complete once fit returns: the final one was flushed before exit
    assert [int(s) for s, _ in write_ends].count(12) == 2  # epoch=0-step=12.ckpt and last.ckpt
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt")) == [
        "epoch=0-step=12.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt", "last.ckpt"]


def test_async_checkpoints_with_preemption_resume_exactly(tmp_path: Path, reference: dict[str, Any],
                                                         data_dir: Path) -> None:
    config = write_config(tmp_path, data_dir, callbacks=(fault(["train:4"], tmp_path, "SIGTERM"),))
    results = [fit(config, "--async_checkpoint", "true") for _ in range(2)]
    assert [r.returncode for r in results] == [PREEMPTED_EXIT_CODE, 0], results[0].stdout[-3000:]
    # the preemption checkpoint was written in the background and flushed before the exit
    manifest = yaml.safe_load((tmp_path / "run" / "checkpoints" / "preempted.ckpt.manifest.json").read_text())
    assert manifest["global_step"] == 5
    assert_same(final_state(tmp_path), reference["state"])
    assert batches(tmp_path) == reference["batches"]


def test_truncated_newest_checkpoint_is_skipped(tmp_path: Path, reference: dict[str, Any],
                                                data_dir: Path) -> None:
    # the reference's checkpoints minus the final steps, with the newest one cut short on disk
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt"):
        for suffix in ("", ".manifest.json"):
            source = reference["folder"] / "run" / "checkpoints" / (name + suffix)
            (checkpoints / (name + suffix)).write_bytes(source.read_bytes())
    newest = checkpoints / "epoch=0-step=9.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    result = fit(write_config(tmp_path, data_dir))
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"skipping checkpoint {newest}" in result.stdout and "truncated" in result.stdout
    assert f"resuming from {checkpoints}/epoch=0-step=6.ckpt" in result.stdout
    assert_same(final_state(tmp_path), reference["state"])


def test_checkpoint_of_another_model_shape_is_one_error(tmp_path: Path, reference: dict[str, Any],
                                                        data_dir: Path) -> None:
    source = reference["folder"] / "run" / "checkpoints" / "epoch=0-step=6.ckpt"
    before = source.read_bytes()
    result = fit(write_config(tmp_path, data_dir, n_embd=32), "--resume", str(source))
    assert result.returncode == 2, result.stdout[-3000:]
    error = result.stdout.strip().splitlines()[-1]
    assert error.startswith(f"error: checkpoint {source} does not fit this model")
    assert "size mismatch for model.embed.weight" in error and "[258, 16]" in error and "[258, 32]" in error
    assert source.read_bytes() == before
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing written for the failed run


@pytest.mark.slow
def test_two_rank_ddp_kill_and_one_rank_preempted_resume_exactly(tmp_path: Path, data_dir: Path) -> None:
    rank_seed = {"class_path": "tests.helpers.ft_callbacks.RankSeed"}
    reference = tmp_path / "reference"
    assert fit(write_config(reference, data_dir, devices=2, callbacks=(rank_seed,))).returncode == 0

    # all ranks SIGKILLed after step 4; later only rank 1 gets SIGUSR1 during step 8, the end of epoch 0
    # with a validation due (which Lightning skips on resume): both ranks stop after it.
    interrupted = tmp_path / "interrupted"
    config = write_config(interrupted, data_dir, devices=2, callbacks=(
        rank_seed, fault(["train:4"], interrupted), fault(["train:7"], interrupted, "SIGUSR1", rank=1),
    ))
    _, preempted, finished = run_until_done(config, [-signal.SIGKILL, PREEMPTED_EXIT_CODE, 0])
    # rank zero alone tells the ending
    assert preempted.stdout.count("Run preempted (signal on another rank) at step 8") == 1, preempted.stdout
    assert finished.stdout.count("Run finished: max_steps=12 reached") == 1

    manifest_file = interrupted / "run" / "checkpoints" / "preempted.ckpt.manifest.json"
    manifest = yaml.safe_load(manifest_file.read_text())
    assert manifest["global_step"] == 8
    rng = final_state(interrupted)["rng"]["per_rank"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])  # each rank's own states
    assert_same(final_state(interrupted), final_state(reference))
    for rank in (0, 1):
        assert batches(interrupted, rank) == batches(reference, rank)
