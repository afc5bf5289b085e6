"""Run by ``tests/test_families_parallel.py``: a few training steps of each model family's tiny GPT under one
layout, each family a fit of its own in this one process group (torchrun starts the ranks; ``single`` is
one process without it), so a layout starts its ranks once for every family.

A family's model is the ``GPTConfig`` that ``models/hf.py`` reads from the family's tiny transformers config
(``tests/test_hf_families.py``'s, the one its logits are checked on). Each rank writes
``<out>/<family>/rank<R>.json`` (``strategy_probe.StrategyProbe``: the losses over the global batch and the
gradient norms before clipping, each step) and ``<out>/<family>/rank<R>.safetensors`` (the whole gradients
of the parameters its stages hold, at the first step). Under tp or pp, each rank also writes
``<out>/generations-rank<R>.json``: each family's greedy completions, sharded for generation as the layout
splits it and in one process (``generations``).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.helpers.families_parallel \\
        tp2 OUT llama3 olmo2
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import transformers
from safetensors.torch import save_file

from lightning_train import PretrainModule
from lightning_train._compat import end_distributed_process
from lightning_train.models.config import GPTConfig
from lightning_train.models.gpt import GPT
from lightning_train.models.hf import config_from_hf
from lightning_train.strategies import ParallelStrategy
from lightning_train.strategies.generation import shard_for_generation

sys.path.insert(0, str(Path(__file__).parent))
from strategy_probe import PatternDataModule, StrategyProbe  # noqa: E402

from tests.test_hf_families import FAMILIES as NEW_FAMILIES  # noqa: E402
from tests.test_hf_families import SMALL  # noqa: E402

# the families of test_hf_families, and the two that loaded before them (tests/test_hf.py), at the same size;
# GPT-2's dropout off, as the other families' is: a dropout mask is drawn per rank
FAMILIES = {"gpt2": ("GPT2Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
            "llama": ("LlamaConfig", {}), **NEW_FAMILIES}

GLOBAL_BATCH = 8
# layout -> (processes, ParallelStrategy's arguments); "single" is Lightning's one-device strategy
LAYOUTS: dict[str, tuple[int, dict]] = {
    "single": (1, {}),
    "fsdp": (2, {"sharding": "fsdp"}),  # 2 data-parallel ranks, half the global batch each
    "tp2": (2, {"tensor_parallel": 2}),
    "pp2": (2, {"pipeline_parallel": 2}),
    "tp2xpp2": (4, {"tensor_parallel": 2, "pipeline_parallel": 2}),
}


class FirstGradients(L.Callback):
    """Writes the whole gradients of this rank's parameters at the first step, before clipping (from the same
    weights in every layout, so each parameter's gradient is compared as computed, not as AdamW's steps
    amplify rounding); gathered: a collective on the ranks that share each parameter, in the same order."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if trainer.global_step > 0:
            return
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                 for name, p in pl_module.named_parameters()}
        self.out.mkdir(parents=True, exist_ok=True)
        save_file(grads, self.out / f"rank{trainer.global_rank}.safetensors")


def family_config(name: str) -> GPTConfig:
    """The GPTConfig of family ``name``'s tiny model, as ``open_pretrained`` reads it from its folder."""
    config_class, extra = FAMILIES[name]
    hf = getattr(transformers, config_class)(**SMALL | extra)
    return config_from_hf(hf.to_dict(), name)


def fit(name: str, layout: str, out: Path) -> None:
    devices, options = LAYOUTS[layout]
    data_parallel = devices // (options.get("tensor_parallel", 1) * options.get("pipeline_parallel", 1))
    L.seed_everything(1234, verbose=False)
    module = PretrainModule(family_config(name), learning_rate=3e-3, warmup_steps=2, decay_steps=100)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=ParallelStrategy(**options) if options else "auto",
        precision="32-true", max_steps=5, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[StrategyProbe(str(out / name)), FirstGradients(out / name)],
    )
    data = PatternDataModule(samples=5 * GLOBAL_BATCH, vocab_size=SMALL["vocab_size"],
                             batch_size=GLOBAL_BATCH // data_parallel)
    trainer.fit(module, data)


def generations(layout: str, families: list[str]) -> dict[str, dict[str, list[list[int]]]]:
    """Each family's greedy completion of a 5-token prompt (odd: padded for tp=2), with the KV cache and
    without, on its model laid out by ``shard_for_generation`` as ``layout`` splits it and in one process
    (init_std 0.4: logits far apart, so rounding cannot swap the top two)."""
    options = LAYOUTS[layout][1]
    prompt = torch.tensor([[11, 12, 13, 14, 15]])
    completions = {}
    for name in families:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(family_config(name), init_std=0.4)).eval()
        sharded = shard_for_generation(copy.deepcopy(model), options.get("tensor_parallel", 1),
                                       options.get("pipeline_parallel", 1))
        completions[name] = {
            f"{way}, {'cached' if cache else 'uncached'}": generator.generate(
                prompt, 12, temperature=0, use_cache=cache
            ).tolist()[0]
            for way, generator in (("one process", model), ("sharded", sharded)) for cache in (True, False)
        }
    return completions


def main(layout: str, out: Path, families: list[str]) -> None:
    torch.set_num_threads(1)
    for name in families:
        fit(name, layout, out)
    if layout in ("tp2", "pp2", "tp2xpp2"):
        rank = torch.distributed.get_rank()
        (out / f"generations-rank{rank}.json").write_text(json.dumps(generations(layout, families)))
    end_distributed_process(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
