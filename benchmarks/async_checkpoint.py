"""Training time blocked per checkpoint: synchronous ``AtomicCheckpointIO`` against ``async_save=True``.

A checkpoint of model + AdamW state (the Lightning layout: ``state_dict``, ``optimizer_states``, counters)
is saved the way the Trainer saves it. Synchronous: training is blocked for the whole write (serialise,
sha256, fsync, rename, manifest). Asynchronous: blocked only while the state is copied to host memory;
the write runs in the background thread. Measured on the tiny CPU config and on a GPT-2-124M-sized model
(1.5 GB of weights and moments), in pairs alternating which goes first, each side with one plugin for all
its saves as in a run (the first background save, which maps its host buffers, is reported apart).
Also: the step time of training while a background write is in flight against without one (on a
2-core CPU the writer competes for the cores; on a GPU node it would use otherwise idle host cores).
Goal: blocked time <= 10 % of the synchronous save.

    python benchmarks/async_checkpoint.py            # 3 pairs per model, 1 thread
    python benchmarks/async_checkpoint.py --smoke    # seconds; the tiny model only
"""

from __future__ import annotations

import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import (
    base_parser,
    comparison,
    machine_info,
    paired,
    print_table,
    ratio_cell,
    set_threads,
    write_json,
)

from lightning_train.checkpoint import AtomicCheckpointIO, verify_checkpoint
from lightning_train.models.gpt import GPT, GPTConfig

MODELS = {
    "tiny (configs/pretrain-tiny.yaml)": dict(
        vocab_size=258, block_size=128, n_layer=4, n_head=4, n_embd=128
    ),
    "GPT-2 124M (configs/gpt2-124m.yaml)": dict(
        vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, norm="layernorm",
        position="learned", mlp="gelu", bias=True,
    ),
}


class Training:
    """A model, AdamW with its moments, and one training step on a small batch."""

    def __init__(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**config))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, config["vocab_size"], (1, 65))
        self.step()

    def step(self) -> None:
        logits = self.model(self.tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def checkpoint(self, step: int) -> dict[str, Any]:
        return {"state_dict": self.model.state_dict(), "optimizer_states": [self.optimizer.state_dict()],
                "global_step": step, "epoch": 0}

    def state_bytes(self) -> int:
        tensors = list(self.model.state_dict().values())
        tensors += [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)


def save(io: AtomicCheckpointIO, training: Training, folder: Path) -> dict[str, float]:
    """Seconds training was blocked, and seconds until the checkpoint was complete on disk. ``io`` is
    the one plugin of the run: a later background save reuses the host buffers of the first."""
    path = folder / f"{'async' if io.async_save else 'sync'}.ckpt"
    start = time.perf_counter()
    io.save_checkpoint(training.checkpoint(step=1), path)
    blocked = time.perf_counter() - start
    io.flush()  # waits for the background write
    complete = time.perf_counter() - start
    verify_checkpoint(path)
    io.remove_checkpoint(path)
    return {"blocked": blocked, "complete": complete}


def step_times(training: Training, folder: Path, steps: int) -> dict[str, float]:
    """Median seconds per training step without a write in flight, and during a background write."""
    idle = []
    for _ in range(steps):
        start = time.perf_counter()
        training.step()
        idle.append(time.perf_counter() - start)
    io = AtomicCheckpointIO(async_save=True)
    io.save_checkpoint(training.checkpoint(step=2), folder / "during.ckpt")
    during = []
    while io.writer.busy or not during:
        start = time.perf_counter()
        training.step()
        during.append(time.perf_counter() - start)
    io.teardown()
    io.remove_checkpoint(folder / "during.ckpt")
    return {"idle": statistics.median(idle), "during_write": statistics.median(during),
            "steps_during": len(during)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("async_checkpoint", __doc__.splitlines()[0], pairs=3)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    models = dict(list(MODELS.items())[:1]) if args.smoke else MODELS
    pairs = 1 if args.smoke else args.pairs
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, config in models.items():
            training = Training(config)
            background_io = AtomicCheckpointIO(async_save=True)
            first = save(background_io, training, folder)  # the run's first checkpoint maps the host buffers
            sync = partial(save, AtomicCheckpointIO(), training, folder)
            measured = paired(sync, partial(save, background_io, training, folder), pairs)
            background_io.teardown()
            blocked = comparison("sync", "async", [(a["blocked"], b["blocked"]) for a, b in measured], "s")
            complete = comparison("sync", "async", [(a["complete"], b["complete"]) for a, b in measured], "s")
            steps = step_times(training, folder, steps=3 if args.smoke else 10)
            results[name] = {"state_bytes": training.state_bytes(), "blocked": blocked,
                             "until_complete": complete, "step_time": steps, "first_async_save": first}
            rows.append([
                name, f"{training.state_bytes() / 2**20:,.0f} MiB", blocked["a_stats"]["median"],
                blocked["b_stats"]["median"], ratio_cell(blocked["ratio_b_over_a"]), first["blocked"],
                complete["b_stats"]["median"], f"{steps['during_write'] / steps['idle']:.2f}x",
            ])
    print_table(["model", "state", "sync blocked, s", "async blocked, s", "async / sync blocked",
                 "first async save blocked, s", "async until on disk, s", "step time during a write"], rows)
    payload = {"benchmark": "async_checkpoint", "smoke": args.smoke, "pairs": pairs,
               "machine": machine_info(args.threads), "results": results}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
