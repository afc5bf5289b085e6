"""The health/perf callbacks never read a tensor's value on the host on a non-logging training step.

Every way of copying a tensor's value to the host (``item``, ``tolist``, ``bool(t)``, ``float(t)``,
``.cpu()``, ...) is patched to record calls made from code in ``lightning_train/callbacks/`` (anywhere
up the stack, so a Lightning call the callback makes counts too), during a real training run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_train.callbacks
from lightning_train.callbacks import (
    GoodputMonitor,
    GradNormMonitor,
    HangWatchdog,
    LossScaleMonitor,
    StragglerMonitor,
    ThroughputMonitor,
    TimeToQuality,
)
from lightning_train.models.gpt import GPTConfig
from lightning_train.modules import PretrainModule
from tests.helpers.tiny_runs import TINY, WithValidation

CALLBACKS_DIR = str(Path(lightning_train.callbacks.__file__).parent)
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def all_callbacks() -> list[L.Callback]:
    """The telemetry callbacks, doing their normal work (LossScaleMonitor is idle in fp32)."""
    return [
        GradNormMonitor(), ThroughputMonitor(peak_flops=1e12), TimeToQuality(target=0.0), LossScaleMonitor(),
        HangWatchdog(timeout=60, grace_steps=1), StragglerMonitor(), GoodputMonitor(start="created"),
    ]


@contextmanager
def host_reads_from(trainer: L.Trainer, folder: str = CALLBACKS_DIR) -> Iterator[list[dict]]:
    """Records the host reads made from code under ``folder`` ("" for every read, from anywhere)."""
    reads: list[dict] = []

    def recording(name: str, original):
        def read(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.startswith(folder):
                    where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                    reads.append({"read": name, "at": where, "step": trainer.global_step,
                                  "validating": trainer.validating, "training": trainer.training})
                    break
                frame = frame.f_back
            return original(tensor, *args, **kwargs)
        return read

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
        yield reads


def fit_and_record(tmp_path, log_every_n_steps: int, max_steps: int) -> list[dict]:
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, log_every_n_steps=log_every_n_steps, gradient_clip_val=1.0,
        val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0, callbacks=all_callbacks(),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with host_reads_from(trainer) as reads:
        trainer.fit(PretrainModule(GPTConfig(**TINY)), WithValidation())
    return reads


def test_no_host_reads_on_non_logging_steps(tmp_path):
    reads = fit_and_record(tmp_path, log_every_n_steps=50, max_steps=8)
    training_reads = [r for r in reads if not r["validating"]]
    assert training_reads == []
    # TimeToQuality reads the validation metrics at the end of each validation (after steps 4 and 8).
    assert {(r["at"].split(":")[0], r["step"]) for r in reads} == {
        ("time_to_quality.py", 4), ("time_to_quality.py", 8)
    }


def test_logging_steps_read_once_per_interval(tmp_path):
    """The counter works: with a log every 3 steps the reads appear, and only on steps 3 and 6."""
    reads = [r for r in fit_and_record(tmp_path, log_every_n_steps=3, max_steps=6) if not r["validating"]]
    assert {r["step"] for r in reads} == {3, 6}
    grad_norm_copies = [r for r in reads if r["at"].startswith("grad_norm.py")]
    assert [r["read"] for r in grad_norm_copies] == ["tolist", "tolist"]  # one host copy per interval


def test_the_training_loop_reads_nothing_on_non_logging_steps(tmp_path):
    """All of it: Lightning's loop and logging, PretrainModule, the progress bar and the monitors. A loss
    logged with prog_bar=True was read by Lightning after every batch (a GPU sync a step). Left out:
    ThroughputMonitor, whose progress-bar value is a host tensor on purpose (read every batch, no sync)."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_train.callbacks.progress import TokenProgressBar

    L.seed_everything(0)
    callbacks = [GradNormMonitor(), TimeToQuality(target=0.0), LossScaleMonitor(),
                 TokenProgressBar(refresh_rate=5)]
    trainer = L.Trainer(
        accelerator="cpu", max_steps=12, log_every_n_steps=5, gradient_clip_val=1.0, limit_val_batches=0,
        callbacks=callbacks, logger=CSVLogger(tmp_path), enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )
    with host_reads_from(trainer, folder="") as reads:
        trainer.fit(PretrainModule(GPTConfig(**TINY)), WithValidation())
    steps_with_reads = {r["step"] for r in reads if r["training"]}
    assert {5, 10} <= steps_with_reads  # the logging steps (the counter works)
    assert steps_with_reads <= {0, 5, 10, 12}  # and data setup before the first step, teardown after the last
