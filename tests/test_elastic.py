"""Elastic restarts through the CLI: a rank SIGKILLed under ``torchrun --max-restarts`` and the group's
restart resuming without a flag; a requeued SLURM job that is finished, another job's folder, an explicit
``--resume none``; torchrun's process layout against ``trainer.devices``, also inside SLURM.

The tiny deterministic run of test_fault_tolerance (12 steps, checkpoints every 3, validation every 4).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.plugins.environments import ClusterEnvironment

from lightning_train.checkpoint import AtomicCheckpointIO
from lightning_train.cli.elastic import torchrun_layout
from lightning_train.cli.run_defaults import run_defaults
from lightning_train.errors import UserInputError
from tests.conftest import REPO, cli_env
from tests.helpers.ft_runs import MAX_STEPS, assert_same, batches, final_state, fit, write_config

RESUMED = "resuming as with --resume auto (no --resume or --ckpt_path given)"


def kill_rank(rank: int, after_step: int, folder: Path) -> dict:
    """SIGKILL of one rank's own process before step ``after_step`` + 1, once (a marker file remembers)."""
    return {"class_path": "tests.helpers.ft_callbacks.Fault", "init_args": {
        "points": [f"train:{after_step}"], "marker_dir": str(folder / "markers"), "signal_name": "SIGKILL",
        "rank": rank, "whole_group": False}}


def launch(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m lightning_train fit --config CONFIG ARGS`` (no ``--resume``) with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_train", "fit", "--config", str(config), *args], cwd=REPO,
        env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
    )


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_as_an_uninterrupted_one(
        tmp_path: Path, data_dir: Path) -> None:
    reference = tmp_path / "reference"
    assert fit(write_config(reference, data_dir, devices=2)).returncode == 0

    # rank 1 kills itself after step 7 (the last checkpoint: step 6); torchrun restarts both ranks
    elastic = tmp_path / "elastic"
    config = write_config(elastic, data_dir, devices=2, callbacks=(kill_rank(1, 7, elastic),))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
         "--max-restarts=1", "-m", "lightning_train", "fit", "--config", str(config), "--trainer.devices=2"],
        cwd=REPO, env=cli_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=400,
    )
    output = result.stdout
    assert result.returncode == 0, output[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in output  # the kill, seen by torchrun
    assert output.count(RESUMED) == 1 and "holds checkpoints of this job (TORCHELASTIC_RUN_ID=" in output
    assert f"--resume auto: resuming from {elastic / 'run' / 'checkpoints'}" in output
    assert output.count("Run finished: max_steps=12 reached") == 1
    assert_same(final_state(elastic), final_state(reference))
    for rank in (0, 1):  # step 7 was trained twice, on the same batch both times
        assert batches(elastic, rank) == batches(reference, rank)


@pytest.fixture
def finished_run(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The config of a run whose final checkpoint (step 12) SLURM job 41 wrote, as AtomicCheckpointIO
    writes it."""
    config = write_config(tmp_path, data_dir)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    AtomicCheckpointIO().save_checkpoint({"global_step": MAX_STEPS, "epoch": 0},
                                         tmp_path / "run" / "checkpoints" / "last.ckpt")
    return config


def test_a_requeued_job_after_its_final_checkpoint_exits_0_at_once(finished_run: Path) -> None:
    result = launch(finished_run, SLURM_JOB_ID="41", SLURM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stdout[-3000:]
    checkpoints = finished_run.parent / "run" / "checkpoints"
    assert f"{checkpoints} holds checkpoints of this job (SLURM_JOB_ID=41): {RESUMED}" in result.stdout
    assert f"is finished: its checkpoint last.ckpt is at step {MAX_STEPS}" in result.stdout
    assert sorted(p.name for p in (finished_run.parent / "run").iterdir()) == ["checkpoints"]  # no launch


def test_another_jobs_run_and_an_explicit_resume_none_are_not_resumed(finished_run: Path) -> None:
    other = launch(finished_run, SLURM_JOB_ID="42", SLURM_RESTART_COUNT="1")
    assert other.returncode == 2, other.stdout[-3000:]
    assert "SLURM_RESTART_COUNT=1, but the checkpoints in" in other.stdout and RESUMED not in other.stdout
    assert other.stdout.strip().splitlines()[-1].endswith(
        "already holds a run; a new fit would mix with it. Continue that run with --resume auto, or start "
        "a new one in its own folder with --run_name NAME")

    explicit = launch(finished_run, "--resume", "none", SLURM_JOB_ID="41", SLURM_RESTART_COUNT="1")
    assert explicit.returncode == 2, explicit.stdout[-3000:]
    assert RESUMED not in explicit.stdout and "already holds a run" in explicit.stdout


def test_devices_other_than_torchruns_processes_is_one_error(tmp_path: Path, data_dir: Path) -> None:
    torchrun_env = {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29999"}
    result = launch(write_config(tmp_path, data_dir), "--trainer.devices=1", **torchrun_env)
    assert result.returncode == 2, result.stdout[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "error: --trainer.devices=1 does not match torchrun's --nproc_per_node=2 (the processes it started "
        "on this node, one device each); pass --trainer.devices=2 (or auto), or start torchrun with "
        "--nproc_per_node=1")
    assert not (tmp_path / "run").exists()


def test_torchrun_layout_follows_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                        "GROUP_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert torchrun_layout({"devices": "auto", "num_nodes": 1}) == {"devices": 4, "num_nodes": 2}
    assert torchrun_layout({"devices": [0, 1, 2, 3]}) == {"devices": [0, 1, 2, 3], "num_nodes": 2}
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # an elastic group restarted on one node of two
    with pytest.warns(UserWarning, match="--trainer.num_nodes=2 ignored: this torchrun group has 1 node"):
        assert torchrun_layout({"devices": 4, "num_nodes": 2}) == {"devices": 4, "num_nodes": 1}

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's default store sharing
    with pytest.raises(UserInputError, match="start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        torchrun_layout({"devices": 4})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert torchrun_layout({"devices": 4}) == {"devices": 4, "num_nodes": 1}


def test_under_torchrun_inside_slurm_the_ranks_are_torchruns(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    def environments() -> list[str]:
        plugins = run_defaults({"default_root_dir": str(tmp_path)}, "fit", ["fit"])["plugins"]
        return [type(plugin).__name__ for plugin in plugins if isinstance(plugin, ClusterEnvironment)]

    monkeypatch.setenv("SLURM_NTASKS", "2")  # srun started this process: one task of a SLURM job step
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "pretrain")
    assert environments() == ["SLURMEnvironment"]  # with auto_requeue=False, the ranks from SLURM
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # srun started torchrun, which started this process
    assert environments() == []  # Lightning's own choice: TorchElasticEnvironment, the ranks from torchrun
