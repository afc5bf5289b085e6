"""A decoder-only transformer language model in plain PyTorch (no Lightning imports).

The default is a Llama-style block (pre-norm RMSNorm, rotary position embeddings, SwiGLU MLP, no
biases, optional grouped-query attention): it is what current open models use, it trains stably
without tuning, and Llama-family checkpoints map onto it weight for weight. The same config can
describe a GPT-2 block (LayerNorm with bias, learned positions, GELU MLP) so GPT-2 checkpoints map
onto it too. Attention runs through ``scaled_dot_product_attention`` (flash/memory-efficient kernels
where the device has them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

import torch
import torch.nn.functional as F
from torch import nn

from lightning_train.errors import UserInputError
from lightning_train.models.generate import decode
from lightning_train.models.init import draw_seed, seeded_normal_, tensor_seed

VOCAB_MULTIPLE = 64  # a vocabulary taken from the data is padded to this: faster matmuls (nanoGPT, LitGPT)


@dataclass
class GPTConfig:
    """Shape and flavour of the model. The defaults are a small Llama-style model.

    Example (the Llama-style default and a GPT-2 block of the same width):

        >>> from lightning_train import GPT, GPTConfig
        >>> llama = GPTConfig(vocab_size=258, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
        >>> llama.head_dim, llama.intermediate_size  # SwiGLU: ~8/3 of n_embd, rounded up to 32
        (16, 192)
        >>> gpt2 = GPTConfig(
        ...     vocab_size=258, n_layer=2, n_head=4, n_embd=64, norm="layernorm", position="learned",
        ...     mlp="gelu", bias=True,
        ... )
        >>> gpt2.intermediate_size, GPT(gpt2).num_params() > GPT(llama).num_params()
        (256, True)
    """

    vocab_size: int | None = None  # None: the data's, padded (PretrainModule/FinetuneModule fill it in)
    block_size: int = 256  # longest context the model accepts
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # < n_head: grouped-query attention; None: same as n_head
    n_embd: int = 256
    intermediate_size: int | None = None  # MLP width; None: 4*n_embd (gelu) or ~8/3*n_embd (swiglu)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    position: Literal["rope", "learned"] = "rope"
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _check_ranges(self)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_embd % self.n_head:
            raise UserInputError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise UserInputError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if self.position == "rope" and self.head_dim % 2:  # rotary embeddings rotate pairs of dimensions
            raise UserInputError(
                f"n_embd={self.n_embd} / n_head={self.n_head} gives heads of {self.head_dim} dimensions; "
                "position='rope' needs an even number: change n_embd or n_head"
            )
        if self.intermediate_size is None:
            if self.mlp == "gelu":
                self.intermediate_size = 4 * self.n_embd
            else:  # 2/3 of 4*n_embd keeps the parameter count of a GELU MLP; round up to 32
                self.intermediate_size = 32 * math.ceil(8 * self.n_embd / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _check_ranges(config: GPTConfig) -> None:
    """Refuse a value no model can have (a traceback, or a model of empty tensors, later on)."""
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size"):
        value = getattr(config, name)
        if value is not None and value < 1:  # None: filled in (see the fields' comments)
            raise UserInputError(f"{name}={value} must be at least 1")
    if not 0 <= config.dropout < 1:
        raise UserInputError(f"dropout={config.dropout} is outside [0, 1); use 0.0 for none, or e.g. 0.1")
    defaults = {field.name: field.default for field in fields(config)}
    for name in ("rope_theta", "norm_eps", "init_std"):
        value = getattr(config, name)
        if not 0 < value < math.inf:  # also refuses nan
            raise UserInputError(f"{name}={value} must be positive and finite (default {defaults[name]})")
    for name, hint in get_type_hints(GPTConfig).items():  # norm, position, mlp: Python does not check them
        value = getattr(config, name)
        if get_origin(hint) is Literal and value not in get_args(hint):
            raise UserInputError(f"{name}={value!r} is not one of {', '.join(get_args(hint))}")


def padded_vocab_size(vocab_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``VOCAB_MULTIPLE``: the rows past the tokenizer's are
    never inputs nor targets, and ``GPT.generate`` never samples them.

        >>> from lightning_train.models.gpt import padded_vocab_size
        >>> padded_vocab_size(258), padded_vocab_size(512), padded_vocab_size(50257)
        (320, 512, 50304)
    """
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary embeddings (the "rotate half" layout used by Llama checkpoints)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta = config.head_dim, config.block_size, config.rope_theta
        # Non-persistent: derived from the config, so not in checkpoints; rebuilt by reset_parameters()
        # after a strategy materialises the model from the meta device.
        self.register_buffer("cos", torch.empty(self.max_len, self.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(self.max_len, self.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device if self.cos.device.type != "meta" else None
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        )
        angles = torch.outer(torch.arange(self.max_len, device=device).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables of positions ``start .. start + length - 1``, each (length, head_dim)."""
        return self.cos[start : start + length], self.sin[start : start + length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, heads, T, head_dim) by the angles whose cos/sin are given."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # x is bf16/fp16 under autocast
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.qkv = nn.Linear(
            config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias
        )
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | None, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        past = cache.past_length(self.layer) if cache is not None else 0
        if rope is not None:  # looked up here, where x holds whole sequences (sequence parallelism too)
            tables = rope(past, T)
            q, k = apply_rotary(q, *tables), apply_rotary(k, *tables)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        # One new token attends to every cached position; a prompt (T > 1) needs the causal mask, and
        # T > 1 tokens after cached ones (tensor-parallel decoding) the causal mask shifted by the past.
        mask = None
        if past and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        dropout = self.config.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=T > 1 and mask is None, dropout_p=dropout,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # -1: the local heads under TP


class MLP(nn.Module):
    """SwiGLU, ``down(silu(gate(x)) * up(x))``, or GELU, ``down(gelu(up(x)))``. gate and up are two
    layers, as in Llama checkpoints: one fused layer split in two copies its gradient in backward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.intermediate_size
        gated = config.mlp == "swiglu"
        self.gate = nn.Linear(config.n_embd, hidden, bias=config.bias) if gated else None
        self.up = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.down = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    Example (the block keeps the shape of the residual stream):

        >>> import torch
        >>> from lightning_train.models import GPT, Block, GPTConfig
        >>> config = GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=32)
        >>> block, rope = Block(config, layer=0), GPT(config).rope
        >>> block(torch.randn(2, 8, 32), rope).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = Attention(config, layer)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, cache))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """The language model: token embedding, ``n_layer`` ``Block``s, a final norm and the lm_head.

    Example:

        >>> import torch
        >>> from lightning_train import GPT, GPTConfig
        >>> model = GPT(GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=32))
        >>> model(torch.zeros(1, 8, dtype=torch.long)).shape  # (batch, tokens, vocabulary) logits
        torch.Size([1, 8, 258])
        >>> model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, temperature=0).shape  # greedy
        torch.Size([1, 7])
        >>> model.num_params() == sum(p.numel() for p in model.parameters())  # the tied lm_head once
        True
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is None; set it to the tokenizer's vocabulary size")
        self.config = config
        # taken first: building the layers on a device draws from the global generator, on meta not
        self.init_seed = draw_seed()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_embed = (
            nn.Embedding(config.block_size, config.n_embd) if config.position == "learned" else None
        )
        self.rope = RotaryEmbedding(config) if config.position == "rope" else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) weights, zero biases, and residual output projections scaled down by
        sqrt(2 * n_layer) so the residual stream's variance does not grow with depth (GPT-2).

        Each weight is drawn from its own generator, seeded by ``init_seed`` and its name
        (``models.init``), so a model built on the meta device and materialised shard by shard under
        any layout (a strategy calls this after ``to_empty``) gets one process's values; meta
        tensors are skipped."""
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if self.config.tie_embeddings and name == "lm_head":  # the embedding's, drawn once
                    continue
                scaled = name.endswith(("attn.proj", "mlp.down"))
                scaled_std = std / math.sqrt(2 * self.config.n_layer) if scaled else std
                seeded_normal_(module.weight, scaled_std, tensor_seed(self.init_seed, f"{name}.weight"))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                seeded_normal_(module.weight, std, tensor_seed(self.init_seed, f"{name}.weight"))
            elif isinstance(module, (nn.RMSNorm, nn.LayerNorm, RotaryEmbedding)):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits of shape (B, T, vocab_size) for token ids ``idx`` of shape (B, T).

        A pipeline stage holds some of the blocks only (``lightning_train.strategies.pipeline``): a later
        stage takes the hidden states (B, T, n_embd) of the stage before as ``idx``, and a stage without
        the ``lm_head`` returns its hidden states."""
        x = self.embed_tokens(idx, cache) if idx.dim() == 2 else idx
        for block in self.blocks:
            x = block(x, self.rope, cache)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))

    def embed_tokens(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The residual stream's start: token (and learned position) embeddings of ``idx`` (B, T)."""
        start = cache.length if cache is not None else 0
        T = idx.shape[1]
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds the model's block_size={self.config.block_size}; "
                "use shorter sequences or a model with a larger block_size"
            )
        x = self.embed(idx)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(start, start + T, device=idx.device))
        return self.dropout(x)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). ``non_embedding`` drops the token and position tables
        but keeps an untied lm_head (a Linear), as transformers' ``num_parameters(exclude_embeddings=True)``
        does."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
            n -= self.pos_embed.weight.numel() if self.pos_embed is not None else 0
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 per weight that multiplies (every weight
        but the table lookups; a tied lm_head counts) plus attention's 12 * n_layer * n_embd * seq_len
        (PaLM, appendix B)."""
        c = self.config
        seq_len = seq_len or c.block_size
        # counted from the config, not the parameters: the same for a pipeline stage or a sharded model
        norm = c.n_embd * (2 if c.norm == "layernorm" and c.bias else 1)
        qkv_width = (c.n_head + 2 * c.n_kv_head) * c.head_dim
        mlp_layers = 3 if c.mlp == "swiglu" else 2
        block = c.n_embd * qkv_width + c.n_embd**2 + mlp_layers * c.n_embd * c.intermediate_size + 2 * norm
        if c.bias:
            block += qkv_width + c.n_embd + (mlp_layers - 1) * c.intermediate_size + c.n_embd
        weights = c.n_layer * block + norm + c.vocab_size * c.n_embd  # + final norm, lm_head
        return 6 * weights + 12 * c.n_layer * c.n_embd * seq_len

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_id: int | None = None,
        use_cache: bool = True,
        tokenizer_vocab_size: int | None = None,
    ) -> torch.Tensor:
        """Continue ``idx`` (B, T) by up to ``max_new_tokens``. temperature 0 is greedy; with
        ``eos_id``, a row that produced it is padded with eos_id and generation ends when all did.
        With ``tokenizer_vocab_size``, only ids below it are generated (not a padded vocabulary's rest).
        The loop is ``models.generate.decode``, shared with generation on a sharded model."""
        cache = KVCache(self.config.n_layer) if use_cache else None

        def last_logits(idx: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
            # with a cache, only the tokens it does not hold yet
            return self(idx[:, cache.length :] if cache is not None else idx, cache)[:, -1]

        return decode(
            last_logits, idx, max_new_tokens, self.config.block_size, cache, temperature, top_k, eos_id,
            tokenizer_vocab_size,
        )
