"""TokenProgressBar: what a person sees. One bar of optimizer steps for the whole run (right after a
resume), the loss, tokens/s from ThroughputMonitor, one ETA, and a bar that ends its own line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lightning as L

from lightning_train import PretrainModule
from lightning_train.callbacks import ThroughputMonitor
from lightning_train.callbacks.progress import TokenProgressBar, _si
from tests.conftest import cli_env
from tests.helpers.tiny_runs import WithValidation


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
    trainer.fit(PretrainModule(tiny_config, warmup_steps=2), WithValidation(val_rows=64))
    assert "perf/tokens_per_sec" not in snapshot.items
    # The loss is read when the bar redraws; as a progress-bar metric Lightning would read it to the host
    # after every batch (a GPU sync a step).
    assert "train/loss" not in trainer.progress_bar_metrics
    assert snapshot.items["train/loss"] == snapshot.loss  # this step's loss
    assert snapshot.items["tok/s"][-1] in "0123456789kMG"
    assert snapshot.eta > 0 and snapshot.items["eta"].count(":") == 2  # H:MM:SS
    assert TokenProgressBar().eta_seconds(trainer) is None  # no steps seen yet: no guess


CONFIG = """
seed_everything: 1234
trainer:
  accelerator: cpu
  default_root_dir: run
  log_every_n_steps: 2
  val_check_interval: 4
  limit_val_batches: 1
  callbacks:
    - class_path: lightning_train.callbacks.progress.TokenProgressBar
      init_args: {refresh_rate: 2}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true}
model:
  class_path: lightning_train.PretrainModule
  init_args:
    config: {n_layer: 1, n_head: 2, n_embd: 32, block_size: 32}
    warmup_steps: 1
data:
  class_path: lightning_train.TextDataModule
  init_args: {seq_len: 32, batch_size: 4}
"""


def _console(tmp_path: Path, *args: str) -> str:
    """stdout and stderr of ``fit`` as one terminal shows them (one stream, in order)."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_train", "fit", "--config", "run.yaml", *args], cwd=tmp_path,
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def _bar_screens(console: str) -> list[str]:
    """Every state of the training bar, in order (tqdm redraws a line with carriage returns)."""
    return [screen for screen in re.split(r"[\r\n]", console) if screen.startswith("Epoch ")]


def test_one_bar_for_the_whole_run_before_and_after_a_resume(tmp_path):
    (tmp_path / "run.yaml").write_text(CONFIG)
    first = _console(tmp_path, "--trainer.max_steps=4")
    resumed = _console(tmp_path, "--trainer.max_steps=8", "--ckpt_path=run/checkpoints/last.ckpt")
    for console, start, end in ((first, 0, 4), (resumed, 4, 8)):
        screens = _bar_screens(console)
        counts = [re.search(r"\| (\d+)/(\S+) \[", screen).groups() for screen in screens]
        assert counts[0] == (str(start), str(end)) and counts[-1] == (str(end), str(end))  # steps of the run
        assert {total for _, total in counts} == {str(end)}  # never "?" nor an epoch's batch count
        for screen in screens:
            assert screen.count("eta=") <= 1 and "<" not in screen  # one ETA: tqdm's own is not shown
        last = screens[-1]
        assert "train/loss=" in last and "val/loss=" in last and "eta=0:00:00" in last and "v_num" not in last
        # The bar ends its line: the run summary starts on a line of its own.
        assert f"\nRun finished: max_steps={end} reached" in console
    rate = float(re.search(r"([\d.]+)step/s", _bar_screens(resumed)[-1]).group(1))
    assert rate < 1000  # measured over this launch's 4 steps, not 8 steps over its few seconds


def test_si_formatting():
    assert [_si(v) for v in (950, 12_345.6, 3.2e6, 1.5e9)] == ["950", "12.3k", "3.2M", "1.5G"]


class StopAtStep3(L.Callback):
    """Stops the run (or fails it) at step 3 of 10 and, like an end-of-run summary, prints when training
    ends; it runs before the bar's own hooks."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            if self.fail:
                raise RuntimeError("boom")
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        print("SUMMARY: stopped early")


def test_bar_ends_its_line_when_the_run_stops_early_or_fails(tmp_path, tiny_config, capsys):
    import pytest

    for fail in (False, True):
        trainer = L.Trainer(max_steps=10, callbacks=[StopAtStep3(fail), TokenProgressBar()], logger=False,
                            enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
                            enable_model_summary=False, default_root_dir=tmp_path)
        if fail:
            with pytest.raises(RuntimeError, match="boom"):
                trainer.fit(PretrainModule(tiny_config, warmup_steps=2), WithValidation(val_rows=64))
        else:
            trainer.fit(PretrainModule(tiny_config, warmup_steps=2), WithValidation(val_rows=64))
        out = capsys.readouterr().out
        # The failure comes before the bar sees step 3: it shows the last step it drew, then ends its line.
        assert re.findall(r"\| (\d+/\d+) \[", out)[-1] == ("2/10" if fail else "3/10")
        assert out.endswith("\n")  # closed: an error message or the next line starts on a line of its own
        if not fail:
            assert "\nSUMMARY: stopped early\n" in out
