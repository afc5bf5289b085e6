"""Data: tokenizers, token shards, the default corpus and TextDataModule, on real files in tmp_path."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_train.data import (
    ByteTokenizer,
    HFTokenizer,
    TextDataModule,
    default_corpus_dir,
    load_tokenizer,
    prepare,
    read_meta,
)
from lightning_train.data.sources import PIECE_BYTES
from lightning_train.errors import UserInputError
from tests.conftest import cli_env
from tests.helpers.tiny_runs import Recorder, sentences

EOS = "<|endoftext|>"


def read_split(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    files = [s["file"] for s in meta["shards"] if s["split"] == split]
    return np.concatenate([np.fromfile(folder / f, dtype=meta["dtype"]) for f in files] or [np.zeros(0, int)])


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[str], list[str]]:
    """A folder of text files (plus a hidden and a binary file that must be skipped) and a JSONL file;
    returns the inputs and the documents in the order prepare reads them."""
    docs = sentences(12)
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: hidden\n")
    (folder / "image.png").write_bytes(b"\x89PNG\0\0binary")
    paths = [folder / "a.txt", folder / "b.md", folder / "sub" / "c.py"]
    for path, doc in zip(paths, docs[:3], strict=True):
        path.write_text(doc, encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[3:])) + "\n")
    return [str(folder), str(jsonl)], docs


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """~4k byte tokens: about 230 train windows of 16 tokens (58 batches of 4), some val windows."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(30)))
    return prepare([str(src)], tmp_path / "data", val_fraction=0.1, num_workers=0).output_dir


def train_hf_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(20), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


# Tokenizers


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    text = "naïve café ✓ <|endoftext|> literal"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256  # the literal stays bytes
    assert tok.decode(ids) == text
    assert tok.decode([*tok.encode("a"), tok.eos_id, tok.pad_id]) == "a<|endoftext|><|pad|>"
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.name) == (258, 256, 257, "byte")


def test_hf_tokenizer_round_trip(tmp_path: Path):
    path = train_hf_tokenizer(tmp_path / "tok")
    for spec in (str(path), str(path.parent)):  # the file or its folder
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        text = "the lazy café ✓ says <|endoftext|> as text"
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.decode(ids) == text
        assert tok.vocab_size == 300 and tok.decode([tok.eos_id]) == EOS
        assert (tok.eos_id, tok.pad_id) == (0, 1)
        assert load_tokenizer(tok.name).vocab_size == tok.vocab_size  # name rebuilds it
    # tokenizer_config.json next to the file names the tokens, as in Hugging Face model folders
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|pad|>"}}))
    assert load_tokenizer(str(path)).eos_id == 1
    with pytest.raises(UserInputError, match="<nope>"):
        HFTokenizer(path, eos_token="<nope>")


def test_load_tokenizer_missing(tmp_path: Path):
    missing = str(tmp_path / "nothing" / "tokenizer.json")
    with pytest.raises(UserInputError, match="not found") as err:
        load_tokenizer(missing)
    assert missing in str(err.value)


# Shards


def test_prepare_round_trip(tmp_path: Path, corpus):
    inputs, docs = corpus
    out = prepare(inputs, tmp_path / "data", val_fraction=0.0, num_workers=0).output_dir
    meta = read_meta(out)
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 258 and meta["dtype"] == "uint16"
    assert [s["file"] for s in meta["shards"]] == ["train_00000.bin"]
    tokens = read_split(out, "train")
    assert meta["total_tokens"] == len(tokens) == meta["shards"][0]["num_tokens"]
    assert meta["shards"][0]["max_token_id"] == int(tokens.max()) == 256
    assert ByteTokenizer().decode(tokens.tolist()) == EOS.join(docs) + EOS  # hidden/binary files skipped


def test_prepare_split_shards_and_determinism(tmp_path: Path, corpus):
    inputs, docs = corpus
    a = prepare(inputs, tmp_path / "a", val_fraction=0.25, shard_tokens=300, num_workers=0).output_dir
    b = prepare(inputs, tmp_path / "b", val_fraction=0.25, shard_tokens=300, num_workers=2).output_dir  # pool
    meta = read_meta(a)
    assert all(s["num_tokens"] <= 300 for s in meta["shards"]) and len(meta["shards"]) > 4
    for split in ("train", "val"):
        assert read_split(a, split).tobytes() == read_split(b, split).tobytes()
    train, val = read_split(a, "train"), read_split(a, "val")
    assert 0.15 < len(val) / (len(train) + len(val)) < 0.35
    # every document lands whole in one split, followed by eos
    tok = ByteTokenizer()
    found = tok.decode(train.tolist()).split(EOS)[:-1] + tok.decode(val.tolist()).split(EOS)[:-1]
    assert sorted(found) == sorted(docs)


