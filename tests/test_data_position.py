"""The data position of TextDataModule and SFTDataModule: one global order, skip_batches, any world size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_train.data import SFTDataModule, TextDataModule, prepare
from lightning_train.errors import UserInputError
from tests.conftest import REPO, cli_env
from tests.helpers.sample_log import row_digest
from tests.helpers.tiny_runs import sentences


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


@pytest.mark.parametrize("saved_after", [1, 3, 6])
def test_resume_after_a_skip_with_workers_continues_as_the_run_would(dataset: Path, saved_after: int):
    """A checkpoint taken while batches drawn before the skip are still coming (or after them) resumes into
    the very batches the uninterrupted run trains on: the prefetched ones, then the batches after the skip."""
    reference = take(iter(text_loader(dataset)), 14)
    loader = text_loader(dataset, num_workers=1)
    iterator = iter(loader)
    take(iterator, 1)
    loader.sampler.skip_batches(3)  # batches 1..4 are drawn already; 5, 6, 7 are skipped
    take(iterator, saved_after - 1)
    state = loader.state_dict()
    expected = (reference[1:5] + reference[8:])[saved_after - 1 : saved_after + 3]
    assert same(take(iterator, 4), expected)
    for num_workers in (0, 1):
        resumed = text_loader(dataset, num_workers=num_workers)
        resumed.load_state_dict(state)
        assert same(take(iter(resumed), 4), expected), num_workers


def test_a_position_in_another_order_is_refused(dataset: Path):
    loader = text_loader(dataset)
    next(iter(loader))
    state = loader.state_dict()
    other_seq_len = TextDataModule(str(dataset), seq_len=32, batch_size=4).train_loader()
    with pytest.raises(UserInputError) as error:
        other_seq_len.load_state_dict(state)
    assert str(error.value) == (
        "the checkpoint's data position is in the order of 240 windows of seq_len=16 with seed=1234; this "
        "run's train split has 120 windows of seq_len=32 with seed=1234. Resume with the data, seq_len and "
        "seed the checkpoint was saved with, or start a new run from its weights"
    )
    with pytest.raises(UserInputError, match="seq_len=16 with seed=1234; .* seq_len=16 with seed=7"):
        text_loader(dataset, seed=7).load_state_dict(state)


@pytest.mark.slow
def test_cli_resumes_across_device_counts_and_strategies(tmp_path: Path):
    """fsdp on 2 devices (6 steps, mid-epoch 0) -> ddp on 1 device with a worker (to step 20: the rest of
    epoch 0, into epoch 1) -> ddp on 2 devices (to step 24) -> tensor parallelism over 2 devices, one
    data-parallel rank (to step 28), each from the last one's last.ckpt. The rows all data-parallel ranks
    train on, step by step, are the documented global order: nothing repeated, nothing skipped."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(120)))
    data = prepare([str(src)], tmp_path / "data", val_fraction=0.1, num_workers=0).output_dir
    log = tmp_path / "log"
    common = [
        sys.executable, "-m", "lightning_train", "fit", "--config", str(REPO / "configs/pretrain-tiny.yaml"),
        "--trainer.accelerator=cpu", f"--data.init_args.data_dir={data}", "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=4", "--trainer.limit_val_batches=0",
        "--trainer.limit_train_batches=0.25",
        "--trainer.callbacks+=tests.helpers.sample_log.SampleLog", f"--trainer.callbacks.folder={log}",
    ]  # fmt: skip
    tensor_parallel = ["--trainer.strategy=lightning_train.strategies.ParallelStrategy",
                       "--trainer.strategy.tensor_parallel=2"]  # fmt: skip
    launches = [
        (["--trainer.strategy=lt_fsdp"], 2, 0, 6, None),
        (["--trainer.strategy=lt_ddp"], 1, 1, 20, tmp_path / "run0/checkpoints/last.ckpt"),
        (["--trainer.strategy=lt_ddp"], 2, 0, 24, tmp_path / "run1/checkpoints/last.ckpt"),
        (tensor_parallel, 2, 0, 28, tmp_path / "run2/checkpoints/last.ckpt"),
    ]
    for i, (strategy, devices, workers, max_steps, ckpt) in enumerate(launches):
        args = [f"--trainer.default_root_dir={tmp_path / f'run{i}'}", *strategy,
                f"--trainer.devices={devices}", f"--data.init_args.num_workers={workers}",
                f"--trainer.max_steps={max_steps}"] + ([f"--ckpt_path={ckpt}"] if ckpt else [])  # fmt: skip
        proc = subprocess.run(common + args, env=cli_env(), cwd=REPO, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    by_step: dict[int, list[list[str]]] = {}
    for rank in (0, 1):
        for line in (log / f"samples-rank{rank}.txt").read_text().splitlines():
            step, digest = line.split()
            rows = by_step.setdefault(int(step), [[], []])[rank]
            rows.append(digest)
    trained = []
    for step in sorted(by_step):  # rank r holds samples r, r + world_size, ... of each global batch
        rank0, rank1 = by_step[step]
        if step > 24:  # both ranks of the tensor-parallel group read the one data-parallel rank's batch
            assert rank0 == rank1
            trained += rank0
        else:
            trained += [d for pair in zip(rank0, rank1, strict=True) for d in pair] if rank1 else rank0
    windows = TextDataModule(str(data), seq_len=32).train_loader().sampler.dataset
    orders = [np.random.default_rng((1234, epoch)).permutation(len(windows)) for epoch in (0, 1)]
    # epoch 0: 48 samples at 8 a step, then 44 at 4 (a quarter of the 93 whole batches of 4: 23 batches);
    # epoch 1: 12 samples at 4 a step, then 32 at 8, then 16 at 4 (tp: one data-parallel rank)
    expected = [row_digest(windows[int(i)]["input_ids"]) for i in [*orders[0][:92], *orders[1][:60]]]
    assert sorted(by_step) == list(range(1, 29))
    assert trained == expected


def sft_module(path: Path, batch_size: int = 2) -> SFTDataModule:
    data = SFTDataModule(str(path), str(path), tokenizer="byte", batch_size=batch_size, seq_len=32)
    data.setup()
    return data


@pytest.mark.parametrize("kind", ["text", "sft"])
def test_the_position_moves_between_world_sizes(dataset: Path, tmp_path: Path, kind: str):
    """2 ranks -> 1 -> 2, by loader states as Lightning saves them (rank zero's): the rows of every step,
    rank 0's and rank 1's interleaved, are the one global order, each once."""
    if kind == "text":
        module = TextDataModule(str(dataset), seq_len=16, batch_size=2)
        windows = module.train_loader().sampler.dataset

        def key(row: torch.Tensor) -> tuple[int, ...]:
            return tuple(row.tolist())

        def item_key(index: int) -> tuple[int, ...]:
            return key(windows[index]["input_ids"])
    else:
        path = tmp_path / "train.jsonl"
        path.write_text(
            "".join(json.dumps({"prompt": f"p{i} ", "response": f"r{i}"}) + "\n" for i in range(90))
        )
        module = sft_module(path)

        def key(row: torch.Tensor) -> str:
            return bytes(t for t in row.tolist() if t < 256).decode().split(" ")[0]

        def item_key(index: int) -> str:
            return key(torch.tensor(module.train_set[index]["input_ids"]))

    def steps(loaders, n: int) -> list:
        iterators = [iter(loader) for loader in loaders]
        rows = []
        for _ in range(n):
            batches = [next(iterator)["input_ids"] for iterator in iterators]
            rows += [key(row) for step_rows in zip(*batches, strict=True) for row in step_rows]
        return rows

    two = [module.train_loader(rank, 2) for rank in (0, 1)]
    trained = steps(two, 3)
    one = module.train_loader(0, 1)
    one.load_state_dict(two[0].state_dict())
    trained += steps([one], 5)
    again = [module.train_loader(rank, 2) for rank in (0, 1)]
    for loader in again:
        loader.load_state_dict(one.state_dict())
    trained += steps(again, 2)
    order = list(module.train_loader().sampler)
    assert trained == [item_key(i) for i in order[: 3 * 4 + 5 * 2 + 2 * 4]]


def test_every_validation_starts_from_the_beginning(dataset: Path):
    """Lightning stops a validation after limit_val_batches; the next one reads the same batches again."""
    loader = TextDataModule(str(dataset), seq_len=16, batch_size=4).val_loader()
    first = take(iter(loader), 2)
    assert same(take(iter(loader), 2), first)


def test_an_iterator_dropped_early_leaves_no_batch_out(dataset: Path):
    """Workers draw batches ahead; when Lightning drops the iterator early (on_train_batch_start returned
    -1), the batches drawn but not handed out come next, not the ones after them."""
    reference = take(iter(text_loader(dataset)), 8)
    loader = text_loader(dataset, num_workers=1)
    got = take(iter(loader), 2)
    loader.sampler.set_epoch(1)  # Lightning's next epoch; the data's epoch 0 goes on
    got += take(iter(loader), 3)
    assert same(got, reference[:5])
