"""A decoder-only transformer language model in plain PyTorch (no Lightning imports).

The default is a Llama-style block (pre-norm RMSNorm, rotary position embeddings, SwiGLU MLP, no
biases, optional grouped-query attention): it is what current open models use, it trains stably
without tuning, and Llama-family checkpoints map onto it weight for weight. The same config can
describe a GPT-2 block (LayerNorm with bias, learned positions, GELU MLP) so GPT-2 checkpoints map
onto it too. Attention runs through ``scaled_dot_product_attention`` (flash/memory-efficient kernels
where the device has them); packed rows through FlexAttention on CUDA (``models/flex.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_train.models.config import GPTConfig
from lightning_train.models.documents import Documents
from lightning_train.models.flex import uses_flex
from lightning_train.models.generate import decode
from lightning_train.models.init import draw_seed, seeded_normal_, tensor_seed
from lightning_train.models.kv_cache import KVCache
from lightning_train.models.layers import MLP, Attention, make_norm
from lightning_train.models.rope import RotaryEmbedding, cache_needs_recompute

VOCAB_MULTIPLE = 64  # a vocabulary taken from the data is padded to this: faster matmuls (nanoGPT, LitGPT)


def padded_vocab_size(vocab_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``VOCAB_MULTIPLE``: the rows past the tokenizer's are
    never inputs nor targets, and ``GPT.generate`` never samples them.

        >>> from lightning_train.models.gpt import padded_vocab_size
        >>> padded_vocab_size(258), padded_vocab_size(512), padded_vocab_size(50257)
        (320, 512, 50304)
    """
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


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
        pre, post = config.block_norms in ("pre", "both"), config.block_norms in ("post", "both")
        self.attn_norm = make_norm(config) if pre else nn.Identity()
        self.attn = Attention(config, layer)
        self.attn_post_norm = make_norm(config) if post else nn.Identity()  # on the sublayer output
        self.mlp_norm = make_norm(config) if pre else nn.Identity()
        self.mlp = MLP(config)
        self.mlp_post_norm = make_norm(config) if post else nn.Identity()
        self.parallel_residual = config.parallel_residual
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding | None,
        cache: KVCache | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        # documents by keyword: tensor parallelism's input plan covers (x, rope, cache) only
        attention = self.attn(self.attn_norm(x), rope, cache, documents=documents)
        attended = x + self.dropout(self.attn_post_norm(attention))
        source = x if self.parallel_residual else attended  # parallel: both sublayers read the block's input
        return attended + self.dropout(self.mlp_post_norm(self.mlp(self.mlp_norm(source))))


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
        rope = config.position == "rope"
        self.rope = RotaryEmbedding(
            config.rotary_dim, config.block_size, config.rope_theta, config.rope_scaling
        ) if rope else None
        self.local_rope = RotaryEmbedding(  # Gemma 3: sliding-window layers have a rope base of their own
            config.rotary_dim, config.block_size, config.local_rope_theta
        ) if rope and config.local_rope_theta else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = make_norm(config)
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
            elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
        self.init_buffers()

    def init_buffers(self) -> None:
        """Compute the rotary tables: derived from the config, never in a checkpoint (loading weights
        into a model materialised from the meta device leaves them to this)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters()

    def forward(
        self, idx: torch.Tensor, cache: KVCache | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of shape (B, T, vocab_size) for token ids ``idx`` of shape (B, T).

        ``position_ids`` (B, T): packed rows, several examples a row, each counting its positions from 0;
        each attends only within itself (``models.documents``). None: one sequence a row.

        A pipeline stage holds some of the blocks only (``lightning_train.strategies.pipeline``): a later
        stage takes the hidden states (B, T, n_embd) of the stage before as ``idx``, and a stage without
        the ``lm_head`` returns its hidden states."""
        if position_ids is not None and (cache is not None or position_ids.shape != idx.shape[:2]):
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} must match the tokens' "
                f"{tuple(idx.shape[:2])}, without a KV cache (packed rows are for training)"
            )
        documents = None
        if position_ids is not None:
            documents = Documents(position_ids, flex=uses_flex(self.config, position_ids.device))
        x = self.embed_tokens(idx, cache, position_ids) if idx.dim() == 2 else idx
        for block in self.blocks:
            local = self.local_rope is not None and block.attn.window is not None
            x = block(x, self.local_rope if local else self.rope, cache, documents=documents)
        if self.lm_head is None:
            return x
        logits, cap = self.lm_head(self.norm(x)), self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def embed_tokens(
        self, idx: torch.Tensor, cache: KVCache | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The residual stream's start: token (and learned position) embeddings of ``idx`` (B, T)."""
        start = cache.length if cache is not None else 0
        T = idx.shape[1]
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds the model's block_size={self.config.block_size}; "
                "use shorter sequences or a model with a larger block_size"
            )
        x = self.embed(idx)
        if self.config.embed_scale:  # in the embeddings' dtype, as Gemma rounds it
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        if self.pos_embed is not None:
            if position_ids is None:
                position_ids = torch.arange(start, start + T, device=idx.device)
            x = x + self.pos_embed(position_ids)
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
        mlp_layers = 3 if c.mlp in ("swiglu", "geglu") else 2
        block = (c.n_embd * qkv_width + c.n_head * c.head_dim * c.n_embd
                 + mlp_layers * c.n_embd * c.intermediate_size + 2 * norm)
        if c.bias:
            block += qkv_width + c.n_embd + (mlp_layers - 1) * c.intermediate_size + c.n_embd
        block += qkv_width * (c.qkv_bias and not c.bias) + 2 * norm * (c.block_norms == "both")
        qk_norms = {"none": 0, "head": 2 * c.head_dim, "projection": (c.n_head + c.n_kv_head) * c.head_dim}
        block += qk_norms[c.qk_norm]
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
            scaling = self.config.rope_scaling
            if cache is not None and cache_needs_recompute(scaling, cache.length, idx.shape[1]):
                cache.crop(0)
            # with a cache, only the tokens it does not hold yet
            return self(idx[:, cache.length :] if cache is not None else idx, cache)[:, -1]

        return decode(
            last_logits, idx, max_new_tokens, self.config.block_size, cache, temperature, top_k, eos_id,
            tokenizer_vocab_size,
        )
