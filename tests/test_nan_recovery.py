"""NaNRecovery under fault injection (CPU): skipped steps change nothing, spikes are caught, rollbacks
restore the snapshot and skip data, aborts leave a checkpoint and a forensic report, ranks decide
together, and the ladder's state survives a resume."""

from __future__ import annotations

import csv
import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_train import GPTConfig, PretrainModule, TextDataModule, UserInputError
from lightning_train.callbacks import GradNormMonitor, LossScaleMonitor, NaNRecovery, TrainingAborted
from lightning_train.loggers.alerts import read_alerts
from lightning_train.plugins import AmpPrecision
from tests.helpers.nan_faults import InjectFault, PatternDataModule, PatternTokens

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


class Recorder(Callback):
    """The training state after every optimizer step, keyed by ``global_step`` (so ``after[k]`` is the
    state before step index k, the one a snapshot taken at step k holds)."""

    def __init__(self) -> None:
        self.after: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        optimizer = trainer.optimizers[0]
        self.names = [name for name, _ in pl_module.named_parameters()]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.after[trainer.global_step] = {
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "state": [{k: v.clone() for k, v in optimizer.state[p].items()} for p in pl_module.parameters()],
            "last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "lr": optimizer.param_groups[0]["lr"],
            "scaler": scaler.state_dict() if scaler is not None else {},
        }

    def unchanged(self, a: int, b: int) -> bool:
        """Whether parameters and optimizer state are bit-identical after steps a and b."""
        x, y = self.after[a], self.after[b]
        same_params = all(torch.equal(p, q) for p, q in zip(x["params"], y["params"], strict=True))
        states = zip(x["state"], y["state"], strict=True)
        same_state = all(torch.equal(s[k], t[k]) for s, t in states for k in s)
        return same_params and same_state


def fit(tmp_path, callbacks, max_steps=10, plugins=None, precision="32-true", ckpt_path=None,
        module_class=PretrainModule, config=TINY, data=None, **kwargs):
    torch.manual_seed(0)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", log_every_n_steps=5,
        logger=CSVLogger(tmp_path, name="", version=0), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=callbacks, plugins=plugins or [],
        precision=None if plugins else precision, **kwargs,
    )
    module = module_class(config, warmup_steps=4, decay_steps=400)
    # PretrainModule's hyper-parameters hold a GPTConfig, which weights_only loading refuses.
    data = data or PatternDataModule(batch_size=4)
    trainer.fit(module, data, ckpt_path=ckpt_path, weights_only=False)
    return trainer, module


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_nan_loss_step_changes_nothing_and_training_goes_on(tmp_path, precision):
    recorder, recovery = Recorder(), NaNRecovery()
    amp = AmpPrecision("16-mixed", "cpu", init_scale=2.0**10, growth_interval=3)
    plugins = [amp] if precision == "16-mixed" else None
    monitor = LossScaleMonitor()
    fit(tmp_path, [monitor, recovery, InjectFault("nan_loss", steps=[5]), recorder], max_steps=9,
        plugins=plugins, precision=precision)
    assert recorder.unchanged(5, 6)  # step index 5 was skipped: bit-identical parameters and AdamW state
    assert recorder.after[6]["last_epoch"] == recorder.after[5]["last_epoch"] == 5  # schedule held
    assert recorder.after[6]["lr"] == recorder.after[5]["lr"]
    assert recorder.after[6]["scaler"] == recorder.after[5]["scaler"]  # 16-mixed: scale, growth tracker kept
    assert not recorder.unchanged(6, 7) and recorder.after[9]["last_epoch"] == 8  # training goes on
    assert all(torch.isfinite(p).all() for p in recorder.after[9]["params"])
    assert recovery.skipped_steps == 1 and recovery.rollbacks == 0
    assert monitor.state_dict()["overflow_steps"] == 0  # a NaN loss is NaNRecovery's, counted once
    alerts = read_alerts(tmp_path / "version_0")
    assert [a["step"] for a in alerts if a["title"] == "NaNRecovery skipped a step"] == [5]


