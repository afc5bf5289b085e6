"""``GPTConfig``: the shape and options of the model, checked as it is made. One configurable block
serves every family (docs/models.md lists which options each uses)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from lightning_train.errors import UserInputError
from lightning_train.models.rope import check_scaling


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
    norm: Literal["rmsnorm", "layernorm", "offset_rmsnorm"] = "rmsnorm"  # offset: (1 + weight), Gemma's
    position: Literal["rope", "learned"] = "rope"
    mlp: Literal["swiglu", "gelu", "geglu", "gelu_exact"] = "swiglu"  # geglu: gated tanh-GELU (Gemma),
    # gelu_exact: GELU by erf rather than its tanh approximation (GPT-NeoX/Pythia)
    bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The options of the open model families (docs/models.md names each family's):
    head_size: int | None = None  # the width of a head (head_dim); None: n_embd // n_head (Qwen3, Gemma)
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2); `bias` puts them on every layer
    # RMSNorm of q and k before rope: of each head (Qwen3), or of the whole projection (OLMo-2)
    qk_norm: Literal["none", "head", "projection"] = "none"
    block_norms: Literal["pre", "post", "both"] = "pre"  # norms before the sublayers, after them (OLMo-2)
    rope_scaling: dict[str, Any] | None = None  # models.rope.SCALINGS: llama3, linear, yarn, longrope (Phi-3)
    sliding_window: int | None = None  # a position attends to itself and the window - 1 before it
    sliding_window_layers: list[int] | None = None  # the layers with the window; None: all of them
    local_rope_theta: float | None = None  # the rope base of the sliding-window layers (Gemma 3)
    embed_scale: bool = False  # token embeddings times sqrt(n_embd) (Gemma)
    query_scale_dim: float | None = None  # scores scaled by its -0.5 power; None: head_dim (Gemma 2/3)
    attn_softcap: float | None = None  # scores squashed into (-cap, cap) by cap * tanh(s / cap) (Gemma 2)
    logit_softcap: float | None = None  # the same on the output logits (Gemma 2)
    rope_fraction: float = 1.0  # the share of each head's dimensions that rope rotates (GPT-NeoX: 0.25)
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm(x)), one sum (GPT-NeoX)
    family: str | None = None  # the Hugging Face model_type it was read from: export writes the same
    # packed rows' attention (models/flex.py): SDPA with a mask; auto: FlexAttention on CUDA (opt-in until
    # this project has run it on a GPU), flex: FlexAttention everywhere
    packed_attention: Literal["auto", "sdpa", "flex"] = "sdpa"

    def __post_init__(self) -> None:
        _check_ranges(self)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        split = f"n_embd={self.n_embd} / n_head={self.n_head}"
        set_by = f"head_size={self.head_size}" if self.head_size else split
        if self.head_size is None and self.n_embd % self.n_head:
            raise UserInputError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise UserInputError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        rotated = f" ({self.rotary_dim} rotated)" if self.rope_fraction < 1 else ""
        if self.position == "rope" and self.rotary_dim % 2:  # rotary embeddings rotate pairs of dimensions
            raise UserInputError(
                f"{set_by} gives heads of {self.head_dim} dimensions{rotated}; position='rope' needs an even "
                "number: change n_embd, n_head, head_size or rope_fraction"
            )
        if self.packed_attention == "flex" and self.dropout:
            raise UserInputError(
                f"packed_attention='flex' with dropout={self.dropout}: FlexAttention has no attention "
                "dropout; use packed_attention='auto' (SDPA where there is dropout) or dropout=0"
            )
        if self.intermediate_size is None:
            if self.mlp in ("gelu", "gelu_exact"):
                self.intermediate_size = 4 * self.n_embd
            else:  # 2/3 of 4*n_embd keeps the parameter count of a GELU MLP; round up to 32
                self.intermediate_size = 32 * math.ceil(8 * self.n_embd / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_fraction)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention; None: it sees the whole context."""
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or layer in layers else None


def _check_ranges(config: GPTConfig) -> None:
    """Refuse a value no model can have (a traceback, or a model of empty tensors, later on)."""
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size",
                 "head_size", "sliding_window"):
        value = getattr(config, name)
        if value is not None and value < 1:  # None: filled in (see the fields' comments)
            raise UserInputError(f"{name}={value} must be at least 1")
    if not 0 <= config.dropout < 1:
        raise UserInputError(f"dropout={config.dropout} is outside [0, 1); use 0.0 for none, or e.g. 0.1")
    defaults = {field.name: field.default for field in fields(config)}
    for name in ("rope_theta", "norm_eps", "init_std", "local_rope_theta", "query_scale_dim", "attn_softcap",
                 "logit_softcap"):
        value = getattr(config, name)
        if value is not None and not 0 < value < math.inf:  # None: not used; also refuses nan
            raise UserInputError(f"{name}={value} must be positive and finite (default {defaults[name]})")
    if not 0 < config.rope_fraction <= 1:
        fraction = config.rope_fraction
        raise UserInputError(f"rope_fraction={fraction} is outside (0, 1]; 1.0 rotates all of each head")
    for name, hint in get_type_hints(GPTConfig).items():  # norm, position, mlp: Python does not check them
        value = getattr(config, name)
        if get_origin(hint) is Literal and value not in get_args(hint):
            raise UserInputError(f"{name}={value!r} is not one of {', '.join(get_args(hint))}")
    check_scaling(config.rope_scaling, config.rotary_dim)
