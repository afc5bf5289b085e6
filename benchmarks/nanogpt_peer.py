"""The nanoGPT-style peer of the throughput benchmarks: a single-file GPT and nanoGPT's ``train.py`` loop
in plain PyTorch and NumPy (no lightning or lightning_train import, so that a run of it as its own
process pays for torch's import only, as nanoGPT's does).

The model has two blocks: nanoGPT's own GPT-2 block (``model.py``: LayerNorm without bias, learned
positions, exact GELU, no biases) and the default config's Llama-style block (RMSNorm, rotary positions,
SwiGLU) written the way a single-file reference writes it. ``throughput.py`` times its steps in-process;
run as a script, this file is nanoGPT's ``train.py`` at one device (``python benchmarks/nanogpt_peer.py
--help``) and ``whole_process.py`` times it as a process:

- ``get_batch``: ``np.memmap`` re-opened per batch, random offsets, the next batch fetched right after the
  forward (pinned, ``non_blocking`` copies on CUDA);
- ``get_lr``: linear warmup then cosine decay, set every iteration;
- AdamW with decay on parameters of 2+ dimensions, ``fused`` on CUDA only (``configure_optimizers``);
- one micro-step a step (``gradient_accumulation_steps = 1``), a no-op GradScaler in fp32, clipping at
  1.0, ``zero_grad(set_to_none=True)``, ``loss.item()`` every ``log_interval`` steps;
- ``estimate_loss`` (``eval_iters`` batches, ``model.eval()``, ``torch.no_grad``) every ``eval_interval``
  steps, then a ``torch.save`` checkpoint of model and optimizer (``always_save_checkpoint``).

Two changes make it do what ``fit`` of ``configs/pretrain-tiny.yaml`` does, no more: it evaluates the
validation split only (nanoGPT also estimates the train split's loss, which lightning_train's validation
does not) and not before the first step, and it stops after ``max_iters`` steps (nanoGPT's loop takes
one more after the last evaluation). So 200 iterations with ``--eval-interval 100`` are 200 steps and 2
evaluations, as ``fit`` with ``max_steps: 200`` and ``val_check_interval: 100``.

``time_to_quality.py`` runs it with nanoGPT's own CPU recipe (``--recipe nanogpt``: the learning rates,
warmup and beta2 of ``config/train_shakespeare_char.py`` with its CPU overrides), evaluates on fixed
validation windows (``--val-starts``, the ones lightning_train's validation reads, instead of random
ones) and stops after the evaluation that reaches ``--target``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


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
        self.mlp = nn.Sequential(  # nanoGPT's MLP: exact GELU (nn.GELU()), 4 x wide
            nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(), nn.Linear(4 * n_embd, n_embd, bias=False),
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


# name: (lr, min_lr, warmup_iters, beta2); "config": the default config's, "nanogpt": nanoGPT's CPU recipe
# (config/train_shakespeare_char.py: lr 1e-3, min_lr 1e-4, warmup 100, beta2 0.99, decay to max_iters)
RECIPES = {"config": (2e-3, 2e-4, 50, 0.95), "nanogpt": (1e-3, 1e-4, 100, 0.99)}


def configure_optimizer(
    model: nn.Module, device: torch.device, lr: float, beta2: float = 0.95
) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: decay on 2+-dimensional parameters, fused on CUDA only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), **extra)


def batch_reader(path: Path, shape: dict[str, Any], device: torch.device):
    """nanoGPT's ``get_batch`` for one split."""
    batch_size, block_size = shape["batch_size"], shape["block_size"]

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(path, dtype=shape["dtype"], mode="r")  # re-opened per batch, as nanoGPT does
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    return get_batch


def fixed_batches(path: Path, shape: dict[str, Any], starts: list[int], device: torch.device):
    """The validation batches at the token offsets ``starts``, in order and the same at every evaluation."""
    batch_size, block_size = shape["batch_size"], shape["block_size"]
    data = np.memmap(path, dtype=shape["dtype"], mode="r")
    windows = torch.stack([torch.from_numpy(data[i : i + block_size + 1].astype(np.int64)) for i in starts])
    batches = [windows[i : i + batch_size] for i in range(0, len(starts), batch_size)]
    return [(b[:, :-1].contiguous().to(device), b[:, 1:].contiguous().to(device)) for b in batches]


