"""TokenProgressBar (issue #8's progress bar): the loss, tokens/s from ThroughputMonitor and an ETA."""

from __future__ import annotations

import lightning as L

from lightning_train import PretrainModule
from lightning_train.callbacks import ThroughputMonitor
from lightning_train.callbacks.progress import TokenProgressBar, _si
from tests.test_wandb import TokenBatches


class Snapshot(L.Callback):
    """Records what the bar would show after the 4th of 8 steps."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 4:
            bar = trainer.progress_bar_callback
            self.items, self.eta = bar.get_metrics(trainer, pl_module), bar.eta_seconds(trainer)
            self.loss = outputs["loss"].item()


def test_bar_shows_tokens_per_second_and_eta(tmp_path, tiny_config):
    snapshot = Snapshot()
    callbacks = [ThroughputMonitor(log_every_n_steps=2), TokenProgressBar(), snapshot]
    trainer = L.Trainer(max_steps=8, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, accelerator="cpu", enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(PretrainModule(tiny_config, warmup_steps=2), TokenBatches())
    assert "perf/tokens_per_sec" not in snapshot.items
    # The loss is read when the bar redraws; as a progress-bar metric Lightning would read it to the host
    # after every batch (a GPU sync a step).
    assert "train/loss" not in trainer.progress_bar_metrics
    assert snapshot.items["train/loss"] == snapshot.loss  # this step's loss
    assert snapshot.items["tok/s"][-1] in "0123456789kMG"
    assert snapshot.eta > 0 and snapshot.items["eta"].count(":") == 2  # H:MM:SS
    assert TokenProgressBar().eta_seconds(trainer) is None  # no steps seen yet: no guess


def test_si_formatting():
    assert [_si(v) for v in (950, 12_345.6, 3.2e6, 1.5e9)] == ["950", "12.3k", "3.2M", "1.5G"]
