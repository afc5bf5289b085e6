"""Local Hugging Face folders (GPT-2, Llama) mapped into our GPT give the transformers model's logits."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_train.checkpoint import open_pretrained
from lightning_train.errors import UserInputError
from lightning_train.modules.finetune import FinetuneModule

transformers = pytest.importorskip("transformers")


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def randomize(model: torch.nn.Module) -> None:
    """Weights far from their init (norm gains and biases included) so a mapping slip would show."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)


def assert_same_logits(hf_model: torch.nn.Module, folder) -> None:
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf_model.eval(), ids)
    assert expected.std() > 0.1  # not a degenerate comparison
    module = FinetuneModule(str(folder))
    module.configure_model()
    with torch.no_grad():
        ours = module.model.eval()(ids)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_gpt2_folder_matches_transformers(tmp_path):
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    randomize(model)
    model.save_pretrained(tmp_path)
    assert_same_logits(model, tmp_path)
    source = open_pretrained(tmp_path)
    assert (source.config.norm, source.config.position, source.config.mlp) == ("layernorm", "learned", "gelu")
    assert source.config.tie_embeddings


@pytest.mark.parametrize("tied", [False, True])
def test_llama_folder_matches_transformers(tmp_path, tied):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config)
    randomize(model)
    model.save_pretrained(tmp_path)
    assert_same_logits(model, tmp_path)
    ours = open_pretrained(tmp_path).config
    assert (ours.n_kv_head, ours.rope_theta, ours.norm_eps, ours.tie_embeddings) == (2, 500000.0, 1e-5, tied)


def test_hf_tokenizer_comes_with_the_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=4, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    module = FinetuneModule(str(tmp_path))
    assert module.tokenizer_spec == str(tmp_path / "tokenizer.json")


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(UserInputError, match=r"holds a 'bert' model .*supported .*\['gpt2', 'llama'"):
        FinetuneModule(str(tmp_path))


def test_unsupported_llama_variant_is_named(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UserInputError, match=r"rope_type='dynamic' is not supported .*: its frequencies"):
        FinetuneModule(str(tmp_path))


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_num_params_matches_transformers(tmp_path, flavour, tied):
    if flavour == "gpt2":
        config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         tie_word_embeddings=tied)
        hf_model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
        )
        hf_model = transformers.LlamaForCausalLM(config)
    hf_model.save_pretrained(tmp_path)
    ours = open_pretrained(tmp_path).build()
    assert ours.num_params() == hf_model.num_parameters()
    assert ours.num_params(non_embedding=True) == hf_model.num_parameters(exclude_embeddings=True)
    if flavour == "llama" and not tied:  # the untied lm_head (300 x 64) counts; the token table does not
        assert ours.num_params(non_embedding=True) == ours.num_params() - 300 * 64 == 80_960