def cosine_lr(
    it: int, max_iters: int, lr: float = 2e-3, min_lr: float = 2e-4, warmup_iters: int = 50
) -> float:
    """nanoGPT's ``get_lr`` with the default config's learning rates and warmup."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (lr - min_lr)


def train(args: argparse.Namespace, launched: float) -> dict[str, Any]:
    """nanoGPT's ``train.py`` loop (see the module docstring); seconds by part, as Goodput splits ours."""
    shape = json.loads(args.shape)
    device = torch.device(args.device)
    torch.manual_seed(1337)
    model = PeerGPT(shape).to(device)
    lr, min_lr, warmup_iters, beta2 = RECIPES[args.recipe]
    optimizer = configure_optimizer(model, device, lr=lr, beta2=beta2)
    if args.compile:
        model = torch.compile(model)
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp32: nanoGPT's no-op scaler
    ctx = nullcontext()  # fp32: no autocast
    train_batch = batch_reader(args.train_bin, shape, device)
    val_batch = batch_reader(args.val_bin, shape, device)
    fixed = None  # with --val-starts: the k-th batch of every evaluation is the k-th of these
    if args.val_starts is not None:
        starts = json.loads(args.val_starts.read_text())
        fixed = fixed_batches(args.val_bin, shape, starts, device)[: args.eval_iters]

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = val_batch() if fixed is None else fixed[k]
            with ctx:
                losses[k] = model(X, Y).item()
        model.train()
        return losses.mean().item()

    seconds = {"startup": 0.0, "productive": 0.0, "validation": 0.0, "checkpoint": 0.0}
    X, Y = train_batch()
    iter_num, mark, lossf, val_loss, history = 0, time.time(), None, None, []
    seconds["startup"] = mark - launched
    while True:
        if iter_num % args.eval_interval == 0 and iter_num > 0:
            val_loss = estimate_loss()
            history.append([iter_num, val_loss])
            print(f"step {iter_num}: val loss {val_loss:.4f}", flush=True)  # as nanoGPT prints it
            evaluated = time.time()
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "iter_num": iter_num, "best_val_loss": val_loss}
            torch.save(checkpoint, args.out_dir / "ckpt.pt")
            saved = time.time()
            seconds["validation"] += evaluated - mark
            seconds["checkpoint"] += saved - evaluated
            mark = saved
        if iter_num == args.max_iters or (args.target is not None and history and val_loss <= args.target):
            break
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(iter_num, args.max_iters, lr, min_lr, warmup_iters)
        with ctx:
            loss = model(X, Y)
        X, Y = train_batch()  # the next batch, while the device works
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if iter_num % args.log_interval == 0:
            lossf = loss.item()  # what nanoGPT prints
        iter_num += 1
        now = time.time()
        seconds["productive"] += now - mark
        mark = now
    return {"seconds": seconds, "steps": iter_num, "last_logged_loss": lossf, "val_loss": val_loss,
            "val_history": history}


def main(argv: list[str] | None = None) -> None:
    launched = time.time() - _process_age()
    parser = argparse.ArgumentParser(prog="benchmarks/nanogpt_peer.py", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, help="JSON: block, vocab_size, block_size, n_layer, "
                        "n_head, n_embd, hidden, batch_size, dtype (throughput.peer_shape)")
    parser.add_argument("--train-bin", type=Path, required=True)
    parser.add_argument("--val-bin", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True, help="where ckpt.pt goes")
    parser.add_argument("--result", type=Path, required=True, help="the JSON of seconds by part")
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=10)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--recipe", choices=list(RECIPES), default="config", help="LRs, warmup, beta2")
    parser.add_argument("--val-starts", type=Path, help="JSON list of token offsets: fixed val windows")
    parser.add_argument("--target", type=float, help="stop after the evaluation whose loss is <= this")
    args = parser.parse_args(argv)
    args.result.write_text(json.dumps(train(args, launched)))


def _process_age() -> float:
    """Seconds since this process started, from /proc (as Goodput measures lightning_train's start-up)."""
    stat = Path("/proc/self/stat").read_text()
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
