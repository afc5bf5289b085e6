"""The open model families: a tiny random model of each, built and saved here, loads with transformers'
logits, generates its greedy tokens (with and without our KV cache), exports as the same architecture in
the dtype it came in (fine-tuning each: test_families_finetune.py). Each case is a row of docs/models.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_train.checkpoint import export, open_pretrained
from lightning_train.errors import UserInputError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None)  # generations run their full length
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
# LongRoPE's switch at 12, inside the 24 tokens compared, the 26 of a generation here and the 17 of
# test_families_parallel's: both lists are used
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4,  # a factor per pair of a 16-wide head's dimensions
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.2, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}
PHI4_MINI_ROPE = LONGROPE | {"partial_rotary_factor": 0.75, "short_factor": LONGROPE["short_factor"][:6],
                             "long_factor": LONGROPE["long_factor"][:6]}  # 12 of 16 dimensions rotated
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # a base per layer type
# family -> (transformers' config class, its arguments beyond SMALL); windows of 6 are shorter than the
# 24 tokens compared and the 26 of a generation, so the masking is tested, the KV cache's too
FAMILIES = {
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 1e4}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                       "original_max_position_embeddings": 16}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 6,
                                     "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),  # heads wider than hidden_size / num_attention_heads
    "mistral-window": ("MistralConfig", {"sliding_window": 6}),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {"pad_token_id": None, "sliding_window": 6}),  # qkv and gate_up fused in HF
    "phi3-longrope": ("Phi3Config", {"pad_token_id": None, "original_max_position_embeddings": 12,
                                     "rope_parameters": LONGROPE}),
    "phi4-mini": ("Phi3Config", {"pad_token_id": None, "original_max_position_embeddings": 12,
                                 "tie_word_embeddings": True, "rope_parameters": PHI4_MINI_ROPE}),
    "gpt-neox": ("GPTNeoXConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.25}}),
    "gemma": ("GemmaConfig", {"head_dim": 24, "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", {"head_dim": 24, "sliding_window": 6, "query_pre_attn_scalar": 20,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 24, "sliding_window": 6, "query_pre_attn_scalar": 20,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_parameters": GEMMA3_ROPE}),
}


def hf_folder(name: str, folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's tiny model with weights far from their init (norm gains, biases), saved in ``dtype``;
    returns transformers' model of the folder, in fp32."""
    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**SMALL | extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    model.to(dtype).save_pretrained(folder)
    return load_hf(folder)


def load_hf(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def tokens(length: int = 24) -> torch.Tensor:
    return torch.randint(2, SMALL["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_transformers(tmp_path, name):
    theirs = hf_folder(name, tmp_path)
    ours = open_pretrained(tmp_path).build()
    with torch.no_grad():
        expected, got = theirs(tokens()).logits, ours(tokens())
    assert expected.std() > 0.1  # not a degenerate comparison
    difference = relative_difference(got, expected)
    print(f"{name}: logits relative difference {difference:.1e}")
    assert difference <= 1e-5


def test_longrope_switches_to_its_long_factors_where_transformers_does(tmp_path):
    """12 tokens (the original context) rotate by the short factors, 13 by the long ones, every position;
    the 24 of test_logits_equal_transformers see the long ones only."""
    theirs = hf_folder("phi3-longrope", tmp_path)
    ours = open_pretrained(tmp_path).build()
    with torch.no_grad():
        short, long = ours(tokens(12)), ours(tokens(13))
        assert relative_difference(short, theirs(tokens(12)).logits) <= 1e-5
        assert relative_difference(long, theirs(tokens(13)).logits) <= 1e-5
    assert relative_difference(short, long[:, :12]) > 0.01


def test_a_phi3_128k_config_of_the_first_release_loads(tmp_path):
    """Phi-3-mini-128k's first config.json: LongRoPE named "su", the original context at top level only."""
    hf_folder("phi3-longrope", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    factors = {key: rope[key] for key in ("short_factor", "long_factor")}
    config |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "su", **factors}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = open_pretrained(tmp_path).build()
    assert ours.config.rope_scaling["rope_type"] == "longrope"
    with torch.no_grad():
        assert relative_difference(ours(tokens(13)), load_hf(tmp_path)(tokens(13)).logits) <= 1e-5


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_equals_transformers(tmp_path, name, use_cache):
    theirs = hf_folder(name, tmp_path)
    ours = open_pretrained(tmp_path).build()
    prompt = tokens(6)[:1]
    expected = theirs.generate(prompt, max_new_tokens=20, do_sample=False)
    got = ours.generate(prompt, max_new_tokens=20, temperature=0, use_cache=use_cache)
    assert got.shape == (1, 26)  # past the window
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_is_the_same_architecture_and_dtype(tmp_path, name, dtype):
    theirs = hf_folder(name, tmp_path / "in", dtype)
    export(str(tmp_path / "in"), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(theirs).__name__]
    assert {tensor.dtype for tensor in load_file(tmp_path / "out" / "model.safetensors").values()} == {dtype}
    exported = load_hf(tmp_path / "out")
    assert type(exported) is type(theirs)
    for key in ("sliding_window", "layer_types", "rope_parameters", "head_dim"):
        if hasattr(theirs.config, key):
            assert getattr(exported.config, key) == getattr(theirs.config, key), key
    with torch.no_grad():
        assert relative_difference(exported(tokens()).logits, theirs(tokens()).logits) <= 1e-5


@pytest.mark.parametrize(
    ("model_type", "nearest"),
    [("gemma3", "gemma3_text"), ("phimoe", "phi3"), ("stablelm", "llama"), ("phi", "gpt2")],
)
def test_a_refused_family_names_the_nearest_supported_one(tmp_path, model_type, nearest):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    expected = rf"'{model_type}' model .*nearest supported family is '{nearest}'"
    with pytest.raises(UserInputError, match=expected):
        open_pretrained(tmp_path)


def test_a_checkpoint_of_the_config_before_it_moved_still_loads(tmp_path, monkeypatch):
    """GPTConfig lived in models/gpt.py: hyper-parameters pickled under that name load (safe globals)."""
    from lightning_train.checkpoint.format import load_torch_file
    from lightning_train.models.config import GPTConfig

    config = GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    with monkeypatch.context() as patch:
        patch.setattr(GPTConfig, "__module__", "lightning_train.models.gpt")
        torch.save({"config": config}, tmp_path / "old.ckpt")
    assert b"lightning_train.models.gpt" in (tmp_path / "old.ckpt").read_bytes()
    assert load_torch_file(tmp_path / "old.ckpt")["config"] == config


def test_a_refused_config_value_says_why_it_matters(tmp_path):
    config = transformers.LlamaConfig(**SMALL | {"partial_rotary_factor": 0.75})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UserInputError, match=r"partial_rotary_factor=0.75 .*: only part of each head"):
        open_pretrained(tmp_path)
