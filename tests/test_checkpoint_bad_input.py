"""Bad checkpoint input, through every path a user passes one: one ``error:`` line naming the file and the
fix, exit code 2, no traceback, and nothing in a hostile file executed (each command runs in this process
from its argv on: a hostile file that ran would create its marker here as well)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from lightning_train.checkpoint import consolidate, save_safetensors
from lightning_train.models.gpt import GPT
from tests.conftest import REPO, run_cli_in_process

PRETRAIN = str(REPO / "configs" / "pretrain-tiny.yaml")
FINETUNE = str(REPO / "configs" / "finetune-tiny.yaml")


class RunsCode:
    """Unpickling this creates the file ``marker``: proof that a loader executed the checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def hostile(folder: Path) -> tuple[Path, Path]:
    """A zip-format checkpoint whose pickle calls ``open`` when loaded, and the marker it would create."""
    marker = folder / "EXECUTED"
    path = folder / "hostile.ckpt"
    torch.save({"state_dict": {"model.embed.weight": torch.zeros(2)}, "global_step": 1,
                "payload": RunsCode(marker)}, path)
    return path, marker


def truncated(folder: Path) -> Path:
    whole = folder / "whole.ckpt"
    torch.save({"state_dict": {"model.embed.weight": torch.zeros(4096)}, "global_step": 1}, whole)
    path = folder / "truncated.ckpt"
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return path


def foreign(folder: Path) -> Path:
    path = folder / "foreign.ckpt"
    path.write_text("not a checkpoint\n" * 20)
    return path


# every command line that takes a checkpoint, up to the checkpoint's path
PATHS = {
    "fit --ckpt_path": ["fit", "--config", PRETRAIN, "--ckpt_path"],
    "validate --ckpt_path": ["validate", "--config", PRETRAIN, "--ckpt_path"],
    "fit --resume": ["fit", "--config", PRETRAIN, "--resume"],
    "generate --checkpoint": ["generate", "--prompt", "hi", "--checkpoint"],
    "consolidate --checkpoint": ["consolidate", "--output", "exported", "--checkpoint"],
    "FinetuneModule(init_from)": ["fit", "--config", FINETUNE, "--model.init_args.init_from"],
}
FIXES = {  # what each error line tells the user
    "hostile": "re-save its tensors", "truncated": "not a readable torch file", "foreign": "not a checkpoint",
}


def assert_one_error_line(result, path: Path, fix: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert path.name in errors[0] and fix in errors[0], errors[0]


# a foreign file takes the same road as a truncated one (no manifest, not a zip): checked once
CASES = [(where, kind) for where in PATHS for kind in ("hostile", "truncated")]
CASES.append(("fit --ckpt_path", "foreign"))


@pytest.mark.parametrize(("where", "kind"), CASES)
def test_bad_checkpoint_is_one_error_line(tmp_path, where, kind):
    if kind == "hostile":
        path, marker = hostile(tmp_path)
    else:
        path, marker = (truncated if kind == "truncated" else foreign)(tmp_path), tmp_path / "EXECUTED"
    args = PATHS[where]
    root = ["--trainer.default_root_dir", str(tmp_path / "run")] if args[0] in ("fit", "validate") else []
    result = run_cli_in_process(*args, str(path), *root, cwd=tmp_path)
    assert_one_error_line(result, path, FIXES[kind])
    assert not marker.exists()  # nothing in the file ran


def test_hostile_sharded_folder_runs_nothing(tmp_path, tiny_config):
    """DCP's own reader unpickles ``.metadata`` with plain pickle: ours refuses anything but its classes."""
    from torch.distributed.checkpoint import save

    folder, marker = tmp_path / "sharded", tmp_path / "EXECUTED"
    model = GPT(tiny_config)
    save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=str(folder))
    torch.save({"global_step": 3, "hyper_parameters": {"config": tiny_config}}, folder / "meta.pt")
    consolidate(str(folder), str(tmp_path / "fine"))  # the honest folder exports

    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    output = str(tmp_path / "x")
    result = run_cli_in_process("consolidate", "--checkpoint", str(folder), "--output", output, cwd=tmp_path)
    assert_one_error_line(result, folder, "is not allowed in a DCP .metadata file")
    assert not marker.exists()

    torch.save({"hyper_parameters": {"config": tiny_config}, "payload": RunsCode(marker)}, folder / "meta.pt")
    result = run_cli_in_process("generate", "--checkpoint", str(folder), "--prompt", "hi", cwd=tmp_path)
    assert_one_error_line(result, folder, "re-save its tensors")
    assert not marker.exists()


def test_consolidate_writes_files_readable_like_any_other(tmp_path, tiny_config):
    old = os.umask(0o022)
    try:
        folder = save_safetensors(GPT(tiny_config), tmp_path / "export")
        mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    finally:
        os.umask(old)
    assert mode == {"model.safetensors": 0o644, "config.json": 0o644}
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt"


def test_consolidate_returns_what_it_wrote_and_prints_nothing(tmp_path, tiny_config, capsys):
    model = GPT(tiny_config)
    source = tmp_path / "m.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"config": tiny_config}}, source)
    written = consolidate(str(source), str(tmp_path / "out"))
    assert written == tmp_path / "out" / "model.safetensors" and written.is_file()
    assert capsys.readouterr().out == ""
