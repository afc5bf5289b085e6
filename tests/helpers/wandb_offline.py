"""Read what W&B wrote offline: the ``run-<id>.wandb`` file of ``wandb/offline-run-*/``.

wandb >= 0.30 writes these files from its Go core and ships no Python reader, so the W&B tests read
back what the logger wrote with this small one. The format (``core/pkg/leveldb`` in the wandb
repository) is LevelDB's log:

* a 7-byte file header: ``b":W&B"``, magic ``0xBEE1`` (uint16 LE), version ``0`` (uint8);
* then 32 KiB blocks (the first block includes the header) of chunks, each a 7-byte header (CRC-32
  IEEE of type byte + payload as uint32 LE, payload length uint16 LE, type uint8) and its payload;
  a chunk never crosses a block boundary, and a block tail too short for a header is zero padding;
* chunk types FULL=1, FIRST=2, MIDDLE=3, LAST=4 join into records, each a serialized
  ``wandb.proto.wandb_internal_pb2.Record``.

    run = read_run(find_run_files(tmp_path / "wandb")[-1], timeout=30)
    run.history[-1]["train/loss"], run.metrics["val/loss"]["summary"], run.alerts
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK_SIZE = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """The file is not a W&B run file, or it is corrupt."""


def iter_records(path: str | Path) -> Iterator[Any]:
    """Every ``Record`` of a ``.wandb`` file, in order. A torn last record (a run still writing, or
    killed mid-write) ends the iteration; corruption anywhere else raises ``WandbFileError``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < HEADER.size or HEADER.unpack_from(data) != (IDENT, MAGIC, VERSION):
        raise WandbFileError(f"{path} is not a W&B run file (bad header {data[:HEADER.size]!r})")
    position, pending = HEADER.size, bytearray()
    while position + CHUNK.size <= len(data):
        room = BLOCK_SIZE - position % BLOCK_SIZE
        if room < CHUNK.size:  # zero padding at the end of a block
            position += room
            continue
        checksum, length, kind = CHUNK.unpack_from(data, position)
        start, end = position + CHUNK.size, position + CHUNK.size + length
        if kind == 0 and length == 0:  # preallocated (zeroed) tail: nothing more was written
            return
        if end > len(data):
            return
        if zlib.crc32(data[start - 1 : end]) != checksum:  # the CRC covers the type byte too
            raise WandbFileError(f"{path}: checksum mismatch in the chunk at byte {position}")
        if kind in (FULL, FIRST):
            pending = bytearray()
        pending += data[start:end]
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(bytes(pending))
            yield record
        position = end


@dataclass
class OfflineRun:
    """The parts of a run file that dashboards and tests care about."""

    run_id: str = ""
    project: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # name or glob -> definition
    alerts: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    finished: bool = False  # the run's exit record is in the file

    def history_keys(self) -> set[str]:
        return {key for row in self.history for key in row}


def read_run(path: str | Path, timeout: float = 0.0) -> OfflineRun:
    """Collect run metadata, config, history rows, metric definitions, alerts and summary.

    wandb-core writes the file in the background: even after ``run.finish()`` (or the training
    process) returned, the records may land a moment later. ``timeout``: seconds to wait for the
    run's exit record before returning what is there.
    """
    deadline = time.monotonic() + timeout
    run = _read_run(path)
    while not run.finished and time.monotonic() < deadline:
        time.sleep(0.1)
        run = _read_run(path)
    return run


def _read_run(path: str | Path) -> OfflineRun:
    run = OfflineRun()
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            # the first run record starts the run; later ones (tag or group updates) amend it
            run.run_id = record.run.run_id or run.run_id
            run.project = record.run.project or run.project
            run.group = record.run.run_group or run.group
            run.tags = list(record.run.tags) or run.tags
            _apply_items(run.config, record.run.config.update)
        elif kind == "config":
            _apply_items(run.config, record.config.update)
        elif kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "metric":
            metric = record.metric
            summary = [name for name in ("min", "max", "mean", "last", "first", "none")
                       if getattr(metric.summary, name)]
            run.metrics[metric.name or metric.glob_name] = {
                "step_metric": metric.step_metric,
                "summary": summary,
                "hidden": metric.options.hidden,
            }
        elif kind == "alert":
            alert = record.alert
            run.alerts.append({"title": alert.title, "text": alert.text, "level": alert.level})
        elif kind == "summary":
            _apply_items(run.summary, record.summary.update)
        elif kind == "exit":
            run.finished = True
    run.config.pop("_wandb", None)
    return run


def find_run_files(directory: str | Path) -> list[Path]:
    """All ``run-*.wandb`` files below ``directory``, oldest run folder first."""
    return sorted(Path(directory).rglob("run-*.wandb"), key=lambda p: p.parent.name)


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def _items(items: Any) -> dict[str, Any]:
    return {_key(item): json.loads(item.value_json) for item in items}


def _apply_items(target: dict[str, Any], items: Any) -> None:
    target.update(_items(items))
