"""Recipe changes, one at a time, to the default config's target: ``fit`` of ``configs/pretrain-tiny.yaml``
as it is (the baseline), then once per variant with one change, each a whole process (one thread, the
config's seed), validating every ``--val-every`` steps until TimeToQuality's target (the config's, 1.60).

Per run: the steps to the target (the first validation at or below it), val/loss at each validation, the
process's CPU seconds (``RUSAGE_CHILDREN``, user + system: start-up, steps, validations and checkpoints, to
the stop at the target) and those over the steps run. A variant **wins** when it reaches the target in fewer
steps than the baseline and with fewer CPU seconds (on this shared machine CPU seconds alone move with the
load; steps do not: seeded one-thread runs repeat their losses exactly). If two variants that change
different settings win, the best two run once more combined.

Batch-size warmup is measured through a subclass (``batch_warmup.py``) that trains on fewer rows of each
batch early on: the package's batch size is fixed for a run, and is made to change only if the ramp wins.

    python benchmarks/recipes.py                       # 10 runs (+1 combined); docs/benchmarks/recipes.json
    python benchmarks/recipes.py --variants "warmup 25" # the baseline and the named variants only
    python benchmarks/recipes.py --variants "warmup 100" --combine "warmup 100" "init_std 0.04"
    python benchmarks/recipes.py --smoke               # a tiny model, a few steps
"""

from __future__ import annotations

import math
import os
from typing import Any

from common import base_parser, machine_info, print_table, write_json
from throughput import SMOKE_SHAPE
from time_to_quality import run_ours, steps_to

BASELINE = "baseline: pretrain-tiny.yaml"
MODEL = "--model.init_args"
_BATCH_WARMUP = "--model.class_path=benchmarks.batch_warmup.BatchWarmupPretrainModule"
VARIANTS: dict[str, list[str]] = {  # name: the fit flags of its one change
    "lr 3e-3, min_lr 3e-4": [f"{MODEL}.learning_rate=3e-3", f"{MODEL}.min_lr=3e-4"],
    "lr 4e-3, min_lr 4e-4": [f"{MODEL}.learning_rate=4e-3", f"{MODEL}.min_lr=4e-4"],
    "warmup 25": [f"{MODEL}.warmup_steps=25"],
    "warmup 100": [f"{MODEL}.warmup_steps=100"],
    "cosine ends at step 400": [f"{MODEL}.decay_steps=400"],
    # GPT-NeoX's small_init: sqrt(2 / (5 * n_embd)), n_embd 128 (the residual projections keep our scaling)
    "init_std 0.0559 (GPT-NeoX)": [f"{MODEL}.config.init_std={math.sqrt(2 / (5 * 128)):.4f}"],
    "init_std 0.04": [f"{MODEL}.config.init_std=0.04"],
    "QK-norm per head": [f"{MODEL}.config.qk_norm=head"],
    "z-loss 1e-4": ["--model.class_path=benchmarks.z_loss.ZLossPretrainModule", f"{MODEL}.z_loss=1e-4"],
    "batch 4 to 16 rows over 100 steps": [_BATCH_WARMUP, f"{MODEL}.ramp_steps=100"],
    "batch 4 to 16 rows over 200 steps": [_BATCH_WARMUP, f"{MODEL}.ramp_steps=200"],
}
SMOKE_VARIANTS = ("lr 4e-3, min_lr 4e-4", "z-loss 1e-4")


