"""Throughput: tokens/s of the default config (``configs/pretrain-tiny.yaml`` through the CLI, as a user
runs it: TextDataModule on the default corpus, CSV logging, the progress bar) against a nanoGPT-style
single-file training loop with the same model size, batch and sequence length, reading the same token
file. Goal: ratio (lightning tokens/s / nanoGPT tokens/s) >= 1.0.

The peer is ``nanogpt_peer.py`` (self-contained, no lightning_train imports), written as nanoGPT's
``model.py`` and ``train.py`` are: ``np.memmap`` random-offset batches, AdamW (fused on CUDA only, as
nanoGPT's ``configure_optimizers``), warmup+cosine LR, clipping at 1.0 and ``loss.item()`` every
``log_interval`` steps; here only its steps are timed (``whole_process.py`` runs it whole, as a process).
It has two blocks: nanoGPT's own GPT-2 block (LayerNorm, learned positions, exact GELU) and the default
config's Llama-style block (RMSNorm, rotary positions, SwiGLU). Rows:

1. the default config against the peer with the same block: what the framework costs;
2. the default config against nanoGPT's GPT-2 block with as many parameters (837 K): what a user gets
   out of the box against nanoGPT as it is;
3. row 2 with ``torch.compile`` on both sides (``model.compile: true``; nanoGPT compiles by default).

A last table times the three models alone (forward+backward, alternated step by step), which tells a
gap in the model from a gap in the loop around it.

    python benchmarks/throughput.py            # 5 pairs per row, 1 thread
    python benchmarks/throughput.py --smoke    # a minute; checks the script works
"""

from __future__ import annotations

import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
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
    synchronize,
    write_json,
)
from nanogpt_peer import PeerGPT, batch_reader, configure_optimizer, cosine_lr

from lightning_train.data import default_corpus_dir

CONFIG = REPO / "configs" / "pretrain-tiny.yaml"
SMOKE_SHAPE = ["--model.init_args.config.n_layer=1", "--model.init_args.config.n_embd=32",
               "--model.init_args.config.block_size=32", "--data.init_args.seq_len=32",
               "--data.init_args.batch_size=4"]


# ---- the peer: nanogpt_peer's model and nanoGPT's step, timed in this process ------------------------
def train_peer(
    shape: dict[str, Any], train_bin: Path, steps: int, warmup: int, device: torch.device, compile: bool
) -> dict:
    """nanoGPT's training step (``nanogpt_peer.train`` without its evaluations and checkpoints)."""
    model = PeerGPT(shape).to(device)
    optimizer = configure_optimizer(model, device, lr=2e-3)
    if compile:
        model = torch.compile(model)
    get_batch = batch_reader(train_bin, shape, device)
    X, Y = get_batch()
    for it in range(steps):
        if it == warmup:
            synchronize(device)
            start = clock()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(it, steps)
        loss = model(X, Y)
        X, Y = get_batch()  # prefetch the next batch while the device works
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 10 == 0:  # nanoGPT's log_interval, as the config's log_every_n_steps
            loss.item()
    synchronize(device)
    return per_step(start, clock(), steps - warmup)


# ---- our side: the CLI's config, fit in this process --------------------------------------------------
def build_cli(overrides: list[str], root: str, steps: int):
    from lightning_train.cli import LightningTrainCLI

    args = ["--config", str(CONFIG), f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}"]
    return LightningTrainCLI(args=args + overrides, run=False)


