"""Resuming at another global batch: Lightning's epoch, the data's and GlobalBatch's accumulation agree."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_train.callbacks import GlobalBatch
from lightning_train.data import TextDataModule
from lightning_train.errors import UserInputError

# Lightning runs whose global batch changes on resume: the per-device batch size here, the device count in
# test_data_position.py's CLI test; the sampler sees the same thing, batch_size x devices.


class RowRecorder(L.LightningModule):
    """Remembers every row it trained on, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(258, 1)
        self.rows: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        self.rows += [tuple(row) for row in batch["input_ids"].tolist()]
        return self.embedding(batch["input_ids"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_rows(
    dataset: Path,
    root: Path,
    batch_size: int,
    max_steps: int,
    num_workers: int = 0,
    ckpt_path: str | None = None,
    limit: int | float = 1.0,
    every: int | None = None,
    global_batch_size: int | None = None,
    accumulate: int = 1,
) -> list[tuple[int, ...]]:
    """Rows trained on, in order; checkpoints every ``every`` steps (None: at max_steps) or, with 0, as
    the CLI's ``save_last`` does: when the run stops, which Lightning records as the end of the epoch."""
    model = RowRecorder()
    every = max_steps if every is None else every
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, limit_train_batches=limit, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[ModelCheckpoint(root, every_n_train_steps=every, save_top_k=-1, save_last=True),
                   GlobalBatch()],
        accumulate_grad_batches=accumulate,
    )  # fmt: skip
    data = TextDataModule(str(dataset), seq_len=16, batch_size=batch_size, num_workers=num_workers,
                          global_batch_size=global_batch_size)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model.rows


def stream_rows(dataset: Path, global_batch: int, epochs: int, limit: float = 1.0) -> list[tuple[int, ...]]:
    """The documented order: epoch e is the permutation seeded by (seed, e), cut into whole global batches,
    the first ``limit`` of them."""
    windows = TextDataModule(str(dataset), seq_len=16, seed=1234).train_loader().sampler.dataset
    rows = []
    for epoch in range(epochs):
        order = np.random.default_rng((1234, epoch)).permutation(len(windows))
        batches = int(len(order) // global_batch * limit)
        rows += [tuple(windows[int(i)]["input_ids"].tolist()) for i in order[: batches * global_batch]]
    return rows


def test_a_fractional_limit_train_batches_cuts_each_epoch_once(dataset: Path, tmp_path: Path):
    """limit_train_batches=0.25 trains on a quarter of each epoch's batches (15 of 60), not a quarter of a
    quarter, and the next epoch starts with its own permutation."""
    rows = fit_rows(dataset, tmp_path, batch_size=4, max_steps=20, limit=0.25)
    assert len(stream_rows(dataset, 4, 1, limit=0.25)) == 15 * 4
    assert rows == stream_rows(dataset, 4, 2, limit=0.25)[: 20 * 4]


@pytest.mark.parametrize(
    ("before", "after", "num_workers"), [(4, 8, 0), (8, 4, 1)], ids=["grows", "shrinks-with-workers"]
)
def test_resume_at_another_global_batch_repeats_and_skips_nothing(
    dataset: Path, tmp_path: Path, before, after, num_workers
):
    """Mid-epoch 0, the global batch changes; the resumed run finishes epoch 0 with exactly the samples not
    yet consumed (the last incomplete batch dropped) and goes on with epoch 1 from its start."""
    first_steps, resumed_steps = 20, 30
    rows = fit_rows(dataset, tmp_path / "a", before, first_steps, num_workers)
    (ckpt,) = (tmp_path / "a").glob(f"*step={first_steps}.ckpt")
    rows += fit_rows(dataset, tmp_path / "b", after, first_steps + resumed_steps, num_workers, str(ckpt))
    epoch0 = stream_rows(dataset, before, 1)[: first_steps * before]
    rest = stream_rows(dataset, after, 1)[first_steps * before :]  # epoch 0 cut at the new size
    epoch1 = stream_rows(dataset, after, 2)[len(stream_rows(dataset, after, 1)) :]
    expected = epoch0 + rest + epoch1
    assert len(rows) == first_steps * before + resumed_steps * after
    assert rows == expected[: len(rows)]


def test_global_batch_size_keeps_the_samples_of_a_step_when_the_batch_per_device_changes(
    dataset: Path, tmp_path: Path
):
    """global_batch_size=8: 4 per device x 2 accumulated micro-batches, resumed as 8 x 1 (what a node lost
    from a group does to the data-parallel size): 20 steps of 8 rows, in the one global order."""
    rows = fit_rows(dataset, tmp_path / "a", 4, 10, global_batch_size=8)
    assert len(rows) == 10 * 8
    (ckpt,) = (tmp_path / "a").glob("*step=10.ckpt")
    rows += fit_rows(dataset, tmp_path / "b", 8, 20, ckpt_path=str(ckpt), global_batch_size=8)
    assert rows == stream_rows(dataset, 8, 1)[: 20 * 8]

    with pytest.raises(UserInputError, match=r"global_batch_size=10 is not a multiple of batch_size=4 x 1 "
                                             r"data-parallel ranks = 4; use a multiple of it"):
        fit_rows(dataset, tmp_path / "c", 4, 1, global_batch_size=10)
    with pytest.raises(UserInputError, match=r"--trainer.accumulate_grad_batches=2 and global_batch_size=8 "
                                             r"both set the accumulation"):
        fit_rows(dataset, tmp_path / "d", 4, 1, global_batch_size=8, accumulate=2)


class EpochEnds(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("keeper", [True, False], ids=["GlobalBatch", "without"])
def test_after_a_resume_at_another_global_batch_lightnings_epoch_ends_with_the_datas(
    dataset: Path, tmp_path: Path, keeper: bool
):
    """20 steps of 4 (80 of 240 windows), resumed with batches of 8: the data's epoch 0 ends after 20 more
    steps, and GlobalBatch makes Lightning's end there too (step 40). Without it Lightning counts the 20
    batches done at the old size and ends its epoch elsewhere (the samples stay right: the sampler goes on
    with its own epoch), and the loader says what to add."""
    first = L.Trainer(accelerator="cpu", devices=1, max_steps=20, limit_val_batches=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    first.fit(RowRecorder(), TextDataModule(str(dataset), seq_len=16, batch_size=4))
    first.save_checkpoint(tmp_path / "step20.ckpt")
    ends = EpochEnds()
    resumed = L.Trainer(accelerator="cpu", devices=1, max_steps=50, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[ends, GlobalBatch()] if keeper else [ends])
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        resumed.fit(RowRecorder(), TextDataModule(str(dataset), seq_len=16, batch_size=8),
                    ckpt_path=tmp_path / "step20.ckpt")
    advice = [w for w in warned if "add lightning_train.callbacks.GlobalBatch()" in str(w.message)]
    if keeper:
        assert ends.steps[0] == 40 and not advice
    else:  # the control: the count does need restating, and a Trainer without GlobalBatch is told
        assert ends.steps[0] != 40 and len(advice) == 1


def test_resume_from_the_checkpoint_written_when_max_steps_stopped_the_run(dataset: Path, tmp_path: Path):
    """Lightning counts that checkpoint's epoch as complete; the data's epoch still goes on, so the resumed
    run (fit to 10 steps, then on to 25, in epochs of 15 batches) trains on what one run of 25 steps does."""
    straight = fit_rows(dataset, tmp_path / "a", 4, 25, limit=15, every=0)
    rows = fit_rows(dataset, tmp_path / "b", 4, 10, limit=15, every=0)
    rows += fit_rows(dataset, tmp_path / "c", 4, 25, limit=15, ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    assert straight == stream_rows(dataset, 4, 2, limit=0.25)[: 25 * 4]
    assert rows == straight
