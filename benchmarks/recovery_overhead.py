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
"""

from __future__ import annotations

from functools import partial
from typing import Any

from callback_overhead import fit_tiny, random_batches, shrink_for_smoke, tiny_config
from common import (
    StepTimer,
    base_parser,
    compare_clocks,
    comparison_row,
    machine_info,
    paired,
    print_table,
    set_threads,
    write_json,
)

from lightning_train.callbacks import NaNRecovery


def train(setup: dict[str, Any], batches: list, warmup: int, snapshot_every: int, recovery: bool) -> dict:
    timer = StepTimer(warmup)
    fit_tiny(setup, batches, [NaNRecovery(snapshot_every=snapshot_every), timer] if recovery else [timer])
    return timer.per_step()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("recovery_overhead", __doc__.splitlines()[0], pairs=10)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    setup = tiny_config()
    steps, warmup, snapshot_every, pairs = 110, 10, 100, args.pairs
    if args.smoke:
        shrink_for_smoke(setup)
        steps, warmup, snapshot_every, pairs = 8, 2, 4, 1
    batches = random_batches(setup, steps)
    machine = machine_info(args.threads)
    labels = ("without NaNRecovery", "with NaNRecovery")
    off, on = (partial(train, setup, batches, warmup, snapshot_every, flag) for flag in (False, True))
    results = compare_clocks(*labels, paired(off, on, pairs), "s/step")
    payload = {
        "benchmark": "recovery_overhead",
        "goal": "with / without NaNRecovery, seconds per step: about 1.01 or less",
        "smoke": args.smoke,
        "setup": {
            "model": vars(setup["model"]), "batch_size": setup["batch_size"], "seq_len": setup["seq_len"],
            "steps": steps, "timed_steps": steps - warmup, "snapshot_every": snapshot_every,
            "gradient_clip_val": setup["gradient_clip_val"], "grad_norm_monitor": False,
        },
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
    }
    print_table(
        ["clock", f"{labels[0]} ms/step", f"{labels[1]} ms/step", "ratio, median (min-max)"],
        [comparison_row(clock_name, result, scale=1e3) for clock_name, result in results.items()],
    )
    print(f"{pairs} pairs of {steps - warmup} timed steps (one snapshot every {snapshot_every} steps)")
    if not args.smoke or args.out != parser.get_default("out"):  # a smoke run keeps the real results
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
