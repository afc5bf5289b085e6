"""The KV cache of incremental decoding: keys and values of past positions, one entry per block."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of past positions for incremental decoding, one entry per block.

    Example (decoding one token at a time with the cache gives the logits of the full sequence):

        >>> import torch
        >>> from lightning_train.models import GPT, GPTConfig, KVCache
        >>> model = GPT(GPTConfig(vocab_size=258, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
        >>> tokens = torch.tensor([[5, 6, 7, 8]])
        >>> cache = KVCache(model.config.n_layer)
        >>> first = model(tokens[:, :3], cache)  # the prompt, once
        >>> last = model(tokens[:, 3:], cache)  # then only the new token
        >>> cache.length, torch.allclose(last[:, -1], model(tokens)[:, -1], atol=1e-5)
        (4, True)
    """

    def __init__(self, n_layer: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Forget the positions from ``length`` on (a forward that computed more positions than it keeps)."""
        self.keys = [None if k is None else k[:, :, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :, :length] for v in self.values]

    @property
    def length(self) -> int:
        return self.past_length(0)

    def past_length(self, layer: int) -> int:
        """Positions already cached for ``layer`` (before this forward's update)."""
        keys = self.keys[layer]
        return 0 if keys is None else keys.shape[2]