def test_prepare_streams_big_file_in_pieces(tmp_path: Path):
    text = "".join(sentences(2000))  # ~50 KB of multi-byte text: several pieces cut at line ends
    assert len(text.encode()) > 3 * PIECE_BYTES
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    out = prepare([str(tmp_path / "big.txt")], tmp_path / "data", val_fraction=0.0, num_workers=0).output_dir
    assert ByteTokenizer().decode(read_split(out, "train").tolist()) == text + EOS
    # with a split, pieces of one document go to both; the jumps are marked by eos, no text is lost
    out = prepare([str(tmp_path / "big.txt")], tmp_path / "split", val_fraction=0.1, num_workers=0).output_dir
    train, val = read_split(out, "train"), read_split(out, "val")
    assert len(val) > 0 and len(train) + len(val) > len(text.encode())
    both = np.concatenate([train, val])
    assert np.array_equal(np.sort(both[both != 256]), np.sort(np.frombuffer(text.encode(), np.uint8)))


def test_dtype_follows_vocab_size(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS: 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w69999 w2 w65536")
    out = prepare([str(tmp_path / "doc.txt")], tmp_path / "data", str(tmp_path / "tokenizer.json"), 0.0)
    out = out.output_dir
    meta = read_meta(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    assert read_split(out, "train").tolist() == [69999, 2, 65536, 0]
    assert meta["shards"][0]["max_token_id"] == 69999


def test_prepare_bad_inputs(tmp_path: Path):
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(UserInputError, match="does not exist") as err:
        prepare([missing], tmp_path / "out")
    assert missing in str(err.value)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserInputError, match="0 tokens"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(UserInputError, match="not valid JSON") as err:
        prepare([str(bad)], tmp_path / "out")
    assert f"{bad}:2" in str(err.value)
    bad.write_text('{"text": "fine"}\n\n{"body": "x"}\n')
    with pytest.raises(UserInputError, match="text_field") as err:
        prepare([str(bad)], tmp_path / "out")
    assert f"{bad}:3" in str(err.value) and "'text'" in str(err.value)
    bad.write_text('{"body": "fine"}\n')
    assert prepare([str(bad)], tmp_path / "out", text_field="body").output_dir.is_dir()
    with pytest.raises(UserInputError, match="val_fraction=1.0"):
        prepare([str(bad)], tmp_path / "out2", val_fraction=1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.jsonl",
        "empty.txt",
        "out",
    ]  # no temp leftovers


def test_prepare_overwrites_only_a_dataset_it_wrote(tmp_path: Path, corpus):
    inputs, _ = corpus
    out = tmp_path / "data"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for overwrite in (False, True):  # not a dataset: refused either way, and --overwrite is no fix
        with pytest.raises(UserInputError, match="is not a dataset prepare wrote") as err:
            prepare(inputs, out, overwrite=overwrite)
        assert str(out) in str(err.value)
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and (
        out / "precious.txt"
    ).read_text() == "keep me"
    (out / "precious.txt").unlink()
    prepare(inputs, out)
    with pytest.raises(UserInputError, match="pass --overwrite true to replace it"):
        prepare(inputs, out)  # a dataset: replaced only when asked
    prepare(inputs, out, overwrite=True)
    assert (out / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "docs.jsonl", "texts"]


# Default corpus


def test_default_corpus_builds_once_and_survives_a_race(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_TRAIN_CACHE", str(tmp_path / "cache"))
    with multiprocessing.get_context("fork").Pool(2) as pool:  # two processes build at the same time
        paths = pool.starmap(default_corpus_dir, [()] * 2)
    assert paths[0] == paths[1] == default_corpus_dir()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [paths[0].name]  # no temp leftovers
    meta = read_meta(paths[0])
    assert meta["total_tokens"] > 1_000_000 and meta["tokenizer"] == "byte"
    assert {s["split"] for s in meta["shards"]} == {"train", "val"}
    text = ByteTokenizer().decode(read_split(paths[0], "val")[:20_000].tolist())
    assert "def " in text and "import " in text
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("LIGHTNING_TRAIN_CACHE", str(tmp_path / "file"))
    with pytest.raises(UserInputError, match="set LIGHTNING_TRAIN_CACHE to a writable folder") as err:
        default_corpus_dir()
    assert str(tmp_path / "file") in str(err.value)


# TextDataModule


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
