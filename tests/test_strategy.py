"""DataParallelStrategy in one process: registry names, bad input, the memory planner, activation
checkpointing, and sharded-checkpoint loading/export (multi-rank runs: test_strategy_multiprocess.py)."""

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from safetensors.torch import load_file

from lightning_train.checkpoint import consolidate, load_sharded_model_state
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.strategies import DataParallelStrategy, ParallelStrategy, estimate_memory
from lightning_train.strategies.memory import choose_sharding
from lightning_train.strategies.parallelize import apply_activation_checkpointing
from tests.conftest import run_cli


@pytest.mark.parametrize("sharding", ["ddp", "fsdp", "auto"])
def test_registry_names_build_the_strategy(sharding):
    strategy = StrategyRegistry.get(f"lt_{sharding}")
    assert isinstance(strategy, DataParallelStrategy) and strategy.sharding == sharding


def test_data_parallel_strategy_is_a_preset_of_the_one_strategy():
    """One strategy class: DataParallelStrategy only fixes the model-parallel options of ParallelStrategy,
    which is built on Lightning's plain ParallelStrategy, not on a ModelParallelStrategy it would skip."""
    strategy = DataParallelStrategy("fsdp", reshard_after_forward=False)
    assert isinstance(strategy, ParallelStrategy) and not isinstance(strategy, ModelParallelStrategy)
    assert (strategy.tensor_parallel, strategy.pipeline_parallel, strategy.sharding) == (1, 1, "fsdp")
    assert not strategy.reshard_after_forward
    with pytest.raises(TypeError, match="tensor_parallel"):
        DataParallelStrategy(tensor_parallel=2)


def test_bad_options_name_the_value():
    with pytest.raises(UserInputError, match="sharding='zero3' is not one of ddp, fsdp, auto"):
        DataParallelStrategy(sharding="zero3")
    with pytest.raises(UserInputError, match="comm_hook='int8'"):
        DataParallelStrategy(comm_hook="int8")


def test_mesh_that_does_not_divide_the_world_fails_before_launch():
    with pytest.raises(
        UserInputError, match=r"replicate_size=3 does not divide the world size 2 .*devices=2"
    ):
        L.Trainer(
            strategy=DataParallelStrategy(sharding="fsdp", replicate_size=3), accelerator="cpu", devices=2
        )


def test_replicate_size_nodes_follows_the_node_count_of_each_launch():
    strategy = DataParallelStrategy(sharding="fsdp", replicate_size="nodes")
    for nodes in (1, 2, 3):  # an elastic group that lost a node, or gained one
        strategy.num_nodes = nodes
        assert strategy.replicate_size == nodes
    with pytest.raises(UserInputError, match=r"replicate_size='node' does not divide .* or 'nodes'"):
        L.Trainer(strategy=DataParallelStrategy(sharding="fsdp", replicate_size="node"), accelerator="cpu",
                  devices=1)


def test_memory_estimate_counts_adamw_states_and_shards(tiny_config):
    model = GPT(tiny_config)
    estimate = estimate_memory(model, shard_size=2, batch_size=4, seq_len=32)
    params = model.num_params() * 4  # tied embedding counted once
    assert (estimate.param_bytes, estimate.grad_bytes, estimate.optimizer_bytes) == (
        params,
        params,
        2 * params,
    )
    assert estimate.activation_bytes > 0 and estimate.fsdp_bytes < estimate.ddp_bytes
    with_checkpointing = estimate_memory(
        model, shard_size=2, batch_size=4, seq_len=32, activation_checkpointing=True
    )
    assert with_checkpointing.activation_bytes < estimate.activation_bytes
    assert choose_sharding(estimate, budget_bytes=estimate.ddp_bytes // 2) == "fsdp"
    assert choose_sharding(estimate, budget_bytes=2 * estimate.ddp_bytes) == "ddp"


def test_activation_checkpointing_gives_the_same_gradients(tiny_config):
    torch.manual_seed(0)
    plain = GPT(tiny_config)
    checkpointed = GPT(tiny_config)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()  # checkpoints stay compatible
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 17))
    for model in (plain, checkpointed):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=name)


def _sharded_checkpoint(folder, config: GPTConfig) -> GPT:
    """A sharded checkpoint folder as DataParallelStrategy writes it (DCP + meta.pt), from one process."""
    from torch.distributed.checkpoint import save

    torch.manual_seed(1)
    model = GPT(config)
    save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=str(folder))
    torch.save({"global_step": 3, "hyper_parameters": {"config": config}}, folder / "meta.pt")
    return model


def test_load_sharded_state_and_consolidate(tmp_path, tiny_config):
    saved = _sharded_checkpoint(tmp_path / "ckpt", tiny_config)
    model = GPT(tiny_config)
    load_sharded_model_state(tmp_path / "ckpt", model)
    for (name, a), b in zip(saved.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "export"))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["n_embd"] == tiny_config.n_embd and config["model_type"] == "gpt"
    exported = GPT(GPTConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    exported.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"))  # strict: every key
    tokens = torch.randint(0, tiny_config.vocab_size, (1, 8))
    torch.testing.assert_close(exported(tokens), saved(tokens), rtol=0, atol=0)

    with pytest.raises(UserInputError, match="already exists"):  # nothing overwritten by accident
        consolidate(str(tmp_path / "ckpt"), str(tmp_path / "export"))


def test_incompatible_sharded_checkpoint_names_keys_and_shapes(tmp_path, tiny_config):
    _sharded_checkpoint(tmp_path / "ckpt", tiny_config)
    wider = GPT(GPTConfig(vocab_size=258, block_size=32, n_layer=3, n_head=2, n_embd=64))
    with pytest.raises(UserInputError) as error:
        load_sharded_model_state(tmp_path / "ckpt", wider)
    message = str(error.value)
    assert "model.embed.weight: checkpoint (258, 32) vs model (258, 64)" in message
    assert "does not fit this model" in message


def test_consolidate_cli(tmp_path, tiny_config):
    _sharded_checkpoint(tmp_path / "ckpt", tiny_config)
    result = run_cli(
        "consolidate", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "config.json").is_file()
    missing = run_cli(
        "consolidate", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "o2"), cwd=tmp_path
    )
    assert (
        missing.returncode == 2
        and "error: checkpoint" in missing.stderr
        and "does not exist" in missing.stderr
    )
