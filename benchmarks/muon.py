"""Muon's cost per step against AdamW: ``PretrainModule(optimizer="muon")`` and the default AdamW on the
default config's model (``configs/pretrain-tiny.yaml``: 4 blocks, 128 wide, batch 16 x 128 tokens), one
process, paired A/B (alternating order). Two rows: the optimizer step alone, and the whole training step
(forward, backward, optimizer step), each in CPU and wall seconds. The extra cost is Newton-Schulz: five
iterations of three matmuls on each block matrix, which a step of AdamW has not.

    python benchmarks/muon.py            # 5 pairs of 20 steps each, 1 thread
    python benchmarks/muon.py --smoke    # seconds; checks the script works
"""

from __future__ import annotations

from typing import Any

import torch
from common import (
    base_parser,
    clock,
    compare_clocks,
    comparison_row,
    machine_info,
    paired,
    print_table,
    set_threads,
    write_json,
)

from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules import PretrainModule

DEFAULT = {"vocab_size": 320, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}
SMOKE = {"vocab_size": 320, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}


class Run:
    """A model and its optimizer, stepping on fixed random batches."""

    def __init__(self, optimizer: str, config: dict[str, int], batch: int) -> None:
        torch.manual_seed(0)
        module = PretrainModule(GPTConfig(**config), optimizer=optimizer, decay_steps=10_000)
        module.model = self.model = GPT(module.config)
        self.optimizer = module.configure_optimizers()["optimizer"]
        self.tokens = torch.randint(0, config["vocab_size"], (batch, config["block_size"] + 1))

    def backward(self) -> None:
        logits = self.model(self.tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()

    def timed(self, steps: int, whole_step: bool) -> dict[str, float]:
        """Seconds a step: the whole training step, or the optimizer step alone (on kept gradients)."""
        if not whole_step:
            self.backward()
        spent_wall = spent_cpu = 0.0
        for _ in range(steps):
            wall, cpu = clock()
            if whole_step:
                self.optimizer.zero_grad()
                self.backward()
            self.optimizer.step()
            end_wall, end_cpu = clock()
            spent_wall, spent_cpu = spent_wall + end_wall - wall, spent_cpu + end_cpu - cpu
        return {"wall": spent_wall / steps, "cpu": spent_cpu / steps}


def main() -> None:
    parser = base_parser("muon", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per measurement")
    args = parser.parse_args()
    set_threads(args.threads)
    config, batch = (SMOKE, 2) if args.smoke else (DEFAULT, 16)
    steps, pairs = (2, 1) if args.smoke else (args.steps, args.pairs)
    adamw, muon = Run("adamw", config, batch), Run("muon", config, batch)
    for run in (adamw, muon):  # warm-up: first-call allocations and lazy state
        run.timed(2, whole_step=True)
    results: dict[str, Any] = {}
    for name, whole in (("optimizer step", False), ("training step", True)):
        measured = paired(lambda: adamw.timed(steps, whole), lambda: muon.timed(steps, whole), pairs)  # noqa: B023
        results[name] = compare_clocks("adamw", "muon", measured, "s/step")
    rows = [comparison_row(f"{name}, {key} ms", result[key], scale=1000)
            for name, result in results.items() for key in ("cpu", "wall")]
    table = print_table(["what", "AdamW", "Muon", "Muon / AdamW"], rows)
    write_json(args.out, {
        "benchmark": "muon", "smoke": args.smoke, "model": config, "batch": batch, "steps": steps,
        "results": results, "table": table, "machine": machine_info(args.threads),
    })


if __name__ == "__main__":
    main()
