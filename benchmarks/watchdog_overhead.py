"""Cost of HangWatchdog + StragglerMonitor: ``Trainer.fit`` of the tiny CPU config with both on, against
the same run without them (same weights, same batches, same Trainer settings).

Pairs alternate which side runs first; the result is the median of the per-pair ratios of seconds per
optimizer step, with min-max, for the wall clock and this process's CPU time (steadier on a shared
machine). Only steady-state steps are timed (after ``warmup``, by when the watchdog is watching and
its timeout derived); the window holds logging steps in their normal proportion. One process: the
straggler all-gather (one number per rank, on logging steps only) is a no-op here. Goal: ratio <= 1.005.
The per-step hooks of both callbacks are also timed directly (CPU microseconds a step), which the
machine's load hardly blurs.

    python benchmarks/watchdog_overhead.py            # 10 pairs of 60 steps, 1 thread
    python benchmarks/watchdog_overhead.py --smoke    # seconds; checks the script works
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import lightning as L
from callback_overhead import fit_tiny, random_batches, setup_record, shrink_for_smoke, tiny_config
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

from lightning_train.callbacks import HangWatchdog, StragglerMonitor


def train(setup: dict[str, Any], batches: list, warmup: int, watched: bool) -> dict[str, float]:
    timer = StepTimer(warmup)
    callbacks = [HangWatchdog(), StragglerMonitor()] if watched else []
    fit_tiny(setup, batches, [*callbacks, timer])
    if watched:
        assert callbacks[0].timeout_s is not None and callbacks[1].last_ratio == 1.0  # both did their work
    return timer.per_step()


def hook_microseconds(calls: int = 20_000) -> float:
    """CPU microseconds a training step spends in the two callbacks' per-step hooks (the watchdog's
    batch start/end beats, the straggler timer's forward pre/post hooks), called on a real Trainer."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=1)
    dog, timer = HangWatchdog(), StragglerMonitor()
    dog._previous_batch_end = time.monotonic()
    timer.on_train_start(trainer, L.LightningModule())
    module = L.LightningModule()
    start = time.process_time()
    for index in range(calls):
        dog.on_train_batch_start(trainer, module, None, index)
        timer._timer.start_hook(module, ())
        timer._timer.stop_hook(module, (), None)
        dog.on_train_batch_end(trainer, module, None, None, index)
    return 1e6 * (time.process_time() - start) / calls


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("watchdog_overhead", __doc__.splitlines()[0], pairs=10)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    setup = tiny_config()
    steps, warmup, pairs = 60, 10, args.pairs
    if args.smoke:
        shrink_for_smoke(setup)
        steps, warmup, pairs = 10, 6, 1
    batches = random_batches(setup, steps)
    labels = ("no watchdog", "HangWatchdog + StragglerMonitor")
    measured = paired(*(partial(train, setup, batches, warmup, on) for on in (False, True)), pairs)
    results = compare_clocks(*labels, measured, "s/step")
    hooks_us = hook_microseconds()
    step_us = 1e6 * sorted(without["cpu"] for without, _ in measured)[len(measured) // 2]
    payload = {
        "benchmark": "watchdog_overhead",
        "goal": "with / without HangWatchdog + StragglerMonitor, seconds per step <= 1.005",
        "smoke": args.smoke,
        "setup": setup_record(setup, steps, warmup, callbacks=["HangWatchdog()", "StragglerMonitor()"]),
        "machine": {**machine_info(args.threads),
                    "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
        "hooks_cpu_us_per_step": hooks_us,
        "hooks_share_of_step": hooks_us / step_us,
    }
    print_table(
        ["clock", f"{labels[0]} ms/step", "with both ms/step", "ratio, median (min-max)"],
        [comparison_row(clock_name, result, scale=1e3) for clock_name, result in results.items()],
    )
    print(f"{pairs} pairs of {steps - warmup} timed steps; goal <= 1.005x")
    print(f"time inside the two callbacks' per-step hooks: {hooks_us:.2f} us CPU a step, "
          f"{100 * hooks_us / step_us:.4f}% of the {step_us / 1e3:.1f} ms step")
    if not args.smoke or args.out != parser.get_default("out"):  # a smoke run keeps the real results
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
