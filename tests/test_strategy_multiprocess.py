"""DataParallelStrategy on 2 real gloo ranks, launched through the CLI as a user would.

``StrategyProbe`` (tests/helpers/strategy_probe.py) records the loss averaged over ranks per optimizer
step, the bytes each rank holds and what the strategy decided; each run writes ``rank<R>.json``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from lightning_train.checkpoint import consolidate
from lightning_train.models.gpt import GPT, GPTConfig
from tests.conftest import REPO, cli_env, run_cli, run_cli_in_process
from tests.helpers.strategy_probe import PatternDataset

pytestmark = pytest.mark.slow
FSDP_CONFIG = str(REPO / "configs" / "pretrain-tiny-fsdp.yaml")
HELPERS = str(REPO / "tests" / "helpers")
ENV = cli_env(PYTHONPATH=os.pathsep.join([str(REPO), HELPERS]))
TINY = {"vocab_size": 258, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _fit(tmp_path: Path, name: str, *args: str) -> tuple[list[dict], str]:
    """Run ``fit`` with the probe; returns the per-rank reports and stderr. A one-device run (a
    reference) runs in this process: the same code from argv on, without an interpreter's start-up."""
    out = tmp_path / "probe" / name
    args = ("fit", *args, f"--trainer.default_root_dir={tmp_path / name}",
            "--trainer.callbacks+=strategy_probe.StrategyProbe", f"--trainer.callbacks.output_dir={out}")
    if "--trainer.devices=1" in args:
        sys.path.insert(0, HELPERS)  # strategy_probe, as ENV's PYTHONPATH gives it to a subprocess
        try:
            result = run_cli_in_process(*args, cwd=tmp_path)
        finally:
            sys.path.remove(HELPERS)
    else:
        result = run_cli(*args, cwd=tmp_path, env=ENV)
    if result.returncode != 0:  # each rank's own error first: another rank's traceback can fill the tail
        errors = [line for line in result.stderr.splitlines() if "Error" in line or "what()" in line]
        raise AssertionError("\n".join(errors[:20]) + "\n...\n" + result.stderr[-3000:])
    reports = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    return reports, result.stderr


def _assert_losses_equal(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected) >= 6
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    from lightning_train.data import prepare

    folder = tmp_path_factory.mktemp("data")
    return prepare([str(REPO / "lightning_train" / "models")], folder / "tokens", num_workers=0).output_dir


def test_single_process_ddp_and_fsdp_agree_step_by_step(tmp_path, small_dataset):
    """Same global batch of 8 and seed: 1 process x 8, ddp 2 ranks x 2 x 2 accumulation micro-steps,
    fsdp (picked by "auto" under a tiny memory budget, with activation checkpointing) 2 ranks x 4."""
    common = [
        "--config",
        FSDP_CONFIG,
        *(f"--model.init_args.config.{k}={v}" for k, v in TINY.items()),
        "--model.init_args.warmup_steps=2",
        "--model.init_args.decay_steps=100",
        "--model.init_args.learning_rate=3e-3",
        f"--data.init_args.data_dir={small_dataset}",
        "--data.init_args.seq_len=16",
        "--trainer.max_steps=12",
        "--trainer.limit_val_batches=0",
        "--trainer.gradient_clip_val=0.2",
        "--trainer.enable_progress_bar=false",
    ]
    [single], _ = _fit(
        tmp_path,
        "single",
        *common,
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--data.init_args.batch_size=8",
    )
    ddp, ddp_log = _fit(
        tmp_path,
        "ddp",
        *common,
        "--trainer.strategy.init_args.sharding=ddp",
        "--trainer.strategy.init_args.comm_hook=bf16_compress",
        "--data.init_args.batch_size=2",
        "--trainer.accumulate_grad_batches=2",
    )
    fsdp, fsdp_log = _fit(
        tmp_path,
        "fsdp",
        *common,
        "--trainer.strategy.init_args.sharding=auto",
        "--trainer.strategy.init_args.memory_budget_gb=0.0001",
        "--trainer.strategy.init_args.activation_checkpointing=true",
        "--data.init_args.batch_size=4",
    )

    assert single["strategy"] == "SingleDeviceStrategy" and len(ddp) == len(fsdp) == 2
    assert [r["sharding"] for r in ddp + fsdp] == ["ddp", "ddp", "fsdp", "fsdp"]
    for report in ddp + fsdp:  # same initial weights, then the same loss at every step
        assert report["initial_weights"] == single["initial_weights"]
        _assert_losses_equal(report["losses"], single["losses"])
        # strategy.clip_grad_norm_ returns the global pre-clip norm, on every rank (the clipping is real:
        # gradient_clip_val=0.2 is below these norms)
        torch.testing.assert_close(report["grad_norms"], single["grad_norms"], rtol=1e-4, atol=0)
    assert min(single["grad_norms"]) > 0.2

    # fsdp: each rank holds half of the parameters, gradients and AdamW state that a ddp rank holds
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        replicated = ddp[0]["memory"][key]
        assert replicated == ddp[1]["memory"][key] > 0
        assert all(0.45 * replicated <= rank["memory"][key] <= 0.55 * replicated for rank in fsdp), key
        assert sum(rank["memory"][key] for rank in fsdp) >= replicated

    # ddp: no all-reduce on the accumulation micro-step (ranks' gradients differ), one on the last
    for rank in ddp:
        assert [m["grad_sync"] for m in rank["micro_steps"]] == [False, True] * 12
        assert [m["grads_equal_across_ranks"] for m in rank["micro_steps"]] == [False, True] * 12
    assert "comm_hook='bf16_compress' is not supported on the gloo backend" in ddp_log
    assert all(rank["registered_comm_hook"] is None for rank in ddp)

    assert "sharding='auto') chose 'fsdp'" in fsdp_log and "budget 104.9 KiB per device" in fsdp_log
    last = tmp_path / "fsdp" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and {"meta.pt", ".metadata", "manifest.json"} <= {p.name for p in last.iterdir()}


