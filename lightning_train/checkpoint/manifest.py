"""The checkpoint format's names and the parts of a manifest shared by local disks (``format.py``) and
object storage (``remote.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lightning_train.errors import IncompatibleCheckpointError

FORMAT_VERSION = 1  # bump when the checkpoint layout changes incompatibly
FORMAT_KEY = "lightning_train"  # checkpoint[FORMAT_KEY] = {"format_version": FORMAT_VERSION}
MANIFEST_SUFFIX = ".manifest.json"
FOLDER_MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded save
# The launcher job that wrote a checkpoint, recorded in its manifest as {key: value} of those set: a
# restarted torchrun group or requeued SLURM job resumes implicitly only from its own (cli/elastic.py).
LAUNCH_IDS = {"torchelastic_run_id": "TORCHELASTIC_RUN_ID", "slurm_job_id": "SLURM_JOB_ID"}


def launch_ids() -> dict[str, str]:
    """This process's launcher job ids (torchrun's run id, SLURM's job id), those that are set."""
    return {key: os.environ[name] for key, name in LAUNCH_IDS.items() if os.environ.get(name)}


def new_manifest(
    global_step: int | None, epoch: int | None, files: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """A manifest naming ``files`` (name -> size and sha256), written by this process now."""
    return {
        "format_version": FORMAT_VERSION, "global_step": global_step, "epoch": epoch,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "launch": launch_ids(), "files": files,
    }


def check_format_version(version: int, source: str | Path) -> None:
    if version > FORMAT_VERSION:
        raise IncompatibleCheckpointError(
            f"{source} was written with checkpoint format {version}, but this lightning_train reads format "
            f"{FORMAT_VERSION} and older; upgrade lightning_train to resume from it"
        )
