"""GPU: tokens/s and MFU of ``configs/gpt2-124m.yaml`` on one GPU (bf16-mixed, torch.compile, fused AdamW,
flash attention through SDPA), paired with a raw PyTorch loop running the same compiled model and step on
batches already on the GPU (the ceiling: no framework, no data loading). Goal: >= 50% MFU on one
H100/H200-class GPU. Without CUDA it says so and does nothing (exit code 0), except with ``--smoke``.

It also counts the host-device synchronisations in a few training steps after the timed ones
(``torch.cuda.set_sync_debug_mode``): each one stalls the CPU until the GPU is idle, so the goal is 0.

    python benchmarks/gpu.py            # one GPU, 2 pairs, about 5 minutes (mostly torch.compile)
    python benchmarks/gpu.py --smoke    # also on CPU: a tiny model in fp32, not compiled
"""

from __future__ import annotations

import tempfile
import warnings
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    REPO,
    StepTimer,
    base_parser,
    clock,
    compare_clocks,
    machine_info,
    paired,
    per_step,
    print_table,
    ratio_cell,
    set_threads,
    synchronize,
    write_json,
)
from lightning.pytorch.callbacks import Callback

from lightning_train.callbacks.throughput import device_peak_flops
from lightning_train.cli import LightningTrainCLI
from lightning_train.models.gpt import GPT, GPTConfig

CONFIG = REPO / "configs" / "gpt2-124m.yaml"
ONE_GPU = ["--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.num_sanity_val_steps=0"]
SMOKE = [
    "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--model.init_args.compile=false",
    "--model.init_args.config.vocab_size=320", "--model.init_args.config.n_layer=1",
    "--model.init_args.config.n_head=2", "--model.init_args.config.n_embd=32",
    "--model.init_args.config.block_size=32", "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=2", "--data.init_args.num_workers=0",
]


class SyncCounter(Callback):
    """Counts synchronising CUDA calls during the training steps from ``start`` on."""

    def __init__(self, start: int) -> None:
        self.start, self.steps, self.records = start, 0, []
        self._catcher: warnings.catch_warnings | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.start and pl_module.device.type == "cuda":
            self._catcher = warnings.catch_warnings(record=True)
            self.records = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._catcher is not None:
            self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        if self._catcher is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self._catcher = None

    def summary(self) -> dict[str, Any]:
        syncs = [str(r.message) for r in self.records if "synchroniz" in str(r.message)]
        per_step = len(syncs) / self.steps if self.steps else None  # None: not counted (no CUDA)
        return {"steps": self.steps, "syncs_per_step": per_step, "first": syncs[:5]}


def build_cli(overrides: list[str], root: str, steps: int) -> LightningTrainCLI:
    run = [f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}"]
    return LightningTrainCLI(args=["--config", str(CONFIG), *ONE_GPU, *run, *overrides], run=False)


def train_lightning(
    overrides: list[str], steps: int, warmup: int, audit: int, report: dict[str, Any]
) -> dict[str, float]:
    """``fit`` of the config for ``steps`` timed (after ``warmup``) plus ``audit`` steps counting syncs."""
    with tempfile.TemporaryDirectory() as root:
        cli = build_cli(overrides, root, steps + audit)
        timer, syncs = StepTimer(warmup, until=steps), SyncCounter(start=steps)
        cli.trainer.callbacks.extend([timer, syncs])
        if cli.trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        cli.trainer.fit(cli.model, cli.datamodule)
    report["syncs"] = syncs.summary()
    report["peak_memory_gb"] = _peak_memory_gb()
    return timer.per_step()


def train_raw(
    config: GPTConfig, batch_size: int, seq_len: int, steps: int, warmup: int, device: torch.device,
    compile: bool, dtype: torch.dtype,
) -> dict[str, float]:
    """The same model, compiled, bf16 autocast, fused AdamW and clipping, on batches made on the GPU."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    if compile:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=True)
    tokens = torch.randint(0, config.vocab_size, (steps, batch_size, seq_len + 1), device=device)
    for step in range(steps):
        if step == warmup:
            synchronize(device)
            start = clock()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(tokens[step, :, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[step, :, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return per_step(start, clock(), steps - warmup)


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU: ``--peak_tflops`` or ThroughputMonitor's datasheet value."""
    if override_tflops:
        return override_tflops * 1e12
    return device_peak_flops(device, "bf16-mixed")


def _flops_per_token(config: GPTConfig, seq_len: int) -> float:
    with torch.device("meta"):  # the formula needs the parameter count only, not real weights
        return GPT(config).flops_per_token(seq_len)


def _peak_memory_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = base_parser("gpu", __doc__.splitlines()[0], pairs=2)
    parser.add_argument("--peak_tflops", type=float, default=None, help="the GPU's dense bf16 peak, TFLOP/s")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("not run: no CUDA device here (benchmarks/gpu.py measures one GPU; --smoke runs on CPU)")
        return None
    set_threads(args.threads)
    overrides = SMOKE if args.smoke else []
    steps, warmup, audit, pairs = (4, 1, 1, 1) if args.smoke else (60, 15, 5, args.pairs)
    with tempfile.TemporaryDirectory() as root:
        resolved = build_cli(overrides, root, steps)
    config, data = resolved.model.config, resolved.datamodule
    device = resolved.trainer.strategy.root_device
    compile_model = bool(resolved.model.hparams.compile)
    dtype = torch.bfloat16 if "bf16" in str(resolved.trainer.precision) else torch.float32
    report: dict[str, Any] = {}
    shape = (config, data.batch_size, data.seq_len, steps, warmup, device, compile_model, dtype)
    measured = paired(
        partial(train_lightning, overrides, steps, warmup, audit, report), partial(train_raw, *shape), pairs
    )
    results = compare_clocks("lightning_train fit", "raw loop, batches on GPU", measured, "s/step")
    tokens_per_step = data.batch_size * data.seq_len
    flops_per_token = _flops_per_token(config, data.seq_len)
    peak = peak_flops(device, args.peak_tflops)
    wall = results["wall"]
    rows = []
    for side, key in (("lightning_train fit", "a_stats"), ("raw loop, batches on GPU", "b_stats")):
        tokens_per_second = tokens_per_step / wall[key]["median"]
        mfu = tokens_per_second * flops_per_token / peak if peak else None
        rows.append([side, tokens_per_second, f"{100 * mfu:.1f}%" if mfu else "unknown peak"])
        wall[f"{key[0]}_tokens_per_second"], wall[f"{key[0]}_mfu"] = tokens_per_second, mfu
    print_table(["side", "tokens/s (median)", "MFU"], rows)
    ratio = wall["ratio_b_over_a"]
    print(f"lightning_train / raw tokens/s: {ratio_cell(ratio)}; {pairs} pairs")
    print(f"synchronisations per step in fit: {report['syncs']['syncs_per_step']} (goal 0)")
    payload = {
        "benchmark": "gpu",
        "goal": "MFU >= 50% on one H100/H200-class GPU",
        "smoke": args.smoke,
        "setup": {"config": str(CONFIG.relative_to(REPO)), "overrides": overrides, "model": vars(config),
                  "batch_size": data.batch_size, "seq_len": data.seq_len, "steps": steps,
                  "timed_steps": steps - warmup, "compile": compile_model, "dtype": str(dtype),
                  "flops_per_token": flops_per_token, "peak_flops": peak},
        "machine": machine_info(args.threads),
        "results": results,
        "fit_diagnostics": report,
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
