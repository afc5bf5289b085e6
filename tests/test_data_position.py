"""The data position of TextDataModule and SFTDataModule: one global order, skip_batches, any world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_train.data import SFTDataModule, TextDataModule, prepare
from tests.test_data import sentences


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """~4k byte tokens: about 230 train windows of 16 tokens."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(30)))
    return prepare([str(src)], tmp_path / "data", val_fraction=0.1, num_workers=0)


def text_loader(dataset: Path, rank: int = 0, world_size: int = 1, num_workers: int = 0, **kwargs):
    data = TextDataModule(str(dataset), seq_len=16, batch_size=4, num_workers=num_workers, **kwargs)
    return data.train_loader(rank=rank, world_size=world_size)


def take(iterator, n: int) -> list[torch.Tensor]:
    return [next(iterator)["input_ids"] for _ in range(n)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_skip_batches_passes_over_global_batches_on_every_rank(dataset: Path, world_size: int):
    for rank in range(world_size):
        reference = take(iter(text_loader(dataset, rank, world_size)), 9)
        loader = text_loader(dataset, rank, world_size)
        iterator = iter(loader)
        got = take(iterator, 3)
        loader.sampler.skip_batches(4)  # global batches 3..6 are never loaded
        got += take(iterator, 2)
        assert same(got, reference[:3] + reference[7:9])
        # the saved position counts the skip: a resumed loader continues after it
        state, expected = loader.state_dict(), take(iterator, 2)
        resumed = text_loader(dataset, rank, world_size)
        resumed.load_state_dict(state)
        assert same(take(iter(resumed), 2), expected)


def test_skip_batches_leaves_prefetched_batches_alone(dataset: Path):
    """With workers, prefetch_factor x num_workers batches are drawn ahead: they still come, then the skip."""
    reference = take(iter(text_loader(dataset)), 12)
    loader = text_loader(dataset, num_workers=1)  # prefetch_factor 4: batches 1..4 are drawn with batch 0
    iterator = iter(loader)
    got = take(iterator, 1)
    loader.sampler.skip_batches(3)
    got += take(iterator, 6)
    assert same(got, reference[:5] + reference[8:10])


def test_skip_past_the_epoch_end_goes_on_into_the_next_epoch(dataset: Path):
    loader = text_loader(dataset)
    per_epoch = len(loader)
    next_epoch = text_loader(dataset)
    next_epoch.sampler.set_epoch(1)
    reference = take(iter(next_epoch), 4)
    iterator = iter(loader)
    take(iterator, per_epoch - 2)
    loader.sampler.skip_batches(5)  # the epoch's last 2 batches and the next epoch's first 3
    assert list(iterator) == []
    loader.sampler.set_epoch(1)
    assert same(take(iter(loader), 1), reference[3:4])


def test_sft_loader_skips_and_has_its_own_generator(tmp_path: Path):
    rows = [{"prompt": f"p{i} ", "response": f"r{i}"} for i in range(40)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def loader():
        data = SFTDataModule(str(path), str(path), tokenizer="byte", batch_size=4, seq_len=32)
        data.setup()
        return data.train_loader()

    reference = take(iter(loader()), 6)
    skipping = loader()
    iterator = iter(skipping)
    got = take(iterator, 1)
    skipping.sampler.skip_batches(2)
    got += take(iterator, 3)
    assert same(got, reference[:1] + reference[3:6])
    # creating iterators draws worker seeds from the loader's own generator, not the global RNG
    state = torch.random.get_rng_state()
    iter(loader())
    assert torch.equal(state, torch.random.get_rng_state())
