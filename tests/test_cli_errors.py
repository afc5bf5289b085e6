"""Bad input through the CLI, as a user meets it: exit code 2, exactly one ``error:`` line naming the
value and the fix, no traceback, nothing written. Each command runs in this process from its argv on
(``run_cli_in_process``: the same code path without a new interpreter's seconds of start-up);
tests/test_cli.py checks that a real process prints the same single line and exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli_in_process
from tests.helpers.user_errors import MESSAGE

CONFIG = str(REPO / "configs" / "pretrain-tiny.yaml")
TINY = [
    "--model.init_args.config.n_layer=1",
    "--model.init_args.config.n_embd=32",
    "--model.init_args.config.n_head=2",
    "--model.init_args.config.block_size=32",
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=4",
    "--model.init_args.warmup_steps=2",
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
]
EVALUABLE = [
    "--model.class_path=tests.helpers.user_errors.EvaluableModule",
    "--data.class_path=tests.helpers.user_errors.EvaluableData",
]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _assert_one_clear_error(result, *expected: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = _errors(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def _files(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run folder with a 2-step checkpoint of the tiny model (EvaluableModule, so `test` runs)."""
    root = tmp_path_factory.mktemp("trained") / "run"
    result = run_cli_in_process(
        "fit", "--config", CONFIG, *TINY, *EVALUABLE, f"--trainer.default_root_dir={root}", cwd=root.parent
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root


# ---- a UserInputError raised anywhere inside a run is reported as itself --------------------------
@pytest.mark.parametrize(
    ("subcommand", "point"),
    [("fit", point) for point in ("setup", "load_checkpoint", "first_batch", "batch_end", "loader")]
    + [("validate", point) for point in ("setup", "load_checkpoint", "first_batch", "loader")]
    + [("test", point) for point in ("setup", "first_batch", "loader")],
)
def test_bad_input_raised_inside_a_run_is_its_own_error_line(tmp_path, trained, subcommand, point):
    raiser = json.dumps(
        {"class_path": "tests.helpers.user_errors.RaiseUserInputError", "init_args": {"at": point}}
    )
    # fit resumes only where the point is the resume itself (a resumed fit restores the data position
    # of the run's own loader, which the "loader" point replaces)
    resumes = subcommand != "fit" or point == "load_checkpoint"
    checkpoint = [f"--ckpt_path={trained / 'checkpoints' / 'last.ckpt'}"] if resumes else []
    result = run_cli_in_process(
        subcommand,
        "--config",
        CONFIG,
        *TINY,
        *EVALUABLE,
        "--trainer.max_steps=4",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        *checkpoint,
        f"--trainer.callbacks+={raiser}",
        cwd=tmp_path,
    )
    assert _assert_one_clear_error(result) == f"error: {MESSAGE.format(point=point)}"
    assert "iter(combined_loader)" not in result.stderr
    if point in ("setup", "load_checkpoint"):  # failed before it ran: no folder left (was hparams.yaml)
        assert not (tmp_path / "run").exists(), sorted(map(str, (tmp_path / "run").rglob("*")))


# ---- --resume for validate and test ---------------------------------------------------------------
def test_validate_and_test_resume_auto_use_the_newest_checkpoint(tmp_path, trained):
    for subcommand, metric in (("validate", "val/loss"), ("test", "test/loss")):
        result = run_cli_in_process(
            subcommand,
            "--config",
            CONFIG,
            *TINY,
            *EVALUABLE,
            f"--trainer.default_root_dir={trained}",
            "--resume=auto",
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"--resume auto: {subcommand} {trained / 'checkpoints' / 'last.ckpt'}" in result.stderr
        assert metric in result.stdout


def test_validate_resume_auto_without_a_checkpoint_refuses(tmp_path):
    result = run_cli_in_process(
        "validate",
        "--config",
        CONFIG,
        *TINY,
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--resume=auto",
        cwd=tmp_path,
    )
    error = _assert_one_clear_error(
        result, "validate --resume auto: no valid checkpoint in", "`fit`", "--ckpt_path"
    )
    assert "val/loss" not in result.stdout, error  # no validation of untrained weights


# ---- a table of bad values for every subcommand --------------------------------------------------
def _lightning(subcommand: str, *args: str) -> list[str]:
    return [subcommand, "--config", CONFIG, *TINY, "--trainer.default_root_dir=run", *args]


BAD_VALUES = [
    # (command line, texts the error line must hold: the value, the fix)
    (_lightning("fit", "--trainer.max_steps=-5"), ["-5", "-1"]),
    (_lightning("fit", "--data.init_args.batch_size=0"), ["batch_size=0", "at least 1"]),
    (_lightning("fit", "--trainer.strategy=bogus"), ["'bogus'", "lt_ddp", "lt_fsdp"]),
    (_lightning("fit", "--trainer.strategy=lt_fsdp", "--trainer.strategy.replicate_size=nodes"),
     ["--trainer.strategy.replicate_size=nodes needs the class named, not --trainer.strategy=lt_fsdp",
      "lightning_train.strategies.DataParallelStrategy"]),
    (_lightning("fit", "--data.init_args.global_batch_size=0"), ["global_batch_size=0", "at least 1"]),
    (_lightning("fit", "--trainer.val_check_interval=0"), ["val_check_interval=0", "positive"]),
    (_lightning("fit", "--trainer.log_every_n_steps=0"), ["log_every_n_steps=0", "at least 1"]),
    (_lightning("fit", "--trainer.accumulate_grad_batches=0"), ["accumulate_grad_batches=0", "1 for no"]),
    (_lightning("fit", "--trainer.gradient_clip_val=-1"), ["gradient_clip_val=-1", "no clipping"]),
    (_lightning("fit", "--trainer.devices=0"), ["devices=0", "positive count"]),
    (_lightning("fit", "--trainer.accelerator=bogus"), ["'bogus'", "cpu"]),
    (_lightning("fit", "--trainer.precision=bogus"), ["--trainer.precision=bogus", "bf16-mixed"]),
    (_lightning("fit", "--model.init_args.config.n_head=3"), ["n_head=3", "divisible"]),
    (_lightning("fit", "--data.init_args.seq_len=0"), ["seq_len=0", "at least 1"]),
    (_lightning("fit", "--model.init_args.warmup_steps=-1"), ["warmup_steps=-1", "0: no warmup"]),
    (_lightning("fit", "--model.init_args.learning_rate=0"), ["learning_rate=0", "1e-3"]),
    (_lightning("fit", "--model.init_args.decay_steps=0"), ["decay_steps=0", ">= 1"]),
    (_lightning("fit", "--resume=/no/such.ckpt"), ["/no/such.ckpt", "auto"]),
    (_lightning("fit", "--ckpt_path=/no/such.ckpt"), ["/no/such.ckpt", "check the path", "--resume auto"]),
    (_lightning("fit", "--resume=auto", "--ckpt_path=x.ckpt"), ["--resume", "not both"]),
    (_lightning("validate", "--resume=auto"), ["--resume auto", "`fit`"]),
    (_lightning("validate", "--ckpt_path=/no/such.ckpt"), ["/no/such.ckpt", "--resume auto"]),
    (_lightning("validate", "--trainer.limit_val_batches=-1"), ["-1", "[0.0, 1.0]"]),
    (_lightning("validate", "--data.init_args.batch_size=0"), ["batch_size=0", "at least 1"]),
    (_lightning("test"), ["PretrainModule.test_step", "TextDataModule.test_dataloader", "`validate`"]),
    (_lightning("test", "--trainer.strategy=bogus"), ["'bogus'", "lt_ddp"]),
    (_lightning("predict"), ["PretrainModule.predict_step", "generate"]),
    (_lightning("predict", "--trainer.devices=0"), ["devices=0", "positive count"]),
    (["prepare", "--inputs", "[]", "--output_dir", "out"], ["inputs is empty", "at least one"]),
    (["prepare", "--inputs", "[/no/such/dir]", "--output_dir", "out"], ["/no/such/dir", "existing"]),
    (["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--val_fraction", "1.5"], ["1.5", "0.01"]),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--shard_tokens", "0"],
        ["shard_tokens=0", "50_000_000"],
    ),
    (["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--num_workers", "-1"], ["-1", "use 0"]),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--tokenizer", "/no/tok.json"],
        ["/no/tok.json", "'byte'"],
    ),
    (["prepare", "--inputs", "[doc.txt]"], ["output_dir is missing", "--output_dir"]),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--train_tokenizer", "bpe"],
        ["needs vocab_size", "--vocab_size N", "258"],
    ),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir=out", "--train_tokenizer=bpe", "--vocab_size=257"],
        ["vocab_size=257", "below 258", "4096"],
    ),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--train_tokenizer", "wordpiece"],
        ["'wordpiece'", "'bpe'"],
    ),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--vocab_size", "512"],
        ["vocab_size=512", "--train_tokenizer bpe"],
    ),
    (
        ["prepare", "--inputs", "[doc.txt]", "--output_dir", "out", "--tokenizer", "t.json",
         "--train_tokenizer", "bpe", "--vocab_size", "512"],
        ["'t.json'", "'bpe'", "only one"],
    ),
    (["generate", "--checkpoint", "none.ckpt", "--prompt", "x"], ["none.ckpt", ".safetensors"]),
    (["generate", "--checkpoint", "doc.txt", "--prompt", "x"], ["doc.txt", ".safetensors"]),
    (["generate", "--checkpoint", "model", "--prompt", "x", "--max_new_tokens", "0"], ["0", "at least 1"]),
    (["generate", "--checkpoint", "model", "--prompt", "x", "--temperature", "-1"], ["-1", "greedy"]),
    (["generate", "--checkpoint", "model", "--prompt", "x", "--top_k", "0"], ["--top_k 0", "at least 1"]),
    (["generate", "--checkpoint", "model", "--prompt", ""], ["prompt 0 is empty", "at least one token"]),
    (["generate", "--checkpoint", "model", "--prompt", "x", "--tokenizer", "/no/tok.json"], ["/no/tok.json"]),
    (["consolidate", "--checkpoint", "none.ckpt", "--output", "out"], ["none.ckpt", "does not exist"]),
    (["consolidate", "--checkpoint", "doc.txt", "--output", "out"], ["doc.txt", ".safetensors"]),
    (["consolidate", "--checkpoint", "model", "--output", "model"],
     ["--output model", "the checkpoint being exported", "another folder"]),
    (["report", "nowhere"], ["'nowhere'", "pass the run folder"]),
    (["report", "doc.txt"], ["'doc.txt'", "pass the run folder"]),
    (["dashboard", "--run_dir", "nowhere"], ["'nowhere'", "pass a run folder"]),
    (["dashboard", "--run_dir", "doc.txt"], ["'doc.txt'", "pass a run folder"]),
    (["report"], ["run_dir", "required"]),
    ([], ["no subcommand given", "fit", "prepare", "--help"]),
    (["bogus"], ["'bogus'", "validate", "dashboard"]),
    (
        ["consolidate", "--checkpoint", "model", "--output", "out", "--overwrite", "maybe"],
        ["maybe", "true"],
    ),
]


def _id(args: list[str]) -> str:
    return " ".join(dict.fromkeys(args[:1] + args[-2:])) or "no-arguments"


@pytest.mark.parametrize(("args", "expected"), BAD_VALUES, ids=[_id(args) for args, _ in BAD_VALUES])
def test_bad_value_is_one_clear_error_line_and_nothing_written(tmp_path, args, expected):
    from lightning_train.checkpoint import save_safetensors
    from lightning_train.models.gpt import GPT, GPTConfig

    (tmp_path / "doc.txt").write_text("some text " * 100)
    save_safetensors(
        GPT(GPTConfig(vocab_size=258, block_size=32, n_layer=1, n_head=2, n_embd=32)), tmp_path / "model"
    )
    before = _files(tmp_path)
    result = run_cli_in_process(*args, cwd=tmp_path)
    _assert_one_clear_error(result, *expected)
    assert _files(tmp_path) == before
