"""Tensor parallelism's memory per rank: tp=2 (``ParallelStrategy(tensor_parallel=2)``, sequence parallel)
on 2 CPU ranks (gloo) against one process and against FSDP2 on 2 ranks (``DataParallelStrategy(
sharding="fsdp")``), all three training the same global batch.

Per rank: the bytes of parameters, gradients and AdamW state this rank holds after a few real optimizer
steps (``measured_state_bytes``: local shards of DTensors), and the activations: the bytes of the tensors
autograd saves for backward during one training forward (model and loss), caught with
``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, the local shard of a DTensor,
parameters (and FSDP's all-gathered ones) not counted. That is what a rank holds when backward starts,
the activation peak, measured the same way on any device. Goals (issue 16): tp's state <= 0.55x and its
activations <= 0.6x of one process.

    python benchmarks/model_parallel.py            # writes docs/benchmarks/model_parallel.json
    python benchmarks/model_parallel.py --smoke    # seconds: a tiny model

Each layout is a fresh ``python benchmarks/model_parallel.py --worker LAYOUT`` launch; Lightning's
launcher starts rank 1 by re-running that command line. The three launches run at the same time: they
count bytes, which sharing the cores does not change.
"""

from __future__ import annotations

import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import (
    add_worker_flags,
    base_parser,
    launch_worker,
    machine_info,
    print_table,
    set_threads,
    write_json,
)
from ddp_vs_fsdp import MemoryProbe, RandomTokens
from torch.utils.data import DataLoader

