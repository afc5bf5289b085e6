"""DDP vs FSDP2 with DataParallelStrategy on 2 CPU ranks (gloo): memory per rank and step time, paired.

Per rank: the bytes of parameters, gradients and AdamW state this rank holds after a step (exact, from
the tensors), and the process's peak RSS (which also counts Python, torch and the data). Step time: the
same training under both shardings, run back to back in alternating order (see common.py), median of
per-pair ratios. Goal: fsdp's parameter + gradient + optimizer bytes <= 0.55x ddp's.

    python benchmarks/ddp_vs_fsdp.py            # writes docs/benchmarks/ddp_vs_fsdp.json
    python benchmarks/ddp_vs_fsdp.py --smoke    # seconds: a tiny model, one pair

Each measurement is a fresh ``python benchmarks/ddp_vs_fsdp.py --worker SHARDING`` launch; Lightning's
launcher starts rank 1 by re-running that command line.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import (
    StepTimer,
    add_worker_flags,
    base_parser,
    compare_clocks,
    comparison_row,
    launch_worker,
    machine_info,
    print_table,
    set_threads,
    write_json,
)
from torch.utils.data import DataLoader, Dataset

from lightning_train.strategies.memory import measured_state_bytes

SIZES = {  # (model, per-rank batch, steps, warmup steps)
    "full": ({"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 128}, 4, 20, 5),
    "smoke": ({"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32}, 2, 4, 1),
}
MiB = 2**20


class RandomTokens(Dataset):
    def __init__(self, samples: int, seq_len: int, vocab_size: int) -> None:
        self.tokens = torch.randint(
            0, vocab_size, (samples, seq_len + 1), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class MemoryProbe(L.Callback):
    """After the last step: model-state bytes on this rank and the process's peak RSS."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.result = {
            **measured_state_bytes(pl_module, trainer.optimizers[0]),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        }


def worker(sharding: str, size: str, result_dir: Path) -> None:
    """One 2-rank training run; every rank writes its numbers to ``result_dir/rank<R>.json``."""
    from lightning_train import GPTConfig, PretrainModule
    from lightning_train.strategies import DataParallelStrategy

    shape, batch, steps, warmup = SIZES[size]
    L.seed_everything(0, verbose=False)
    config = GPTConfig(vocab_size=258, **shape)
    module = PretrainModule(config, warmup_steps=2, decay_steps=100)
    data = DataLoader(RandomTokens(2 * batch * steps, shape["block_size"], 258), batch_size=batch)
    timer, memory = StepTimer(warmup), MemoryProbe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DataParallelStrategy(sharding=sharding),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, memory],
    )
    trainer.fit(module, data)
    result = {**memory.result, "step_time": timer.per_step(), "num_params": module.model.num_params()}
    (result_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(sharding: str, size: str, threads: int) -> list[dict[str, Any]]:
    """The per-rank results of one fresh run of ``sharding``."""
    return launch_worker(__file__, sharding, size, threads)


def main() -> None:
    parser = base_parser("ddp_vs_fsdp", __doc__.splitlines()[0], pairs=3)
    add_worker_flags(parser, ["ddp", "fsdp"], SIZES)
    args = parser.parse_args()
    set_threads(args.threads)
    if args.worker:
        return worker(args.worker, args.size, args.result_dir)

    size, pairs = ("smoke", 1) if args.smoke else ("full", args.pairs)
    runs = []
    for i in range(pairs):  # alternate which side goes first
        order = ("ddp", "fsdp") if i % 2 == 0 else ("fsdp", "ddp")
        result = {sharding: launch(sharding, size, args.threads) for sharding in order}
        runs.append((result["ddp"], result["fsdp"]))

    def per_rank(key: str, sharding: int) -> float:  # the larger rank, median over runs
        values = sorted(max(rank[key] for rank in run[sharding]) for run in runs)
        return values[len(values) // 2]

    for rank in (rank for run in runs for side in run for rank in side):
        rank["model_state_bytes"] = rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_bytes"]
    rows, memory = [], {}
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "peak_rss_bytes"):
        ddp, fsdp = per_rank(key, 0), per_rank(key, 1)
        memory[key] = {"ddp": ddp, "fsdp": fsdp, "ratio_fsdp_over_ddp": fsdp / ddp}
        rows.append(
            [f"{key.removesuffix('_bytes')} per rank (MiB)", ddp / MiB, fsdp / MiB, f"{fsdp / ddp:.3f}x"]
        )
    timing = compare_clocks(
        "ddp", "fsdp", [(a[0]["step_time"], b[0]["step_time"]) for a, b in runs], "s/step"
    )
    rows += [comparison_row(f"step time, {clock} (ms)", timing[clock], 1000) for clock in ("wall", "cpu")]
    print_table(["per rank, 2 CPU ranks (gloo)", "ddp", "fsdp", "fsdp / ddp"], rows)
    ratio = memory["model_state_bytes"]["ratio_fsdp_over_ddp"]
    verdict = "met" if ratio <= 0.55 else "NOT met"
    print(f"goal: fsdp params+grads+optimizer <= 0.55x ddp: {ratio:.3f}x -> {verdict}")
    write_json(
        args.out,
        {
            "benchmark": "ddp_vs_fsdp",
            "smoke": args.smoke,
            "pairs": pairs,
            "setup": {
                "model": SIZES[size][0],
                "per_rank_batch": SIZES[size][1],
                "steps": SIZES[size][2],
                "warmup_steps": SIZES[size][3],
                "ranks": 2,
                "num_params": runs[0][0][0]["num_params"],
            },
            "memory": memory,
            "step_time": timing,
            "goal_met": ratio <= 0.55,
            "machine": machine_info(args.threads),
        },
    )


if __name__ == "__main__":
    main()
