"""Cost of the health/perf callbacks: ``Trainer.fit`` of the tiny CPU config with the callbacks on,
against the same run without them (same weights, same batches, same Trainer settings).

Pairs alternate which side runs first; the result is the median of the per-pair ratios of seconds
per optimizer step, with min-max, for both the wall clock and this process's CPU time (steadier on
a shared machine). Only steady-state steps are timed (after ``warmup``); the timed window holds
logging steps in their normal proportion (one in ``log_every_n_steps``). Goal: ratio <= 1.01.

    python benchmarks/callback_overhead.py            # 10 pairs of 40 steps, 1 thread
    python benchmarks/callback_overhead.py --smoke    # seconds; checks the script works
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
import yaml
from common import (
    REPO,
    StepTimer,
    base_parser,
    clock,
    compare_clocks,
    comparison_row,
    machine_info,
    paired,
    per_step,
    print_table,
    set_threads,
    summarize,
    write_json,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_train.callbacks
from lightning_train.models.gpt import GPTConfig
from lightning_train.modules.pretrain import PretrainModule

# The callbacks measured together, with the arguments that make them do their normal work.
CALLBACKS: dict[str, dict[str, Any]] = {
    "GradNormMonitor": {},
    "ThroughputMonitor": {"peak_flops": 1e12},  # so the MFU arithmetic runs too
    "TimeToQuality": {"target": 0.0},  # never reached
    "LossScaleMonitor": {},  # measured when present (it is another engineer's; fp32 makes it idle)
}


STEP_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def build_callbacks() -> list[Callback]:
    return [getattr(lightning_train.callbacks, name)(**kwargs) for name, kwargs in CALLBACKS.items()
            if hasattr(lightning_train.callbacks, name)]


def tiny_config() -> dict[str, Any]:
    """Model shape, batch and Trainer settings of configs/pretrain-tiny.yaml."""
    config = yaml.safe_load((REPO / "configs" / "pretrain-tiny.yaml").read_text())
    data = config["data"]["init_args"]
    return {
        "model": GPTConfig(**config["model"]["init_args"]["config"]),
        "batch_size": data["batch_size"], "seq_len": data["seq_len"],
        "gradient_clip_val": config["trainer"]["gradient_clip_val"],
        "log_every_n_steps": config["trainer"]["log_every_n_steps"],
    }


def shrink_for_smoke(setup: dict[str, Any]) -> None:
    """A model and batch small enough for ``--smoke`` (seconds)."""
    model = GPTConfig(vocab_size=258, block_size=32, n_layer=2, n_head=2, n_embd=32)
    setup.update(model=model, seq_len=32, batch_size=4, log_every_n_steps=2)


def setup_record(setup: dict[str, Any], steps: int, warmup: int, **extra: Any) -> dict[str, Any]:
    """What a result JSON says about the run it timed."""
    return {
        "model": vars(setup["model"]), "batch_size": setup["batch_size"], "seq_len": setup["seq_len"],
        "steps": steps, "timed_steps": steps - warmup, "log_every_n_steps": setup["log_every_n_steps"],
        "gradient_clip_val": setup["gradient_clip_val"], **extra,
    }


def fit_tiny(setup: dict[str, Any], batches: list, callbacks: list[Callback]) -> None:
    """``Trainer.fit`` of ``setup``'s model over ``batches`` with ``callbacks`` (a ``StepTimer`` among
    them): the one Trainer the overhead benchmarks time (fp32, a CSV logger, no checkpoints, no
    validation), seeded the same for both sides of a pair."""
    L.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=len(batches), precision="32-true",
            gradient_clip_val=setup["gradient_clip_val"], log_every_n_steps=setup["log_every_n_steps"],
            logger=CSVLogger(root, name=""), callbacks=callbacks, default_root_dir=root,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, num_sanity_val_steps=0,
        )
        trainer.fit(PretrainModule(setup["model"], warmup_steps=10), DataLoader(batches, batch_size=None))


def random_batches(setup: dict[str, Any], steps: int) -> list[dict[str, torch.Tensor]]:
    """Random tokens: the content does not change the cost of a step."""
    generator = torch.Generator().manual_seed(0)
    shape = (setup["batch_size"], setup["seq_len"] + 1)
    rows = [torch.randint(0, setup["model"].vocab_size, shape, generator=generator) for _ in range(steps)]
    return [{"input_ids": r[:, :-1].contiguous(), "labels": r[:, 1:].contiguous()} for r in rows]


def time_hooks(callbacks: list[Callback], warmup: int, spent: list[float]) -> None:
    """Wrap the callbacks' per-step hooks so that their own wall and CPU seconds in the timed steps add up
    in ``spent``: a direct measure of their cost that the machine's load hardly blurs."""

    def timed(hook: Callable[..., Any]) -> Callable[..., Any]:
        def run(trainer: L.Trainer, *args: Any, **kwargs: Any) -> Any:
            if trainer.global_step < warmup:
                return hook(trainer, *args, **kwargs)
            start = clock()
            result = hook(trainer, *args, **kwargs)
            end = clock()
            spent[0] += end[0] - start[0]
            spent[1] += end[1] - start[1]
            return result
        return run

    for callback in callbacks:
        for name in STEP_HOOKS:
            setattr(callback, name, timed(getattr(callback, name)))


