"""Throughput: tokens/s of the default config (``configs/pretrain-tiny.yaml`` through the CLI, as a user
runs it: TextDataModule on the default corpus, CSV logging, the progress bar) against a nanoGPT-style
single-file training loop with the same model size, batch and sequence length, reading the same token
file. Goal: ratio (lightning tokens/s / nanoGPT tokens/s) >= 1.0.

The peer below is self-contained (no lightning_train imports), written as nanoGPT's ``model.py`` and
``train.py`` are: ``np.memmap`` random-offset batches, fused AdamW, warmup+cosine LR, clipping at 1.0 and
``loss.item()`` every ``log_interval`` steps. It has two blocks: nanoGPT's own GPT-2 block (LayerNorm,
learned positions, tanh-GELU MLP) and the default config's Llama-style block (RMSNorm, rotary positions,
SwiGLU) written the way a single-file reference writes it. Rows:

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

import math
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
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
from torch import nn

from lightning_train.data import default_corpus_dir

CONFIG = REPO / "configs" / "pretrain-tiny.yaml"
SMOKE_SHAPE = ["--model.init_args.config.n_layer=1", "--model.init_args.config.n_embd=32",
               "--model.init_args.config.block_size=32", "--data.init_args.seq_len=32",
               "--data.init_args.batch_size=4"]


# ---- the peer: a nanoGPT-style model and loop in plain PyTorch ----------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GPT2Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=False), nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(approximate="tanh"),
            nn.Linear(4 * n_embd, n_embd, bias=False),
        )

    def forward(self, x: torch.Tensor, rope: None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LlamaBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, hidden: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.RMSNorm(n_embd, eps=1e-5), nn.RMSNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.w1, self.w3 = nn.Linear(n_embd, hidden, bias=False), nn.Linear(n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        h = self.ln_2(x)
        return x + self.c_proj(F.silu(self.w1(h)) * self.w3(h))


class PeerGPT(nn.Module):
    def __init__(self, shape: dict[str, Any]) -> None:
        super().__init__()
        n_layer, n_head, n_embd = shape["n_layer"], shape["n_head"], shape["n_embd"]
        self.llama = shape["block"] == "llama"
        self.wte = nn.Embedding(shape["vocab_size"], n_embd)
        if self.llama:
            self.h = nn.ModuleList(LlamaBlock(n_embd, n_head, shape["hidden"]) for _ in range(n_layer))
            self.ln_f = nn.RMSNorm(n_embd, eps=1e-5)
            head_dim = n_embd // n_head
            inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2) / head_dim)
            freqs = torch.outer(torch.arange(shape["block_size"]), inv_freq)
            self.register_buffer("cos", freqs.cos().repeat(1, 2), persistent=False)
            self.register_buffer("sin", freqs.sin().repeat(1, 2), persistent=False)
        else:
            self.wpe = nn.Embedding(shape["block_size"], n_embd)
            self.h = nn.ModuleList(GPT2Block(n_embd, n_head) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, shape["vocab_size"], bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.wte(idx)
        rope = (self.cos[:T], self.sin[:T]) if self.llama else None
        if not self.llama:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x, rope)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def train_peer(
    shape: dict[str, Any], train_bin: Path, steps: int, warmup: int, device: torch.device, compile: bool
) -> dict:
    """nanoGPT's training loop, trimmed to one device and no evaluation."""
    batch_size, block_size = shape["batch_size"], shape["block_size"]
    log_interval, lr, min_lr, warmup_iters = 10, 2e-3, 2e-4, 50
    model = PeerGPT(shape).to(device)
    if compile:
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(train_bin, dtype=shape["dtype"], mode="r")  # re-opened per batch, as nanoGPT does
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return lr * (it + 1) / (warmup_iters + 1)
        ratio = (it - warmup_iters) / max(1, steps - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (lr - min_lr)

    X, Y = get_batch()
    for it in range(steps):
        if it == warmup:
            synchronize(device)
            start = clock()
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        loss = model(X, Y)
        X, Y = get_batch()  # prefetch the next batch while the device works
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % log_interval == 0:
            loss.item()  # what nanoGPT prints
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
