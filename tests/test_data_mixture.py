"""Data mixtures: proportions, determinism, exact resume at another world size, per-source logging and
validation through the CLI, and every refusal."""

from __future__ import annotations

import collections
import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lightning_train import GPTConfig, PretrainModule
from lightning_train.data import GlobalOrderSampler, TextDataModule, prepare
from lightning_train.data.mixture import MixtureWindows
from lightning_train.errors import UserInputError
from tests.conftest import run_cli


def _source(folder: Path, name: str, documents: list[str], tokenizer: str = "byte") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return str(prepare([str(folder / f"{name}.jsonl")], str(folder / name), tokenizer=tokenizer,
                       val_fraction=0.1, num_workers=0).output_dir)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("mixture")
    return {  # about 1,150 and 300 windows of 16 tokens: "code" is weighted far above its size
        "prose": _source(folder, "prose", ["".join(f"the {i}.{k} cat sat on mat {k}. " for k in range(10))
                                           for i in range(70)]),
        "code": _source(folder, "code", ["".join(f"x{i}_{k} = [j * {k} for j in y]\n" for k in range(10))
                                         for i in range(22)]),
    }


def _data(sources: dict[str, str], **kwargs) -> TextDataModule:
    mixture = {sources["prose"]: 0.6, sources["code"]: 0.4}
    return TextDataModule(mixture=mixture, **{"seq_len": 16, "batch_size": 8, **kwargs})


def _rows(loader, batches: int) -> list[tuple[int, tuple[int, ...]]]:
    """(source, token ids) of each row of the next ``batches`` batches, across mixture epochs."""
    rows: list[tuple[int, tuple[int, ...]]] = []
    while len(rows) < batches * loader.batch_size:
        for batch in loader:  # one mixture epoch per iterator
            pairs = zip(batch["source"], batch["input_ids"], strict=True)
            rows += [(int(source), tuple(ids.tolist())) for source, ids in pairs]
            if len(rows) == batches * loader.batch_size:
                break
    return rows


def test_proportions_follow_the_weights(sources: dict[str, str]) -> None:
    data = _data(sources)
    data.setup("fit")
    rows = _rows(data.train_loader(), batches=250)  # 2,000 samples, over more than one mixture epoch
    share = collections.Counter(source for source, _ in rows)
    assert abs(share[0] / 2000 - 0.6) <= 0.02 and abs(share[1] / 2000 - 0.4) <= 0.02, share
    assert data.source_progress() == {}  # no Trainer loop has handed batches out yet


