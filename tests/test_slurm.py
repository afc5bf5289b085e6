"""``scripts/slurm-requeue.sbatch`` on a real SLURM cluster (munged, slurmctld and slurmd of this machine,
``tests.helpers.slurm_cluster``): submitted with sbatch, preempted by ``scontrol requeue`` and by the
script's own ``--signal=USR1@180`` warning (the running job's time limit cut so that it is due),
requeued, and resumed to the weights, optimizer, scheduler, RNG and callback states of an uninterrupted
run, bitwise.

The job is the tiny deterministic 2-rank run of test_fault_tolerance (12 steps, checkpoints every 3),
one node, 2 tasks started by the script's srun; Lightning's SLURMEnvironment gives the ranks. The first
launch waits after step 5 until SLURM's signal comes (``tests.helpers.preemption_wait``), so the
preemption lands at a known step however long the start-up took.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_train.checkpoint.format import read_manifest
from tests.conftest import REPO, cli_env
from tests.helpers.ft_runs import assert_same, batches, final_state, fit, write_config
from tests.helpers.slurm_cluster import SlurmCluster, free_port, skip_reason, slurm_cluster

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

SCRIPT = REPO / "scripts" / "slurm-requeue.sbatch"
# The script asks for 2 nodes of 8 GPUs; options on the command line override its #SBATCH lines
# (and a 10-minute limit bounds a job that went wrong).
ONE_CPU_NODE = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10")
PREEMPT_AFTER = 5
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Any]:
    """The same 2-rank run, uninterrupted and without SLURM."""
    folder = tmp_path_factory.mktemp("reference")
    result = fit(write_config(folder, data_dir, devices=2))
    assert result.returncode == 0, result.stdout[-3000:]
    return {"state": final_state(folder), "batches": [batches(folder, rank) for rank in (0, 1)]}


class Job:
    """One submission of the script: its run folder, log and SLURM job id."""

    def __init__(self, cluster: SlurmCluster, folder: Path, data_dir: Path) -> None:
        wait = {"class_path": "tests.helpers.preemption_wait.WaitForPreemption",
                "init_args": {"step": PREEMPT_AFTER, "marker_dir": str(folder / "markers")}}
        config = write_config(folder, data_dir, devices=2, callbacks=(wait,))
        self.cluster, self.folder, self.log = cluster, folder, folder / "job.out"
        # MASTER_PORT: Lightning derives it from the job id, which two clusters (xdist workers) share.
        env = cli_env(CONFIG=str(config), MASTER_PORT=str(free_port()),
                      PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # `python`
        self.id = cluster.sbatch(SCRIPT, *ONE_CPU_NODE, f"--output={self.log}", env=env, cwd=REPO)

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def wait_until(self, what: str, condition: Any, timeout: float) -> dict[str, str]:
        def done() -> bool:
            info = self.info()
            if condition(info):
                return True
            assert info["JobState"] not in FINISHED, f"job {self.id} ended ({info['JobState']}) {self.tail()}"
            return False

        try:
            self.cluster.wait_for(f"job {self.id}: {what}", done, timeout)
        except TimeoutError as error:
            raise AssertionError(f"{error} ({self.info()}) {self.tail()}") from None
        return self.info()

    def wait_at_step(self) -> None:
        """Until both ranks wait after step PREEMPT_AFTER for the signal."""
        markers = [self.folder / "markers" / f"waiting-rank{rank}" for rank in (0, 1)]
        self.wait_until(f"both ranks at step {PREEMPT_AFTER}", lambda _: all(map(Path.exists, markers)), 240)

    def rerun_now(self, *updates: str) -> None:
        """Once requeued, start it soon: SLURM holds a requeued job (here about 2 minutes) before it
        becomes eligible again. Not in the same second: slurmd revoked the job's credential when it ended
        the first launch and refuses one created in that second too ("Job credential revoked": the job
        FAILED), so the rerun starts 2 s on."""
        info = self.wait_until("requeued", lambda i: i["JobState"] == "PENDING" and i["Restarts"] != "0", 120)
        assert info["Restarts"] == "1"
        self.cluster.command("scontrol", "update", f"JobId={self.id}", "StartTime=now+2", *updates)

    def tail(self) -> str:
        text = self.log.read_text() if self.log.exists() else "(no log)"
        return f"\n--- {self.log}\n{text[-5000:]}\n{self.cluster.logs()}"

    def check_resumed_to_the_reference(self, reference: dict[str, Any], signal_name: str) -> str:
        info = self.wait_until("completed", lambda i: i["JobState"] == "COMPLETED", 300)
        assert (info["Restarts"], info["ExitCode"]) == ("1", "0:0")
        log, checkpoints = self.log.read_text(), self.folder / "run" / "checkpoints"
        preempted = checkpoints / "preempted.ckpt"
        # --open-mode=append: the first launch and the rerun in one log
        assert f"Preempted ({signal_name}) after step {PREEMPT_AFTER}: saving {preempted}" in log, self.tail()
        assert f"--resume auto: resuming from {preempted}" in log, self.tail()
        assert log.count("Run finished: max_steps=12 reached") == 1, self.tail()
        assert (read_manifest(preempted) or {})["launch"]["slurm_job_id"] == self.id  # written inside the job
        assert_same(final_state(self.folder), reference["state"])
        for rank in (0, 1):  # steps 1-5 before, 6-12 after the requeue: each on the reference's batch
            assert batches(self.folder, rank) == reference["batches"][rank]
        return log


def test_scontrol_requeue_checkpoints_requeues_and_resumes_exactly(
        cluster: SlurmCluster, reference: dict[str, Any], tmp_path: Path, data_dir: Path) -> None:
    job = Job(cluster, tmp_path, data_dir)
    job.wait_at_step()
    # SLURM ends the running job as at a preemption (SIGTERM to every process, SIGKILL after KillWait)
    # and requeues it itself: the ranks save preempted.ckpt and exit 75; the batch shell dies of SIGTERM.
    cluster.command("scontrol", "requeue", job.id)
    job.rerun_now()
    job.check_resumed_to_the_reference(reference, "SIGTERM")


@pytest.mark.slow  # a 2-rank job run twice, and up to 30 s for SLURM's time-limit check: ~1 min
def test_the_time_limit_warning_checkpoints_and_the_script_requeues(
        cluster: SlurmCluster, reference: dict[str, Any], tmp_path: Path, data_dir: Path) -> None:
    job = Job(cluster, tmp_path, data_dir)
    job.wait_at_step()
    # A time limit 3 minutes after the job's current whole minute (2-3 minutes from now): the script's
    # --signal=USR1@180 is due, and SLURM sends SIGUSR1 to the tasks at its next time-limit check (every
    # 30 s); the ranks save and exit 75, and the script runs scontrol requeue.
    minutes = seconds(job.info()["RunTime"]) // 60 + 3
    cluster.command("scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}")
    # The rerun gets a limit long enough not to be warned again at once.
    job.rerun_now("TimeLimit=10")
    log = job.check_resumed_to_the_reference(reference, "SIGUSR1")
    assert f"preempted at a checkpoint: requeueing job {job.id}" in log, job.tail()


def seconds(duration: str) -> int:
    """SLURM's [days-]hours:minutes:seconds in seconds."""
    days, _, clock = duration.rpartition("-")
    hours, minutes, secs = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs
