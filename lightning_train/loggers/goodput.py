"""The goodput files: where each launch's wall time went, and the sum over the launches of one run.

``lightning_train.callbacks.GoodputMonitor`` writes two files into a launch's log folder (``version_N/``):

* ``goodput.json``: the run so far, i.e. every launch of the run summed, and each launch on its own;
  written when training starts, on logging steps at most once a minute, and at the end. People and
  the report read it (the report brings its launch up to date from the live record).
* ``.goodput.live``: this launch's own counters, one fixed-size binary record rewritten in place
  (through a memory map) after every optimizer step, so that a launch killed with SIGKILL still tells
  the next one how far it got and how long it took.

A run is a chain of launches that resumed one another (as in ``launches.py``); they share a run id,
which the checkpoint carries. A resumed launch rebuilds the run's history from the checkpoint it
loaded (the launches before the one that saved it, and that launch's counters at the save) and the
live records of the folder's launches: what a launch trained after the checkpoint the run continues
from is *lost* work, recomputed by the resumed launch.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

PARTS = ("startup", "productive", "checkpoint", "validation", "recovery", "lost", "other")
STEP_KINDS = ("productive", "recovery", "lost")
GOODPUT_FILE = "goodput.json"
LIVE_FILE = ".goodput.live"
STATES = ("training", "finished", "stopped")  # in the live record; an earlier "training" one was killed
# run id, state; started (unix s), wall, the parts but "lost" (a running launch loses nothing yet),
# first and last step, productive and recovery steps, the step it resumed from (-1: a fresh start)
_LIVE = struct.Struct("<2q13d")
_LIVE_PARTS = tuple(part for part in PARTS if part != "lost")

Record = dict[str, Any]  # one launch: see ``launch_record``


def launch_record(name: str, started: float, state: str, first_step: int, last_step: int,
                  resumed_from: int | None, seconds: dict[str, float], steps: dict[str, int]) -> Record:
    """One launch as goodput.json lists it; ``wall_sec`` is the sum of its parts."""
    return {
        "name": name, "started": started, "state": state, "first_step": first_step, "last_step": last_step,
        "resumed_from_step": resumed_from, "wall_sec": sum(seconds[part] for part in PARTS),
        "seconds": {part: seconds[part] for part in PARTS},
        "steps": {kind: steps[kind] for kind in STEP_KINDS},
    }


def total(launches: list[Record]) -> Record:
    """The run: the launches' seconds and steps summed, the share of wall time in productive steps, and
    ``between_launches_sec``: the time from each launch's last record to the next one's start (a restart
    waiting for its rendezvous, a requeued job waiting for its nodes), which no process of the run saw and
    so no part holds."""
    seconds = {part: sum(launch["seconds"][part] for launch in launches) for part in PARTS}
    wall = sum(seconds.values())
    ordered = sorted(launches, key=lambda launch: launch["started"])
    between = sum(max(later["started"] - (earlier["started"] + earlier["wall_sec"]), 0.0)
                  for earlier, later in itertools.pairwise(ordered))
    return {
        "productive_fraction": seconds["productive"] / wall if wall > 0 else 0.0, "wall_sec": wall,
        "between_launches_sec": between,
        "seconds": seconds, "steps": {kind: sum(launch["steps"][kind] for launch in launches)
                                      for kind in STEP_KINDS},
    }


# ---- the live record ------------------------------------------------------------------------------
class LiveRecord:
    """``folder/.goodput.live``, rewritten in place through a shared memory map: a write is a copy of a
    few dozen bytes into the page cache (no system call, no fsync), which a process killed with SIGKILL
    leaves behind for the kernel to write out."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LIVE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # written, not only sized: the page is then allocated, and a full disk is an OSError here
            # rather than a SIGBUS at the map's first write
            os.pwrite(fd, bytes(_LIVE.size), 0)
            self._map = mmap.mmap(fd, _LIVE.size)
        finally:
            os.close(fd)  # the map keeps the file

    def write(self, run_id: int, state: str, started: float, seconds: dict[str, float], pending: float,
              first_step: int, last_step: int, steps: dict[str, int], resumed_from: int | None) -> None:
        """The launch's counters; ``pending``: seconds not yet in a part, counted as other here."""
        parts = [seconds[part] + pending if part == "other" else seconds[part] for part in _LIVE_PARTS]
        _LIVE.pack_into(self._map, 0, run_id, STATES.index(state), started, sum(parts), *parts, first_step,
                        last_step, steps["productive"], steps["recovery"],
                        -1 if resumed_from is None else resumed_from)

    def close(self) -> None:
        self._map.close()


