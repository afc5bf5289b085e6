"""Framework overhead: ``Trainer.fit`` of a ``PretrainModule`` with every health callback on, against a
raw PyTorch loop training the same GPT (same initial weights) on the same batches for the same steps.

Both sides do the same work: AdamW (fused), warmup+cosine LR per step, gradient clipping at 1.0, and
the loss copied to the host every ``log_every`` steps. Only steady-state steps are timed (the first
``warmup`` steps, the Trainer's start-up and teardown are not). The two final losses are compared
too: equal losses prove both sides trained the same model the same way. Goal: ratio <= 1.03x.

    python benchmarks/overhead.py            # 5 pairs, the pretrain-tiny model shape, 1 thread
    python benchmarks/overhead.py --smoke    # seconds; checks the script works
"""

from __future__ import annotations

import copy
import tempfile
import time
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from callback_overhead import tiny_config
from common import (
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
    synchronize,
    write_json,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules.pretrain import PretrainModule, warmup_cosine

HEALTH_CALLBACKS = (
    "GradNormMonitor", "ThroughputMonitor", "TimeToQuality", "LossScaleMonitor", "NaNRecovery",
)
OPTIM = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "weight_decay": 0.1, "betas": (0.9, 0.95)}
CLIP, LOG_EVERY = 1.0, 10
CALLBACK_ARGS = {"TimeToQuality": {"target": 0.0}}  # never reached: it checks at every validation
Batches = list[dict[str, torch.Tensor]]


def health_callbacks() -> tuple[list[Callback], dict[str, str]]:
    """Every health callback of ``lightning_train.callbacks`` that exists, built with its defaults,
    and what became of each name ("on", "missing" or why it could not be built)."""
    try:
        import lightning_train.callbacks as module
    except ImportError as error:
        return [], dict.fromkeys(HEALTH_CALLBACKS, f"missing ({error})")
    callbacks, status = [], {}
    for name in HEALTH_CALLBACKS:
        cls = getattr(module, name, None)
        if cls is None:
            status[name] = "missing"
            continue
        try:
            callbacks.append(cls(**CALLBACK_ARGS.get(name, {})))
            status[name] = "on"
        except (TypeError, ValueError) as error:
            status[name] = f"off: {error}"
    return callbacks, status


def make_batches(config: GPTConfig, batch_size: int, steps: int, seed: int = 0) -> Batches:
    """``steps`` batches of random tokens (the content does not change the cost of a step)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return batches


def train_lightning(model: GPT, batches: Batches, warmup: int, device: torch.device) -> dict[str, float]:
    """``Trainer.fit`` over ``batches`` with every health callback on (fresh ones each run)."""
    module = PretrainModule(model.config, decay_steps=len(batches), **OPTIM)
    module.model = model  # built by the caller so both sides start from the same weights
    timer = StepTimer(warmup)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator=device.type, devices=1, max_steps=len(batches), precision="32-true",
            gradient_clip_val=CLIP, log_every_n_steps=LOG_EVERY, logger=CSVLogger(root, name=""),
            callbacks=[*health_callbacks()[0], timer], default_root_dir=root, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        started = time.perf_counter()
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
        total = time.perf_counter() - started
    return {**timer.per_step(), "total": total, "loss": timer.last_loss.item()}


def train_raw(model: GPT, batches: Batches, warmup: int, device: torch.device) -> dict[str, float]:
    """The hand-written loop a user would write for the same training; same outputs as ``train_lightning``."""
    started = time.perf_counter()
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("embed")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or n.startswith("embed")]
    groups = [
        {"params": decay, "weight_decay": OPTIM["weight_decay"]},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=OPTIM["learning_rate"], betas=OPTIM["betas"], fused=True)
    schedule = partial(
        warmup_cosine, warmup_steps=OPTIM["warmup_steps"], decay_steps=len(batches),
        min_lr_ratio=OPTIM["min_lr"] / OPTIM["learning_rate"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    logged = []  # what a logger would get: one host copy of the loss every LOG_EVERY steps
    for step, batch in enumerate(batches):
        if step == warmup:
            synchronize(device)
            start = clock()
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        logits = model(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if (step + 1) % LOG_EVERY == 0:
            logged.append((step, loss.item(), scheduler.get_last_lr()[0]))
    synchronize(device)
    end = clock()
    return {**per_step(start, end, len(batches) - warmup), "total": end[0] - started, "loss": loss.item()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = base_parser("overhead", __doc__.splitlines()[0], pairs=5).parse_args(argv)
    set_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        config = GPTConfig(vocab_size=258, block_size=32, n_layer=2, n_head=2, n_embd=32)
        batch_size, steps, warmup, pairs = 4, 6, 2, 1
    else:  # the model and batch of configs/pretrain-tiny.yaml
        setup = tiny_config()
        config, batch_size = setup["model"], setup["batch_size"]
        steps, warmup, pairs = 40, 5, args.pairs
    callback_status = health_callbacks()[1]
    batches = make_batches(config, batch_size, steps)
    torch.manual_seed(0)
    initial = GPT(config)
    machine = machine_info(args.threads)
    runs: dict[str, list[dict[str, float]]] = {"raw": [], "lightning": []}

    def run(side: str) -> dict[str, float]:
        model = copy.deepcopy(initial)
        train = train_raw if side == "raw" else train_lightning
        result = train(model, batches, warmup, device)
        runs[side].append(result)
        return result

    labels = ("raw PyTorch loop", "lightning_train fit + health callbacks")
    results = compare_clocks(*labels, paired(partial(run, "raw"), partial(run, "lightning"), pairs), "s/step")
    loss_diff = max(abs(r["loss"] - lt["loss"]) for r, lt in zip(runs["raw"], runs["lightning"], strict=True))
    payload = {
        "benchmark": "overhead",
        "goal": "lightning / raw seconds per step <= 1.03",
        "smoke": args.smoke,
        "setup": {
            "model": vars(config), "batch_size": batch_size, "steps": steps, "timed_steps": steps - warmup,
            "device": device.type, "precision": "32-true", "callbacks": callback_status,
        },
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
        "end_to_end_seconds": {side: [r["total"] for r in values] for side, values in runs.items()},
        "max_abs_final_loss_diff": loss_diff,
    }
    print_table(
        ["clock", f"{labels[0]} ms/step", f"{labels[1]} ms/step", "ratio, median (min-max)"],
        [comparison_row(clock_name, result, scale=1e3) for clock_name, result in results.items()],
    )
    print(f"{pairs} pairs; goal <= 1.03x; largest difference of the final losses: {loss_diff:.2e}")
    print("callbacks: " + ", ".join(f"{name}={state}" for name, state in callback_status.items()))
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
