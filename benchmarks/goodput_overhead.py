"""Cost of Goodput (which the CLI adds to every fit): ``Trainer.fit`` of the tiny CPU config with it,
against the same run without it (same weights, same batches, same Trainer settings, a CSV logger).

Pairs alternate which side runs first; the result is the median of the per-pair ratios of seconds per
optimizer step, with min-max, for the wall clock and this process's CPU time (steadier on a shared
machine). Only steady-state steps are timed (after ``warmup``); the window holds logging steps, where
``goodput.json`` is rewritten, in their normal proportion. Its per-step hooks are also timed directly
inside the same runs (CPU microseconds a step, logging steps included), which the machine's load
hardly blurs. Goal: ratio <= 1.005 (negligible, so that the CLI can add it by default).

    python benchmarks/goodput_overhead.py            # 10 pairs of 40 steps, 1 thread
    python benchmarks/goodput_overhead.py --smoke    # seconds; checks the script works
"""

from __future__ import annotations

from functools import partial
from typing import Any

from callback_overhead import (
    fit_tiny,
    random_batches,
    setup_record,
    shrink_for_smoke,
    time_hooks,
    tiny_config,
)
from common import (
    StepTimer,
    base_parser,
    compare_clocks,
    comparison_row,
    machine_info,
    paired,
    print_table,
    set_threads,
    summarize,
    write_json,
)

from lightning_train.callbacks import GoodputMonitor


def train(setup: dict[str, Any], batches: list, warmup: int, measured: bool) -> dict[str, float]:
    timer, hook_seconds = StepTimer(warmup), [0.0, 0.0]
    callbacks = [GoodputMonitor(start="created")] if measured else []
    time_hooks(callbacks, warmup, hook_seconds)
    fit_tiny(setup, batches, [*callbacks, timer])
    if measured:
        assert callbacks[0].steps["productive"] == len(batches)  # it did its work
    steps = timer.steps
    return {**timer.per_step(), "hooks_cpu": hook_seconds[1] / steps if steps else 0.0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("goodput_overhead", __doc__.splitlines()[0], pairs=10)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    setup = tiny_config()
    steps, warmup, pairs = 40, 10, args.pairs
    if args.smoke:
        shrink_for_smoke(setup)
        steps, warmup, pairs = 6, 2, 1
    batches = random_batches(setup, steps)
    labels = ("no Goodput", "Goodput")
    measured = paired(*(partial(train, setup, batches, warmup, on) for on in (False, True)), pairs)
    results = compare_clocks(*labels, measured, "s/step")
    hook_us = summarize([1e6 * on["hooks_cpu"] for _, on in measured])
    hook_share = summarize([on["hooks_cpu"] / on["cpu"] for _, on in measured])
    payload = {
        "benchmark": "goodput_overhead",
        "goal": "with / without Goodput, seconds per step <= 1.005",
        "smoke": args.smoke,
        "setup": setup_record(setup, steps, warmup, callbacks=["GoodputMonitor(start='created')"]),
        "machine": {**machine_info(args.threads),
                    "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
        "hooks_cpu_us_per_step": hook_us,
        "hooks_cpu_share_of_step": hook_share,
    }
    print_table(
        ["clock", f"{labels[0]} ms/step", "with Goodput ms/step", "ratio, median (min-max)"],
        [comparison_row(clock_name, result, scale=1e3) for clock_name, result in results.items()],
    )
    print(f"{pairs} pairs of {steps - warmup} timed steps; goal <= 1.005x")
    print(f"time inside Goodput's hooks: {hook_us['median']:.1f} us CPU a step (min-max {hook_us['min']:.1f}-"
          f"{hook_us['max']:.1f}), {100 * hook_share['median']:.4f}% of the step")
    if not args.smoke or args.out != parser.get_default("out"):  # a smoke run keeps the real results
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
