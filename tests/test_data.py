"""TextDataModule: windows, order, validation, resume and ranks, on a dataset prepared in tmp_path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_train.data import TextDataModule
from lightning_train.errors import UserInputError
from tests.conftest import cli_env
from tests.helpers.tiny_runs import Recorder, read_split


def batches(loader, n: int) -> list[torch.Tensor]:
    """The first ``n`` batches of a fresh pass over ``loader``."""
    iterator = iter(loader)
    return [next(iterator)["input_ids"] for _ in range(n)]


def test_batches_are_shifted_windows(dataset: Path):
    dm = TextDataModule(str(dataset), seq_len=16, batch_size=4)
    batch = next(iter(dm.train_loader()))
    assert set(batch) == {"input_ids", "labels"}
    assert (
        batch["input_ids"].shape == batch["labels"].shape == (4, 16) and batch["labels"].dtype == torch.long
    )
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    tokens = read_split(dataset, "train")
    start = next(iter(dm.train_loader().sampler)) * 16
    assert batch["input_ids"][0].tolist() == tokens[start : start + 16].tolist()
    assert (dm.vocab_size, dm.eos_id, dm.max_token_id, dm.tokenizer.name) == (258, 256, 256, "byte")
    # validation: limit_val_batches=2 batches, the same fixed windows every time, spread over the split
    val = [b["input_ids"] for b in dm.val_loader(limit_batches=2)]
    assert len(val) == 2 and all(
        torch.equal(a, b["input_ids"]) for a, b in zip(val, dm.val_loader(limit_batches=2), strict=True)
    )
    windows = len(dm.val_set)
    val_tokens = read_split(dataset, "val")
    starts = [i * windows // 8 * 16 for i in range(8)]  # 8 windows spread evenly, not the first 8
    assert starts[-1] > 8 * 16
    expected = [torch.from_numpy(val_tokens[s : s + 16].astype(np.int64)) for s in starts]
    assert torch.equal(torch.cat(val), torch.stack(expected))
    with pytest.raises(UserInputError, match="limit_val_batches=0.5"):
        dm.val_loader(limit_batches=0.5)


def test_same_seed_same_batches_other_seed_or_epoch_differs(dataset: Path):
    def first(seed: int, epoch: int = 0) -> list[torch.Tensor]:
        loader = TextDataModule(str(dataset), seq_len=16, batch_size=4, seed=seed).train_loader()
        loader.sampler.set_epoch(epoch)
        return batches(loader, 3)

    assert all(torch.equal(a, b) for a, b in zip(first(1), first(1), strict=True))
    assert not torch.equal(torch.stack(first(1)), torch.stack(first(2)))
    assert not torch.equal(torch.stack(first(1)), torch.stack(first(1, epoch=1)))


def test_ranks_get_disjoint_windows(dataset: Path):
    dm = TextDataModule(str(dataset), seq_len=16, batch_size=4)
    n = len(dm.train_loader().sampler.dataset)
    per_rank = n // 2 // 4 * 4  # whole batches, the same number on every rank
    for epoch in (0, 1):
        shares = []
        for rank in (0, 1):
            sampler = dm.train_loader(rank=rank, world_size=2).sampler
            sampler.set_epoch(epoch)
            shares.append(set(sampler))
        assert len(shares[0]) == len(shares[1]) == per_rank and not shares[0] & shares[1]
        assert n - len(shares[0] | shares[1]) < 2 * 4  # an epoch covers all but less than a batch per rank


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_resumes_exactly(dataset: Path, num_workers: int):
    def loader():
        return TextDataModule(str(dataset), seq_len=16, batch_size=4, num_workers=num_workers).train_loader()

    def take(iterator, n: int) -> list[torch.Tensor]:
        return [next(iterator)["input_ids"] for _ in range(n)]

    original = loader()
    epoch = iter(original)
    take(epoch, 5)
    state, expected = original.state_dict(), take(epoch, 4)
    resumed = loader()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(iter(resumed), 4), expected, strict=True))
    # near the end of a later epoch: the epoch travels with the state
    original = loader()
    original.sampler.set_epoch(3)
    epoch = iter(original)
    take(epoch, len(original) - 2)
    state, expected = original.state_dict(), take(epoch, 2)
    resumed = loader()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip([b["input_ids"] for b in resumed], expected, strict=True))


def fit(
    dataset: Path, root: Path, max_steps: int, num_workers: int, ckpt_path: str | None = None, every: int = 0
):
    model = Recorder()
    callbacks = [ModelCheckpoint(root, every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, limit_train_batches=5, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        enable_checkpointing=bool(every), default_root_dir=root,
    )  # fmt: skip
    data = TextDataModule(str(dataset), seq_len=16, batch_size=4, num_workers=num_workers)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.parametrize(("num_workers", "step"), [(0, 7), (1, 5)])
def test_lightning_checkpoint_restores_the_data_position(dataset: Path, tmp_path: Path, num_workers, step):
    """Lightning saves the loader state in the checkpoint; the resumed run trains on the very batches an
    uninterrupted run does. Epochs are 5 batches: step 7 is mid-epoch 1, step 5 the end of epoch 0 (where
    Lightning creates the resumed iterator, which prefetches with workers, before it sets the next epoch)."""
    straight = fit(dataset, tmp_path / "a", 12, num_workers)
    fit(dataset, tmp_path / "b", step, num_workers, every=step)
    (ckpt,) = (tmp_path / "b").glob(f"*step={step}.ckpt")
    resumed = fit(dataset, tmp_path / "c", 12, num_workers, ckpt_path=str(ckpt))
    assert len(resumed) == 12 - step
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[step:], strict=True))


@pytest.mark.slow
def test_ddp_ranks_train_on_disjoint_windows(dataset: Path, tmp_path: Path):
    """Two real DDP processes: Lightning keeps our sampler, each rank sees its own windows."""
    script = tmp_path / "ddp.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch, lightning as L
        from tests.helpers.tiny_runs import Recorder
        from lightning_train.data import TextDataModule
        model = Recorder()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, limit_val_batches=0,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False)
        trainer.fit(model, TextDataModule({str(dataset)!r}, seq_len=16, batch_size=4))
        torch.save(model.seen, {str(tmp_path)!r} + f"/rank{{trainer.global_rank}}.pt")
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [torch.cat(torch.load(tmp_path / f"rank{r}.pt")) for r in (0, 1)]
    rows = [{tuple(row.tolist()) for row in s} for s in seen]
    n = len(TextDataModule(str(dataset), seq_len=16).train_loader().sampler.dataset)
    assert len(seen[0]) == len(seen[1]) == (n // 2) // 4 * 4
    assert not rows[0] & rows[1]


# DataModule errors


def test_datamodule_bad_inputs(tmp_path: Path, dataset: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(UserInputError, match="prepare --inputs") as err:
        TextDataModule(str(missing)).setup("fit")
    assert str(missing) in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="has no meta.json"):
        TextDataModule(str(tmp_path / "empty")).setup("fit")
    with pytest.raises(UserInputError, match="seq_len=0"):
        TextDataModule(str(dataset), seq_len=0)
    train_tokens = len(read_split(dataset, "train"))
    with pytest.raises(UserInputError, match=f"seq_len=100000 .* seq_len <= {train_tokens - 1}"):
        TextDataModule(str(dataset), seq_len=100_000).setup("fit")
    with pytest.raises(UserInputError, match="batch_size=1000"):
        TextDataModule(str(dataset), seq_len=16, batch_size=1000).train_loader()

    shard = dataset / "train_00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[len(tokens) // 2] = 300  # beyond the byte vocabulary
    tokens.tofile(shard)
    with pytest.raises(UserInputError, match="token id 300") as err:
        TextDataModule(str(dataset)).setup("fit")
    assert str(shard) in str(err.value)
    tokens[:-1].tofile(shard)
    with pytest.raises(
        UserInputError, match=f"{len(tokens) * 2 - 2} bytes, meta.json says {len(tokens) * 2}"
    ):
        TextDataModule(str(dataset)).setup("fit")
    shard.unlink()
    with pytest.raises(UserInputError, match="is missing"):
        TextDataModule(str(dataset)).setup("fit")
