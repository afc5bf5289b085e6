"""Whole process: ``python -m lightning_train fit --config configs/pretrain-tiny.yaml
--trainer.max_steps=200`` from its start to its exit, as a user runs it (import, set-up, 200 steps, 2
validations, checkpoints every 100 steps, the summary), each run a fresh process in a fresh folder.

Rows (B / A, each a paired comparison, alternating which goes first):

- ``release``: this tree (B) against another checkout of the package (A, ``--baseline PATH``, e.g. the
  previous release in a ``git worktree``; each side imports its own package, checked before the pairs);
- ``nanogpt, same block`` / ``nanogpt, GPT-2 block``: this tree against ``nanogpt_peer.py`` run as its
  own process (nanoGPT's ``train.py`` loop, same size, batch and token file, 200 steps, 2 evaluations),
  with the default config's Llama-style block or nanoGPT's GPT-2 block;
- ``nanogpt compiled, GPT-2 block``: both with ``torch.compile`` (``--compile``; nanoGPT compiles by
  default).

Each run reports: the process's wall and CPU seconds (``RUSAGE_CHILDREN``: user + system), and its wall
split as Goodput splits it (``goodput.json``; the peer times the same parts): ``startup`` (process start
to the first training batch), ``step`` (seconds per productive step, batch loading included),
``validation``, ``checkpoint``. The release row also times the imports a fit needs (``IMPORTS``) alone,
wall and CPU: the imports' share of the start-up.

    python benchmarks/whole_process.py --baseline /tmp/prev   # + the release row; 3 pairs a row
    python benchmarks/whole_process.py --rows nanogpt         # the nanoGPT rows only
    python benchmarks/whole_process.py --smoke                # a tiny model, 4 steps, the eager rows
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from common import (
    REPO,
    base_parser,
    comparison,
    machine_info,
    paired,
    print_table,
    ratio_cell,
    summarize,
    write_json,
)
from throughput import SMOKE_SHAPE, peer_shape

CONFIG = Path("configs") / "pretrain-tiny.yaml"
PEER = REPO / "benchmarks" / "nanogpt_peer.py"
NANOGPT_ROWS = {  # name: (the peer's block, torch.compile on both sides)
    "nanogpt, same block": ("llama", False),
    "nanogpt, GPT-2 block": ("gpt2", False),
    "nanogpt compiled, GPT-2 block": ("gpt2", True),
}
# what a fit of the default config imports (named module by module: the package imports lazily)
IMPORTS = ("import lightning_train.cli.trainer, lightning_train.modules.pretrain, lightning_train.data.text, "
           "lightning_train.callbacks.goodput, lightning_train.strategies.data_parallel")
PARTS = ("wall", "cpu", "startup", "step", "validation", "checkpoint")


def timed_process(command: list[str], cwd: str, env: dict[str, str]) -> dict[str, float]:
    """Wall and CPU seconds (user + system, from the children's resource usage) of one process."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu}


def package_env(root: Path, threads: int) -> dict[str, str]:
    """The environment that makes a process import the package of the checkout ``root``."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(root)}


def imported_package(root: Path, threads: int) -> str:
    """Where a run of ``root`` imports ``lightning_train`` from (in a folder outside any checkout)."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [sys.executable, "-c", "import lightning_train; print(lightning_train.__file__)"],
            cwd=cwd, env=package_env(root, threads), capture_output=True, text=True, check=True,
        )
    path = done.stdout.strip()
    if not Path(path).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"a run of {root} imports lightning_train from {path}")
    return path


def fit_process(root: Path, overrides: list[str], steps: int, threads: int, time_import: bool) -> dict:
    """One ``fit`` of ``root``'s default config as its own process, in a fresh folder (its ``runs/``)."""
    env = package_env(root, threads)
    with tempfile.TemporaryDirectory() as cwd:
        record = {}
        if time_import:
            imported = timed_process([sys.executable, "-c", IMPORTS], cwd, env)
            record.update(import_wall=imported["wall"], import_cpu=imported["cpu"])
        command = [sys.executable, "-m", "lightning_train", "fit", "--config", str(root / CONFIG),
                   f"--trainer.max_steps={steps}", "--run_name", "bench", *overrides]
        record.update(timed_process(command, cwd, env))
        goodput = json.loads((Path(cwd) / "runs" / "bench" / "version_0" / "goodput.json").read_text())
    return {**record, **_parts(goodput["seconds"], goodput["steps"]["productive"])}


