"""The ``auto`` layout planner (strategies/planner.py) and its memory estimate under tensor and pipeline
parallelism (memory.estimate_layout): the order layouts are tried in, what each layout divides, the sizes
it refuses, and ParallelStrategy(tensor_parallel="auto") choosing one before the mesh is built."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_train import GPTConfig, PretrainModule
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT
from lightning_train.strategies import ParallelStrategy, estimate_memory
from lightning_train.strategies.memory import _in_flight, estimate_layout, layer_activation_bytes
from lightning_train.strategies.planner import plan_layout, planning_model
from lightning_train.strategies.processes import leave_process_group
from tests.conftest import cli_env, run_cli, run_main
from tests.helpers.tiny_runs import FixedBatches

# 4 query heads, 2 key/value heads, 4 blocks: tp 2 and pp 2 or 4 divide it, tp 4 does not (n_kv_head)
CONFIG = GPTConfig(vocab_size=320, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32)
SIZES = dict(world_size=4, devices_per_node=4, batch_size=8, seq_len=16)


def _model(config: GPTConfig = CONFIG) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def _budget_for(total_bytes: int) -> int:
    """A device memory whose 80% just holds ``total_bytes``."""
    return int(total_bytes / 0.8) + 1


def _plan(memory_bytes: int, config: GPTConfig = CONFIG, **overrides):
    return plan_layout(config, **{**SIZES, "memory_bytes": memory_bytes, **overrides})


def test_layouts_are_tried_ddp_then_fsdp_then_tp_then_pp():
    model = _model()
    ddp = estimate_layout(model, batch_size=8, seq_len=16).total_bytes
    fsdp = estimate_layout(model, shard_size=4, batch_size=8, seq_len=16).total_bytes
    tp2 = estimate_layout(model, tensor_parallel=2, shard_size=2, batch_size=8, seq_len=16).total_bytes
    pp2 = estimate_layout(model, pipeline_parallel=2, shard_size=2, batch_size=8, seq_len=16,
                          microbatches=4).total_bytes
    assert ddp > fsdp > tp2 > pp2  # each step down the order needs less memory here
    chosen = [
        (plan.sharding, plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel)
        for plan in (_plan(_budget_for(size)) for size in (ddp, fsdp, tp2, pp2))
    ]
    assert chosen == [("ddp", 1, 1, 4), ("fsdp", 1, 1, 4), ("fsdp", 2, 1, 2), ("fsdp", 1, 2, 2)]
    plan = _plan(_budget_for(pp2))
    assert plan.microbatches == 4 and plan.per_device_bytes == pp2  # 2 x stages: divides the batch of 8
    assert plan.describe().startswith("fsdp over 2 x pp 2 (4 microbatches): ")


def test_tensor_parallel_takes_the_smallest_divisor_that_fits():
    config = GPTConfig(vocab_size=320, block_size=16, n_layer=4, n_head=8, n_kv_head=8, n_embd=64)
    model, sizes = _model(config), dict(batch_size=8, seq_len=16)
    tp4 = estimate_layout(model, tensor_parallel=4, shard_size=2, **sizes).total_bytes
    tp8 = estimate_layout(model, tensor_parallel=8, **sizes).total_bytes
    assert tp8 < tp4 < estimate_layout(model, tensor_parallel=2, shard_size=4, **sizes).total_bytes
    plan = _plan(_budget_for(tp4), config, world_size=8, devices_per_node=8)
    assert (plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel) == (4, 1, 2)
    plan = _plan(_budget_for(tp8), config, world_size=8, devices_per_node=8)
    assert (plan.tensor_parallel, plan.pipeline_parallel) == (8, 1)
    assert plan.layout == "tp 8"  # nothing left to shard: no data parallelism


def test_vocab_parallel_loss_splits_the_logits_in_the_estimate():
    """With loss_parallel (ParallelStrategy's default) a tensor-parallel rank holds its share of the fp32
    logits and their gradient; gathered, it holds them whole: the difference is exactly the other half."""
    model, sizes = _model(), dict(tensor_parallel=2, batch_size=8, seq_len=16)
    split = estimate_layout(model, **sizes).activation_bytes
    gathered = estimate_layout(model, loss_parallel=False, **sizes).activation_bytes
    logits = 2 * 8 * 16 * CONFIG.vocab_size * 4  # logits + gradient, fp32, whole
    assert gathered - split == logits // 2
    budget = _budget_for(estimate_layout(model, shard_size=2, **sizes).total_bytes)
    assert _plan(budget).tensor_parallel == 2  # fits with the split logits ...
    assert _plan(budget, loss_parallel=False).pipeline_parallel == 2  # ... not with whole ones


def test_only_sizes_that_divide_are_planned():
    # n_kv_head=3: no tp of 2 or 4 divides it; n_layer=2: pp 4 has too few blocks; 2 nodes of 2 devices
    config = GPTConfig(vocab_size=320, block_size=16, n_layer=2, n_head=6, n_kv_head=3, n_embd=48)
    pp2 = estimate_layout(_model(config), pipeline_parallel=2, shard_size=2, batch_size=8, seq_len=16,
                          microbatches=4).total_bytes
    plan = _plan(_budget_for(pp2), config, devices_per_node=2)
    assert (plan.tensor_parallel, plan.pipeline_parallel) == (1, 2)
    with pytest.raises(UserInputError) as refused:
        _plan(_budget_for(pp2) // 2, config, devices_per_node=2)
    message = str(refused.value)
    assert "\n" not in message
    for part in (
        "world size 4 (2 per node)", "n_head=6, n_kv_head=3", "n_layer=2",
        "the smallest, fsdp over 2 x pp 2 (4 microbatches), needs",
        "lower batch_size or seq_len, set activation_checkpointing=true, or use more devices",
    ):
        assert part in message, part
    # a batch that neither 2 x stages nor the stages split leaves pipelining out: fsdp is the smallest left
    with pytest.raises(UserInputError, match="the smallest, fsdp over 4, needs"):
        _plan(1, config, devices_per_node=2, batch_size=3)


def test_world_size_must_be_whole_nodes():
    with pytest.raises(UserInputError, match="world size 6 is not a whole number of nodes of 4 devices"):
        _plan(2**30, world_size=6)


def test_estimate_without_model_parallelism_is_the_ddp_and_fsdp_estimate():
    model = GPT(CONFIG)
    for checkpointing in (False, True):
        sizes = dict(batch_size=8, seq_len=16, activation_checkpointing=checkpointing)
        reference = estimate_memory(model, shard_size=4, **sizes)
        assert estimate_layout(model, **sizes).total_bytes == pytest.approx(reference.ddp_bytes, abs=4)
        fsdp = estimate_layout(model, shard_size=4, **sizes).total_bytes
        assert fsdp == pytest.approx(reference.fsdp_bytes, abs=4)


def test_tensor_parallel_splits_matrices_and_sequence_parallel_activations():
    model, sizes = _model(), dict(batch_size=8, seq_len=16)
    whole, tp2 = estimate_layout(model, **sizes), estimate_layout(model, tensor_parallel=2, **sizes)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)  # norm weights: kept whole
    assert tp2.state_bytes == 16 * (matrices // 2 + vectors)  # fp32 weights, grads, AdamW's two moments
    # sequence parallelism halves the blocks' activations, the vocab-parallel loss the logits
    assert tp2.activation_bytes == pytest.approx(whole.activation_bytes / 2, abs=1)
    logits = 2 * 16 * 8 * CONFIG.vocab_size * 4  # fp32 logits and their gradient
    per_layer = layer_activation_bytes(CONFIG, 8, 16)  # Korthikanti et al.'s count, in fp32
    assert whole.activation_bytes == int(CONFIG.n_layer * per_layer + logits)


def test_pipeline_stages_hold_their_blocks_and_1f1b_holds_stages_microbatches():
    assert [_in_flight("1F1B", rank, 4, 1, 8) for rank in range(4)] == [4, 3, 2, 1]
    assert _in_flight("1F1B", 0, 4, 1, 2) == 2  # never more than there are
    assert _in_flight("GPipe", 3, 4, 1, 8) == 8
    assert _in_flight("Interleaved1F1B", 0, 2, 2, 8) == 2.5  # Korthikanti et al.: x (1 + (p-1)/(p*v))
    untied = GPTConfig(vocab_size=320, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_embeddings=False)
    model, sizes = _model(untied), dict(batch_size=8, seq_len=16, microbatches=8)
    whole = estimate_layout(model)
    pp2 = estimate_layout(model, pipeline_parallel=2)
    assert pp2.state_bytes < 0.6 * whole.state_bytes  # a stage: half the blocks, one of embedding and head
    # 1F1B: at most 2 of the 8 microbatches in flight, so more microbatches mean less memory; GPipe holds all
    one_f_one_b = estimate_layout(model, pipeline_parallel=2, **sizes)
    gpipe = estimate_layout(model, pipeline_parallel=2, schedule="GPipe", **sizes)
    fewer = estimate_layout(model, pipeline_parallel=2, **{**sizes, "microbatches": 2})
    assert one_f_one_b.activation_bytes < fewer.activation_bytes < gpipe.activation_bytes


def test_planning_model_takes_the_data_vocabulary():
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert planning_model(config, SimpleNamespace(vocab_size=258)).vocab_size == 320  # padded, as fit does
    with pytest.raises(UserInputError, match="set model.config.vocab_size"):
        planning_model(config, None)


def test_auto_leaves_pipeline_and_sharding_to_the_plan():
    # checked when the Trainer configures the launcher (before any process starts), not in __init__
    with pytest.raises(UserInputError, match="'auto' plans pipeline_parallel and sharding too"):
        L.Trainer(accelerator="cpu", devices=1, logger=False,
                  strategy=ParallelStrategy(tensor_parallel="auto", pipeline_parallel=2))
    with pytest.raises(UserInputError, match=r"\(got 1 and 'fsdp'\)"):
        L.Trainer(accelerator="cpu", devices=1, logger=False,
                  strategy=ParallelStrategy(tensor_parallel="auto", sharding="fsdp"))
    strategy = ParallelStrategy(tensor_parallel="auto")
    assert (strategy.tensor_parallel, strategy.layout_plan) == (1, None)  # until planned


def test_trainer_plans_before_the_mesh_and_logs_it(caplog):
    strategy = ParallelStrategy(tensor_parallel="auto", memory_budget_gb=1.0)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, strategy=strategy, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    module = PretrainModule(GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=32))
    try:
        with caplog.at_level(logging.INFO):
            trainer.fit(module, FixedBatches(batch_size=4, seq_len=16))
    finally:
        leave_process_group()
    assert strategy.layout_plan.layout == "ddp over 1" and strategy.sharding == "ddp"
    assert trainer.global_step == 1
    logged = [r.getMessage() for r in caplog.records if "tensor_parallel='auto') chose" in r.getMessage()]
    assert len(logged) == 1 and "ddp over 1: " in logged[0] and "of 1.0 GiB, 80% of it usable" in logged[0]


TINY_ARGS = [
    "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=2",
    "--trainer.precision=32-true", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    "--trainer.strategy=lightning_train.strategies.ParallelStrategy",
    "--trainer.strategy.tensor_parallel=auto",
    "--model=lightning_train.PretrainModule", "--data=lightning_train.TextDataModule",
    "--data.seq_len=16", "--data.batch_size=8",
    *(f"--model.config.{key}={value}" for key, value in
      dict(vocab_size=320, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32).items()),
]


def test_cli_refuses_a_model_no_layout_fits_before_any_process_starts(tmp_path):
    code, _, err = run_main(
        "fit", *TINY_ARGS, "--trainer.strategy.memory_budget_gb=0.0001",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    )
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert "tensor_parallel='auto': no layout fits for batch_size=8, seq_len=16 on world size 2" in errors[0]
    assert "more than 80% of 104.9 KiB" in errors[0]
    assert not (tmp_path / "run").exists()


def test_cli_plans_tensor_parallel_on_two_ranks_and_trains(tmp_path):
    # 1.5 MiB: ddp (~1.6 MB) and fsdp over 2 (~1.4 MB) need more than 80% of it, tp 2 (~0.8 MB) fits
    done = run_cli(
        "fit", *TINY_ARGS, "--trainer.strategy.memory_budget_gb=0.0015",
        f"--trainer.default_root_dir={tmp_path / 'run'}", cwd=tmp_path, env=cli_env(), timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    chose = [line for line in done.stderr.splitlines() if "(tensor_parallel='auto') chose" in line]
    assert len(chose) == 1 and "chose tp 2: " in chose[0], done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_dir()  # sharded: the model-parallel layout
