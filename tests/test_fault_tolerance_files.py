"""Checkpoint files in one process: atomic writes, manifests, verification, choosing what to resume from,
and the one-line errors for bad checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_train.callbacks.preemption import PreemptionCheckpoint
from lightning_train.checkpoint import (
    AtomicCheckpointIO,
    find_resume_checkpoint,
    resolve_resume,
    verify_checkpoint,
)
from lightning_train.checkpoint.atomic import atomic_checkpoint_dir, begin_checkpoint_dir
from lightning_train.checkpoint.format import manifest_path, read_manifest
from lightning_train.errors import CorruptCheckpointError, IncompatibleCheckpointError, UserInputError
from lightning_train.models.gpt import GPTConfig


def save(io: AtomicCheckpointIO, path: Path, step: int, **extra: object) -> Path:
    io.save_checkpoint({"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((64,), float(step))},
                        **extra}, path)
    return path


def test_save_writes_checkpoint_and_manifest_and_loads_back(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = save(io, tmp_path / "ckpts" / "step=3.ckpt", 3, hyper_parameters={"config": GPTConfig(n_layer=2)})
    manifest = read_manifest(path)
    assert manifest["global_step"] == 3 and manifest["format_version"] == 1
    assert manifest["files"]["step=3.ckpt"]["size"] == path.stat().st_size
    assert not list(path.parent.glob(".*"))  # no temporaries left behind

    loaded = io.load_checkpoint(path)  # weights_only, yet the module's GPTConfig comes back
    assert loaded["hyper_parameters"]["config"] == GPTConfig(n_layer=2)
    assert torch.equal(loaded["state_dict"]["w"], torch.full((64,), 3.0))

    io.remove_checkpoint(path)
    assert not path.exists() and not manifest_path(path).exists()


def test_corruption_is_detected_and_auto_resume_falls_back(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    old, new = save(io, tmp_path / "a.ckpt", 3), save(io, tmp_path / "b.ckpt", 6)
    assert find_resume_checkpoint(tmp_path) == new

    data = bytearray(new.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    new.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="does not match the sha256"):
        io.load_checkpoint(new)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {new}"):
        assert find_resume_checkpoint(tmp_path) == old
    # a named checkpoint that is corrupt is an error, never silently replaced by another one
    with pytest.raises(CorruptCheckpointError):
        resolve_resume(str(new), tmp_path)


def test_newest_is_by_step_and_manifestless_files_are_checked_as_zip(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    newest = save(io, tmp_path / "step=9.ckpt", 9)
    save(io, tmp_path / "written-later.ckpt", 2)  # newer file, older step
    torch.save({"global_step": 5}, tmp_path / "plain.ckpt")  # plain Lightning: no manifest
    (tmp_path / ".last.ckpt.partial").write_bytes(b"torn")  # an interrupted write is never a candidate
    assert find_resume_checkpoint(tmp_path) == newest

    verify_checkpoint(tmp_path / "plain.ckpt")
    (tmp_path / "torn.ckpt").write_bytes((tmp_path / "plain.ckpt").read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="not a readable torch file"):
        verify_checkpoint(tmp_path / "torn.ckpt")


@pytest.mark.parametrize("manifest, file, resumed, said", [
    ("unreadable", "whole", "older", "the manifest {manifest} is unreadable"),
    ("missing", "whole", "newer", "checkpoint {newer} has no manifest; its files pass the checks"),
    # neither a manifest nor the file says its step: named all the same, as possibly the newest
    ("missing", "torn", "older",
     "skipping checkpoint {newer}, whose step cannot be read: checkpoint {newer} is not a readable torch "
     "file"),
    ("unreadable", "torn", "older",
     "skipping checkpoint {newer}, whose step cannot be read: the manifest {manifest} is unreadable"),
])
def test_auto_resume_never_passes_over_a_newer_checkpoint_silently(
    manifest: str, file: str, resumed: str, said: str, tmp_path: Path
) -> None:
    io = AtomicCheckpointIO()
    older = save(io, tmp_path / "step=3.ckpt", 3)
    newer = save(io, tmp_path / "step=6.ckpt", 6)
    os.utime(older, (1, 1))  # the older one written later: ordering is by the step the checkpoint records
    if manifest == "missing":
        manifest_path(newer).unlink()
    else:
        manifest_path(newer).write_text('{"files": {"step=6.ckpt": ')
    if file == "torn":
        newer.write_bytes(newer.read_bytes()[:-100])
    with pytest.warns(UserWarning) as warned:
        assert find_resume_checkpoint(tmp_path) == {"older": older, "newer": newer}[resumed]
    messages = [str(warning.message) for warning in warned]
    assert any(said.format(newer=newer, manifest=manifest_path(newer)) in m for m in messages), messages
    rescued = [m for m in messages if f"delete {manifest_path(newer)} to resume from it" in m]
    assert len(rescued) == (manifest == "unreadable" and file == "whole"), messages


def test_resume_choices_and_their_errors(tmp_path: Path) -> None:
    assert resolve_resume(None, tmp_path) is None and resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "missing") is None  # a fresh run
    with pytest.raises(UserInputError, match="--resume nope.ckpt: no such file or folder"):
        resolve_resume("nope.ckpt", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="no valid checkpoint in this folder"):
        resolve_resume(str(tmp_path / "empty"), tmp_path)
    path = save(AtomicCheckpointIO(), tmp_path / "ckpts" / "last.ckpt", 4)
    assert resolve_resume(str(tmp_path / "ckpts"), tmp_path) == str(path)


def test_newer_format_is_one_clear_error_and_stops_auto_resume(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    save(io, tmp_path / "old.ckpt", 3)
    path = save(io, tmp_path / "new.ckpt", 6)
    manifest = json.loads(manifest_path(path).read_text())
    manifest_path(path).write_text(json.dumps({**manifest, "format_version": 2}))
    with pytest.raises(IncompatibleCheckpointError, match="format 2, but this lightning_train reads"):
        find_resume_checkpoint(tmp_path)  # falling back to old.ckpt would throw the newer progress away

    inner = torch.load(path, weights_only=True)
    inner["lightning_train"]["format_version"] = 2
    torch.save(inner, path)  # no manifest check this time: the version inside the file still counts
    manifest_path(path).unlink()
    with pytest.raises(IncompatibleCheckpointError, match="upgrade lightning_train"):
        io.load_checkpoint(path)


def test_ranks_touch_a_folder_checkpoint_only_after_the_writer_cleared_it(tmp_path: Path) -> None:
    """The writer clears what an interrupted write left and creates the staging folder before the barrier;
    the other ranks touch it only after. Before the fix they created it before the barrier too, and a rank
    whose mkdir found the folder while the writer's rmtree removed it raised FileExistsError (a dp2 x pp2
    CI run died of it)."""
    final = tmp_path / "last.ckpt"
    staging = final.with_name(".last.ckpt.partial")
    seen_at_barrier = []
    folder = begin_checkpoint_dir(
        final, is_writer=False, barrier=lambda: seen_at_barrier.append(staging.exists())
    )
    assert seen_at_barrier == [False] and folder == staging and staging.is_dir()

    (staging / "__0_0.distcp").write_bytes(b"stale")
    seen_at_barrier.clear()
    folder = begin_checkpoint_dir(
        final, is_writer=True, barrier=lambda: seen_at_barrier.append(list(staging.iterdir()))
    )
    assert seen_at_barrier == [[]] and folder == staging and staging.is_dir()


def test_checkpoint_folder_is_atomic_and_verified(tmp_path: Path) -> None:
    final = tmp_path / "step=5.ckpt"
    with atomic_checkpoint_dir(final, global_step=5, epoch=0) as staging:
        assert not final.exists()
        torch.save({"w": torch.ones(8)}, staging / "__0_0.distcp")
        (staging / ".metadata").write_bytes(b"index")
    manifest = verify_checkpoint(final)
    assert manifest["global_step"] == 5 and set(manifest["files"]) == {"__0_0.distcp", ".metadata"}
    assert find_resume_checkpoint(tmp_path) == final

    (final / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        verify_checkpoint(final)
    (final / "manifest.json").unlink()
    (final / ".metadata").unlink()
    with pytest.raises(CorruptCheckpointError, match="unfinished"):
        verify_checkpoint(final)


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    save(AtomicCheckpointIO(), path, 1)
    before = path.read_bytes()
    # a real process killed while torch.save streams a large checkpoint into the temporary file
    script = (
        "import os, signal, threading, torch, sys\n"
        "from lightning_train.checkpoint import AtomicCheckpointIO\n"
        "partial = sys.argv[2]\n"
        "def kill_when_writing():\n"
        "    while not (os.path.exists(partial) and os.path.getsize(partial) > 0): pass\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "threading.Thread(target=kill_when_writing, daemon=True).start()\n"
        "AtomicCheckpointIO().save_checkpoint({'global_step': 2, 'w': torch.randn(1 << 24)}, sys.argv[1])\n"
    )
    partial = tmp_path / ".last.ckpt.partial"
    result = subprocess.run([sys.executable, "-c", script, str(path), str(partial)], timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.returncode == -signal.SIGKILL and partial.stat().st_size > 0  # died mid-write
    assert path.read_bytes() == before and verify_checkpoint(path)["global_step"] == 1
    assert find_resume_checkpoint(tmp_path) == path


def test_unknown_preemption_signal_is_a_user_error() -> None:
    with pytest.raises(UserInputError, match="unknown signal 'SIGNOPE'"):
        PreemptionCheckpoint(signals=["SIGTERM", "SIGNOPE"])
    assert [s.name for s in PreemptionCheckpoint(signals=["usr1"]).signals] == ["SIGUSR1"]