def test_each_source_is_drawn_in_whole_shuffled_passes() -> None:
    small, large = list(range(1000, 1013)), list(range(50))  # "windows" that name themselves
    mixture = MixtureWindows([large, small], weights=[0.5, 0.5], seed=3)
    sampler = GlobalOrderSampler(mixture, num_replicas=1, rank=0, seed=3, batch_size=1)
    draws = [mixture[i] for i in sampler]
    small_draws = [d for d in draws if d >= 1000]
    passes = [small_draws[k : k + 13] for k in range(0, 26, 13)]
    assert all(sorted(p) == small for p in passes)  # every window once per pass of the source
    assert passes[0] != passes[1]  # each pass in its own order
    assert mixture.progress(epoch=1, consumed=0)["epoch"] == [0, len(small_draws) // 13]


def test_deterministic_and_exactly_resumable_at_another_world_size(sources: dict[str, str]) -> None:
    data = _data(sources)
    data.setup("fit")
    uninterrupted = _rows(data.train_loader(), batches=12)
    again = _data(sources)
    again.setup("fit")
    assert _rows(again.train_loader(), batches=12) == uninterrupted  # the same seed, the same draws

    first = again.train_loader()
    head = _rows(first, batches=5)
    state = first.state_dict()
    two_ranks = [again.train_loader(rank, 2) for rank in (0, 1)]  # 2 x 4 rows: the same global batch
    for loader in two_ranks:
        loader.load_state_dict(state)
    rank_rows = [_rows(loader, batches=7) for loader in two_ranks]
    per_step = [rank_rows[rank][4 * step : 4 * (step + 1)] for step in range(7) for rank in (0, 1)]
    resumed = [row for rows in per_step for row in rows]
    assert sorted(head + resumed) == sorted(uninterrupted)
    assert [sorted(head + resumed[: 8 * k]) for k in (1, 7)] == [
        sorted(uninterrupted[: 40 + 8 * k]) for k in (1, 7)
    ]  # batch by batch, nothing repeated, nothing skipped


def test_cli_logs_each_source_and_validates_on_each(tmp_path: Path, sources: dict[str, str]) -> None:
    mixture = json.dumps({sources["prose"]: 0.6, sources["code"]: 0.4})
    result = run_cli(
        "fit", "--model", "PretrainModule", "--data", "TextDataModule", "--data.mixture", mixture,
        "--model.config", '{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}',
        "--data.seq_len", "16", "--data.batch_size", "8", "--trainer.limit_val_batches", "2",
        "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "3", "--trainer.val_check_interval", "6",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
        cwd=tmp_path, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    seen = [r for r in rows if r.get("data/prose/tokens_seen")]
    assert [float(r["data/prose/tokens_seen"]) + float(r["data/code/tokens_seen"]) for r in seen] == [
        3 * 8 * 16, 6 * 8 * 16]  # every row of a batch is counted once, as 16 target tokens
    val = next(r for r in rows if r.get("val/loss"))
    assert float(val["val/prose/loss"]) > 0 and float(val["val/code/loss"]) > 0
    assert min(float(val["val/prose/loss"]), float(val["val/code/loss"])) <= float(val["val/loss"])


def test_bad_mixtures_are_one_clear_error(tmp_path: Path, sources: dict[str, str]) -> None:
    cases = {
        "must be a number >= 0": {sources["prose"]: -1.0, sources["code"]: 1.0},
        "sum to 0": {sources["prose"]: 0.0, sources["code"]: 0.0},
        "is not a folder; make it with `prepare` first": {str(tmp_path / "missing"): 1.0},
        "mixture is empty": {},
    }
    for message, mixture in cases.items():
        with pytest.raises(UserInputError, match=message.replace("(", r"\(")):
            TextDataModule(mixture=mixture)
    with pytest.raises(UserInputError, match="pass data_dir or mixture, not both"):
        TextDataModule(data_dir=sources["prose"], mixture={sources["code"]: 1.0})
    other = tmp_path / "other"
    tokenizer = other / "tokenizer.json"
    other.mkdir()
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2, "</s>": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tokenizer))
    words = _source(other, "words", ["the cat " * 40] * 10, tokenizer=str(tokenizer))
    with pytest.raises(UserInputError, match="differ in tokenizer"):
        TextDataModule(mixture={sources["prose"]: 1.0, words: 1.0}, seq_len=16).setup("fit")

    result = run_cli("fit", "--model", "PretrainModule", "--data", "TextDataModule",
                     "--data.mixture", json.dumps({sources["prose"]: -1}), cwd=tmp_path, timeout=120)
    last_line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last_line.startswith("error: mixture weight -1.0 of"), last_line


def test_each_sources_validation_loss_is_the_loss_of_its_own_rows():
    """val/<source>/loss is compute_loss over that source's rows only (the other rows' labels ignored, so
    sharded logits need no slicing), and the sources' token-weighted mean is val/loss."""
    torch.manual_seed(0)
    module = PretrainModule(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
    module.configure_model()
    module.val_source_loss = nn.ModuleDict({"prose": MeanMetric(), "code": MeanMetric()})
    input_ids, labels = torch.randint(0, 64, (5, 8)), torch.randint(0, 64, (5, 8))
    labels[3, :5] = -100  # a row with fewer scored tokens: the weights matter
    source = torch.tensor([0, 1, 0, 1, 1])
    with torch.no_grad():
        module.validation_step({"input_ids": input_ids, "labels": labels, "source": source}, 0)
        logits = module(input_ids)
    for index, metric in enumerate(module.val_source_loss.values()):
        rows = source == index
        expected = F.cross_entropy(logits[rows].flatten(0, 1), labels[rows].flatten(), ignore_index=-100)
        torch.testing.assert_close(metric.compute(), expected)
    weights = [(labels[source == i] != -100).sum() for i in (0, 1)]
    mean = sum(w * m.compute() for w, m in zip(weights, module.val_source_loss.values(), strict=True))
    torch.testing.assert_close(mean / sum(weights), module.val_loss.compute())
