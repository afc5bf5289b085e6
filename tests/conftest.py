"""Shared fixtures: a tiny model config, a small prepared corpus, and running the CLI (a real subprocess, or
in this process)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_train.data import prepare
from lightning_train.models.gpt import GPTConfig
from tests.helpers.tiny_runs import TINY, sentences

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that hold a ``slow`` test run first, the rest after them, each module's tests together and
    in their order. ``make test`` runs ``pytest -n 2 --dist worksteal``: the first worker starts on the
    slow half, the second on the short half and then takes the first's remaining tests from the end of
    its queue, so neither sits idle while the other runs minute-long multi-process tests."""
    heavy = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(autouse=True)
def no_process_group_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test that leaves a default process group in this worker, not the later test whose own
    group then cannot start ("trying to initialize the default process group twice")."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a process group initialized", pytrace=False)


@pytest.fixture
def process_group() -> Iterator[None]:
    """A real one-process gloo group, gone after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def tiny_config() -> GPTConfig:
    return GPTConfig(**TINY)


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: this checkout importable, one thread a process, W&B offline with
    a W&B service of its own, and one shared cache for the default corpus."""
    env = dict(os.environ)
    env.pop("WANDB_SERVICE", None)  # exported by an in-process wandb.init; a subprocess starts its own
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        LIGHTNING_TRAIN_CACHE=os.environ.get(
            "LIGHTNING_TRAIN_CACHE", str(REPO / ".pytest_cache" / "lt-cache")
        ),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m lightning_train ARGS`` in ``cwd``; the finished process (never raises on exit code)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_train", *args],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_torchrun(
    ranks: int, *args: str, cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=RANKS ARGS`` (``-m module ...``) in ``cwd``, with
    ``cli_env``; the finished process (never raises on exit code)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *args],
        cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )


def run_main(*args: str) -> tuple[int, str, str]:
    """``python -m lightning_train ARGS`` in this process (the same code path from argv on, without
    a new interpreter's start-up): exit code, stdout, stderr."""
    from lightning_train.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _log_handlers_writing_to(err):
        try:
            main(list(args))
        except SystemExit as stopped:
            code = stopped.code
        finally:
            _leave_process_group()
    return code, out.getvalue(), err.getvalue()


def _leave_process_group() -> None:
    """What a finished process's exit does for a run that joined a process group (an ``atexit`` handler,
    which an in-process run never reaches): a later test in this worker can then start a group of its own."""
    if "lightning_train.strategies.processes" in sys.modules:
        from lightning_train.strategies.processes import leave_process_group

        leave_process_group()


@contextlib.contextmanager
def _log_handlers_writing_to(stream: io.StringIO) -> Iterator[None]:
    """Point the console handlers of every logger (Lightning's hold the stderr of their import) at
    ``stream`` for a while, so that what a process would print to its console is captured too."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {handler for logger in loggers if isinstance(logger, logging.Logger)
                for handler in logger.handlers if type(handler) is logging.StreamHandler}
    previous = {handler: handler.setStream(stream) for handler in handlers}
    try:
        yield
    finally:
        for handler, original in previous.items():
            handler.setStream(original)


def run_cli_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``run_cli`` without the new interpreter: ``run_main`` in ``cwd``, with the environment ``cli_env``
    gives a subprocess. For tests of what a command answers; a test of the process itself (its exit
    through a signal, its imports, its ranks) runs it with ``run_cli``."""
    saved = dict(os.environ)
    os.environ.update({name: value for name, value in cli_env().items() if name != "PYTHONPATH"})
    try:
        with contextlib.chdir(cwd):
            code, out, err = run_main(*args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["lightning_train", *args], code, out, err)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small prepared corpus (one per test module), the data of ``tests.helpers.ft_runs``'s run.
    About 65 windows of 16 tokens: 16 batches of 4 per epoch on one rank, 8 per rank on two."""
    folder = tmp_path_factory.mktemp("data")
    words, rng = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"], random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(4))}) for _ in range(60)]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    tokens = prepare([str(folder / "docs.jsonl")], str(folder / "tokens"), val_fraction=0.2, num_workers=0)
    return tokens.output_dir


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """~4k byte tokens of English sentences prepared in ``tmp_path``: 240 train windows of 16 tokens (60
    batches of 4), some val windows."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(30)))
    return prepare([str(src)], tmp_path / "data", val_fraction=0.1, num_workers=0).output_dir