def _pattern_config(tmp_path: Path) -> str:
    config = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "precision": "32-true",
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "gradient_clip_val": 0.5,
        },
        "model": {
            "class_path": "lightning_train.PretrainModule",
            "init_args": {
                "config": {**TINY, "vocab_size": 64},
                "learning_rate": 3e-3,
                "warmup_steps": 2,
                "decay_steps": 100,
            },
        },
        # 48 samples = 6 global batches of 8 per epoch, the same order every epoch
        "data": {
            "class_path": "strategy_probe.PatternDataModule",
            "init_args": {"samples": 48, "batch_size": 4},
        },
    }
    (tmp_path / "pattern.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "pattern.yaml")


def test_ddp_comm_hook_is_registered_where_gloo_supports_it(tmp_path):
    config = _pattern_config(tmp_path)
    reports, log = _fit(
        tmp_path,
        "hook",
        "--config",
        config,
        "--trainer.max_steps=2",
        "--trainer.strategy=lightning_train.strategies.DataParallelStrategy",
        "--trainer.strategy.sharding=ddp",
        "--trainer.strategy.comm_hook=fp16_compress",
    )
    assert [r["registered_comm_hook"] for r in reports] == ["fp16_compress_hook"] * 2
    assert "DDP comm hook 'fp16_compress' registered" in log


def test_sharded_checkpoint_resumes_on_1_then_2_ranks_and_consolidates(tmp_path):
    """fsdp 2 ranks for 18 steps, its checkpoints written in the background (--async_checkpoint); resume
    its step-6 checkpoint on 1 rank to step 12, that one on 2 ranks to step 18: the same losses as the
    uninterrupted run. Then export and reject a wrong model."""
    config = _pattern_config(tmp_path)
    every_6 = [
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=6",
        "--trainer.callbacks.save_top_k=-1",
    ]
    fsdp = ["--config", config, "--trainer.strategy=lt_fsdp"]
    [a0, _], _ = _fit(tmp_path, "a", *fsdp, "--trainer.max_steps=18", *every_6, "--async_checkpoint=true")
    step_6 = tmp_path / "a" / "checkpoints" / "epoch=0-step=6.ckpt"
    [b0], _ = _fit(
        tmp_path,
        "b",
        *fsdp,
        "--trainer.max_steps=12",
        "--trainer.devices=1",
        "--data.init_args.batch_size=8",
        *every_6,
        f"--ckpt_path={step_6}",
    )
    _assert_losses_equal(b0["losses"], a0["losses"][6:12])
    [c0, _], _ = _fit(
        tmp_path,
        "c",
        *fsdp,
        "--trainer.max_steps=18",
        f"--ckpt_path={tmp_path / 'b' / 'checkpoints' / 'epoch=1-step=12.ckpt'}",
    )
    _assert_losses_equal(c0["losses"], a0["losses"][12:18])

    # the consolidated weights give the loss the 1-rank resume saw on its first batch
    consolidate(str(step_6), str(tmp_path / "export"))
    gpt_config = json.loads((tmp_path / "export" / "config.json").read_text())
    model = GPT(GPTConfig(**{k: v for k, v in gpt_config.items() if k != "model_type"}))
    model.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"))
    tokens = PatternDataset(48, 16, 64).tokens[:8]
    with torch.no_grad():
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(b0["losses"][0], abs=2e-5)

    wrong = run_cli(
        "fit",
        *fsdp,
        "--trainer.devices=1",
        "--model.init_args.config.n_embd=64",
        "--trainer.max_steps=7",
        f"--trainer.default_root_dir={tmp_path / 'wrong'}",
        f"--ckpt_path={step_6}",
        cwd=tmp_path,
        env=ENV,
    )
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert "does not fit this model" in wrong.stderr
    assert "model.embed.weight: checkpoint (64, 32) vs model (64, 64)" in wrong.stderr


def test_ddp_vs_fsdp_benchmark_smoke(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "ddp_vs_fsdp.py"),
            "--smoke",
            "--out",
            str(tmp_path / "b.json"),
        ],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| model_state per rank (MiB) |" in done.stdout
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["goal_met"] and 0.45 <= result["memory"]["model_state_bytes"]["ratio_fsdp_over_ddp"] <= 0.55
    assert result["step_time"]["wall"]["a_stats"]["median"] > 0
