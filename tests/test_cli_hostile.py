"""The whole CLI driven as a hostile user would (issue 33): every subcommand and tool given values of the
wrong type or out of range, paths that are missing, files where folders belong (and folders where files
belong), text that is not UTF-8, config files that hold no options, and folders in odd states.

Each case of the table is a command line, the state it finds (a workspace of small inputs, changed by the
case's ``setup``), its exit code and what its one ``error:`` line must say (the value and the fix). Every
command runs in this process (``run_cli_in_process``) and must end with that exit code, exactly one
``error:`` line and no traceback, leaving every file of the workspace as it was and writing nothing."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from lightning_train.checkpoint import save_safetensors
from lightning_train.models.gpt import GPT, GPTConfig
from tests.conftest import run_cli_in_process
from tests.test_cli_errors import CONFIG, TINY
from tests.test_tool_outputs import error_line, snapshot

NOT_UTF8 = "caf\udce9"  # how Python hands over the argv bytes b"caf\xe9" (latin-1, not UTF-8)
ALERT = b'{"time": 0, "step": 1, "level": "WARN", "title": "t", "text": "x"}\n'  # as send_alert writes it


class Case(NamedTuple):
    args: list[str]
    expected: list[str]  # texts the error line holds: the value, the fix
    setup: Callable[[Path], object] | None = None  # puts the workspace in the state the case needs
    code: int = 2


def _fit(*args: str) -> list[str]:
    """A tiny fit on the workspace's data into a new run folder, with ``args`` last."""
    return ["fit", "--config", CONFIG, *TINY, "--data.init_args.data_dir=data",
            "--trainer.default_root_dir=new-run", *args]


def _sft(*args: str) -> list[str]:
    return _fit("--data=lightning_train.SFTDataModule", "--data.init_args.seq_len=32", *args)


def _write(path: str, content: str | bytes) -> Callable[[Path], object]:
    """A setup that writes ``content`` to ``path`` in the workspace (making its folders)."""

    def setup(workspace: Path) -> None:
        target = workspace / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content if isinstance(content, bytes) else content.encode())

    return setup


def _folder(path: str) -> Callable[[Path], object]:
    return lambda workspace: (workspace / path).mkdir(parents=True)


