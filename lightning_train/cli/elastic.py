"""Elastic restarts: ``fit`` in a restarted torchrun group or a requeued SLURM job.

When a rank dies, ``torchrun --max-restarts N`` restarts the whole group with the same command line,
and SLURM reruns a requeued job's script; both count the restarts in the environment
(``TORCHELASTIC_RESTART_COUNT``, ``SLURM_RESTART_COUNT``). A restarted ``fit`` that names neither
``--resume`` nor ``--ckpt_path`` resumes as ``--resume auto`` would, so continuing needs no flag to
remember; an explicit one still wins. It resumes only the job's own run: checkpoint manifests record
the job that wrote them (``launch``: torchrun's run id, SLURM's job id), and a restart whose folder
holds only another job's checkpoints starts as its command says (a first launch that was refused
because the folder holds a run stays refused).

Under torchrun the process layout is torchrun's: ``trainer.devices`` must be its ``--nproc_per_node``
(``auto`` and ``-1`` become it), and ``trainer.num_nodes`` is the group's node count, which an elastic
group (``--nnodes=MIN:MAX``) may change from one restart to the next.

Example (a process of a torchrun group's first restart, as torchrun sets it up):

    >>> import os
    >>> import tempfile
    >>> from lightning_train.cli.elastic import restart_resume, torchrun_layout
    >>> os.environ.update(TORCHELASTIC_RUN_ID="job-1", TORCHELASTIC_RESTART_COUNT="1", RANK="0",
    ...                   LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2")
    >>> restart_resume(None, None, tempfile.mkdtemp())  # no checkpoint yet: auto starts fresh
    'auto'
    >>> restart_resume("none", None, tempfile.mkdtemp())  # an explicit choice wins
    'none'
    >>> torchrun_layout({"devices": "auto", "num_nodes": 1})
    {'devices': 2, 'num_nodes': 2}
    >>> torchrun_layout({"devices": 8, "num_nodes": 1})
    Traceback (most recent call last):
    ...
    lightning_train.errors.UserInputError: --trainer.devices=8 does not match torchrun's ...
    >>> for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "LOCAL_RANK",
    ...              "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
    ...     del os.environ[name]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_train.checkpoint.format import LAUNCH_IDS, launch_ids, read_manifest
from lightning_train.checkpoint.resume import checkpoints_newest_first
from lightning_train.errors import CorruptCheckpointError, UserInputError

RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_resume(resume: str | None, ckpt_path: str | None, checkpoint_dir: str | Path) -> str | None:
    """``fit``'s ``--resume``: ``"auto"`` when neither ``--resume`` nor ``--ckpt_path`` was given and
    the checkpoint folder holds checkpoints of this job, or none at all in a restarted one; else
    ``resume`` as given.

    This job: torchrun's run id (kept across ``--max-restarts``; ``--standalone`` makes a new one per
    torchrun, ``--rdzv-id`` names it), SLURM's job id in a requeued job. torchrun counts restarts per
    node (a node whose workers were stopped for another node's failure, or that joined later, counts
    fewer), so the checkpoints' job, the same on every rank, decides; the count only where no job
    id tells (a first attempt that died before its first checkpoint, or ``--rdzv-id`` left "none")."""
    if resume is not None or ckpt_path is not None:
        return resume
    counts = ", ".join(f"{name}={_count(name)}" for name in RESTART_COUNTS if _count(name) > 0)
    job = {key: value for key, value in launch_ids().items() if value != "none"}
    if not _count("SLURM_RESTART_COUNT"):
        job.pop("slurm_job_id", None)  # two fits in one job script stay two runs
    written = [_launch_of(path) for path in checkpoints_newest_first(checkpoint_dir)]
    ids = ", ".join(f"{LAUNCH_IDS[key]}={value}" for key, value in job.items())
    if any(launch.get(key) == value for launch in written for key, value in job.items()):
        why = f"{checkpoint_dir} holds checkpoints of this job ({ids})"
    elif counts and not written:
        why = f"{counts}, no checkpoint yet"
    elif counts and not job:
        why = f"{counts}, no job id to tell whose checkpoints these are"
    else:
        if counts:
            rank_zero_info(f"{counts}, but the checkpoints in {checkpoint_dir} are another job's: not "
                           "resuming them without --resume auto")
        return resume
    rank_zero_info(f"{why}: resuming as with --resume auto (no --resume or --ckpt_path given)")
    return "auto"


def torchrun_layout(trainer: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's ``devices`` and ``num_nodes`` under torchrun (nothing elsewhere, or when the
    config names its own cluster environment). A ``devices`` count other than torchrun's processes
    per node is one ``UserInputError`` naming both; so is ``--max-restarts`` with the store torchrun
    shares with its workers by default (torch 2.13), in which a restarted group cannot connect."""
    plugins = trainer.get("plugins")
    plugins = plugins if isinstance(plugins, list) else [plugins]
    if (not TorchElasticEnvironment.detect() or "LOCAL_WORLD_SIZE" not in os.environ
            or any(isinstance(p, ClusterEnvironment) for p in plugins)):
        return {}
    restarts = _count("TORCHELASTIC_MAX_RESTARTS")
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The workers' keys (every process group's addresses) are not namespaced by attempt in the
        # store torchrun keeps across restarts: a restarted group reads the last attempt's and fails.
        raise UserInputError(
            f"torchrun --max-restarts={restarts} shares its rendezvous store with the workers, where a "
            "restarted group finds the previous attempt's addresses and fails to connect; start torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and the c10d rendezvous "
            "(--standalone on one machine, --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT across machines)"
        )
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or int(os.environ["WORLD_SIZE"]) // per_node)
    devices = trainer.get("devices", "auto")
    count = _device_count(devices)
    if count is not None and count != per_node:
        raise UserInputError(
            f"--trainer.devices={devices} does not match torchrun's --nproc_per_node={per_node} (the "
            f"processes it started on this node, one device each); pass --trainer.devices={per_node} "
            f"(or auto), or start torchrun with --nproc_per_node={count}"
        )
    configured = trainer.get("num_nodes")
    if configured not in (None, 1, nodes):
        rank_zero_warn(f"--trainer.num_nodes={configured} ignored: this torchrun group has {nodes} node(s) "
                       f"of {per_node} processes")
    return {"devices": per_node if count is None else devices, "num_nodes": nodes}


def _count(name: str) -> int:
    try:
        return int(os.environ.get(name) or 0)
    except ValueError:
        return 0


def _launch_of(checkpoint: Path) -> dict[str, Any]:
    try:
        manifest = read_manifest(checkpoint)
    except CorruptCheckpointError:
        return {}
    return (manifest or {}).get("launch") or {}


def _device_count(devices: Any) -> int | None:
    """How many devices ``devices`` names; None for ``auto`` and ``-1`` (every device)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip().lower()
    if text in ("auto", "-1"):
        return None
    if "," in text:
        return len([part for part in text.split(",") if part.strip()])
    return int(text) if text.isdigit() else None
