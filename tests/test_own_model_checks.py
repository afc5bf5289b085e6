"""The checks of a user's own model against a layout, in one process: its decoder layers found, a
tensor-parallel plan that cannot apply, a model a pipeline cannot split; each one error naming the cause."""

import pytest
import torch
from torch import nn

from lightning_train import GPT, GPTConfig, PretrainModule
from lightning_train.errors import UserInputError
from lightning_train.strategies.layers import decoder_layers
from lightning_train.strategies.parallelize import check_model_layout
from tests.helpers.hf_llama import OwnLlamaModule, tiny_llama


def _own(model: nn.Module | None = None) -> OwnLlamaModule:
    module = OwnLlamaModule()
    module.model = model if model is not None else tiny_llama()
    return module


def _check(module: nn.Module, tp: int = 1, pp: int = 1, plan: dict | None = None, **kwargs) -> None:
    check_model_layout(module, 4 * pp, tp, pp, 1, "1F1B", None, 2 * pp, 1, False, plan, **kwargs)


class Blocks(nn.Module):  # a model of one's own: repeated blocks in a ModuleList, no transformers
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))


def test_decoder_layers_are_found_from_the_model_or_named():
    llama = tiny_llama()
    assert decoder_layers(llama) == list(llama.model.layers)  # _no_split_modules: LlamaDecoderLayer
    blocks = Blocks()
    assert decoder_layers(blocks) == list(blocks.layers)  # the repeated ModuleList
    assert decoder_layers(blocks, ["Linear"]) == [layer[0] for layer in blocks.layers]
    message = r"layer_classes=\['Block'\] matches no module of Blocks.*Linear"
    with pytest.raises(UserInputError, match=message):
        decoder_layers(blocks, ["Block"])


def test_the_builtin_llama_plan_and_a_good_user_plan_pass():
    _check(_own(), tp=2)
    plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    _check(_own(), tp=2, plan=plan)


@pytest.mark.parametrize(
    ("tp", "plan", "message"),
    [
        (2, {"model.layer.*.mlp.up_proj": "colwise"},
         "tensor_parallel_plan pattern 'model.layer.*.mlp.up_proj' matches no module of LlamaForCausalLM"),
        (2, {"model.layers.*.mlp.up_proj": "columnwise"},
         r"tensor_parallel_plan\['model.layers.\*.mlp.up_proj'\]='columnwise' is not one of colwise"),
        (4, None,
         "tensor_parallel=4 does not divide the 2 attention heads of model.layers.0.self_attn.k_proj"),
        (3, {"model.layers.*.mlp.up_proj": "colwise"},
         "tensor_parallel=3 does not divide model.layers.0.mlp.up_proj's 64 output features"),
    ],
    ids=["pattern-matches-nothing", "unknown-style", "heads", "features"],
)
def test_a_plan_that_cannot_apply_is_one_error_naming_it(tp, plan, message):
    with pytest.raises(UserInputError, match=message):
        _check(_own(), tp=tp, plan=plan)


def test_a_model_without_a_builtin_plan_asks_for_one():
    module = _own()
    module.model = Blocks()
    message = "no built-in plan for Blocks; give the strategy a tensor_parallel_plan"
    with pytest.raises(UserInputError, match=message):
        _check(module, tp=2)


def test_the_gpt_keeps_its_own_plan():
    module = _own()
    module.model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(UserInputError, match="tensor_parallel_plan is for a model of one's own"):
        _check(module, tp=2, plan={"blocks.*.mlp.up": "colwise"})


def test_pipeline_checks_name_the_real_cause():
    _check(OwnLlamaModule(), pp=2)  # not built yet: checked once built (was "the model has n_layer=0")
    _check(_own(), pp=2)
    message = "8 pipeline stages need at least 8 blocks; the model has n_layer=4"
    with pytest.raises(UserInputError, match=message):
        _check(_own(), pp=8)
    tied = tiny_llama()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(UserInputError, match="tied input and output embeddings.*tie_word_embeddings=False"):
        _check(_own(tied), pp=2)
    module = _own()
    module.model = Blocks()
    with pytest.raises(UserInputError, match="Blocks has no embed_tokens, layers, norm. Use pipeline"):
        _check(module, pp=2)


def test_a_stage_computes_what_the_whole_model_does():
    from lightning_train.strategies.layer_stages import CausalLMStage, split_layers

    model = tiny_llama().eval()
    ids = torch.randint(0, 64, (2, 8))
    splits = split_layers(model, 2)
    first, last = (CausalLMStage(model, split, i == 0, i == 1) for i, split in enumerate(splits))
    torch.testing.assert_close(last(first(ids)), model(ids).logits, rtol=0, atol=0)
    names = [name for stage in (first, last) for name, _ in stage.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()]  # the whole model's names, each once


def test_export_and_generate_of_a_checkpoint_of_ones_own_model_say_what_they_need(tmp_path):
    """A checkpoint of a LightningModule holding a transformers model: one error naming the cause (not the
    GPT) and the way out (save_pretrained from the loaded module), not a list of missing GPT weights."""
    from lightning_train.checkpoint import open_pretrained

    state = {f"model.{name}": tensor for name, tensor in tiny_llama().state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {}}, tmp_path / "own.ckpt")
    message = r"holds a model of its own, not this package's GPT \(its weights are named like 'model.model"
    with pytest.raises(UserInputError, match=message + ".*save_pretrained"):
        open_pretrained(str(tmp_path / "own.ckpt"), allow_pickle=True)


def test_a_build_model_of_ones_own_is_not_checked_against_the_unused_gpt_config():
    """Before it is built, a PretrainModule subclass's model is not the GPT its config describes: 8 stages
    are not refused for the default config's 4 layers (the model is checked once built)."""
    from tests.helpers.hf_llama import LlamaPretrain

    _check(LlamaPretrain(), pp=8)
    message = "8 pipeline stages need at least 8 blocks; the model has n_layer=4"
    with pytest.raises(UserInputError, match=message):  # PretrainModule's own GPT: checked before it is built
        _check(PretrainModule(), pp=8)
