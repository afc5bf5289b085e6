"""``PretrainModule(compile=True)`` trains through torch.compile on CPU (inductor), matching eager."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_train.models.gpt import GPTConfig
from lightning_train.modules.pretrain import PretrainModule


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def train_two_steps(config: GPTConfig, compile: bool) -> tuple[list[bool], list[float]]:
    """The losses of two steps, and for each run of the first block whether it ran under torch.compile
    (``torch.compiler.is_compiling()`` inside the block: True while compiled code is traced)."""
    torch.manual_seed(0)
    module = PretrainModule(config, learning_rate=1e-2, warmup_steps=1, compile=compile)
    module.configure_model()  # builds (and compiles) the model from the seed above
    compiling: list[bool] = []
    module.model.blocks[0].register_forward_pre_hook(
        lambda block, args: compiling.append(torch.compiler.is_compiling())
    )
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 4, config.block_size + 1), generator=generator)
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return compiling, recorder.losses


@pytest.mark.slow  # inductor compiles C++ kernels: ~30 s on 2 cores the first time
def test_compiled_training_matches_eager(tiny_config: GPTConfig) -> None:
    compiled, compiled_losses = train_two_steps(tiny_config, compile=True)
    eager, eager_losses = train_two_steps(tiny_config, compile=False)
    assert compiled and all(compiled)  # the blocks ran through torch.compile, not silently eager
    assert eager == [False, False]  # one eager forward a step
    assert len(compiled_losses) == 2 and all(torch.isfinite(torch.tensor(compiled_losses)))
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-4)
    assert compiled_losses[1] != compiled_losses[0]  # the optimizer step changed the model
