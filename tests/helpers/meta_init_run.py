"""A fit of a few steps under one layout that records how the model was built (run as a script: Lightning
starts the other ranks), for tests/test_meta_init.py and benchmarks/sharded_init.py.

Each rank writes ``<out>/rank<R>.json``: the devices of the parameters right after ``configure_model``
(before the strategy's setup), the parameter bytes this rank holds after setup and the whole model's, and
the rise of the process's peak resident memory (VmHWM) from before the model is built to the first
step; and ``<out>/rank<R>.safetensors``: the whole (gathered) tensors of the parameters its stages hold,
as initialised (or loaded: ``--init_from``) before the first step, with ``<out>/rank<R>.logits.safetensors``,
the whole logits of fixed tokens then (without pipeline parallelism).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from lightning_train import FinetuneModule, GPTConfig, PretrainModule
from lightning_train.strategies import ParallelStrategy
from lightning_train.strategies.processes import leave_process_group

sys.path.insert(0, str(Path(__file__).parent))
from strategy_probe import PatternDataModule  # noqa: E402


def peak_rss_bytes() -> int:
    """The process's resident-memory high-water mark (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class BuildRecorder(L.Callback):
    """Records the build: devices after configure_model (the module's hook below), bytes at fit start
    (after the strategy's setup), the peak-memory rise, weights and logits at the first step (after the
    module's own on_fit_start, which loads ``init_from`` into a sharded model)."""

    def __init__(self, out: Path, save_weights: bool) -> None:
        self.out, self.save_weights, self.report = out, save_weights, {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.report["rss_before_build"] = peak_rss_bytes()  # before configure_model

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = dict(pl_module.model.named_parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params.values()]
        self.report["local_param_bytes"] = sum(t.numel() * t.element_size() for t in local)
        self.report["model_param_bytes"] = pl_module.whole_model_bytes
        self.report["built_on"] = pl_module.built_on

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if "rss_rise" in self.report:
            return
        self.report["rss_rise"] = peak_rss_bytes() - self.report["rss_before_build"]
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.report))
        if self.save_weights:  # gathered whole: off where the peak memory is measured
            params = dict(pl_module.model.named_parameters())
            whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in params.items()}
            tensors = {n: t.detach().cpu().contiguous() for n, t in whole.items()}
            save_file(tensors, self.out / f"rank{trainer.global_rank}.safetensors")
            if getattr(trainer.strategy, "pipeline", None) is None:  # each rank runs the model (its shards)
                with torch.no_grad():
                    logits = pl_module.model(torch.arange(12).view(2, 6) % pl_module.config.vocab_size)
                logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
                path = self.out / f"rank{trainer.global_rank}.logits.safetensors"
                save_file({"logits": logits.float().contiguous()}, path)


def recording(base: type) -> type:
    class Recorded(base):
        def configure_model(self) -> None:
            super().configure_model()
            self.built_on = sorted({p.device.type for p in self.model.parameters()})
            self.whole_model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    return Recorded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--replicate_size", type=int, default=1)
    parser.add_argument("--config", default='{"vocab_size": 64, "n_layer": 4, "n_head": 4, "n_kv_head": 2, '
                        '"n_embd": 32, "block_size": 16}')
    parser.add_argument("--init_from", default=None, help="a FinetuneModule's starting weights")
    parser.add_argument("--no_weights", action="store_true", help="write no rank<R>.safetensors")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(7, verbose=False)
    strategy = ParallelStrategy(
        tensor_parallel=args.tp, pipeline_parallel=args.pp, sharding=args.sharding,
        replicate_size=args.replicate_size,
    ) if args.devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=1, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[BuildRecorder(args.out, not args.no_weights)],
    )
    config = GPTConfig(**json.loads(args.config))
    if args.init_from:
        module = recording(FinetuneModule)(args.init_from, warmup_steps=1)
    else:
        module = recording(PretrainModule)(config, warmup_steps=1)
    trainer.fit(module, PatternDataModule(vocab_size=module.config.vocab_size, seq_len=16, batch_size=4))
    leave_process_group()


if __name__ == "__main__":
    main()