def train_lightning(overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        cli = build_cli(overrides, root, steps)
        timer = StepTimer(warmup)
        cli.trainer.callbacks.append(timer)
        cli.trainer.fit(cli.model, cli.datamodule)
    return timer.per_step()


def peer_shape(overrides: list[str], block: str) -> tuple[dict[str, Any], Path]:
    """The peer's shape (``block``: "gpt2" or "llama") for the model/batch the config resolves to, and the
    default corpus' first train shard. The GPT-2 block gets nanoGPT's 4 * n_embd MLP."""
    with tempfile.TemporaryDirectory() as root:
        cli = build_cli(overrides, root, steps=1)
        data, config = cli.datamodule, cli.model.config
        folder = Path(data.data_dir) if data.data_dir else default_corpus_dir()
        meta = data.meta
    shape = {"block": block, "vocab_size": config.vocab_size, "block_size": data.seq_len,
             "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
             "hidden": config.intermediate_size, "batch_size": data.batch_size, "dtype": meta["dtype"]}
    train_file = next(s["file"] for s in meta["shards"] if s["split"] == "train")
    return shape, folder / train_file


def model_parity(overrides: list[str], steps: int) -> dict[str, float]:
    """Median CPU milliseconds of one forward+backward of our GPT (the config's) and of both peer models
    on the same batch, the three alternated step by step in this process: no loop, no data, and the
    machine's drift cancels. Says whether a throughput gap is the model or the loop around it."""
    from lightning_train.models.gpt import GPT

    with tempfile.TemporaryDirectory() as root:
        config = build_cli(overrides, root, steps=1).model.config
    shape, _ = peer_shape(overrides, "llama")
    torch.manual_seed(0)
    x, y = (torch.randint(config.vocab_size, (shape["batch_size"], shape["block_size"])) for _ in range(2))
    ours, same, gpt2 = GPT(config), PeerGPT(shape), PeerGPT({**shape, "block": "gpt2"})
    steps_of = {
        "lightning_train GPT": (ours, lambda: F.cross_entropy(ours(x).flatten(0, 1), y.flatten())),
        "peer, same block": (same, lambda: same(x, y)),
        "peer, GPT-2 block": (gpt2, lambda: gpt2(x, y)),
    }
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for step in range(steps + 2):  # 2 warmup steps
        order = list(steps_of.items())
        for name, (model, loss) in order if step % 2 else reversed(order):
            start = time.process_time()
            loss().backward()
            if step >= 2:
                times[name].append(time.process_time() - start)
            model.zero_grad(set_to_none=True)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


ROWS = {  # name: (our CLI overrides, the peer's block, torch.compile on both sides)
    "default config / same block": ([], "llama", False),
    "default config / nanoGPT GPT-2 block": ([], "gpt2", False),
    "both compiled: default config / nanoGPT GPT-2 block": (["--model.init_args.compile=true"], "gpt2", True),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = base_parser("throughput", __doc__.splitlines()[0], pairs=5).parse_args(argv)
    set_threads(args.threads)
    device = torch.device("cpu")  # the default config is the CPU one
    # Compiled runs compile in their first steps: the warmup leaves them out of the timing.
    steps, warmup, pairs = (4, 2, 1) if args.smoke else (40, 5, args.pairs)
    machine = machine_info(args.threads)
    results, shapes, rows = {}, {}, {}
    for name, (overrides, block, compile) in ROWS.items():
        overrides = overrides + (SMOKE_SHAPE if args.smoke else [])
        rows[name] = {"lightning_overrides": overrides, "peer_block": block, "compile": compile}
        shape, train_bin = peer_shape(overrides, block)
        shapes[name] = shape
        measured = paired(
            partial(train_lightning, overrides, steps, warmup),
            partial(train_peer, shape, train_bin, steps, warmup, device, compile),
            pairs,
        )
        results[name] = compare_clocks("lightning_train", "nanoGPT-style loop", measured, "s/step")
        tokens = shape["batch_size"] * shape["block_size"]
        for result in results[name].values():
            result["tokens_per_step"] = tokens
    print_table(
        ["row", "clock", "lightning_train tokens/s", "nanoGPT-style tokens/s", "ratio, median (min-max)"],
        [
            [name, key, *_tokens_per_second(result)]
            for name, by_clock in results.items() for key, result in by_clock.items()
        ],
    )
    print(f"{pairs} pairs per row, {steps - warmup} timed steps a run; goal: ratio >= 1.0")
    parity = model_parity(SMOKE_SHAPE if args.smoke else [], steps=2 if args.smoke else 40)
    ours_ms = parity["lightning_train GPT"]
    print_table(["model alone", "forward+backward, CPU ms", "/ lightning_train GPT"],
                [[name, ms, f"{ms / ours_ms:.3f}x"] for name, ms in parity.items()])
    payload = {
        "benchmark": "throughput",
        "goal": "lightning tokens/s / nanoGPT-style tokens/s >= 1.0 (ratio_b_over_a of seconds per step)",
        "smoke": args.smoke,
        "setup": {"config": str(CONFIG.relative_to(REPO)), "rows": rows,
                  "shapes": shapes, "steps": steps, "timed_steps": steps - warmup, "device": device.type},
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": results,
        "model_parity_ms": parity,
    }
    write_json(args.out, payload)
    return payload


def _tokens_per_second(result: dict[str, Any]) -> list[Any]:
    """Seconds per step turned into tokens/s; the time ratio peer/ours is our throughput ratio."""
    row = comparison_row("", result)
    return [result["tokens_per_step"] / row[1], result["tokens_per_step"] / row[2], row[3]]


if __name__ == "__main__":
    main()
