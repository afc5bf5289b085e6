"""Cost of NaNRecovery: ``Trainer.fit`` of the tiny CPU config with NaNRecovery on, against the same run
without it (same weights, same batches, same Trainer settings).

NaNRecovery runs with its defaults and without a GradNormMonitor, so it computes its own fused
gradient norm (the worst case): per step one norm pass, one all-reduce of three numbers (a no-op on
one process) and one host read; every ``snapshot_every`` steps a host copy of weights and AdamW state
(the timed window holds snapshots in their normal proportion). Pairs alternate which side runs
first; the result is the median of the per-pair ratios of seconds per optimizer step, with min-max,
for the wall clock and this process's CPU time. Fault-free steps only: a skipped step costs the same.

    python benchmarks/recovery_overhead.py            # 10 pairs of 100 timed steps, 1 thread
    python benchmarks/recovery_overhead.py --smoke    # seconds; checks the script works

With ``--rerun`` the pair is NaNRecovery() against NaNRecovery(rerun=True) when nothing triggers: what the
rerun costs a healthy step is its bookkeeping (a reference to each batch and the RNG state at each step's
first batch). Besides the paired ratio, both sides' per-step hooks are timed directly (their own seconds
inside the timed steps), which the machine's load hardly blurs; the difference, as a share of a step, is
the rerun's cost (goal <= 0.5 %). Results in ``recovery_rerun_overhead.json``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from callback_overhead import fit_tiny, random_batches, shrink_for_smoke, time_hooks, tiny_config
from common import (
    RESULTS_DIR,
    StepTimer,
    base_parser,
    compare_clocks,
    comparison,
    comparison_row,
    machine_info,
    paired,
    per_step,
    print_table,
    set_threads,
    write_json,
)

from lightning_train.callbacks import NaNRecovery


def train(setup: dict[str, Any], batches: list, warmup: int, snapshot_every: int, recovery: bool) -> dict:
    timer = StepTimer(warmup)
    fit_tiny(setup, batches, [NaNRecovery(snapshot_every=snapshot_every), timer] if recovery else [timer])
    return timer.per_step()


def train_rerun(setup: dict[str, Any], batches: list, warmup: int, snapshot_every: int, rerun: bool) -> dict:
    """A fit with NaNRecovery, ``rerun`` on or off, its per-step hooks timed too (``hooks_cpu``)."""
    timer, hook_seconds = StepTimer(warmup), [0.0, 0.0]
    recovery = NaNRecovery(snapshot_every=snapshot_every, rerun=rerun)
    time_hooks([recovery], warmup, hook_seconds)
    fit_tiny(setup, batches, [recovery, timer])
    hooks = per_step((0.0, 0.0), (hook_seconds[0], hook_seconds[1]), timer.steps)
    return {**timer.per_step(), "hooks_wall": hooks["wall"], "hooks_cpu": hooks["cpu"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("recovery_overhead", __doc__.splitlines()[0], pairs=10)
    parser.add_argument("--rerun", action="store_true", help="NaNRecovery() / NaNRecovery(rerun=True)")
    args = parser.parse_args(argv)
    if args.rerun and args.out == parser.get_default("out"):
        args.out = RESULTS_DIR / "recovery_rerun_overhead.json"
    set_threads(args.threads)
    setup = tiny_config()
    steps, warmup, snapshot_every, pairs = 110, 10, 100, args.pairs
    if args.smoke:
        shrink_for_smoke(setup)
        steps, warmup, snapshot_every, pairs = 8, 2, 4, 1
    batches = random_batches(setup, steps)
    machine = machine_info(args.threads)
    if args.rerun:
        labels, run = ("NaNRecovery()", "NaNRecovery(rerun=True)"), train_rerun
    else:
        labels, run = ("without NaNRecovery", "with NaNRecovery"), train
    off, on = (partial(run, setup, batches, warmup, snapshot_every, flag) for flag in (False, True))
    measured = paired(off, on, pairs)
    results = compare_clocks(*labels, measured, "s/step")
    if args.rerun:  # the rerun's own cost: the hooks' extra seconds, as a share of a step
        hooks = [(a["hooks_cpu"], b["hooks_cpu"]) for a, b in measured]
        results["hooks_cpu"] = comparison(*labels, hooks, "s/step")
        extra = sorted((b["hooks_cpu"] - a["hooks_cpu"]) / a["cpu"] for a, b in measured)
        results["rerun_share_of_step"] = {"median": extra[len(extra) // 2], "min": extra[0], "max": extra[-1]}
    payload = {
        "benchmark": "recovery_rerun_overhead" if args.rerun else "recovery_overhead",
        "goal": ("rerun on / off when nothing triggers: <= 0.5 % of a step" if args.rerun
                 else "with / without NaNRecovery, seconds per step: about 1.01 or less"),
        "smoke": args.smoke,
        "setup": {
            "model": vars(setup["model"]), "batch_size": setup["batch_size"], "seq_len": setup["seq_len"],
            "steps": steps, "timed_steps": steps - warmup, "snapshot_every": snapshot_every,
            "gradient_clip_val": setup["gradient_clip_val"], "grad_norm_monitor": False,
        },
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
    }
    rows = {name: result for name, result in results.items() if name != "rerun_share_of_step"}
    print_table(
        ["clock", f"{labels[0]} ms/step", f"{labels[1]} ms/step", "ratio, median (min-max)"],
        [comparison_row(clock_name, result, scale=1e3) for clock_name, result in rows.items()],
    )
    if args.rerun:
        share = results["rerun_share_of_step"]
        print(f"the rerun's bookkeeping: {100 * share['median']:.3f} % of a step's CPU time "
              f"({100 * share['min']:.3f} - {100 * share['max']:.3f} %), from the hooks' own seconds")
    print(f"{pairs} pairs of {steps - warmup} timed steps (one snapshot every {snapshot_every} steps)")
    if not args.smoke or args.out != parser.get_default("out"):  # a smoke run keeps the real results
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