def test_inf_gradient_in_one_layer_is_skipped(tmp_path):
    recorder, recovery = Recorder(), NaNRecovery()
    fault = InjectFault("inf_grad", steps=[4], param="blocks.0.attn.qkv")
    fit(tmp_path, [recovery, fault, recorder], max_steps=6)
    assert recorder.unchanged(4, 5)
    assert recovery.skipped_steps == 1
    assert "non-finite gradient norm" in recovery.state_dict()["bad_steps"][0]["reason"]


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "recovery-first"])
def test_a_skipped_step_logs_its_own_grad_norm_in_either_callback_order(tmp_path, monitor_first):
    monitor, recovery = GradNormMonitor(log_every_n_steps=1), NaNRecovery()
    fault = InjectFault("inf_grad", steps=[3], param="blocks.0.attn.qkv")
    fit(tmp_path, [monitor, recovery, fault] if monitor_first else [recovery, monitor, fault], max_steps=5)
    with open(tmp_path / "version_0" / "metrics.csv") as f:
        logged = {int(row["step"]): float(row["health/grad_norm"]) for row in csv.DictReader(f)
                  if row.get("health/grad_norm")}
    assert sorted(logged) == [0, 1, 2, 3, 4] and recovery.skipped_steps == 1
    assert logged[3] == math.inf  # the skipped step's norm, measured once before the skip
    assert all(0 < logged[step] < math.inf for step in (0, 1, 2, 4))


def test_scaler_overflow_is_left_to_the_scaler_and_counted_once(tmp_path):
    recovery, monitor = NaNRecovery(), LossScaleMonitor()
    fit(tmp_path, [monitor, recovery, InjectFault("inf_grad", steps=[3])], max_steps=5,
        plugins=[AmpPrecision("16-mixed", "cpu", init_scale=2.0**10)])
    assert monitor.state_dict()["overflow_steps"] == 1
    assert recovery.skipped_steps == 0


def test_loss_spike_is_detected_and_skipped(tmp_path):
    recorder, recovery = Recorder(), NaNRecovery(min_window=8, window=32)
    fit(tmp_path, [recovery, InjectFault("spike", steps=[14], factor=30.0), recorder], max_steps=16)
    assert recovery.spikes == 1 and recovery.skipped_steps == 1
    assert recorder.unchanged(14, 15)
    assert "loss spike" in recovery.state_dict()["bad_steps"][0]["reason"]
    assert max(recovery.state_dict()["losses"]) < 10  # the spike did not enter the window


def loader_batches(count: int) -> list[torch.Tensor]:
    """The first ``count`` batches (input_ids) the training loader gives, in order."""
    loader = iter(PatternDataModule(batch_size=4).train_dataloader())
    return [next(loader)["input_ids"] for _ in range(count)]


def same_batches(seen: list[tuple[int, torch.Tensor]], expected: list[torch.Tensor]) -> bool:
    pairs = zip(seen, expected, strict=False)
    return len(seen) == len(expected) and all(torch.equal(s, e) for (_, s), e in pairs)


def test_rollback_restores_the_snapshot_and_passes_over_the_next_batches_without_computing_them(tmp_path):
    recorder = Recorder()
    recovery = NaNRecovery(snapshot_every=4, max_consecutive_skips=2, skip_batches=3)
    fault = InjectFault("nan_loss", steps=[6, 7])
    trainer, _ = fit(tmp_path, [recovery, fault, recorder], max_steps=13)
    assert recovery.rollbacks == 1 and recovery.snapshot.step == 12
    # step indices 6, 7 were skipped, then the state of the snapshot taken at step 4 came back
    assert recorder.unchanged(8, 4) and recorder.after[8]["last_epoch"] == 4
    assert not recorder.unchanged(9, 4)  # step index 8 trains at once
    # the loader's batches 8, 9, 10 never reached training_step; step index 8 trains on batch 11, and
    # the skip cost no step of max_steps: 13 steps computed, 13 counted
    assert recovery.skipped_data == [[8, 3]]
    batches = loader_batches(16)
    assert same_batches(fault.trained_batches, batches[:8] + batches[11:16])
    assert [step for step, _ in fault.trained_batches] == list(range(13))
    assert trainer.global_step == 13
    alerts = [a["title"] for a in read_alerts(tmp_path / "version_0")]
    assert "NaNRecovery rolled back (1/3)" in alerts


