"""Doctests of ``lightning_train`` (``pytest --doctest-modules lightning_train``).

Each example runs in a temporary working folder with a temporary ``LIGHTNING_TRAIN_CACHE``, so nothing
lands in the repository or the home folder, and the environment variables it leaves behind are undone
(a Trainer's ``MASTER_PORT``, ``PL_GLOBAL_SEED``, ...: inherited, they would mislead the tests' own
subprocesses). The default corpus and the default fine-tuning task are built
into that cache once per test process, here, so the examples do not print the build's progress bar.
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
def _doctest_folders(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if not isinstance(request.node, DoctestItem):
        yield
        return
    environment = dict(os.environ)
    monkeypatch.setenv("LIGHTNING_TRAIN_CACHE", str(request.getfixturevalue("doctest_cache")))
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(environment)
