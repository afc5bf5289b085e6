"""Tests of ``lightning_train._compat.other_api`` (torchmetrics, tqdm, argparse), one a function, and of the
private methods overridden in place: an upgrade that renames or changes one fails the test named after it."""

from __future__ import annotations

import argparse
import inspect
import io
import logging
import subprocess
import sys
from typing import Any

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.connectors import accelerator_connector
from tqdm import tqdm

from lightning_train import _compat
from lightning_train._compat import other_api
from tests.conftest import cli_env


# ---- lm_eval ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("progress", [True, False])
def test_lm_eval_console(tmp_path, monkeypatch, capfd, progress: bool) -> None:
    """The names it patches exist and are put back; git's stderr is gone and its answer is lm_eval's own;
    without progress, lm_eval's bars are off and its log is at errors only."""
    datasets = pytest.importorskip("datasets")
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.evaluator

    monkeypatch.chdir(tmp_path)  # not a git checkout: git prints "fatal: ..."
    names = [(lm_eval.evaluator, "get_git_commit_hash"), (lm_eval.api.task, "tqdm"),
             (lm_eval.api.model, "tqdm")]
    before = [getattr(module, name) for module, name in names]
    expected = before[0]()
    assert "fatal" in capfd.readouterr().err
    with _compat.lm_eval_console(progress):
        assert lm_eval.evaluator.get_git_commit_hash() == expected
        assert "fatal" not in capfd.readouterr().err
        bar = lm_eval.api.task.tqdm(range(3), file=sys.stderr)
        assert bar.disable is not progress
        bar.close()
        assert (logging.getLogger("lm_eval.api.task").getEffectiveLevel() == logging.ERROR) is not progress
        assert datasets.is_progress_bar_enabled() is progress
    assert [getattr(module, name) for module, name in names] == before
    assert datasets.is_progress_bar_enabled()
    assert logging.getLogger("lm_eval.api.task").getEffectiveLevel() < logging.ERROR


# ---- tqdm and argparse ------------------------------------------------------------------------------------
def test_open_tqdm_bars():
    bar = tqdm(total=1, file=io.StringIO())
    assert bar in _compat.open_tqdm_bars()
    bar.close()
    assert bar not in _compat.open_tqdm_bars()


def test_subcommand_actions():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    subparsers.add_parser("fit", help="Train a model.")
    subparsers.add_parser("validate", help="Evaluate.")
    assert [(a.dest, a.help) for a in _compat.subcommand_actions(subparsers)] == [
        ("fit", "Train a model."), ("validate", "Evaluate."),
    ]
    assert _compat.subcommand_actions(parser.add_argument("--seed")) is None


# ---- torchmetrics ----------------------------------------------------------------------------------------
TORCHMETRICS_FLAGS = (
    "import sys\nfrom lightning_train._compat import torchmetrics_without_heavy_extras\n"
    "torchmetrics_without_heavy_extras()\nimport torchmetrics.utilities.imports as flags\n"
    "print([bool(getattr(flags, name)) for name in {flags!r}], 'transformers' in sys.modules, "
    "'matplotlib' in sys.modules, 'scipy.signal' in sys.modules)"
)


@pytest.mark.parametrize("full", [False, True])
def test_torchmetrics_without_heavy_extras(full: bool) -> None:
    """In a fresh interpreter (torchmetrics not yet imported): torchmetrics sees transformers and matplotlib
    as absent and imports neither, nor scipy.signal; with LIGHTNING_TRAIN_FULL_TORCHMETRICS=1 all three are
    as installed (the dev extra installs them)."""
    script = TORCHMETRICS_FLAGS.format(flags=other_api._HEAVY_OPTIONAL_FLAGS)
    env = cli_env(**({_compat.FULL_TORCHMETRICS_ENV: "1"} if full else {}))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    flags = len(other_api._HEAVY_OPTIONAL_FLAGS)
    assert done.stdout.strip() == f"{[full] * flags} {full} {full} {full}"


OBJECT_STORAGE_CHECK = (
    "import sys\nimport fsspec\nimport lightning.fabric.utilities.cloud_io as cloud_io\n"
    "from lightning_train._compat import object_storage_check_without_imports\n"
    "object_storage_check_without_imports()\nfirst = cloud_io._is_object_storage\n"
    "object_storage_check_without_imports()\nassert cloud_io._is_object_storage is first  # once only\n"
    "local = [cloud_io._is_object_storage(fsspec.filesystem('file')), 's3fs' in sys.modules]\n"
    "from s3fs import S3FileSystem\n"
    "print(local, cloud_io._is_object_storage(S3FileSystem(anon=True)))"
)


def test_object_storage_check_without_imports() -> None:
    """In a fresh interpreter: a local filesystem is not object storage and s3fs stays unimported; an
    S3 filesystem (s3fs imported to make it) still is; a second call changes nothing."""
    done = subprocess.run([sys.executable, "-c", OBJECT_STORAGE_CHECK], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[False, False] True"


# ---- private methods overridden in place (listed in _compat's docstring) ----------------------------------
@pytest.mark.parametrize("base, name, caller", [
    (LightningCLI, "_add_subcommands", LightningCLI),
    (LightningCLI, "_parse_ckpt_path", LightningCLI),
    (Strategy, "_configure_launcher", accelerator_connector),
    (argparse.HelpFormatter, "_fill_text", argparse.HelpFormatter),
    (argparse.HelpFormatter, "_get_help_string", argparse.HelpFormatter),
    (argparse.HelpFormatter, "_format_action", argparse.HelpFormatter),
])
def test_overridden_private_methods_are_still_called(base: type, name: str, caller: Any):
    """An override of a method its base renamed would silently never run: each one is still defined
    by the base, and called where it was."""
    assert callable(getattr(base, name, None)) and f".{name}(" in inspect.getsource(caller)