CASES: dict[str, Case] = {
    # ---- the Trainer subcommands' arguments: types, ranges, unknown options, classes -----------------
    "fit batch_size not an int": Case(
        _fit("--data.init_args.batch_size", "abc"), ["--data.batch_size=abc", "use an int"]),
    "fit max_steps a float": Case(_fit("--trainer.max_steps", "1.5"), ["--trainer.max_steps=1.5", "an int"]),
    "fit a model config field not an int": Case(
        _fit("--model.init_args.config.n_layer", "abc"), ["--model.config.n_layer=abc", "use an int"]),
    "fit a model config choice out of its choices": Case(
        _fit("--model.init_args.config.norm", "bogus"), ["--model.config.norm=bogus", "rmsnorm, layernorm"]),
    "fit learning_rate nan": Case(
        _fit("--model.init_args.learning_rate", "nan"), ["--model.learning_rate=nan", "a float"]),
    "fit an option the model lacks": Case(
        _fit("--model.init_args.bogus", "1"),
        ["--model.bogus is not an option of lightning_train.PretrainModule",
         "fit --model.help lightning_train.PretrainModule"]),
    "fit an option the model config lacks": Case(
        _fit("--model.init_args.config.bogus", "1"), ["--model.config.bogus", "lightning_train.GPTConfig"]),
    "fit an option the data lacks": Case(
        _fit("--data.init_args.bogus", "1"), ["--data.bogus is not an option of", "--data.help"]),
    "fit an option the Trainer lacks": Case(
        _fit("--trainer.bogus", "1"), ["unrecognized arguments: --trainer.bogus 1"]),
    "fit a model class that does not exist": Case(
        _fit("--model.class_path", "no.such.Module"),
        ["--model.class_path=no.such.Module", "No module named 'no'", "LightningModule subclass"]),
    "fit a model class as the data": Case(
        _fit("--data.class_path", "lightning_train.PretrainModule"),
        ["--data.class_path=lightning_train.PretrainModule", "LightningDataModule subclass"]),
    "fit a callback that does not exist": Case(
        _fit("--trainer.callbacks+=NoSuchCallback"),
        ["--trainer.callbacks=NoSuchCallback", "not the import path of a class", "a Callback"]),
    "fit a logger that does not exist": Case(
        _fit("--trainer.logger", "bogus"), ["--trainer.logger=bogus", "a Logger", "true or false"]),
    "fit a mixture that is not a mapping": Case(
        _fit("--data.init_args.mixture", "abc"), ["--data.mixture=abc", "a mapping of str to float"]),
    "fit a mixture weight that is infinite": Case(
        _fit("--data.init_args.data_dir=null", "--data.init_args.mixture", '{"data": 1e400}'),
        ["mixture weight inf of data", "finite"]),
    "fit a mixture weight that is nan": Case(
        _fit("--data.init_args.data_dir=null", "--data.init_args.mixture", "{data: .nan}"),
        ["mixture weight nan of data", "finite"]),
    "fit a negative data seed": Case(_fit("--data.init_args.seed", "-1"), ["seed=-1", "[0, 2**64 - 1]"]),
    "fit a data seed past 64 bits": Case(
        _fit("--data.init_args.seed", str(1 << 64)), [f"seed={1 << 64}", "e.g. 1234"]),
    "fit limit_train_batches negative": Case(
        _fit("--trainer.limit_train_batches", "-1"), ["--trainer.limit_train_batches=-1", "[0.0, 1.0]"]),
    "fit limit_val_batches a fraction above 1": Case(
        _fit("--trainer.limit_val_batches", "2.5"), ["--trainer.limit_val_batches=2.5", "an int >= 0"]),
    "fit --resume a file that is no checkpoint": Case(
        _fit("--resume", "nul.txt"), ["nul.txt is not a readable torch file", "pass a .ckpt"]),
    "fit a data folder that is a file": Case(
        _fit("--data.init_args.data_dir", "doc.txt"),
        ["data_dir 'doc.txt' is a file; pass a dataset folder", "prepare --inputs '[doc.txt]' --output_dir"]),
    "fit a run folder that is a file": Case(
        _fit("--trainer.default_root_dir", "doc.txt"), ["doc.txt", "is a file"]),
    "fit a negative seed_everything": Case(
        _fit("--seed_everything", "-1"), ["--seed_everything=-1", "4294967295"]),
    "fit a model of no layers": Case(
        _fit("--model.init_args.config.n_layer", "0"), ["n_layer=0", "at least 1"]),
    "fit a model of zero width": Case(
        _fit("--model.init_args.config.n_embd", "0"), ["n_embd=0", "at least 1"]),
    "fit a model of no heads": Case(_fit("--model.init_args.config.n_head", "0"), ["n_head=0", "at least 1"]),
    "fit a dropout above 1": Case(_fit("--model.init_args.config.dropout", "2"), ["dropout=2", "[0, 1)"]),
    # ---- fine-tuning data (SFT JSONL) -----------------------------------------------------------------
    "fit SFT data that is not UTF-8": Case(
        _sft("--data.init_args.train_file", "latin1.jsonl"), ["latin1.jsonl:2: byte 0xe9 is not UTF-8"]),
    "fit SFT data with a line that is not JSON": Case(
        _sft("--data.init_args.train_file", "bad.jsonl"), ["bad.jsonl:2: not valid JSON", "one JSON object"]),
    "fit SFT data that is a folder": Case(
        _sft("--data.init_args.train_file", "empty"), ["'empty' is a folder", "pass a JSONL file"]),
    "fit SFT data with a negative seed": Case(
        _sft("--data.init_args.train_file", "sft.jsonl", "--data.init_args.seed", "-1"), ["seed=-1"]),
    # ---- config files ---------------------------------------------------------------------------------
    "config that is not YAML": Case(
        ["fit", "--config", "bad.yaml"], ["config file bad.yaml is not valid YAML (line 2, column 1:"]),
    "config with a NUL byte": Case(["fit", "--config", "nul.txt"], ["config file nul.txt is not valid YAML"]),
    "config that is empty": Case(["fit", "--config", "empty.txt"], ["config file empty.txt is empty"]),
    "config that is a list": Case(
        ["fit", "--config", "list.yaml"], ["config file list.yaml holds no options (it starts '- a')"]),
    "config that is not UTF-8": Case(
        ["fit", "--config", "latin1.txt"], ["config file latin1.txt is not UTF-8 text (byte 0xe9", "UTF-8"]),
    "config that does not exist": Case(["fit", "--config", "no.yaml"], ["--config", "no.yaml does not"]),
    "config that is a folder": Case(["fit", "--config", "empty"], ["--config", "empty is not a file"]),
    "config with an unknown key": Case(
        ["fit", "--config", "unknown.yaml"], ["Subcommand 'fit' does not accept option 'bogus_key'"]),
    "config with model options but no class": Case(
        ["fit", "--config", "no-class.yaml"], ["--model.learning_rate is not an option of"]),
    "config with a value of the wrong type": Case(
        ["fit", "--config", CONFIG, "--config", "bad-value.yaml"], ["--model.config.n_layer=abc", "an int"]),
    "tool config with an unknown key": Case(
        ["prepare", "--config", "unknown.yaml"], ["option 'bogus_key' of a config file", "prepare --help"]),
    "tool config that is not UTF-8": Case(["prepare", "--config", "latin1.txt"], ["latin1.txt is not UTF-8"]),
    # ---- prepare ---------------------------------------------------------------------------------------
    "prepare inputs not a list": Case(
        ["prepare", "--inputs", "doc.txt", "--output_dir", "out"], ["--inputs=doc.txt", "a list of str"]),
    "prepare an input named in bytes that are not UTF-8": Case(
        ["prepare", "--inputs", f"[{NOT_UTF8}.txt]", "--output_dir", "out"], ["--inputs", "UTF-8 (0xe9)"]),
    "prepare an input that is not UTF-8": Case(
        ["prepare", "--inputs", "[latin1.txt]", "--output_dir", "out"], ["'latin1.txt' is not a UTF-8 text"]),
    "prepare an input with a NUL byte": Case(
        ["prepare", "--inputs", "[nul.txt]", "--output_dir", "out"], ["'nul.txt' is not a UTF-8 text file"]),
    "prepare an empty input": Case(
        ["prepare", "--inputs", "[empty.txt]", "--output_dir", "out", "--num_workers", "0"],
        ["contain no text (0 tokens)", "non-empty"]),
    "prepare an empty folder": Case(
        ["prepare", "--inputs", "[empty]", "--output_dir", "out"], ["contain no text files"]),
    "prepare an input under a file": Case(
        ["prepare", "--inputs", "[doc.txt/x]", "--output_dir", "out"], ["'doc.txt/x' does not exist"]),
    "prepare JSONL with a line that is not JSON": Case(
        ["prepare", "--inputs", "[bad.jsonl]", "--output_dir", "out", "--num_workers", "0"],
        ["bad.jsonl:2 is not valid JSON", "one JSON object per line"]),
    "prepare JSONL without the text field": Case(
        ["prepare", "--inputs", "[sft.jsonl]", "--output_dir", "out", "--num_workers", "0"],
        ["sft.jsonl:1 has no string field 'text'", "text_field"]),
    "prepare val_fraction not a number": Case(
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--val_fraction", "abc"],
        ["--val_fraction=abc", "a float"]),
    "prepare shard_tokens a float": Case(
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--shard_tokens", "1.5"],
        ["--shard_tokens=1.5", "an int"]),
    "prepare a tokenizer that is not JSON": Case(
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--tokenizer", "nul.txt"],
        ["cannot read tokenizer file", "valid tokenizer.json"]),
    "prepare an unknown option": Case(
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--bogus", "1"],
        ["unrecognized arguments: --bogus 1"]),
    # ---- generate and export ---------------------------------------------------------------------------
    "generate no prompt": Case(
        ["generate", "--checkpoint", "model", "--prompt", "[]"], ["--prompt [] holds no prompt", "--prompt"]),
    "generate a prompt that is not UTF-8": Case(
        ["generate", "--checkpoint", "model", "--prompt", NOT_UTF8], ["prompt 0 holds byte 0xe9", "UTF-8"]),
    "generate a seed past 64 bits": Case(
        ["generate", "--checkpoint", "model", "--prompt", "x", "--seed", str(1 << 70)],
        [f"--seed {1 << 70} is not a 64-bit seed", "e.g. 1234"]),
    "generate max_new_tokens a float": Case(
        ["generate", "--checkpoint", "model", "--prompt", "x", "--max_new_tokens", "1.5"],
        ["--max_new_tokens=1.5", "an int"]),
    "generate from an empty folder": Case(
        ["generate", "--checkpoint", "empty", "--prompt", "x"], ["folder 'empty' holds neither"]),
    "generate from a file that is no checkpoint": Case(
        ["generate", "--checkpoint", "nul.txt", "--prompt", "x"], ["'nul.txt' is not a checkpoint"]),
    "generate with a tokenizer that is not JSON": Case(
        ["generate", "--checkpoint", "model", "--prompt", "x", "--tokenizer", "nul.txt"],
        ["cannot read tokenizer file"]),
    "export a format out of its choices": Case(
        ["export", "--checkpoint", "model", "--output", "out", "--format", "bogus"],
        ["--format=bogus", "hf, safetensors, peft"]),
    # ---- report and dashboard on folders in odd states ----------------------------------------------
    "report an empty folder": Case(["report", "empty"], ["no version_*/metrics.csv under 'empty'"]),
    "report a launch the run lacks": Case(
        ["report", "run", "--launch", "bogus"], ["launch 'bogus'", "version_0"]),
    "report metrics that are not UTF-8": Case(
        ["report", "broken"], ["metrics.csv holds byte 0xff, which is not UTF-8", "move broken/version_0"],
        _write("broken/version_0/metrics.csv", b"\xff")),
    "report metrics that are not numbers": Case(
        ["report", "broken"], ["metrics.csv line 2: train/loss='abc' is not a number", "restore the file"],
        _write("broken/version_0/metrics.csv", "step,train/loss\n1,abc\n")),
    "report metrics.csv that is a folder": Case(
        ["report", "broken"], ["metrics.csv is a folder", "move broken/version_0 out"],
        _folder("broken/version_0/metrics.csv")),
    "report alerts that are not UTF-8": Case(
        ["report", "run"],
        ["alerts.jsonl line 2 holds byte 0xff, which is not UTF-8", "move it out of run/version_0"],
        _write("run/version_0/alerts.jsonl", ALERT + b"\xff\n")),
    "report alerts that are not JSON": Case(
        ["report", "run"],
        ["run/version_0/alerts.jsonl line 2 is not JSON (Expecting value at column 1)", "restore the file"],
        _write("run/version_0/alerts.jsonl", ALERT + b"not json\n")),
    "report alerts that are JSON but no alert": Case(
        ["report", "run"],
        ["run/version_0/alerts.jsonl line 1 is not an alert (an object with step, level, title and text)"],
        _write("run/version_0/alerts.jsonl", '{"step": "1"}\n')),
    "report alerts.jsonl that is a folder": Case(
        ["report", "run"], ["run/version_0/alerts.jsonl is a folder", "move it out of run/version_0"],
        _folder("run/version_0/alerts.jsonl")),
    "dashboard a folder that holds no run": Case(
        ["dashboard", "--run_dir", "empty"], ["no version_*/metrics.csv under --run_dir 'empty'"]),
    "dashboard metrics that are not UTF-8": Case(
        ["dashboard", "--run_dir", "broken"], ["metrics.csv holds byte 0xff, which is not UTF-8", "restore"],
        _write("broken/version_0/metrics.csv", b"\xff\xfe")),
    "dashboard metrics.csv that is a folder": Case(
        ["dashboard", "--run_dir", "broken"], ["metrics.csv is a folder", "move broken/version_0"],
        _folder("broken/version_0/metrics.csv")),
    "dashboard where its spec's name is a folder": Case(
        ["dashboard", "--run_dir", "run"], ["run/wandb_dashboard.json is a folder", "move that folder away"],
        _folder("run/wandb_dashboard.json")),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """What every case starts from: small texts good and bad, config files, a prepared dataset, a model
    folder and a run's metrics."""
    folder = tmp_path_factory.mktemp("template")
    shutil.copytree(data_dir, folder / "data")
    save_safetensors(GPT(GPTConfig(vocab_size=258, block_size=32, n_layer=1, n_head=2, n_embd=32)),
                     folder / "model")
    (folder / "empty").mkdir()
    files: dict[str, str | bytes] = {
        "doc.txt": "some text\n" * 20,
        "empty.txt": "",
        "latin1.txt": b"trainer:\n  max_steps: caf\xe9\n",
        "nul.txt": b"a\x00b\n",
        "sft.jsonl": '{"prompt": "1+1=", "response": "2"}\n' * 9,
        "latin1.jsonl": b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "x"}\n',
        "bad.jsonl": '{"text": "a", "prompt": "a", "response": "b"}\nnot json\n',
        "bad.yaml": "trainer: [unclosed\n",
        "list.yaml": "- a\n- b\n",
        "unknown.yaml": "bogus_key: 1\n",
        "no-class.yaml": "model:\n  init_args:\n    learning_rate: abc\n",
        "bad-value.yaml": "model:\n  init_args:\n    config:\n      n_layer: abc\n",
        "run/version_0/metrics.csv": "step,epoch,train/loss\n0,0,5.5\n1,0,5.0\n",
    }
    for name, content in files.items():
        _write(name, content)(folder)
    return folder


@pytest.fixture
def workspace(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template, tmp_path / "ws")
    return tmp_path / "ws"


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_hostile_input_is_one_error_line_and_nothing_changes(workspace: Path, case: Case) -> None:
    if case.setup is not None:
        case.setup(workspace)
    before = snapshot(workspace)
    result = run_cli_in_process(*case.args, cwd=workspace)
    assert result.returncode == case.code, result.stderr[-3000:]
    line = error_line(result)
    for text in case.expected:
        assert text in line, line
    assert snapshot(workspace) == before


def test_prepare_caps_a_million_tokenizer_processes_at_the_cores(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--num_workers 1000000`` (a pool that large took the machine down) starts one process per core
    this process may run on, and prepares the data."""
    pools: list[int] = []
    real_pool = multiprocessing.Pool

    def counted_pool(processes: int, **kwargs: object) -> object:
        pools.append(processes)
        return real_pool(processes, **kwargs)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # two cores
    monkeypatch.setattr(multiprocessing, "Pool", counted_pool)
    result = run_cli_in_process(
        "prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--num_workers", "1000000", cwd=workspace)
    assert result.returncode == 0, result.stderr[-3000:]
    assert pools == [2]
    assert (workspace / "out" / "meta.json").is_file()
