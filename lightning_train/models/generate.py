"""Generation for many prompts at once: ``generate_batched`` groups token-id prompts by length (our GPT
has no padding mask) and decodes each group with ``GPT.generate``. Used by ``python -m lightning_train
generate`` and by ``FinetuneModule``'s ``val/exact_match``."""

from __future__ import annotations

from collections import defaultdict

import torch

from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT


@torch.no_grad()
def generate_batched(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    top_k: int | None = None,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    use_cache: bool = True,
    tokenizer_vocab_size: int | None = None,
) -> list[list[int]]:
    """Continuations of token-id ``prompts`` (in their order), cut before the first ``eos_id``; with
    ``tokenizer_vocab_size``, of ids below it only (a padded vocabulary's rows past it are never drawn).

    Our GPT has no padding mask, so prompts are batched with others of the same length."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise UserInputError(f"prompt {i} is empty; give at least one token")
        by_length[len(prompt)].append(i)
    completions: list[list[int]] = [[] for _ in prompts]
    for length, indices in sorted(by_length.items()):
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            idx = torch.tensor([prompts[i] for i in chunk], dtype=torch.long, device=device)
            out = model.generate(
                idx, max_new_tokens, temperature=temperature, top_k=top_k, eos_id=eos_id, use_cache=use_cache,
                tokenizer_vocab_size=tokenizer_vocab_size,
            )
            for i, row in zip(chunk, out[:, length:].tolist(), strict=True):
                completions[i] = row[: row.index(eos_id)] if eos_id in row else row
    return completions
