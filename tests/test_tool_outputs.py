"""Where prepare, export, consolidate and report write (issue 33): an output never overlaps an input,
``--overwrite`` replaces only what the tool itself wrote, and a write the file system refuses (full,
read-only, a file where a folder should be) is one ``error:`` line naming the path, with nothing
half-written left behind. Each case runs the CLI in this process on a workspace of tiny inputs, then
checks that every file and folder there is as it was."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_train.checkpoint import save_safetensors
from lightning_train.models.gpt import GPT, GPTConfig
from tests.conftest import run_cli_in_process
from tests.helpers.full_disk import fill, small_disk

# about 120k parameters: half a megabyte of weights, more than a filled small disk has left
MODEL = GPTConfig(vocab_size=258, block_size=16, n_layer=2, n_head=2, n_embd=64)
TOOLS = {  # each tool's command line for an output folder, run in the workspace
    "prepare": lambda out: ["prepare", "--inputs", "[texts]", "--output_dir", out, "--num_workers", "0"],
    "export": lambda out: ["export", "--checkpoint", "model", "--output", out],
    "consolidate": lambda out: ["consolidate", "--checkpoint", "model", "--output", out],
    "report": lambda out: ["report", "run", "--output_dir", out],
}
OVERWRITE = ["--overwrite", "true"]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """The tools' inputs: texts/ (prepare), model/ (export), run/ (report); and what no tool wrote: a
    user's own Hugging Face folder hf/ and a file notes.txt."""
    (tmp_path / "texts").mkdir()
    for n in range(2):  # 220 kB of text: 440 kB of uint16 tokens
        (tmp_path / "texts" / f"t{n}.txt").write_text(f"line {n} of a text to tokenize\n" * 3500)
    save_safetensors(GPT(MODEL), tmp_path / "model")
    (tmp_path / "run" / "version_0").mkdir(parents=True)
    with open(tmp_path / "run" / "version_0" / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "epoch", "train/loss", "train/lr"])
        writer.writeheader()
        writer.writerows({"step": s, "epoch": 0, "train/loss": 5 - s / 10, "train/lr": 1e-3}
                         for s in range(10))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}\n')
    (tmp_path / "hf" / "README.md").write_text("my model\n")
    save_file({"lm_head.weight": torch.ones(4, 4)}, str(tmp_path / "hf" / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "notes.txt").write_text("mine\n")
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {str(path.relative_to(folder)): path.read_bytes() if path.is_file() else None
            for path in sorted(folder.rglob("*"))}


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a refused command (exit code 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


# ---- refused before anything is written -------------------------------------------------------------
REFUSALS = {  # the command, and what its error line says ({ws}: the workspace; prepare names it resolved)
    # prepare replaces its output folder whole at the end: an input in it would go with it
    "prepare into its input folder": (
        [*TOOLS["prepare"]("texts"), *OVERWRITE], "output_dir {ws}/texts is the input texts; "),
    "prepare into a folder that holds an input": (
        [*TOOLS["prepare"]("."), *OVERWRITE], "output_dir {ws} contains the input texts; "),
    "prepare into a folder inside an input": (
        [*TOOLS["prepare"]("texts/tokens"), *OVERWRITE],
        "output_dir {ws}/texts/tokens lies inside the input texts; "),
    "prepare over a folder it did not write": (
        [*TOOLS["prepare"]("hf"), *OVERWRITE],
        "output_dir {ws}/hf already exists and is not empty, and is not a dataset prepare wrote "
        "(--overwrite true replaces only that); "),
    "prepare into a folder that holds its tokenizer": (
        [*TOOLS["prepare"]("hf"), "--tokenizer", "hf/tokenizer.json", *OVERWRITE],
        "output_dir {ws}/hf contains the input hf/tokenizer.json; "),
    "prepare into a file": (TOOLS["prepare"]("notes.txt"), "output_dir {ws}/notes.txt is a file; "),
    "prepare into a file, told to overwrite": (
        [*TOOLS["prepare"]("notes.txt"), *OVERWRITE], "output_dir {ws}/notes.txt is a file; "),
    # export and consolidate replace the files an earlier export wrote: never a user's own model
    "export over a Hugging Face folder it did not write": (
        [*TOOLS["export"]("hf"), *OVERWRITE],
        "--output hf already exists and is not empty, and is not a folder export wrote "
        "(--overwrite true replaces only that); "),
    "consolidate over a Hugging Face folder it did not write": (
        [*TOOLS["consolidate"]("hf"), *OVERWRITE], "--output hf already exists and is not empty, and "),
    "export into the checkpoint's folder": (
        TOOLS["export"]("model/hf"), "--output model/hf lies inside the checkpoint being exported; "),
    "export into a folder that holds the checkpoint": (
        [*TOOLS["export"]("."), *OVERWRITE], "--output . contains the checkpoint being exported; "),
    "export into a file": (
        [*TOOLS["export"]("notes.txt"), *OVERWRITE], "--output notes.txt is a file; "),
    # report replaces an earlier report whole
    "report into its run folder": (TOOLS["report"]("run"), "output_dir run is the run folder; "),
    "report into a folder that holds the run": (
        TOOLS["report"]("."), "output_dir . contains the run folder; "),
    "report into a folder it did not write": (
        TOOLS["report"]("hf"),
        "output_dir hf already exists and is not empty, and is not an earlier report; "),
    "report into a file": (TOOLS["report"]("notes.txt"), "output_dir notes.txt is a file; "),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_output_is_one_error_line_and_nothing_is_touched(workspace, case):
    args, expected = REFUSALS[case]
    before = snapshot(workspace)
    line = error_line(run_cli_in_process(*args, cwd=workspace))
    assert expected.format(ws=workspace) in line, line
    if "is a file" in expected:  # replacing a user's file is never the fix
        assert "overwrite" not in line, line
    assert snapshot(workspace) == before


@pytest.mark.parametrize("tool", list(TOOLS))
def test_the_tool_replaces_what_it_wrote_before(workspace, tool):
    overwrite = [] if tool == "report" else OVERWRITE  # report always replaces an earlier report
    assert run_cli_in_process(*TOOLS[tool]("out"), cwd=workspace).returncode == 0
    first = snapshot(workspace / "out")
    again = run_cli_in_process(*TOOLS[tool]("out"), *overwrite, cwd=workspace)
    assert again.returncode == 0, again.stderr[-3000:]
    assert snapshot(workspace / "out").keys() == first.keys()
    assert sorted(path.name for path in workspace.iterdir()) == [
        "hf", "model", "notes.txt", "out", "run", "texts"]  # no temporary folder left


# ---- refused by the file system while writing -------------------------------------------------------
WHY = {"full": "no space left on the device, ", "read-only": "the file system is read-only; "}


@pytest.mark.parametrize("fault", list(WHY))
@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_refused_write_is_one_error_line_and_leaves_nothing(workspace, tool, fault):
    disk = workspace / "disk"
    with small_disk(disk, "1m"):
        if fault == "full":
            fill(disk, leave=8_000)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
        before = snapshot(workspace)
        line = error_line(run_cli_in_process(*TOOLS[tool]("disk/out"), cwd=workspace))
        assert line.startswith(f"error: cannot write {disk / 'out'}: {WHY[fault]}"), line
        if fault == "full" and tool in ("export", "consolidate"):
            assert "; it needs " in line, line  # the weights' size is known before they are written
        assert snapshot(workspace) == before


@pytest.mark.parametrize("tool", list(TOOLS))
def test_an_earlier_output_stays_as_it_was_when_the_new_one_cannot_be_written(workspace, tool):
    overwrite = [] if tool == "report" else OVERWRITE
    disk = workspace / "disk"
    with small_disk(disk, "2m"):
        assert run_cli_in_process(*TOOLS[tool]("disk/out"), cwd=workspace).returncode == 0
        fill(disk, leave=8_000)
        before = snapshot(workspace)
        line = error_line(run_cli_in_process(*TOOLS[tool]("disk/out"), *overwrite, cwd=workspace))
        assert line.startswith(f"error: cannot write {disk / 'out'}: {WHY['full']}"), line
        assert snapshot(workspace) == before


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_file_where_a_folder_should_be_is_one_error_line(workspace, tool):
    before = snapshot(workspace)
    line = error_line(run_cli_in_process(*TOOLS[tool]("notes.txt/out"), cwd=workspace))
    assert line.startswith(
        f"error: cannot write {workspace / 'notes.txt' / 'out'}: a file stands where a folder should be; "
    ), line
    assert snapshot(workspace) == before