class SGDModule(PretrainModule):
    """Plain SGD (w -= lr * grad) on PretrainModule's schedule shape, so the LR a step used can be read
    off the update itself."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_with_gradient_accumulation_exactly_skip_batches_batches_are_passed_over(tmp_path):
    recovery = NaNRecovery(snapshot_every=2, max_consecutive_skips=2, skip_batches=3)
    fault = InjectFault("nan_loss", steps=[3, 4])
    trainer, _ = fit(tmp_path, [recovery, fault], max_steps=7, accumulate_grad_batches=2)
    # 2 batches a step: steps 0-4 took batches 0-9, the rollback after step 4 passed over 10-12, and
    # steps 5 and 6 accumulate batches 13+14 and 15+16 (the accumulation window starts afresh)
    batches = loader_batches(17)
    assert same_batches(fault.trained_batches, batches[:10] + batches[13:17])
    assert [step for step, _ in fault.trained_batches][10:] == [5, 5, 6, 6]
    assert recovery.skipped_data == [[5, 3]] and trainer.global_step == 7


def test_a_sampler_that_can_jump_passes_over_the_same_batches(tmp_path):
    """TextDataModule's sampler jumps (``skip_batches``, which loads nothing) instead of the draw-and-drop
    fallback: the next batches are passed over all the same, and its position counts them."""
    def text_data() -> TextDataModule:
        return TextDataModule(seq_len=16, batch_size=4)  # the built-in corpus

    recovery = NaNRecovery(snapshot_every=4, max_consecutive_skips=2, skip_batches=3)
    fault = InjectFault("nan_loss", steps=[6, 7])
    data = text_data()
    trainer, _ = fit(tmp_path, [recovery, fault], max_steps=12, data=data,
                     config=GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=16))
    reference = text_data()
    reference.setup("fit")
    loader = iter(reference.train_loader())
    batches = [next(loader)["input_ids"] for _ in range(15)]
    assert recovery.skipped_data == [[8, 3]]
    assert same_batches(fault.trained_batches, batches[:8] + batches[11:15])
    assert trainer.train_dataloader.sampler.state_dict()["consumed"] == 15 * 4  # skipped ones counted


class LRProbe(Callback):
    """Per trained step index: the scheduled LR (before the step) and the LR the update really used."""

    def __init__(self) -> None:
        self.used: dict[int, float] = {}
        self.scheduled: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, *args):
        self.scheduled[trainer.global_step] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        weight = pl_module.model.lm_head.weight
        self._grad = None if weight.grad is None else weight.grad.detach().clone()  # None: skipped
        self._before = weight.detach().clone()

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self._grad is not None and torch.isfinite(self._grad).all():
            delta = self._before - pl_module.model.lm_head.weight.detach()
            big = self._grad.abs() > 0.1 * self._grad.abs().max()
            self.used[trainer.global_step - 1] = (delta[big] / self._grad[big]).median().item()


@pytest.mark.parametrize("plugins", [None, [AmpPrecision("16-mixed", "cpu", init_scale=2.0**10)]],
                         ids=["32-true", "16-mixed"])
def test_rollback_can_scale_the_lr_down_for_a_few_steps(tmp_path, plugins):
    probe = LRProbe()
    recovery = NaNRecovery(snapshot_every=4, max_consecutive_skips=2, skip_batches=3, lr_scale=0.5,
                           lr_scale_steps=2)
    fit(tmp_path, [probe, recovery, InjectFault("nan_loss", steps=[6, 7])], max_steps=11, plugins=plugins,
        module_class=SGDModule)
    # rollback at step index 8 (data skipped without a step); 8 and 9 use half the scheduled LR, 10 all of it
    assert probe.used[8] == pytest.approx(0.5 * probe.scheduled[8], rel=1e-3)
    assert probe.used[9] == pytest.approx(0.5 * probe.scheduled[9], rel=1e-3)
    assert probe.used[10] == pytest.approx(probe.scheduled[10], rel=1e-3)
    assert probe.used[5] == pytest.approx(probe.scheduled[5], rel=1e-3)
    assert probe.scheduled[9] != probe.scheduled[10]  # the schedule itself was not disturbed


def test_persistent_nan_aborts_with_checkpoint_and_forensics(tmp_path):
    recorder = Recorder()
    recovery = NaNRecovery(snapshot_every=4, max_consecutive_skips=2, skip_batches=3, max_rollbacks=2)
    fault = InjectFault("nan_loss", from_step=6)
    with pytest.raises(TrainingAborted) as raised:
        fit(tmp_path, [recovery, fault, recorder, GradNormMonitor()], max_steps=40)
    error = raised.value
    assert error.checkpoint.exists() and error.forensics.exists()
    assert str(error.checkpoint) in str(error) and str(error.forensics) in str(error)
    # the checkpoint holds the last good state: the snapshot of step 4
    weights = torch.load(error.checkpoint, weights_only=False)["state_dict"]
    snapshot = zip(recorder.names, recorder.after[4]["params"], strict=True)
    assert all(torch.equal(weights[name], param) for name, param in snapshot)
    report = json.loads(error.forensics.read_text())
    assert report["rollbacks"] == 2 and report["snapshot_step"] == 4
    # (max_rollbacks + 1) x max_consecutive_skips = 6 bad steps, then the abort; the skipped batches
    # were never computed
    assert [b["step"] for b in report["bad_steps"]] == [6, 7, 8, 9, 10, 11] and report["step"] == 12
    assert [step for step, _ in fault.trained_batches] == list(range(12))
    assert report["bad_steps"][0]["loss"] == "nan"
    # GradNormMonitor's groups, though it comes after NaNRecovery in the list
    assert "block.0" in report["bad_steps"][0]["grad_norm_per_group"]
    actions = [t["action"] for t in report["tried"]]
    assert actions.count("rollback") == 2 and actions[-1] == "abort"
    assert report["skipped_data"] == [[8, 3], [10, 3]]
    assert {"python", "numpy", "torch"} <= set(report["rng"])


def test_persistent_nan_with_the_default_settings_aborts_within_twenty_bad_steps(tmp_path):
    recovery, fault = NaNRecovery(), InjectFault("nan_loss", from_step=3)
    with pytest.raises(TrainingAborted) as raised:
        fit(tmp_path, [recovery, fault], max_steps=1000)
    report = json.loads(raised.value.forensics.read_text())
    # (3 rollbacks + 1) x 5 consecutive skips; each rollback passed over 200 batches without a step
    assert [b["step"] for b in report["bad_steps"]] == list(range(3, 23))
    assert report["skipped_data"] == [[8, 200], [13, 200], [18, 200]]
    assert len(fault.trained_batches) == 23 and raised.value.checkpoint.exists()


class SaveAt(Callback):
    """Saves a checkpoint at the end of the batch that completes optimizer step ``step`` (as
    ModelCheckpoint does: the data loader's position is the one of a running fit)."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_the_ladder_survives_a_resume(tmp_path):
    def ladder() -> NaNRecovery:
        return NaNRecovery(snapshot_every=4, max_consecutive_skips=2, skip_batches=3, lr_scale=0.5,
                           lr_scale_steps=3)

    path = tmp_path / "in-lr-window.ckpt"  # at step 9: after the rollback at 8, inside its LR window [8, 11)
    fit(tmp_path, [ladder(), InjectFault("nan_loss", steps=[6, 7]), SaveAt(9, path)], max_steps=10,
        module_class=SGDModule)

    probe, resumed, fault = LRProbe(), ladder(), InjectFault("nan_loss", steps=[])
    fit(tmp_path / "resumed", [probe, resumed, fault], max_steps=12, ckpt_path=path, module_class=SGDModule)
    assert (resumed.skipped_steps, resumed.rollbacks, resumed.skipped_data) == (2, 1, [[8, 3]])
    assert [b["step"] for b in resumed.state_dict()["bad_steps"]] == [6, 7]
    # the data goes on after the passed-over batches (8 trained, 3 skipped, 1 trained: batch 12 next)
    assert same_batches(fault.trained_batches, loader_batches(15)[12:15])
    # the rollback's LR window goes on too: steps 9 and 10 at half the scheduled LR, 11 at all of it
    assert probe.used[9] == pytest.approx(0.5 * probe.scheduled[9], rel=1e-3)
    assert probe.used[10] == pytest.approx(0.5 * probe.scheduled[10], rel=1e-3)
    assert probe.used[11] == pytest.approx(probe.scheduled[11], rel=1e-3)


def test_one_nan_batch_in_a_hundred_ends_within_two_percent_of_the_clean_run(tmp_path):
    def final_loss(callbacks, folder):
        _, module = fit(tmp_path / folder, callbacks, max_steps=200)
        data = PatternTokens(256, 16, 64, seed=3)
        with torch.no_grad():
            logits = module(data.tokens[:, :-1])
            return module.compute_loss(logits, data.tokens[:, 1:]).item()

    clean = final_loss([NaNRecovery()], "clean")
    recovery = NaNRecovery()
    faulty = final_loss([recovery, InjectFault("nan_loss", every=100)], "faulty")
    assert recovery.skipped_steps == 2
    assert abs(faulty - clean) / clean < 0.02, (clean, faulty)


HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def host_reads_of_a_fit(tmp_path, callbacks) -> int:
    """Every host read of a tensor's value (anywhere: Lightning, the module, the callbacks) in a fit."""
    reads = []
    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, _counting(getattr(torch.Tensor, name), reads))
        fit(tmp_path, callbacks, max_steps=12)
    return len(reads)


def _counting(original, reads: list[int]):
    def read(tensor, *args, **kwargs):
        reads.append(1)
        return original(tensor, *args, **kwargs)
    return read


def test_nan_recovery_costs_the_loop_one_host_read_per_step(tmp_path):
    without = host_reads_of_a_fit(tmp_path / "without", [GradNormMonitor()])
    with_recovery = host_reads_of_a_fit(tmp_path / "with", [NaNRecovery(), GradNormMonitor()])
    assert with_recovery - without == 12  # the one read of (loss, grad norm, overflow) a step


def test_lightning_16_mixed_with_a_fused_optimizer_is_refused(tmp_path):
    with pytest.raises(UserInputError, match="AmpPrecision"):
        fit(tmp_path, [NaNRecovery()], max_steps=2, plugins=[MixedPrecision("16-mixed", "cpu")])
