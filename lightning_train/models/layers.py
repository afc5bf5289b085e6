"""The layers of the decoder block: norms, attention and the MLP, each configured by ``GPTConfig``
(``gpt.py`` composes them into ``Block`` and ``GPT``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_train.models.config import GPTConfig
from lightning_train.models.documents import Documents
from lightning_train.models.flex import flex_packed_attention
from lightning_train.models.kv_cache import KVCache
from lightning_train.models.rope import RotaryEmbedding, apply_rotary


def make_norm(config: GPTConfig, width: int | None = None) -> nn.Module:
    """``config.norm`` over the last ``width`` values (default ``n_embd``)."""
    width = width or config.n_embd
    if config.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    if config.norm == "offset_rmsnorm":
        return OffsetRMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps, bias=config.bias)


class OffsetRMSNorm(nn.RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, computed in fp32; the weight starts at 0."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer, self.window = config, layer, config.window(layer)
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        qkv_width = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.qkv = nn.Linear(config.n_embd, qkv_width, bias=config.bias or config.qkv_bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm != "none":
            per_head = config.qk_norm == "head"
            q_width, k_width = (1, 1) if per_head else (self.n_head, self.n_kv_head)
            self.q_norm = make_norm(config, q_width * self.head_dim)
            self.k_norm = make_norm(config, k_width * self.head_dim)

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding | None, cache: KVCache | None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """``documents``: packed rows, whose examples attend within themselves at their own positions."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        if self.config.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.config.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        past = cache.past_length(self.layer) if cache is not None else 0
        if rope is not None:  # looked up here, where x holds whole sequences (sequence parallelism too)
            tables = rope(past, T) if documents is None else documents.rope_tables(rope)
            q, k = apply_rotary(q, *tables), apply_rotary(k, *tables)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        scale = (self.config.query_scale_dim or self.head_dim) ** -0.5
        softcap = self.config.attn_softcap
        if documents is not None and documents.flex:  # packed rows, the other examples' tiles skipped
            y = flex_packed_attention(q, k, v, documents.block_mask(self.window), scale, softcap)
        else:
            y = self._masked_attention(q, k, v, past, documents, scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # -1: the local heads under TP

    def _masked_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, documents: Documents | None,
        scale: float,
    ) -> torch.Tensor:
        """SDPA with a boolean mask (or ``is_causal``), or the written-out soft-capped scores."""
        T = q.shape[2]
        if documents is None:  # no mask built for unpacked rows: is_causal picks the fast kernels
            mask = attention_mask(past, T, self.window, q.device)
        else:
            mask = documents.mask(self.window)
        dropout = self.config.dropout if self.training else 0.0
        if self.config.attn_softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=T > 1 and mask is None, dropout_p=dropout,
                scale=scale, enable_gqa=self.n_kv_head != self.n_head,
            )
        # sdpa has no soft-capping: the scores written out (Gemma 2's eager attention)
        if mask is None and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
        return softcapped_attention(q, k, v, mask, scale, self.config.attn_softcap, dropout)


def attention_mask(past: int, T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of the ``past + T`` keys each of the ``T`` queries sees, or None where ``is_causal`` says it
    (a prompt) or nothing needs masking (one new token and a window that covers the past). T > 1 tokens
    after cached ones (tensor-parallel decoding) need the causal mask shifted by the past; a sliding
    window hides the keys ``window`` or more positions back, as Mistral's and Qwen2's attention does."""
    if window is None or past + T <= window:
        return torch.ones(T, past + T, dtype=torch.bool, device=device).tril(past) if past and T > 1 else None
    query = torch.arange(past, past + T, device=device)[:, None]
    key = torch.arange(past + T, device=device)
    return (key <= query) & (key > query - window)


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float,
    dropout: float,
) -> torch.Tensor:
    """Attention whose scores are squashed into (-cap, cap) by ``cap * tanh(scores / cap)``."""
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each key/value head serves `groups`
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh(q @ k.transpose(-2, -1) * scale / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.dropout(scores.float().softmax(dim=-1).type_as(q), p=dropout)
    return weights @ v


class MLP(nn.Module):
    """SwiGLU, ``down(silu(gate(x)) * up(x))``, GeGLU, ``down(gelu_tanh(gate(x)) * up(x))`` (Gemma), or
    GELU, ``down(gelu(up(x)))``. gate and up are two layers, as in Llama checkpoints: one fused layer
    split in two copies its gradient in backward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.intermediate_size
        gated = config.mlp in ("swiglu", "geglu")
        self.activation = {"swiglu": F.silu, "gelu_exact": F.gelu}.get(config.mlp, gelu_tanh)
        self.gate = nn.Linear(config.n_embd, hidden, bias=config.bias) if gated else None
        self.up = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.down = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(self.activation(self.gate(x)) * self.up(x))
        return self.down(self.activation(self.up(x)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
