"""Test helpers: a user's own transformers model under ParallelStrategy (importable as ``hf_llama`` with
``tests/helpers`` on PYTHONPATH). Tiny random Llamas, built from a config (nothing is downloaded).

``LlamaPretrain``: ``PretrainModule.build_model`` returning a ``LlamaForCausalLM``. ``OwnLlamaModule``: a
plain LightningModule holding one, with its own training step and optimizer, as a user writes it.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_train import PretrainModule


def tiny_llama(layers: int = 4) -> LlamaForCausalLM:
    """4 query heads, 2 key/value heads (GQA), untied embeddings, 64 tokens."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
    )
    return LlamaForCausalLM(config)


class LlamaPretrain(PretrainModule):
    def build_model(self) -> torch.nn.Module:
        return tiny_llama()


class OwnLlamaModule(L.LightningModule):
    def __init__(self, learning_rate: float = 3e-3) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_llama()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)
