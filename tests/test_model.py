import math

import pytest
import torch
import torch.nn.functional as F

from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig

GPT2_STYLE = dict(norm="layernorm", position="learned", mlp="gelu", bias=True, tie_embeddings=False)


@pytest.mark.parametrize("flavour", [{}, {"n_kv_head": 1}, GPT2_STYLE], ids=["llama", "gqa", "gpt2"])
def test_shapes_and_causality(tiny_config, flavour):
    torch.manual_seed(0)
    config = GPTConfig(**{**tiny_config.__dict__, **flavour})
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, config.vocab_size)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % config.vocab_size  # only future tokens change
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_loss_at_init_is_near_uniform(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config)
    idx = torch.randint(0, tiny_config.vocab_size, (8, 33))
    loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    assert abs(loss.item() - math.log(tiny_config.vocab_size)) < 0.1


def test_blocks_are_a_module_list_and_weights_tied(tiny_config):
    model = GPT(tiny_config)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == tiny_config.n_layer
    assert model.lm_head.weight is model.embed.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_flops_per_token_counts_matmul_weights_and_attention(tiny_config):
    model = GPT(tiny_config)
    c = tiny_config
    per_block = (
        c.n_embd * (c.n_head + 2 * c.n_kv_head) * c.head_dim
        + c.n_embd**2
        + 3 * c.n_embd * c.intermediate_size
    )
    matmul_weights = c.n_layer * per_block + c.vocab_size * c.n_embd  # the (tied) lm_head computes too
    expected = 6 * matmul_weights + 12 * c.n_layer * c.n_embd * c.block_size
    norms = (2 * c.n_layer + 1) * c.n_embd
    assert model.flops_per_token() == pytest.approx(expected + 6 * norms)


def test_too_long_sequence_names_block_size(tiny_config):
    model = GPT(tiny_config)
    with pytest.raises(ValueError, match="block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_generate_with_and_without_cache_agree(tiny_config):
    torch.manual_seed(0)
    model = GPT(tiny_config).eval()
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5))
    cached = model.generate(prompt, 12, temperature=0)
    uncached = model.generate(prompt, 12, temperature=0, use_cache=False)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, uncached)


def test_invalid_head_counts_are_rejected():
    with pytest.raises(ValueError, match="n_head=3"):
        GPTConfig(n_embd=32, n_head=3)


@pytest.mark.parametrize("setting, says", [
    ({"n_layer": 0}, "n_layer=0 must be at least 1"),
    ({"n_kv_head": 0}, "n_kv_head=0 must be at least 1"),  # before n_head % n_kv_head divides by it
    ({"vocab_size": -1}, "vocab_size=-1 must be at least 1"),
    ({"intermediate_size": 0}, "intermediate_size=0 must be at least 1"),
    ({"dropout": 1.0}, "dropout=1.0 is outside [0, 1)"),
    ({"dropout": math.nan}, "dropout=nan is outside [0, 1)"),
    ({"rope_theta": 0.0}, "rope_theta=0.0 must be positive and finite (default 10000.0)"),
    ({"norm_eps": math.inf}, "norm_eps=inf must be positive and finite"),
    ({"init_std": -0.02}, "init_std=-0.02 must be positive and finite"),
    ({"mlp": "relu"}, "mlp='relu' is not one of swiglu, gelu"),
    ({"n_embd": 24, "n_head": 8}, "heads of 3 dimensions; position='rope' needs an even number"),
    ({"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 8, "short_factor": [1.0],
                       "long_factor": [1.0]}},
     "short_factor has 1 values; LongRoPE needs one per rotated pair of dimensions: 32"),
])
def test_a_config_no_model_can_have_is_refused(setting, says):
    """One line naming the value (the CLI prints it as its error line), not a traceback or a model of
    empty tensors later on."""
    with pytest.raises(UserInputError) as refused:
        GPTConfig(**setting)
    assert says in str(refused.value)


def test_odd_heads_are_fine_with_learned_positions():
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_embd=24, n_head=8, position="learned"))
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 16)