def train(setup: dict[str, Any], batches: list, warmup: int, with_callbacks: bool) -> dict[str, float]:
    timer, hook_seconds = StepTimer(warmup), [0.0, 0.0]
    callbacks = build_callbacks() if with_callbacks else []
    time_hooks(callbacks, warmup, hook_seconds)
    fit_tiny(setup, batches, [*callbacks, timer])
    hooks = per_step((0.0, 0.0), (hook_seconds[0], hook_seconds[1]), timer.steps)
    return {**timer.per_step(), "hooks_wall": hooks["wall"], "hooks_cpu": hooks["cpu"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("callback_overhead", __doc__.splitlines()[0], pairs=10)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    setup = tiny_config()
    steps, warmup, pairs = 40, 10, args.pairs
    if args.smoke:
        shrink_for_smoke(setup)
        steps, warmup, pairs = 6, 2, 1
    batches = random_batches(setup, steps)
    machine = machine_info(args.threads)
    names = [type(c).__name__ for c in build_callbacks()]
    labels = ("no callbacks", " + ".join(names))
    without, with_callbacks = (partial(train, setup, batches, warmup, on) for on in (False, True))
    measured = paired(without, with_callbacks, pairs)
    results = compare_clocks(*labels, measured, "s/step")
    # The callbacks' own share of a step: their hooks' CPU seconds over the step's CPU seconds.
    hook_share = summarize([on["hooks_cpu"] / on["cpu"] for _, on in measured])
    payload = {
        "benchmark": "callback_overhead",
        "goal": "with / without callbacks, seconds per step <= 1.01",
        "smoke": args.smoke,
        "setup": setup_record(setup, steps, warmup, callbacks=names),
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
        "hooks_cpu_share_of_step": hook_share,
        "hooks_ms_per_step": summarize([1e3 * on["hooks_cpu"] for _, on in measured]),
    }
    print_table(
        ["clock", f"{labels[0]} ms/step", "with callbacks ms/step", "ratio, median (min-max)"],
        [comparison_row(clock_name, result, scale=1e3) for clock_name, result in results.items()],
    )
    print(f"{pairs} pairs of {steps - warmup} timed steps; callbacks: {', '.join(names)}; goal <= 1.01x")
    print(f"time inside the callbacks' hooks: {payload['hooks_ms_per_step']['median']:.3f} ms CPU a step, "
          f"{100 * hook_share['median']:.2f}% of the step (min-max {100 * hook_share['min']:.2f}-"
          f"{100 * hook_share['max']:.2f}%)")
    if not args.smoke or args.out != parser.get_default("out"):  # a smoke run keeps the real results
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
