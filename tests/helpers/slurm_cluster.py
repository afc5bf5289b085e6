"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd started from the OS packages
(``make slurm`` installs them) as children of the test process, in a folder of their own.

``slurm_cluster(folder)`` writes a munge key and a ``slurm.conf`` (this machine as the node
``localhost``, free ports, state and spool in ``folder``, no cgroups, no accounting database), starts the
three daemons in the foreground, waits until the node is idle and yields a ``SlurmCluster``; on the way
out it cancels every job and stops the daemons. ``skip_reason()`` says why no cluster can start here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel")


def skip_reason() -> str | None:
    missing = [name for name in (*DAEMONS, *COMMANDS) if _which(name) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found); `make slurm` installs it from the "
                "OS packages when run as root with apt-get")
    if os.geteuid() != 0:
        return "slurmd starts jobs as their user and needs root; run the SLURM tests as root"
    return None


class SlurmCluster:
    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env

    def command(self, *args: str, timeout: float = 30) -> str:
        """Run a SLURM command against this cluster; its stdout (a failure raises, with stderr)."""
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def sbatch(self, script: Path, *options: str, env: dict[str, str], cwd: Path) -> str:
        """Submit ``script`` with ``options`` (they override its #SBATCH lines) and ``env`` as the job's
        environment; the job id."""
        env = {name: value for name, value in env.items() if not name.startswith("SLURM_")}
        result = subprocess.run(["sbatch", "--parsable", *options, str(script)], cwd=cwd,
                                env={**env, "SLURM_CONF": self.env["SLURM_CONF"]}, capture_output=True,
                                text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.command("scontrol", "show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, what: str, condition: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.5)

    def cancel_all(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.command("scancel", "--user", str(os.geteuid()))
            self.wait_for("the cancelled jobs to end", lambda: not self.command("squeue", "-h").strip(), 60)

    def logs(self) -> str:
        """The daemons' own logs, for a failure message."""
        logs = [self.folder / f"{name}.log" for name in DAEMONS]
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())


@contextlib.contextmanager
def slurm_cluster(folder: Path, cpus: int = 2) -> Iterator[SlurmCluster]:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("state", "spool", "munge"):
        (folder / name).mkdir(mode=0o700, exist_ok=True)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = folder / "munge" / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(_slurm_conf(folder, socket_path, cpus))
    # This cluster's commands only: a SLURM_* variable of an enclosing job would mislead sbatch.
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    commands = {
        # --force: munged refuses a socket folder that others may enter (a shared /tmp's parents)
        "munged": ["--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                   f"--pid-file={folder / 'munge' / 'pid'}", f"--seed-file={folder / 'munge' / 'seed'}",
                   f"--log-file={folder / 'munge' / 'log'}"],
        "slurmctld": ["-D", "-i"],
        "slurmd": ["-D", "-N", "localhost"],
    }
    processes: list[subprocess.Popen] = []
    cluster = SlurmCluster(folder, env)
    try:
        try:
            for name, arguments in commands.items():
                with (folder / f"{name}.log").open("w") as log:
                    processes.append(subprocess.Popen([_which(name) or name, *arguments], env=env, stdout=log,
                                                      stderr=subprocess.STDOUT, start_new_session=True))
                if name == "munged":
                    cluster.wait_for("munged's socket", socket_path.exists, 30)
            cluster.wait_for("the node to be idle", lambda: _node_state(cluster) == "idle", 60)
        except TimeoutError as error:
            raise RuntimeError(f"SLURM did not start: {error}\n{cluster.logs()}") from None
        yield cluster
    finally:
        if processes:
            cluster.cancel_all()
        for process in reversed(processes):  # slurmd, slurmctld, then munged, which they talk through
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node_state(cluster: SlurmCluster) -> str:
    try:
        return cluster.command("sinfo", "-h", "-N", "-o", "%T", timeout=10).strip()
    except (RuntimeError, subprocess.TimeoutExpired):
        return ""


def _slurm_conf(folder: Path, munge_socket: Path, cpus: int) -> str:
    # localhost as the node name: SLURM_NODELIST is Lightning's MASTER_ADDR, and it must resolve.
    # linuxproc + task/none: no cgroups and no systemd; no slurmdbd, so no sacct (scontrol shows Restarts).
    # config_overrides: the node counts `cpus` CPUs whatever this machine has (2 tasks on 1 core still run).
    return f"""\
ClusterName=lighttest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder / 'state'}
SlurmdSpoolDir={folder / 'spool'}
SlurmctldPidFile={folder / 'slurmctld.pid'}
SlurmdPidFile={folder / 'slurmd.pid'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
KillWait=30
SchedulerType=sched/builtin
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _which(name: str) -> str | None:
    # the daemons live in /usr/sbin, which a non-login PATH may lack
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
