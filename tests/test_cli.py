"""The CLI end to end, as a user runs it: real subprocesses, real files, exit codes and messages (in this
process where only a command's answer is checked: bad input, ``--print_config``)."""

import csv
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli, run_cli_in_process

CONFIG = str(REPO / "configs" / "pretrain-tiny.yaml")
# The default config shrunk so that a run takes seconds.
SMALL = [
    "--model.init_args.config.n_layer=1",
    "--model.init_args.config.n_embd=32",
    "--model.init_args.config.n_head=2",
    "--model.init_args.config.block_size=32",
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=8",
    "--model.init_args.warmup_steps=5",
    "--trainer.max_steps=40",
    "--trainer.val_check_interval=20",
    "--trainer.limit_val_batches=4",
    "--trainer.log_every_n_steps=5",
    "--trainer.enable_progress_bar=false",
]


def _val_losses(metrics_csv: Path) -> list[float]:
    with metrics_csv.open() as f:
        return [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]


def test_fit_writes_checkpoints_and_metrics_and_learns(tmp_path):
    root = tmp_path / "run"
    result = run_cli("fit", "--config", CONFIG, *SMALL, f"--trainer.default_root_dir={root}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (root / "checkpoints" / "last.ckpt").is_file()
    assert (root / "version_0" / "config.yaml").is_file()
    losses = _val_losses(root / "version_0" / "metrics.csv")
    assert len(losses) == 2 and losses[-1] < losses[0]

    # An evaluation of the run logs under validate/, never as a version of the training run.
    again = run_cli(
        "validate",
        "--config",
        CONFIG,
        *SMALL,
        f"--trainer.default_root_dir={root}",
        f"--ckpt_path={root / 'checkpoints' / 'last.ckpt'}",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (root / "validate" / "version_0" / "config.yaml").is_file()
    assert (root / "version_0" / "config.yaml").is_file() and not (root / "version_1").exists()


def test_print_config_resolves_every_section(tmp_path):
    result = run_cli_in_process("fit", "--config", CONFIG, "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["model"]["class_path"] == "lightning_train.PretrainModule"
    assert config["model"]["init_args"]["config"]["n_layer"] == 4
    assert config["data"]["init_args"]["seq_len"] == 128


def test_every_config_is_run_by_a_test():
    """The README promises it: each configs/*.yaml is named (as a string) in a test file that runs it."""
    tests = "".join(path.read_text() for path in (REPO / "tests").glob("test_*.py"))
    untested = [path.name for path in (REPO / "configs").glob("*.yaml") if f'"{path.name}"' not in tests]
    assert not untested, f"no test runs {untested}"


def test_prepare_then_fit_on_own_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox jumps over the dog.\n" * 30)
    result = run_cli(
        "prepare", "--inputs", f"[{corpus}]", "--output_dir", str(tmp_path / "shards"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    # it ends saying what it wrote, in the numbers of meta.json
    meta = json.loads((tmp_path / "shards" / "meta.json").read_text())
    assert len(meta["shards"]) == 1
    val = sum(s["num_tokens"] for s in meta["shards"] if s["split"] == "val")
    summary = result.stdout.splitlines()[-5:]
    total = meta["total_tokens"]
    assert summary[0].startswith(f"wrote {tmp_path / 'shards'} ({total:,} tokens from 20 files")
    assert summary[1].split()[:2] == ["train", f"{meta['total_tokens'] - val:,}"]
    assert summary[2].split()[:2] == ["val", f"{val:,}"]
    assert summary[-1].endswith(f"--data.init_args.data_dir {tmp_path / 'shards'}")
    fit = run_cli(
        "fit",
        "--config",
        CONFIG,
        *SMALL,
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=4",
        f"--data.init_args.data_dir={tmp_path / 'shards'}",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.init_args.bogus=1"], "bogus"),
        (["--trainer.max_steps=many"], "many"),
        (["--data.init_args.data_dir=/no/such/folder"], "/no/such/folder"),
        (["--model.init_args.config.vocab_size=100"], "vocab_size"),
        (["--data.init_args.seq_len=64"], "block_size=32"),
    ],
    ids=["unknown-key", "wrong-type", "missing-data", "ids-exceed-vocab", "seq-longer-than-context"],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, args, expected):
    result = run_cli_in_process(
        "fit",
        "--config",
        CONFIG,
        *SMALL,
        *args,
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_prepare_bad_input(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("prepare", "--inputs", f"[{empty}]", "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(empty) in result.stderr or "empty" in result.stderr

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("precious")
    (tmp_path / "doc.txt").write_text("some text " * 100)
    result = run_cli(
        "prepare", "--inputs", f"[{tmp_path / 'doc.txt'}]", "--output_dir", str(existing), cwd=tmp_path
    )
    assert result.returncode == 2 and "overwrite" in result.stderr
    assert (existing / "keep.txt").read_text() == "precious"
