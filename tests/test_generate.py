"""Generation: the KV cache changes nothing, and `python -m lightning_train generate` prints completions."""

from __future__ import annotations

import pytest
import torch

from lightning_train.checkpoint import save_safetensors
from lightning_train.data.tokenizers import ByteTokenizer
from lightning_train.models.generate import generate_batched
from lightning_train.models.gpt import GPT, GPTConfig
from tests.conftest import run_cli

FLAVOURS = {
    "llama": dict(n_kv_head=1),
    "gpt2": dict(norm="layernorm", position="learned", mlp="gelu", bias=True),
}


def random_model(**overrides) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=258, block_size=48, n_layer=2, n_head=2, n_embd=32, **overrides)
    model = GPT(config).eval()
    with torch.no_grad():  # sharper logits than the init's, so greedy choices are not near-ties
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_kv_cache_generation_matches_full_recompute(flavour):
    model = random_model(**FLAVOURS[flavour])
    prompt = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 30, temperature=0.0, use_cache=True)
    full = model.generate(prompt, 30, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 37) and torch.equal(cached, full)
    # Sampling draws the same tokens too, given the same seed.
    torch.manual_seed(5)
    sampled_cached = model.generate(prompt, 20, temperature=0.8, top_k=20, use_cache=True)
    torch.manual_seed(5)
    sampled_full = model.generate(prompt, 20, temperature=0.8, top_k=20, use_cache=False)
    assert torch.equal(sampled_cached, sampled_full)


def test_longrope_generation_with_the_cache_equals_the_one_without():
    """The sequence passes LongRoPE's original context (20 positions) mid-generation: the cached keys,
    rotated by its short factors, are computed again with the long ones (as transformers' Phi-3 does)."""
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 20,
               "short_factor": [1.0 + i / 4 for i in range(8)], "long_factor": [1.0 + i for i in range(8)]}
    torch.manual_seed(0)  # init_std 0.3: attention far from uniform, so stale keys would change tokens
    model = GPT(GPTConfig(vocab_size=258, block_size=48, n_layer=2, n_head=2, n_embd=32, rope_scaling=scaling,
                          init_std=0.3)).eval()
    prompt = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 30, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 30, temperature=0.0, use_cache=False))
    assert min(len(set(row[7:].tolist())) for row in cached) > 10  # not one token repeated


def test_generation_stops_at_eos_and_at_block_size():
    model = random_model()
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    first = int(model.generate(prompt, 1, temperature=0.0)[0, -1])
    stopped = model.generate(prompt, 10, temperature=0.0, eos_id=first)
    assert stopped.shape[1] == 6  # the eos itself ends generation
    assert model.generate(prompt, 1000, temperature=0.0).shape[1] == model.config.block_size


def test_batched_generation_groups_prompts_of_equal_length():
    model = random_model()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    batched = generate_batched(model, prompts, 6, eos_id=None, batch_size=2)
    single = [generate_batched(model, [p], 6, eos_id=None)[0] for p in prompts]
    assert batched == single and all(len(c) == 6 for c in batched)


def test_generate_command_prints_completions(tmp_path):
    model = random_model()
    save_safetensors(model, tmp_path / "model")
    prompts = ["def ", "import os"]
    tok = ByteTokenizer()
    completions = generate_batched(model, [tok.encode(p) for p in prompts], 12, tok.eos_id)
    expected = "\n\n".join(p + tok.decode(c) for p, c in zip(prompts, completions, strict=True))
    result = run_cli("generate", "--checkpoint", str(tmp_path / "model"), "--prompt", '["def ", "import os"]',
                     "--max_new_tokens", "12", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == expected.rstrip("\n")
    single = run_cli("generate", "--checkpoint", str(tmp_path / "model"), "--prompt", "def ",
                     "--max_new_tokens", "12", cwd=tmp_path, timeout=120)
    assert single.stdout.rstrip("\n") == ("def " + tok.decode(completions[0])).rstrip("\n")


def test_generate_command_reports_a_missing_checkpoint(tmp_path):
    result = run_cli("generate", "--checkpoint", str(tmp_path / "none.ckpt"), "--prompt", "x", cwd=tmp_path,
                     timeout=120)
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: weights source") and "none.ckpt" in last_line