def read_live(folder: Path) -> tuple[int, Record] | None:
    """``(run id, record)`` of ``folder``'s live record; None without a whole one."""
    try:
        data = (folder / LIVE_FILE).read_bytes()
    except OSError:
        return None
    if len(data) != _LIVE.size:
        return None
    run_id, state, started, _wall, *rest = _LIVE.unpack(data)
    seconds = dict(zip(_LIVE_PARTS, rest[: len(_LIVE_PARTS)], strict=True))
    first, last, productive, recovery, resumed = (int(v) for v in rest[len(_LIVE_PARTS):])
    return run_id, launch_record(folder.name, started, STATES[state], first, last,
                                 None if resumed < 0 else resumed, {**seconds, "lost": 0.0},
                                 {"productive": productive, "recovery": recovery, "lost": 0})


# ---- the run's history ----------------------------------------------------------------------------
def earlier_launches(run_folder: Path, run_id: int, checkpointed: list[Record], writer: Record | None,
                     before: float) -> list[Record]:
    """The run's launches before the one started at ``before`` (unix seconds), oldest first.

    ``checkpointed``: the launches the checkpoint being resumed lists (final); ``writer``: the record
    of the launch that saved it, as of the save (None for a fresh start). The live records in the
    folders under ``run_folder`` of the same run give the writer's whole launch, whose steps after the
    checkpoint are lost work, and the launches the checkpoint does not know (started after the writer:
    killed before a checkpoint of theirs was resumed, or an abandoned branch), all of whose steps are
    lost. An earlier launch whose live record still says "training" was killed."""
    live: dict[float, Record] = {}
    for folder in sorted(path.parent for path in run_folder.glob(f"*/{LIVE_FILE}")):
        found = read_live(folder)
        if found is not None and found[0] == run_id:
            live[found[1]["started"]] = found[1]
    launches = [dict(record) for record in checkpointed]
    known = {record["started"] for record in checkpointed}
    if writer is not None:
        whole = live.get(writer["started"])
        launches.append(_lose_after(whole, writer) if whole else {**writer, "state": "unknown"})
        known.add(writer["started"])
    for started, record in live.items():
        if started not in known and started < before:
            launches.append(_lose_after(record, None))
    return sorted(launches, key=lambda launch: launch["started"])


def _lose_after(record: Record, kept: Record | None) -> Record:
    """``record`` with its productive steps after ``kept`` (the same launch at a checkpoint; None: all of
    them) moved to lost work."""
    seconds, steps = dict(record["seconds"]), dict(record["steps"])
    lost_sec = max(0.0, seconds["productive"] - (kept["seconds"]["productive"] if kept else 0.0))
    lost_steps = max(0, steps["productive"] - (kept["steps"]["productive"] if kept else 0))
    seconds["productive"] -= lost_sec
    seconds["lost"] += lost_sec
    steps["productive"] -= lost_steps
    steps["lost"] += lost_steps
    state = "killed" if record["state"] == "training" else record["state"]
    return {**record, "state": state, "seconds": seconds, "steps": steps}


# ---- goodput.json ---------------------------------------------------------------------------------
def write_goodput(folder: Path, run_id: int, launches: list[Record]) -> None:
    """``folder/goodput.json``: the run (``launches`` summed), then each launch; written atomically."""
    path = folder / GOODPUT_FILE
    content = {"run_id": f"{run_id:016x}", **total(launches), "launches": launches}
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{GOODPUT_FILE}.partial")
    try:
        partial.write_text(json.dumps(content, indent=2) + "\n")
    except OSError:
        partial.unlink(missing_ok=True)  # a full disk: no half-written leftover
        raise
    os.replace(partial, path)


def read_goodput(folder: Path) -> Record | None:
    """``folder/goodput.json`` with its own launch brought up to date from the live record (a launch
    killed since its last logging step); None without one."""
    try:
        content = json.loads((folder / GOODPUT_FILE).read_text())
    except (OSError, ValueError):
        return None
    launches = content["launches"]
    found = read_live(folder)
    if found is not None and launches and found[1]["started"] == launches[-1]["started"]:
        launches[-1] = found[1]
    return {**content, **total(launches), "launches": launches}
