"""Helpers shared by the benchmark scripts: paired A/B runs, median of per-pair ratios, machine facts,
a printed table and the JSON result file.

Why paired: these machines are shared and noisy, so two long runs measured minutes apart compare the
load more than the code. Each pair runs A and B back to back (alternating which goes first, so a
drifting load favours neither), and the result is the median of the per-pair ratios with their
min-max, which a single slow outlier cannot move.

    >>> pairs = paired(lambda: 1.0, lambda: 1.1, pairs=3)
    >>> summarize_ratios(pairs)["median"]
    1.1

Scripts run as ``python benchmarks/<name>.py`` (this folder is then on ``sys.path``, so they
``from common import ...``); each writes ``docs/benchmarks/<name>.json`` unless given ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lightning
import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "benchmarks"
T = TypeVar("T")


def base_parser(name: str, description: str, pairs: int = 5) -> argparse.ArgumentParser:
    """The flags every benchmark shares: ``--smoke``, ``--pairs``, ``--threads`` and ``--out``."""
    parser = argparse.ArgumentParser(prog=f"benchmarks/{name}.py", description=description)
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run that checks it works")
    parser.add_argument("--pairs", type=int, default=pairs, help="A/B pairs to run (alternating order)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch/OpenMP threads, the same for both sides of every pair"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"{name}.json", help="the JSON to write")
    return parser


def set_threads(threads: int) -> None:
    """One thread count for the whole process (both sides of every pair run under it)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def paired(run_a: Callable[[], T], run_b: Callable[[], T], pairs: int) -> list[tuple[T, T]]:
    """``pairs`` (a, b) measurements; even pairs run A first, odd pairs run B first."""
    results = []
    for i in range(pairs):
        if i % 2 == 0:
            a = run_a()
            b = run_b()
        else:
            b = run_b()
            a = run_a()
        results.append((a, b))
    return results


def clock() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds). On a shared CPU machine the CPU time counts the work
    a run did and hardly the other users' load, so its ratios are steadier than wall-clock ones."""
    return time.perf_counter(), time.process_time()


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_ratios(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Median and min-max of the per-pair ratios b / a."""
    return summarize([b / a for a, b in pairs])


def comparison(label_a: str, label_b: str, pairs: Sequence[tuple[float, float]], unit: str) -> dict[str, Any]:
    """One A/B comparison as it goes into the JSON: both sides' medians, the ratio b / a and the raw pairs."""
    return {
        "a": label_a,
        "b": label_b,
        "unit": unit,
        "a_stats": summarize([a for a, _ in pairs]),
        "b_stats": summarize([b for _, b in pairs]),
        "ratio_b_over_a": summarize_ratios(pairs),
        "pairs": [list(pair) for pair in pairs],
    }


def compare_clocks(
    label_a: str, label_b: str, pairs: Sequence[tuple[dict[str, float], dict[str, float]]], unit: str
) -> dict[str, dict[str, Any]]:
    """One ``comparison`` per clock ("cpu", "wall") of per-step timings like ``StepTimer.per_step()``."""
    clocks = ("cpu", "wall")
    return {key: comparison(label_a, label_b, [(a[key], b[key]) for a, b in pairs], unit) for key in clocks}


def comparison_row(name: str, result: dict[str, Any], scale: float = 1.0) -> list[Any]:
    """A table row: name, both sides' medians (times ``scale``) and the ratio with its min-max."""
    return [name, scale * result["a_stats"]["median"], scale * result["b_stats"]["median"],
            ratio_cell(result["ratio_b_over_a"])]


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What the numbers were measured on: hardware, software versions, threads, load and commit."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print (and return) a Markdown table, so it can be pasted into docs/benchmarks.md as is."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    table = "\n".join(lines)
    print(table, flush=True)
    return table


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating the folder; says where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def ratio_cell(stats: dict[str, float]) -> str:
    """``1.012x (0.998-1.031)``: a median ratio with its min-max, for tables."""
    return f"{stats['median']:.3f}x ({stats['min']:.3f}-{stats['max']:.3f})"


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer(Callback):
    """Times optimizer steps ``[warmup, until)`` (``until`` None: to the last step), in wall and CPU
    seconds (see ``clock``): from the start of step ``warmup`` (its batch already fetched) to the end of
    step ``until - 1``. Also keeps the last step's loss (on the device)."""

    def __init__(self, warmup: int, until: int | None = None) -> None:
        self.warmup, self.until = warmup, until
        self.start = self.end = (0.0, 0.0)
        self.steps = 0
        self.last_loss: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            synchronize(pl_module.device)
            self.start = clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self.warmup and (self.until is None or trainer.global_step <= self.until):
            synchronize(pl_module.device)
            self.end = clock()
            self.steps = trainer.global_step - self.warmup
        self.last_loss = outputs["loss"].detach()

    def per_step(self) -> dict[str, float]:
        """``{"wall": seconds per step, "cpu": CPU seconds per step}``."""
        return per_step(self.start, self.end, self.steps)


class FirstStepClock(Callback):
    """Writes ``"<wall> <cpu>"`` to the file ``$FIRST_STEP_RECORD`` at the first training batch: the Unix
    time (for the parent, which started the process, to subtract) and this process's CPU seconds so far.
    ``startup.py`` loads it into both fits it compares."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and trainer.is_global_zero:
            Path(os.environ["FIRST_STEP_RECORD"]).write_text(f"{time.time()} {time.process_time()}")


def per_step(start: tuple[float, float], end: tuple[float, float], steps: int) -> dict[str, float]:
    """Wall and CPU seconds per step between two ``clock()`` readings."""
    return {"wall": (end[0] - start[0]) / steps, "cpu": (end[1] - start[1]) / steps}


def add_worker_flags(parser: argparse.ArgumentParser, workers: Sequence[str], sizes: Sequence[str]) -> None:
    """The hidden flags a ``launch_worker`` launch passes back to its script."""
    parser.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=list(sizes), default="full", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)


def launch_worker(script: str, name: str, size: str, threads: int) -> list[dict[str, Any]]:
    """The per-rank results of one fresh ``python SCRIPT --worker NAME`` launch: the worker (whose ranks
    Lightning's launcher starts by re-running the command line) writes ``rank<R>.json`` into
    ``--result-dir``."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, script, "--worker", name, "--size", size, "--result-dir", folder]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
        env.pop("MASTER_PORT", None)  # each launch finds a free port: launches may run side by side
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{name} run failed:\n{done.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"))]
