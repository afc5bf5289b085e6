"""configs/llama3-8b-3d.yaml: parses to the Llama-3-8B shape under fsdp 2 x tp 8 x pp 2 on 4 x 8 GPUs, and
its layout divides the model and fits an 80 GB GPU by the planner's estimate (the model built on the meta
device: nothing allocated)."""

from __future__ import annotations

import pytest
import torch
import yaml

from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.strategies.memory import estimate_layout, format_bytes
from lightning_train.strategies.parallelize import check_layout
from lightning_train.strategies.pipeline import split_blocks
from lightning_train.strategies.planner import plan_layout
from lightning_train.strategies.tensor_parallel import check_tensor_parallel
from tests.conftest import REPO, run_main

CONFIG = REPO / "configs" / "llama3-8b-3d.yaml"
H100 = 80 * 10**9  # bytes of one 80 GB GPU
MARGIN = 0.8  # what ParallelStrategy(tensor_parallel="auto") lets a layout use


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


@pytest.fixture(scope="module")
def meta_model(config: dict) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**config["model"]["init_args"]["config"]))


def test_print_config_resolves_the_3d_strategy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main("fit", "--config", str(CONFIG), "--print_config")
    assert code == 0, err[-2000:]
    resolved = yaml.safe_load(out)
    trainer = resolved["trainer"]
    assert (trainer["devices"], trainer["num_nodes"], trainer["precision"]) == (8, 4, "bf16-mixed")
    strategy = trainer["strategy"]
    assert strategy["class_path"] == "lightning_train.strategies.ParallelStrategy"
    options = strategy["init_args"]
    assert {key: options[key] for key in (
        "tensor_parallel", "pipeline_parallel", "microbatches", "pipeline_schedule", "sharding",
        "activation_checkpointing",
    )} == {
        "tensor_parallel": 8, "pipeline_parallel": 2, "microbatches": 16, "pipeline_schedule": "1F1B",
        "sharding": "fsdp", "activation_checkpointing": True,
    }
    model = resolved["model"]["init_args"]["config"]
    assert {key: model[key] for key in (
        "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "rope_theta",
        "tie_embeddings", "block_size",
    )} == {
        "vocab_size": 128256, "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
        "intermediate_size": 14336, "rope_theta": 500000.0, "tie_embeddings": False, "block_size": 8192,
    }
    data = resolved["data"]
    assert data["class_path"] == "lightning_train.TextDataModule"
    assert data["init_args"]["seq_len"] == 8192 and data["init_args"]["data_dir"] == "data/llama3"


def test_layout_divides_the_model(config, meta_model):
    assert meta_model.num_params() == 8_030_261_248  # Llama-3-8B
    trainer, options = config["trainer"], config["trainer"]["strategy"]["init_args"]
    tp, pp = options["tensor_parallel"], options["pipeline_parallel"]
    check_layout(tp, 1, trainer["num_nodes"], trainer["devices"], pp)  # 32 GPUs: dp 2 left
    assert tp == trainer["devices"]  # tensor parallelism inside a node
    check_tensor_parallel(tp, meta_model.config)
    assert split_blocks(meta_model, pp) == [range(0, 16), range(16, 32)]
    assert config["data"]["init_args"]["batch_size"] % options["microbatches"] == 0
    assert config["data"]["init_args"]["seq_len"] % tp == 0  # sequence parallelism


def test_layout_fits_an_80gb_gpu_and_ddp_does_not(config, meta_model):
    trainer, options = config["trainer"], config["trainer"]["strategy"]["init_args"]
    batch_size, seq_len = config["data"]["init_args"]["batch_size"], config["data"]["init_args"]["seq_len"]
    world_size = trainer["num_nodes"] * trainer["devices"]
    tp, pp = options["tensor_parallel"], options["pipeline_parallel"]
    layout = dict(
        tensor_parallel=tp, pipeline_parallel=pp, shard_size=world_size // (tp * pp), batch_size=batch_size,
        seq_len=seq_len, microbatches=options["microbatches"], activation_dtype=torch.bfloat16,
    )
    assert options["activation_checkpointing"] and trainer["precision"] == "bf16-mixed"
    estimate = estimate_layout(meta_model, activation_checkpointing=True, **layout)
    assert estimate.total_bytes <= MARGIN * H100
    assert format_bytes(estimate.total_bytes) == "6.4 GiB"  # as the config's comment says
    gathered = estimate_layout(meta_model, activation_checkpointing=True, loss_parallel=False, **layout)
    assert format_bytes(gathered.total_bytes) == "13.3 GiB"  # whole logits on each of the 8 tp ranks
    without = estimate_layout(meta_model, **layout)  # no activation checkpointing: fits, with less room
    assert format_bytes(without.total_bytes) == "48.2 GiB" and without.total_bytes <= MARGIN * H100
    ddp = estimate_layout(meta_model, batch_size=batch_size, seq_len=seq_len, activation_checkpointing=True,
                          activation_dtype=torch.bfloat16)
    assert ddp.state_bytes > H100 and format_bytes(ddp.total_bytes) == "453.9 GiB"
    # the planner, given the same cluster, finds a layout too (fewer dimensions suffice for 8B)
    plan = plan_layout(
        meta_model, world_size=world_size, devices_per_node=trainer["devices"], batch_size=batch_size,
        seq_len=seq_len, memory_bytes=H100, precision="bf16-mixed", activation_checkpointing=True,
        microbatches=options["microbatches"],
    )
    assert plan.layout == "fsdp over 4 x tp 8"
    assert format_bytes(plan.per_device_bytes) == "45.7 GiB"