SIZES = {  # (model, global batch, steps, the step whose forward is measured)
    "full": ({"n_layer": 4, "n_embd": 256, "n_head": 8, "block_size": 256}, 4, 3, 1),
    "smoke": ({"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32}, 2, 2, 1),
}
VOCAB = 320  # 258 byte tokens padded to 64, as PretrainModule pads the data's vocabulary
LAYOUTS = {"single": 1, "fsdp": 2, "tp": 2}  # layout: ranks
GROUPS = {"attn_norm": "norms", "mlp_norm": "norms", "norm": "norms", "attn": "attention", "mlp": "mlp",
          "embed": "embedding", "lm_head": "output head"}
MiB = 2**20


def storages(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """(address, bytes) of each storage ``tensor`` lives in. A wrapper subclass (a DTensor: its local
    shard; a functional collective's pending result) has none of its own: its inner tensors'."""
    if hasattr(tensor, "__tensor_flatten__"):  # the tensor-subclass protocol names the inner tensors
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [key for part in inner if isinstance(part, torch.Tensor) for key in storages(part)]
    if tensor.device.type == "meta":
        return []
    storage = tensor.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


class SavedActivations(L.Callback):
    """Bytes saved for backward in the forward of training step ``step``, in total and by the part of the
    model that saved them (``GROUPS``; "loss" for the cross-entropy after the model)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.by_group: dict[str, int] = defaultdict(int)
        self._context: Any = None
        self._handles: list[Any] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.step:
            return
        model, stack, seen = pl_module.model, [], set()

        def enter(group: str, *_: Any) -> None:  # a hook's return value would replace inputs/outputs
            stack.append(group)

        def leave(*_: Any) -> None:
            stack.pop()

        for name, module in model.named_modules():
            group = GROUPS.get(name.split(".")[-1] if name.startswith("blocks.") else name)
            if group is not None:
                self._handles.append(module.register_forward_pre_hook(partial(enter, group)))
                self._handles.append(module.register_forward_hook(leave))

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            # parameters as the module holds them now: FSDP2 swaps in the all-gathered ones for forward
            params = {key for p in model.parameters() for key in storages(p)}
            for key in storages(tensor):
                if key not in seen and key not in params:
                    seen.add(key)
                    self.by_group[stack[-1] if stack else "loss"] += key[1]
            return tensor

        self._context = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self._context.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
            for handle in self._handles:
                handle.remove()

    def result(self) -> dict[str, Any]:
        return {"activation_bytes": sum(self.by_group.values()), "activation_bytes_by_part": self.by_group}


def worker(layout: str, size: str, result_dir: Path) -> None:
    """One training run of ``layout``; every rank writes its numbers to ``result_dir/rank<R>.json``."""
    from lightning_train import GPTConfig, PretrainModule
    from lightning_train.strategies import DataParallelStrategy, ParallelStrategy

    shape, global_batch, steps, measured_step = SIZES[size]
    strategies = {"single": lambda: "auto", "fsdp": lambda: DataParallelStrategy(sharding="fsdp"),
                  "tp": lambda: ParallelStrategy(tensor_parallel=2)}
    # the same global batch everywhere: fsdp's 2 ranks read half of it each, tp's 2 ranks all of it
    batch = global_batch // 2 if layout == "fsdp" else global_batch
    L.seed_everything(0, verbose=False)
    module = PretrainModule(GPTConfig(vocab_size=VOCAB, **shape), warmup_steps=1, decay_steps=100)
    data = DataLoader(RandomTokens(global_batch * steps, shape["block_size"], VOCAB), batch_size=batch)
    memory, activations = MemoryProbe(), SavedActivations(measured_step)
    trainer = L.Trainer(
        accelerator="cpu", devices=LAYOUTS[layout], strategy=strategies[layout](), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[memory, activations],
    )
    trainer.fit(module, data)
    result = {**memory.result, **activations.result(), "per_rank_batch": batch, "steps": trainer.global_step}
    result["model_state_bytes"] = result["param_bytes"] + result["grad_bytes"] + result["optimizer_bytes"]
    result["num_params"] = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    (result_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(layout: str, size: str, threads: int) -> list[dict[str, Any]]:
    """The per-rank results of one fresh run of ``layout``."""
    return launch_worker(__file__, layout, size, threads)


def largest_rank(ranks: list[dict[str, Any]], key: str) -> int:
    return max(rank[key] for rank in ranks)


def main() -> None:
    parser = base_parser("model_parallel", __doc__.splitlines()[0], pairs=1)
    add_worker_flags(parser, LAYOUTS, SIZES)
    args = parser.parse_args()
    set_threads(args.threads)
    if args.worker:
        return worker(args.worker, args.size, args.result_dir)

    size = "smoke" if args.smoke else "full"
    # byte counts, not timings: one run of each layout is exact (the same on every rerun), so the
    # layouts run side by side (each launch a process of its own, waited on by a thread)
    with ThreadPoolExecutor(len(LAYOUTS)) as pool:
        futures = {layout: pool.submit(launch, layout, size, args.threads) for layout in LAYOUTS}
    runs = {layout: future.result() for layout, future in futures.items()}
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "activation_bytes")
    memory = {key: {layout: largest_rank(ranks, key) for layout, ranks in runs.items()} for key in keys}
    for row in memory.values():
        row["tp_over_single"] = row["tp"] / row["single"]
        row["tp_over_fsdp"] = row["tp"] / row["fsdp"]
        row["fsdp_over_single"] = row["fsdp"] / row["single"]
    rows = [
        [f"{key.removesuffix('_bytes')} (MiB)", row["single"] / MiB, row["fsdp"] / MiB, row["tp"] / MiB,
         f"{row['tp_over_single']:.3f}x", f"{row['tp_over_fsdp']:.3f}x"]
        for key, row in memory.items()
    ]
    by_part = {layout: ranks[0]["activation_bytes_by_part"] for layout, ranks in runs.items()}
    for part in by_part["single"]:
        single, fsdp, tp = (by_part[layout].get(part, 0) for layout in LAYOUTS)
        rows.append([f"  activations: {part} (MiB)", single / MiB, fsdp / MiB, tp / MiB,
                     f"{tp / single:.3f}x", f"{tp / fsdp:.3f}x" if fsdp else "-"])
    print_table(["per rank", "1 process", "fsdp, 2 ranks", "tp=2, 2 ranks", "tp / 1 process", "tp / fsdp"],
                rows)
    goals = {"model_state_bytes": 0.55, "activation_bytes": 0.6}
    met = {key: memory[key]["tp_over_single"] <= limit for key, limit in goals.items()}
    for key, limit in goals.items():
        ratio = memory[key]["tp_over_single"]
        print(f"goal: tp {key} <= {limit}x one process: {ratio:.3f}x -> {'met' if met[key] else 'NOT met'}")
    shape, global_batch, steps, measured_step = SIZES[size]
    write_json(
        args.out,
        {
            "benchmark": "model_parallel",
            "smoke": args.smoke,
            "setup": {
                "model": {**shape, "vocab_size": VOCAB}, "global_batch": global_batch, "seq_len":
                shape["block_size"], "steps": steps, "measured_step": measured_step, "precision": "32-true",
                "per_rank_batch": {layout: ranks[0]["per_rank_batch"] for layout, ranks in runs.items()},
                "ranks": {layout: len(ranks) for layout, ranks in runs.items()},
                "num_params": runs["single"][0]["num_params"],
            },
            "memory": memory,
            "activation_bytes_by_part": by_part,
            "per_rank": runs,
            "goals": goals,
            "goal_met": met,
            "machine": machine_info(args.threads),
        },
    )


if __name__ == "__main__":
    main()
