"""Doctests of ``lightning_train`` (``pytest --doctest-modules lightning_train``).

Each example runs in a temporary working folder with a temporary ``LIGHTNING_TRAIN_CACHE``, so nothing
lands in the repository or the home folder, and the environment variables it leaves behind are undone
(a Trainer's ``MASTER_PORT``, ``LOCAL_RANK``, ...: inherited, they would mislead the tests' own
subprocesses; this holds for every test, not only the examples). The default corpus and the default
fine-tuning task are built into that cache once per test process, here, so the examples do not print
the build's progress bar.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(scope="session")
def doctest_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_train.data.default_corpus import default_corpus_dir
    from lightning_train.data.tasks import default_task_dir

    cache = tmp_path_factory.mktemp("lt-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LIGHTNING_TRAIN_CACHE", str(cache))
        default_corpus_dir()
        default_task_dir()
    return cache


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Every test and example: an in-process Trainer sets ``LOCAL_RANK``, ``MASTER_PORT``, ... in
    ``os.environ``; a later CLI subprocess that inherited them would wait for ranks that never come."""
    environment = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(autouse=True)
def _doctest_folders(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if isinstance(request.node, DoctestItem):
        monkeypatch.setenv("LIGHTNING_TRAIN_CACHE", str(request.getfixturevalue("doctest_cache")))
        monkeypatch.chdir(request.getfixturevalue("tmp_path"))
