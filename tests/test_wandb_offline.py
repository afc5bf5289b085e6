"""The offline run-file reader on files written by the real wandb package: records that span 32 KiB
blocks, torn tails and corruption."""

from __future__ import annotations

import pytest
import wandb

from tests.helpers.wandb_offline import (
    BLOCK_SIZE,
    WandbFileError,
    find_run_files,
    iter_records,
    read_run,
)


@pytest.fixture(scope="module")
def run_file(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("offline")
    monkeypatch_module.delenv("WANDB_SERVICE", raising=False)  # wandb.init exports it; undone afterwards
    # A config value of 3 blocks forces one record into FIRST/MIDDLE/LAST chunks.
    blob = "x" * (3 * BLOCK_SIZE)
    run = wandb.init(project="reader", dir=str(folder), mode="offline", config={"blob": blob})
    for step in range(200):
        run.log({"train/loss": 1.0 / (step + 1), "trainer/global_step": step})
    run.alert(title="Rollback", text="restored step 100", level=wandb.AlertLevel.WARN)
    run.finish()
    (path,) = find_run_files(folder)
    assert read_run(path, timeout=30).finished  # wandb-core may still be writing after finish()
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_reads_every_record_across_blocks(run_file):
    assert run_file.stat().st_size > 4 * BLOCK_SIZE
    run = read_run(run_file, timeout=30)
    assert run.config["blob"] == "x" * (3 * BLOCK_SIZE)
    assert [row["trainer/global_step"] for row in run.history] == list(range(200))
    assert run.history[-1]["train/loss"] == pytest.approx(1 / 200)
    assert run.alerts == [{"title": "Rollback", "text": "restored step 100", "level": "WARN"}]
    assert run.project == "reader" and run.run_id in run_file.name


def test_torn_tail_ends_reading_and_corruption_raises(run_file, tmp_path):
    data = run_file.read_bytes()
    complete = sum(1 for _ in iter_records(run_file))

    torn = tmp_path / "run-torn.wandb"
    torn.write_bytes(data[: len(data) - 100])  # killed while writing its last records
    assert 0 < sum(1 for _ in iter_records(torn)) < complete

    corrupt = tmp_path / "run-corrupt.wandb"
    middle = len(data) // 2
    corrupt.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    with pytest.raises(WandbFileError, match="checksum mismatch"):
        list(iter_records(corrupt))

    not_wandb = tmp_path / "run-other.wandb"
    not_wandb.write_bytes(b"hello world")
    with pytest.raises(WandbFileError, match="not a W&B run file"):
        list(iter_records(not_wandb))
