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

import tempfile
from functools import partial
from typing import Any

import lightning as L
from callback_overhead import random_batches, tiny_config
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
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_train.callbacks import NaNRecovery
from lightning_train.models.gpt import GPTConfig
from lightning_train.modules.pretrain import PretrainModule


def train(setup: dict[str, Any], batches: list, warmup: int, snapshot_every: int, recovery: bool) -> dict:
    L.seed_everything(0, verbose=False)
    timer = StepTimer(warmup)
    callbacks = [NaNRecovery(snapshot_every=snapshot_every), timer] if recovery else [timer]
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=len(batches), precision="32-true",
            gradient_clip_val=setup["gradient_clip_val"], log_every_n_steps=setup["log_every_n_steps"],
            logger=CSVLogger(root, name=""), callbacks=callbacks, default_root_dir=root,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, num_sanity_val_steps=0,
        )
        trainer.fit(PretrainModule(setup["model"], warmup_steps=10), DataLoader(batches, batch_size=None))
    return timer.per_step()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("recovery_overhead", __doc__.splitlines()[0], pairs=10)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    setup = tiny_config()
    steps, warmup, snapshot_every, pairs = 110, 10, 100, args.pairs
    if args.smoke:
        model = GPTConfig(vocab_size=258, block_size=32, n_layer=2, n_head=2, n_embd=32)
        setup.update(model=model, seq_len=32, batch_size=4, log_every_n_steps=2)
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
