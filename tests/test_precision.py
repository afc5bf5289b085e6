"""AmpPrecision: real loss scaling on CPU, unscaled gradients for callbacks (fused AdamW included),
skipped steps that change nothing and hold the LR schedule, scaler state in checkpoints."""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_train import GPTConfig, PretrainModule, UserInputError
from lightning_train.plugins import AmpPrecision, step_control
from tests.helpers.nan_faults import InjectFault, PatternDataModule

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


def fit(tmp_path, callbacks, max_steps=8, plugin=None, ckpt_path=None, **trainer_kwargs):
    torch.manual_seed(0)
    module = PretrainModule(TINY, warmup_steps=4, decay_steps=50)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        plugins=[plugin or AmpPrecision("16-mixed", "cpu", init_scale=2.0**10)], **trainer_kwargs,
    )
    # PretrainModule's hyper-parameters hold a GPTConfig, which weights_only loading refuses.
    trainer.fit(module, PatternDataModule(batch_size=4), ckpt_path=ckpt_path, weights_only=False)
    return trainer, module


class Recorder(Callback):
    """Per optimizer step: parameters, optimizer state, scheduler state, LR and loss scale after it."""

    def __init__(self) -> None:
        self.after: dict[int, dict] = {}
        self.scaled: list[torch.Tensor] = []
        self.seen: list[torch.Tensor] = []

    def on_after_backward(self, trainer, pl_module):
        self.scaled.append(pl_module.model.lm_head.weight.grad.clone())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append(pl_module.model.lm_head.weight.grad.clone())

    def on_train_batch_end(self, trainer, pl_module, *args):
        optimizer = trainer.optimizers[0]
        self.after[trainer.global_step] = {
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "state": [{k: v.clone() for k, v in optimizer.state[p].items()} for p in pl_module.parameters()],
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "lr": optimizer.param_groups[0]["lr"],
            "scaler": trainer.precision_plugin.scaler.state_dict(),
        }


def test_16_mixed_on_cpu_scales_for_real_with_configured_settings():
    plugin = AmpPrecision("16-mixed", "cpu", init_scale=256.0, growth_factor=4.0, backoff_factor=0.25,
                          growth_interval=7)
    assert plugin.scaler.is_enabled()
    assert plugin.scaler.state_dict() == {"scale": 256.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                          "growth_interval": 7, "_growth_tracker": 0}
    assert AmpPrecision("bf16-mixed", "cpu").scaler is None


@pytest.mark.parametrize(
    "kwargs", [{"precision": "32-true"}, {"backoff_factor": 1.5}, {"growth_interval": 0}]
)
def test_bad_settings_are_user_errors(kwargs):
    with pytest.raises(UserInputError, match="AmpPrecision"):
        AmpPrecision(**{"device": "cpu", **kwargs})


def test_callbacks_see_unscaled_gradients_with_fused_adamw(tmp_path):
    recorder = Recorder()
    trainer, _ = fit(tmp_path, [recorder], max_steps=3)
    assert trainer.optimizers[0].defaults["fused"]
    for scaled, seen in zip(recorder.scaled, recorder.seen, strict=True):
        torch.testing.assert_close(seen, scaled / 2.0**10, rtol=0, atol=0)  # power-of-two scale: exact


def test_overflow_step_changes_nothing_and_holds_the_lr_schedule(tmp_path):
    recorder = Recorder()
    fit(tmp_path, [InjectFault("inf_grad", steps=[4]), recorder], max_steps=7)
    before, after = recorder.after[4], recorder.after[5]  # state after step index 3, after step index 4
    for p_before, p_after in zip(before["params"], after["params"], strict=True):
        assert torch.equal(p_before, p_after)
    for s_before, s_after in zip(before["state"], after["state"], strict=True):
        assert all(torch.equal(s_before[k], s_after[k]) for k in s_before)
    assert after["scheduler"]["last_epoch"] == before["scheduler"]["last_epoch"] == 4
    assert after["lr"] == before["lr"]
    assert after["scaler"]["scale"] == before["scaler"]["scale"] / 2  # the scaler backs off as designed
    assert after["scaler"]["_growth_tracker"] == 0
    # the next step is a real one again, and the schedule moves on by exactly one
    assert recorder.after[6]["scheduler"]["last_epoch"] == 5
    assert not torch.equal(recorder.after[6]["params"][0], after["params"][0])


def test_gradient_clipping_works_with_fused_adamw(tmp_path):
    # Lightning's MixedPrecision refuses to clip for a fused optimizer
    trainer, _ = fit(tmp_path, [], max_steps=2, gradient_clip_val=0.5)
    assert trainer.global_step == 2


def test_scaler_and_scheduler_state_round_trip_through_checkpoints(tmp_path):
    trainer, _ = fit(tmp_path, [], max_steps=4)
    path = tmp_path / "four.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["AmpPrecision"]["scale"] == trainer.precision_plugin.scaler.get_scale()
    buffer = io.BytesIO()
    torch.save(checkpoint["lr_schedulers"], buffer)
    buffer.seek(0)
    schedulers = torch.load(buffer, weights_only=True)  # plain state, no wrapper objects
    assert schedulers[0]["last_epoch"] == 4

    resumed, _ = fit(tmp_path, [], max_steps=5, plugin=AmpPrecision("16-mixed", "cpu", init_scale=1.0),
                     ckpt_path=path)
    assert resumed.precision_plugin.scaler.get_scale() == checkpoint["AmpPrecision"]["scale"]
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == 5


class SkipStepTwo(Callback):
    """A user's own callback that skips a step through the Trainer's step-control object."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            step_control(trainer).skip(optimizer)


@pytest.mark.parametrize("plugin", [None, "amp"], ids=["lightning-32-true", "amp-16-mixed"])
def test_any_callback_can_skip_a_step_through_the_step_control_object(tmp_path, plugin):
    after: dict[int, tuple[list[torch.Tensor], int]] = {}  # global_step -> (parameters, last_epoch)

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            after[trainer.global_step] = ([p.detach().clone() for p in pl_module.parameters()],
                                          scheduler.last_epoch)

    plugins = [AmpPrecision("16-mixed", "cpu", init_scale=2.0**10)] if plugin else []
    torch.manual_seed(0)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[SkipStepTwo(), Record()], plugins=plugins,
    )
    trainer.fit(PretrainModule(TINY, warmup_steps=4, decay_steps=50), PatternDataModule(batch_size=4),
                weights_only=False)
    (params_before, epoch_before), (params_after, epoch_after) = after[2], after[3]  # around step index 2
    assert all(torch.equal(p, q) for p, q in zip(params_before, params_after, strict=True))
    assert epoch_before == epoch_after == 2
    assert after[4][1] == 3  # 4 steps attempted, 3 real
    assert step_control(trainer) is step_control(trainer)  # one object per Trainer
