"""Several nodes on one machine: each "node" is a torchrun agent of its own (``--nnodes``, the c10d
rendezvous on 127.0.0.1), so the runs see real node ranks, local ranks and node-level meshes, and a
node can be lost (its agent and workers killed) and come back (a new agent joins the rendezvous).
What runs inside the workers is in ``node_faults``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import REPO, cli_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_node(log: Path, port: int, job: str, host: bool, fit_args: list[str], nnodes: str = "2",
               max_restarts: int = 0, env: dict[str, str] | None = None) -> subprocess.Popen:
    """One node: ``torchrun --nnodes=NNODES --nproc_per_node=2 ... -m lightning_train fit FIT_ARGS``,
    its output in ``log``. ``host``: this agent serves the rendezvous store (as the node named by
    ``--rdzv-endpoint`` does on a cluster). Short keep-alive and last-call timeouts let a lost node
    drop out of the rendezvous in seconds instead of the default 15 s + 30 s."""
    conf = f"is_host={int(host)},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}", f"--rdzv-conf={conf}",
        "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        "-m", "lightning_train", "fit", *fit_args,
    ]
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}  # see docs: elastic restarts
    with log.open("ab") as out:
        return subprocess.Popen(command, cwd=REPO, env=cli_env(**extra), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait(nodes: list[subprocess.Popen], timeout: float = 400) -> list[int]:
    """The exit codes of ``nodes``; every process of them is killed if they take longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        return [node.wait(timeout=max(deadline - time.monotonic(), 1)) for node in nodes]
    finally:
        stop(nodes)


def stop(nodes: list[subprocess.Popen]) -> None:
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)  # the agent's session; its workers have sessions of their own
            node.wait()


def run_nodes(folder: Path, fit_args: list[str], nodes: int = 2, timeout: float = 400,
              env: dict[str, str] | None = None, expect: int = 0) -> list[str]:
    """Launch ``nodes`` agents of one job and wait for them; the log of each (asserting that each exited
    with ``expect``)."""
    port, logs = free_port(), [folder / f"node{n}.log" for n in range(nodes)]
    folder.mkdir(parents=True, exist_ok=True)
    agents = [start_node(logs[n], port, folder.name, host=n == 0, fit_args=fit_args, nnodes=str(nodes),
                         env=env) for n in range(nodes)]
    codes = wait(agents, timeout)
    texts = [log.read_text() for log in logs]
    assert codes == [expect] * nodes, "\n".join(f"--- node {n} (exit {c}):\n{t[-3000:]}"
                                           for n, (c, t) in enumerate(zip(codes, texts, strict=True)))
    return texts


def wait_for(condition: Any, what: str, agents: list[subprocess.Popen], timeout: float = 240) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` (and stop the agents) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or all(agent.poll() is not None for agent in agents):
            stop(agents)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def read_step_losses(path: Path) -> list[tuple[int, float, int]]:
    """``StepLoss``'s records in order: (step, loss, world size); a step recomputed after a restart
    appears again."""
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(step), float(loss), int(world)) for step, loss, world in rows]