def peer_process(shape: dict[str, Any], files: dict[str, Path], steps: int, threads: int, compile: bool,
                 evaluation: tuple[int, int]) -> dict:
    """One run of ``nanogpt_peer.py`` (nanoGPT's train.py loop) as its own process; ``evaluation``: its
    interval and batches."""
    with tempfile.TemporaryDirectory() as cwd:
        result = Path(cwd) / "result.json"
        command = [
            sys.executable, str(PEER), "--shape", json.dumps(shape), "--out-dir", cwd,
            "--result", str(result), "--train-bin", str(files["train"]), "--val-bin", str(files["val"]),
            f"--max-iters={steps}", f"--eval-interval={evaluation[0]}", f"--eval-iters={evaluation[1]}",
        ] + (["--compile"] if compile else [])
        record = timed_process(command, cwd, {**os.environ, "OMP_NUM_THREADS": str(threads)})
        done = json.loads(result.read_text())
    return {**record, **_parts(done["seconds"], done["steps"])}


def _parts(seconds: dict[str, float], steps: int) -> dict[str, float]:
    return {"startup": seconds["startup"], "step": seconds["productive"] / steps,
            "validation": seconds["validation"], "checkpoint": seconds["checkpoint"]}


def compare(label_a: str, label_b: str, pairs: list[tuple[dict, dict]], tokens_per_step: int) -> dict:
    """One ``comparison`` per measured part, and B's steady-state tokens/s over A's."""
    keys = [key for key in (*PARTS, "import_wall", "import_cpu") if key in pairs[0][0]]
    result = {key: comparison(label_a, label_b, [(a[key], b[key]) for a, b in pairs], "s") for key in keys}
    result["tokens_per_s"] = {
        "a": tokens_per_step / result["step"]["a_stats"]["median"],
        "b": tokens_per_step / result["step"]["b_stats"]["median"],
        "ratio_b_over_a": summarize([a["step"] / b["step"] for a, b in pairs]),
    }
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("whole_process", __doc__.splitlines()[0], pairs=3)
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with (the previous release)")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout measured (B; default: this)")
    parser.add_argument("--rows", choices=["all", "release", "nanogpt"], default="all")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    steps, pairs = (4, 1) if args.smoke else (args.steps, args.pairs)
    # the config's validation and checkpoint cadence (every 100 steps) scaled to a smoke run's 4 steps
    smoke_cadence = ["--trainer.val_check_interval=2", "--trainer.limit_val_batches=2"]
    overrides = [*SMOKE_SHAPE, *smoke_cadence] if args.smoke else []
    evaluation = (2, 2) if args.smoke else (100, 10)  # the config's val_check_interval, limit_val_batches
    machine = machine_info(args.threads)
    rows: dict[str, dict[str, Any]] = {}
    tree = args.tree
    imported = {"tree": imported_package(tree, args.threads)}
    shape, train_bin = peer_shape(overrides, "llama")
    tokens = shape["batch_size"] * shape["block_size"]
    if args.baseline is not None and args.rows in ("all", "release"):
        imported["baseline"] = imported_package(args.baseline, args.threads)
        measured = paired(partial(fit_process, args.baseline, overrides, steps, args.threads, True),
                          partial(fit_process, tree, overrides, steps, args.threads, True), pairs)
        rows["release"] = compare(f"baseline {args.baseline}", f"tree {tree}", measured, tokens)
    if args.rows in ("all", "nanogpt"):
        files = {"train": train_bin, "val": train_bin.with_name(train_bin.name.replace("train", "val"))}
        for name, (block, compile) in NANOGPT_ROWS.items():
            if compile and args.smoke:  # compiling is most of a smoke run; throughput.py's smoke compiles
                continue
            ours = overrides + (["--model.init_args.compile=true"] if compile else [])
            row_shape, _ = peer_shape(overrides, block)
            peer = partial(peer_process, row_shape, files, steps, args.threads, compile, evaluation)
            measured = paired(peer, partial(fit_process, tree, ours, steps, args.threads, False), pairs)
            rows[name] = compare("nanoGPT-style train.py process", f"tree {tree}", measured, tokens)
    _print(rows)
    print(f"{pairs} pairs a row, {steps} steps a run; B / A: the tree / the other side")
    payload = {
        "benchmark": "whole_process",
        "goal": "release: this tree / previous release <= 1.01x wall; nanoGPT rows: tokens/s ratio >= 1.0",
        "smoke": args.smoke,
        "setup": {"config": str(CONFIG), "steps": steps, "overrides": overrides, "imported": imported,
                  "peer": {"eval_interval": evaluation[0], "eval_iters": evaluation[1], "shape": shape}},
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": rows,
    }
    write_json(args.out, payload)
    return payload


def _print(rows: dict[str, dict[str, Any]]) -> None:
    table = []
    for name, result in rows.items():
        for key, part in result.items():
            if key == "tokens_per_s":
                ratio = ratio_cell(part["ratio_b_over_a"])
                table.append([name, "tokens/s (steps)", part["a"], part["b"], ratio])
            else:
                table.append([name, key, part["a_stats"]["median"], part["b_stats"]["median"],
                              ratio_cell(part["ratio_b_over_a"])])
    print_table(["row", "part", "A, s", "B, s", "B / A, median (min-max)"], table)


if __name__ == "__main__":
    main()
