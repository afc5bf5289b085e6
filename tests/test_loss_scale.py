"""LossScaleMonitor with a real CPU GradScaler (AmpPrecision 16-mixed): overflow counting, scale
logging, alerts, the held LR schedule, bf16/fp32 silence and counters that survive a resume."""

from __future__ import annotations

import csv
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_train import GPTConfig, PretrainModule, UserInputError
from lightning_train.callbacks import LossScaleMonitor
from lightning_train.loggers.alerts import read_alerts
from lightning_train.plugins import AmpPrecision
from tests.helpers.nan_faults import InjectFault, PatternDataModule

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


def fit(tmp_path, callbacks, max_steps=6, precision="16-mixed", ckpt_path=None, init_scale=2.0**10):
    torch.manual_seed(0)
    plugins = [AmpPrecision(precision, "cpu", init_scale=init_scale)] if precision != "32-true" else []
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="", version=0), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, plugins=plugins,
    )
    module = PretrainModule(TINY, warmup_steps=4, decay_steps=50)
    # PretrainModule's hyper-parameters hold a GPTConfig, which weights_only loading refuses.
    trainer.fit(module, PatternDataModule(batch_size=4), ckpt_path=ckpt_path, weights_only=False)
    return trainer


def metric_rows(tmp_path) -> list[dict[str, str]]:
    with open(tmp_path / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def amp_series(tmp_path, name: str) -> list[float]:
    return [float(row[name]) for row in metric_rows(tmp_path) if row.get(name)]


def test_injected_inf_gradient_counts_one_overflow_halves_the_scale_and_holds_the_lr(tmp_path):
    trainer = fit(tmp_path, [LossScaleMonitor(), InjectFault("inf_grad", steps=[3])], max_steps=6)
    scales, overflows = amp_series(tmp_path, "amp/loss_scale"), amp_series(tmp_path, "amp/overflow_steps")
    assert scales == [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert overflows == [0, 0, 0, 1, 1, 1]
    assert amp_series(tmp_path, "amp/growth_count") == [0] * 6
    # 6 optimizer steps were attempted (global_step counts them), 5 were real: the schedule saw 5
    assert trainer.global_step == 6
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5
    lrs = [float(row["train/lr"]) for row in metric_rows(tmp_path) if row.get("train/lr")]
    assert lrs[4] == lrs[3] and lrs[3] != lrs[2]  # the LR used after the skipped step is the skipped one's


def test_growth_is_counted(tmp_path):
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=5, accelerator="cpu", log_every_n_steps=5,
        logger=CSVLogger(tmp_path, name="", version=0), enable_progress_bar=False, enable_model_summary=False,
        callbacks=[LossScaleMonitor()],
        plugins=[AmpPrecision("16-mixed", "cpu", init_scale=8.0, growth_interval=2)],
    )
    trainer.fit(PretrainModule(TINY, warmup_steps=2), PatternDataModule(batch_size=4))
    assert amp_series(tmp_path, "amp/growth_count") == [2]
    assert amp_series(tmp_path, "amp/loss_scale") == [32.0]


def test_collapse_and_repeated_overflows_alert_once(tmp_path):
    monitor = LossScaleMonitor(min_scale=1.0, max_consecutive_overflows=3)
    fit(tmp_path, [monitor, InjectFault("inf_grad", from_step=1)], max_steps=8, init_scale=4.0)
    assert amp_series(tmp_path, "amp/overflow_steps")[-1] == 7
    alerts = read_alerts(tmp_path / "version_0")
    titles = [alert["title"] for alert in alerts]
    assert titles.count("Repeated loss-scale overflows") == 1
    assert titles.count("Loss scale collapsed") == 1
    collapse = next(a for a in alerts if a["title"] == "Loss scale collapsed")
    assert collapse["level"] == "ERROR" and "0.5" in collapse["text"]  # 4 -> 2 -> 1 -> 0.5 < 1


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_without_a_scaler_it_logs_nothing_and_says_so_once(tmp_path, caplog, precision):
    with caplog.at_level(logging.INFO):
        fit(tmp_path, [LossScaleMonitor()], max_steps=3, precision=precision)
    assert not any(name.startswith("amp/") for name in metric_rows(tmp_path)[0])
    assert sum("uses no loss scaling" in record.getMessage() for record in caplog.records) == 1


def test_counters_survive_a_resume(tmp_path):
    trainer = fit(tmp_path, [LossScaleMonitor(), InjectFault("inf_grad", steps=[1])], max_steps=3)
    path = tmp_path / "three.ckpt"
    trainer.save_checkpoint(path)
    resumed = LossScaleMonitor()
    fit(tmp_path / "resumed", [resumed, InjectFault("inf_grad", steps=[4])], max_steps=6, ckpt_path=path)
    assert resumed.state_dict()["overflow_steps"] == 2
    assert amp_series(tmp_path / "resumed", "amp/overflow_steps") == [1, 2, 2]


def test_bad_arguments_are_user_errors():
    with pytest.raises(UserInputError, match="max_consecutive_overflows=0"):
        LossScaleMonitor(max_consecutive_overflows=0)
