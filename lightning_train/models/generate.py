"""Generation: ``decode``, the one decoding loop (greedy or sampled, KV cache, eos cutoff), and
``generate_batched``, which groups token-id prompts by length (our GPT has no padding mask) and decodes each
group. ``GPT.generate`` runs ``decode`` on one model; ``strategies.generation.ShardedGenerator`` runs it on
a model split by tensor and pipeline parallelism. Used by ``python -m lightning_train generate`` and by
``FinetuneModule``'s ``val/exact_match``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from lightning_train.errors import UserInputError

# (tokens so far (B, T), the KV cache or None) -> the last position's logits (B, vocab), or None on a rank
# that does not pick the token (a sharded model's)
LastLogits = Callable[[torch.Tensor, Any], "torch.Tensor | None"]
# (this rank's next tokens (B, 1), or None, the tokens so far) -> the next tokens every rank agrees on
Share = Callable[["torch.Tensor | None", torch.Tensor], torch.Tensor]


class Generates(Protocol):
    """What ``generate_batched`` decodes with: a ``GPT`` or a ``ShardedGenerator``."""

    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
        eos_id: int | None = None, use_cache: bool = True, tokenizer_vocab_size: int | None = None,
    ) -> torch.Tensor: ...


def pick_token(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """The next token (B, 1) for last-position ``logits`` (B, V): the argmax at temperature 0, else a draw
    from torch's default generator, over the ``top_k`` likeliest tokens if given."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


@torch.no_grad()
def decode(
    last_logits: LastLogits,
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    cache: Any = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    tokenizer_vocab_size: int | None = None,
    share: Share | None = None,
) -> torch.Tensor:
    """Continue ``idx`` (B, T) by up to ``max_new_tokens`` tokens (``GPT.generate`` says how); ``cache`` is
    ``last_logits``'s. ``share`` makes every rank of a sharded model take the same token."""
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        if idx.shape[1] >= block_size:
            break
        logits = last_logits(idx, cache)
        next_id = None if logits is None else pick_token(
            logits[:, :tokenizer_vocab_size].float(), temperature, top_k
        )
        if share is not None:
            next_id = share(next_id, idx)
        if eos_id is not None:
            next_id = next_id.masked_fill(finished.unsqueeze(1), eos_id)
            finished |= next_id.squeeze(1) == eos_id
        idx = torch.cat([idx, next_id], dim=1)
        if eos_id is not None and bool(finished.all()):
            break
    return idx


@torch.no_grad()
def generate_batched(
    model: Generates,
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
    ``model`` is a ``GPT``, or a ``ShardedGenerator`` called on every rank with the same prompts.

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