def run(
    name: str, flags: list[str], target: float, max_steps: int, shared_flags: list[str], threads: int
) -> dict[str, Any]:
    """One whole ``fit`` process with ``flags``: its validations, steps to the target and CPU seconds."""
    load_before = os.getloadavg()[0]
    record = run_ours({"target": target}, [*shared_flags, *flags], max_steps, True, threads)
    steps = steps_to(target, record["val"])
    steps_run = record["val"][-1][0] if steps is not None else max_steps
    result = {
        "name": name,
        "flags": flags,
        "val": record["val"],
        "steps_to_target": steps,
        "steps_run": steps_run,
        "cpu": record["cpu"],
        "wall": record["wall"],
        "cpu_per_step": record["cpu"] / steps_run,
        "cpu_to_target": record["cpu"] if steps is not None else None,
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(f"{name}: steps to {target}: {steps}, CPU {record['cpu']:.1f} s, val {record['val']}", flush=True)
    return result


def wins(result: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """Fewer steps to the target than the baseline, and fewer CPU seconds."""
    if result["steps_to_target"] is None or baseline["steps_to_target"] is None:
        return False
    return (
        result["steps_to_target"] < baseline["steps_to_target"]
        and result["cpu_to_target"] < baseline["cpu_to_target"]
    )


def settings(flags: list[str]) -> set[str]:
    """The settings some flags change (``--model.init_args.learning_rate=3e-3``: ``learning_rate``)."""
    return {flag.split("=", 1)[0].rsplit(".", 1)[-1] for flag in flags}


def best_two(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The two winners with the fewest CPU seconds to the target that change different settings, or []."""
    baseline, *variants = results
    winners = sorted((r for r in variants if wins(r, baseline)), key=lambda r: r["cpu_to_target"])
    for i, first in enumerate(winners):
        for second in winners[i + 1 :]:
            if not settings(first["flags"]) & settings(second["flags"]):
                return [first, second]
    return []


def row(result: dict[str, Any], baseline: dict[str, Any], every: int) -> list[Any]:
    shown = [
        f"{loss:.3f}"
        for step, loss in result["val"]
        if step % (4 * every) == 0 or step == result["val"][-1][0]
    ]
    cpu, base_cpu = result["cpu_to_target"], baseline["cpu_to_target"]
    ratio = f"{cpu / base_cpu:.3f}x" if cpu is not None and base_cpu is not None else "—"
    steps = result["steps_to_target"] if result["steps_to_target"] is not None else "not reached"
    return [
        result["name"],
        steps,
        " / ".join(shown),
        cpu if cpu is not None else "—",
        result["cpu_per_step"],
        ratio,
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("recipes", __doc__.splitlines()[0], pairs=1)
    parser.add_argument("--val-every", type=int, default=25, help="validate every N steps")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), help="run only these (and the baseline)"
    )
    parser.add_argument(
        "--combine",
        nargs=2,
        choices=list(VARIANTS),
        metavar="VARIANT",
        help="run these two combined, instead of the best two winners",
    )
    parser.add_argument(
        "--seed", type=int, help="seed_everything for every run (default: the config's, 1234)"
    )
    args = parser.parse_args(argv)
    every = 2 if args.smoke else args.val_every
    shared_flags = [f"--trainer.val_check_interval={every}"]
    if args.seed is not None:  # does a win hold at another seed?
        shared_flags.append(f"--seed_everything={args.seed}")
    if args.smoke:  # a tiny model's few steps: the target about where it starts (ln 258 = 5.55)
        shared_flags += [*SMOKE_SHAPE, "--trainer.limit_val_batches=2"]
    target, max_steps = (5.5, 6) if args.smoke else (1.60, 600)
    chosen = args.variants or (SMOKE_VARIANTS if args.smoke else list(VARIANTS))
    machine = machine_info(args.threads)
    results = [run(BASELINE, [], target, max_steps, shared_flags, args.threads)]
    results += [run(name, VARIANTS[name], target, max_steps, shared_flags, args.threads) for name in chosen]
    combined = (
        [{"name": n, "flags": VARIANTS[n]} for n in args.combine] if args.combine else best_two(results)
    )
    if combined:
        name = " + ".join(r["name"] for r in combined)
        results.append(
            run(
                name,
                [flag for r in combined for flag in r["flags"]],
                target,
                max_steps,
                shared_flags,
                args.threads,
            )
        )
    baseline = results[0]
    for result in results[1:]:
        result["wins"] = wins(result, baseline)
    table = print_table(
        [
            "recipe",
            f"steps to {target}",
            f"val/loss every {4 * every} steps (and the last)",
            "process CPU s to it",
            "CPU s / step run",
            "CPU s / baseline's",
        ],
        [row(result, baseline, every) for result in results],
    )
    payload = {
        "benchmark": "recipes",
        "smoke": args.smoke,
        "setup": {
            "config": "configs/pretrain-tiny.yaml",
            "target": target,
            "max_steps": max_steps,
            "val_every": every,
            "shared_flags": shared_flags,
            "threads": args.threads,
        },
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
        "combined": [r["name"] for r in combined],
        "table": table,
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
