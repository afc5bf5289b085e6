"""A run whose disk fills up or turns read-only mid-run: one ``error:`` line naming the file, the bytes
free and needed, and the fix; no partial file left behind; the checkpoints written before it intact and
the newest valid one; no callback writing after the failure; and once there is room again, ``--resume
auto`` continues the run. On a real file system that fills up: a tmpfs mounted for the test (root only,
skipped with the reason elsewhere)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lightning_train.checkpoint import find_resume_checkpoint
from lightning_train.checkpoint.format import read_manifest
from tests.conftest import run_cli_in_process
from tests.helpers.ft_runs import MAX_STEPS, write_config
from tests.helpers.full_disk import small_disk

CHECKPOINT_AT_6 = "checkpoints/epoch=0-step=6.ckpt"
CASES = {  # (how the disk fails after step 4, bytes left, extra arguments, the start of the error line)
    # read-only: the run's checkpoint folder
    "full": ("full", 40_000, (), f"cannot write {{run}}/{CHECKPOINT_AT_6}: no space left on the device"),
    "full-async": ("full", 40_000, ("--async_checkpoint", "true"),
                   f"cannot write {{run}}/{CHECKPOINT_AT_6}: no space left on the device"),
    "full-sharded": ("full", 40_000, ("--trainer.strategy", "lt_fsdp"),  # a DCP folder per checkpoint
                     f"cannot write {{run}}/{CHECKPOINT_AT_6}: no space left on the device"),
    "read-only": ("read_only", 0, (),
                  f"cannot write {{run}}/{CHECKPOINT_AT_6}: the file system is read-only"),
    # the metrics of step 4's validation no longer fit: Lightning's CSV logger fails, not a checkpoint
    "full-metrics": ("full", 0, (), "cannot write {run}/version_0: no space left on the device"),
}


def files_named(folder: Path, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(pattern))


@pytest.mark.parametrize("case", list(CASES))
def test_a_disk_that_fails_mid_run_ends_it_in_one_line_and_loses_nothing(
    case: str, tmp_path: Path, data_dir: Path
) -> None:
    how, leave, extra, expected = CASES[case]
    disk = tmp_path / "disk"
    with small_disk(disk, "8m"):
        run = disk / "run"
        failing = run / "checkpoints" if how == "read_only" else disk
        fill = {"class_path": "tests.helpers.full_disk.FillDisk",
                "init_args": {"folder": str(failing), "at_step": 4, "leave": leave, "how": how}}
        config = write_config(tmp_path, data_dir, callbacks=(fill,))
        args = ("fit", "--config", str(config), "--trainer.default_root_dir", str(run), *extra)
        failed = run_cli_in_process(*args, cwd=tmp_path)

        assert failed.returncode == 2, failed.stderr[-3000:]
        assert "Traceback" not in failed.stderr
        errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, failed.stderr[-3000:]
        assert errors[0].startswith(f"error: {expected.format(run=run)}"), errors[0]
        assert errors[0].endswith("and continue the run with --resume auto")
        if case.startswith("full") and case != "full-metrics":
            assert "bytes free there; it needs" in errors[0]
        assert ("; make it writable (or" if how == "read_only" else "; free space there (or") in errors[0]
        assert files_named(disk, "*.partial") == []  # nothing half-written keeps the disk full

        newest = find_resume_checkpoint(run / "checkpoints")  # verified against its manifest
        assert newest is not None and read_manifest(newest)["global_step"] == 3
        goodput = json.loads((run / "version_0" / "goodput.json").read_text())
        assert goodput["launches"][-1]["state"] == "training"  # not rewritten as "stopped" after the failure

        if how == "read_only":
            subprocess.run(["umount", str(failing)], check=True)
        (disk / "filler.bin").unlink(missing_ok=True)
        again = write_config(tmp_path / "again", data_dir)  # the same run without the failing disk
        resumed = run_cli_in_process("fit", "--config", str(again), "--trainer.default_root_dir", str(run),
                                     "--resume", "auto", *extra, cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"--resume auto: resuming from {newest}" in resumed.stderr + resumed.stdout
        assert read_manifest(run / "checkpoints" / "last.ckpt")["global_step"] == MAX_STEPS
