"""ThroughputMonitor: tokens/s, step time and MFU agree with the batch shapes and the model's FLOPs."""

from __future__ import annotations

import re
import time

import lightning as L
import pytest
import torch

from lightning_train.callbacks import ThroughputMonitor
from lightning_train.callbacks.throughput import ADDED_PEAK_FLOPS, device_peak_flops
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPTConfig
from lightning_train.modules import PretrainModule
from tests.helpers.tiny_runs import TINY, FixedBatches, MemoryLogger, WithValidation


def fit(tmp_path, monitor, module=None, data=None, **trainer_kwargs) -> tuple[L.Trainer, MemoryLogger]:
    logger = MemoryLogger()
    trainer_kwargs = {"accelerator": "cpu", "max_steps": 6, "limit_val_batches": 0, **trainer_kwargs}
    trainer = L.Trainer(
        logger=logger, callbacks=[monitor], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **trainer_kwargs,
    )
    trainer.fit(module or PretrainModule(GPTConfig(**TINY)), data or FixedBatches(batch_size=4, seq_len=16))
    return trainer, logger


@pytest.mark.parametrize("accumulate", [1, 2])
def test_figures_are_positive_and_consistent_with_tokens_per_step(tmp_path, accumulate):
    module = PretrainModule(GPTConfig(**TINY))
    trainer, logger = fit(
        tmp_path, ThroughputMonitor(log_every_n_steps=2, peak_flops=1e12), module,
        accumulate_grad_batches=accumulate,
    )
    tokens_per_sec, step_time = logger.series("perf/tokens_per_sec"), logger.series("perf/step_time")
    assert len(tokens_per_sec) == len(step_time) == 3
    assert all(v > 0 for v in tokens_per_sec + step_time)
    tokens_per_step = 4 * 16 * accumulate  # batch x seq_len x micro-batches per optimizer step
    for rate, seconds in zip(tokens_per_sec, step_time, strict=True):
        assert rate * seconds == pytest.approx(tokens_per_step)
    flops_per_token = module.model.flops_per_token(16)
    assert logger.series("perf/mfu") == pytest.approx([r * flops_per_token / 1e12 for r in tokens_per_sec])
    assert trainer.progress_bar_metrics["perf/tokens_per_sec"] == pytest.approx(tokens_per_sec[-1])


class SlowValidation(PretrainModule):
    def validation_step(self, batch, batch_idx):
        time.sleep(1.0)
        return super().validation_step(batch, batch_idx)


def test_validation_time_is_not_counted_as_step_time(tmp_path):
    # Validation runs after step 2, inside the interval of steps 1-4; counted, it would add 0.25 s a step.
    _, logger = fit(
        tmp_path, ThroughputMonitor(log_every_n_steps=4), SlowValidation(GPTConfig(**TINY)), WithValidation(),
        max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
    )
    (step_time,) = logger.series("perf/step_time")
    assert step_time < 0.25


def test_no_mfu_on_cpu_without_a_peak(tmp_path):
    _, logger = fit(tmp_path, ThroughputMonitor(log_every_n_steps=3))
    assert logger.series("perf/tokens_per_sec") and not logger.series("perf/mfu")


def matching_addition(device_name: str) -> dict[str, float] | None:
    return next((f for pattern, f in ADDED_PEAK_FLOPS if re.search(pattern, device_name.lower())), None)


@pytest.mark.parametrize(("name", "bf16_peak"), [
    ("NVIDIA H200", 989.4e12),  # Lightning finds no chip in this name
    ("NVIDIA H200 NVL", 835.5e12),
    ("NVIDIA H100 NVL", 835.5e12),  # Lightning's figure is the with-sparsity one of a GPU pair
    ("NVIDIA L40S", 362e12),  # Lightning reads it as an L4 (121e12)
    ("NVIDIA A10", 125e12),
])
def test_the_added_peaks_cover_what_lightning_lacks(name, bf16_peak):
    assert matching_addition(name)["bf16"] == bf16_peak


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
                                  "NVIDIA L4", "Tesla T4", "Tesla V100-SXM2-16GB"])
def test_gpus_lightning_knows_are_left_to_it(name):
    assert matching_addition(name) is None


def test_no_peak_on_cpu():
    assert device_peak_flops(torch.device("cpu"), "bf16-mixed") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mfu_on_a_gpu_uses_its_datasheet_peak(tmp_path):
    device = torch.device("cuda", 0)
    peak = device_peak_flops(device, "bf16-mixed")
    assert peak is not None and peak > 1e13, torch.cuda.get_device_name(device)
    default = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        fp32 = device_peak_flops(device, "32-true")
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores: a higher peak
        assert device_peak_flops(device, "32-true") > fp32
    finally:
        torch.set_float32_matmul_precision(default)
    module = PretrainModule(GPTConfig(**TINY))
    _, logger = fit(tmp_path, ThroughputMonitor(log_every_n_steps=2), module, accelerator="gpu", devices=1,
                    precision="bf16-mixed")
    flops_per_token = module.model.flops_per_token(16)
    expected = [rate * flops_per_token / peak for rate in logger.series("perf/tokens_per_sec")]
    assert logger.series("perf/mfu") == pytest.approx(expected)


def test_a_missing_token_key_is_named(tmp_path):
    with pytest.raises(UserInputError, match="token_key='tokens' is not in the batch"):
        fit(tmp_path, ThroughputMonitor(token_key="tokens"))


def test_bad_peak_is_refused():
    with pytest.raises(UserInputError, match="peak_flops=0"):
        ThroughputMonitor(peak_flops=0)
