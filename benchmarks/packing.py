"""SFT packing against padding on the default fine-tuning task (``configs/finetune-tiny.yaml``: the
generated snake_case -> CamelCase task, the model of ``configs/pretrain-tiny.yaml``): the share of padding
tokens in the batches, and training throughput in real (non-padding) tokens per second.

Padded: the config's data, 32 examples a batch padded to the batch's longest (``seq_len`` 64). Packed:
``SFTDataModule(packing=True)``, rows of 64 tokens (the config's ``seq_len``) and of 128 (the model's
``block_size``), with as many rows a batch as give about the padded batch's tokens. Each side trains
(the loader's next batch, forward, backward, AdamW step) from the same weights; paired A/B in one
process, alternating order. A token is real when it is not the pad id (no example holds it).

    python benchmarks/packing.py            # 5 pairs of 10 steps per side, 1 thread
    python benchmarks/packing.py --smoke    # seconds; checks the script works
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    base_parser,
    clock,
    compare_clocks,
    machine_info,
    paired,
    print_table,
    ratio_cell,
    set_threads,
    write_json,
)

from lightning_train import SFTDataModule
from lightning_train.models.gpt import GPT, GPTConfig

MODEL = {"vocab_size": 320, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}  # pretrain-tiny's
SMOKE_MODEL = {"vocab_size": 320, "block_size": 128, "n_layer": 1, "n_head": 2, "n_embd": 32}
PADDED = "padded, seq_len 64, 32 examples a batch"
PACKED = {  # name -> SFTDataModule arguments
    "packed, rows of 64, 32 rows a batch": {"seq_len": 64, "batch_size": 32},
    "packed, rows of 128, 16 rows a batch": {"seq_len": 128, "batch_size": 16},
}


class Side:
    """A model, its optimizer and an endless stream of one data setting's training batches."""

    def __init__(self, data: dict[str, Any], model: dict[str, int]) -> None:
        self.data = SFTDataModule(**data)
        self.data.setup("fit")
        self.pad_id = self.data.tokenizer.pad_id
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**model))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batches = self._stream()

    def _stream(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield from self.data.train_loader()

    def padding_fraction(self) -> float:
        """The share of padding tokens in one epoch's batches."""
        pad = total = 0
        for batch in self.data.train_loader():
            pad += int((batch["input_ids"] == self.pad_id).sum())
            total += batch["input_ids"].numel()
        return pad / total

    def timed(self, steps: int) -> dict[str, float]:
        """Real tokens per second of ``steps`` training steps, by the CPU and by the wall clock."""
        real = 0
        wall, cpu = clock()
        for _ in range(steps):
            batch = next(self.batches)
            logits = self.model(batch["input_ids"], position_ids=batch.get("position_ids"))
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            real += int((batch["input_ids"] != self.pad_id).sum())
        end_wall, end_cpu = clock()
        return {"cpu": real / (end_cpu - cpu), "wall": real / (end_wall - wall)}


def main() -> None:
    parser = base_parser("packing", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per side per pair")
    args = parser.parse_args()
    set_threads(args.threads)
    model, steps, pairs = (SMOKE_MODEL, 2, 1) if args.smoke else (MODEL, args.steps, args.pairs)
    padded = Side({"seq_len": 64, "batch_size": 32}, model)  # configs/finetune-tiny.yaml's data
    padded.timed(2)  # warm-up: first-call allocations
    results: dict[str, Any] = {PADDED: {"padding_fraction": padded.padding_fraction()}}
    rows = []
    for name, data in PACKED.items():
        packed = Side({**data, "packing": True}, model)
        packed.timed(2)
        measured = paired(lambda: padded.timed(steps), lambda: packed.timed(steps), pairs)  # noqa: B023
        tokens_per_s = compare_clocks("padded", "packed", measured, "real tokens/s")
        results[name] = {"padding_fraction": packed.padding_fraction(), "real_tokens_per_s": tokens_per_s}
        for key in ("cpu", "wall"):
            result = tokens_per_s[key]
            rows.append([name, key, f"{results[PADDED]['padding_fraction']:.3f}",
                         f"{results[name]['padding_fraction']:.3f}", result["a_stats"]["median"],
                         result["b_stats"]["median"], ratio_cell(result["ratio_b_over_a"])])
    table = print_table(["packed side", "clock", "padding, padded", "padding, packed",
                         "real tokens/s, padded", "real tokens/s, packed", "packed / padded"], rows)
    write_json(args.out, {
        "benchmark": "packing", "smoke": args.smoke, "model": model, "steps": steps, "padded": PADDED,
        "results": results, "table": table, "machine": machine_info(args.threads),
    })


if __name__ == "__main__":
    main()
