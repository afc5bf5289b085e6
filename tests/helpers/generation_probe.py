"""``GenerationProbe`` (importable as ``generation_probe`` with ``tests/helpers`` on PYTHONPATH): after each
validation outside the sanity check, the greedy and the sampled (seeded) completions of the data module's
held-out prompts, generated on the model as the strategy laid it out (``ParallelStrategy.generator()``, as a
user samples a model too big for one device where it trains), written to
``<default_root_dir>/completions-rank<R>.json``. With ``reference`` (such a file of another run), also
``FinetuneModule.exact_match`` of the prompts with that run's greedy completions as responses, every
second one cut short (1.0 where generation matches theirs would be 0.5)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch

from lightning_train.models.generate import generate_batched


class GenerationProbe(L.Callback):
    def __init__(self, reference: str | None = None) -> None:
        self.reference = reference

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        data = trainer.datamodule
        prompts = [prompt for prompt, _ in data.eval_examples]
        sharded = getattr(trainer.strategy, "generator", lambda: None)()
        model = sharded or pl_module.model
        pl_module.model.eval()
        common = {"eos_id": data.eos_id, "tokenizer_vocab_size": data.tokenizer.vocab_size,
                  "device": pl_module.device}
        # as long as exact_match generates for responses this long
        greedy = generate_batched(model, prompts, pl_module.hparams.eval_max_new_tokens, **common)
        torch.manual_seed(5)  # on every rank: the rank that draws has one process's generator state
        sampled = generate_batched(model, prompts, 8, temperature=0.9, top_k=50, **common)
        report = {"greedy": greedy, "sampled": sampled, "sharded": sharded is not None}
        if self.reference is not None:
            responses = json.loads(Path(self.reference).read_text())["greedy"]
            responses = [r if i % 2 == 0 else r[:-1] for i, r in enumerate(responses)]
            examples = list(zip(prompts, responses, strict=True))
            report["exact_match"] = pl_module.exact_match(examples, data.eos_id)
        out = Path(trainer.default_root_dir, f"completions-rank{trainer.global_rank}.json")
        out.write_text(json.dumps(report))
