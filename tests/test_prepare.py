"""prepare, tokenizers and the default corpus, on real files in tmp_path."""

from __future__ import annotations

import json
import multiprocessing
import signal
from pathlib import Path

import numpy as np
import pytest

from lightning_train.data import (
    ByteTokenizer,
    HFTokenizer,
    default_corpus_dir,
    load_tokenizer,
    prepare,
    read_meta,
)
from lightning_train.data.sources import PIECE_BYTES
from lightning_train.errors import UserInputError
from tests.helpers.tiny_runs import read_split, sentences

EOS = "<|endoftext|>"


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


def _record_sigterm_action(path: str) -> None:
    Path(path).write_text(str(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL))


def test_tokenizer_workers_are_forked_with_sigterms_default_action(tmp_path: Path, monkeypatch):
    """Lightning's SIGTERM handler (set by any in-process Trainer run) only logs: a worker that inherited it
    and was stuck from the fork outlived the SIGTERM of the pool's exit, which then waited forever (CI hung
    so). Each worker starts with the default action; the parent gets its own handler back."""
    from lightning_train.data import encoding

    records = [tmp_path / "worker0", tmp_path / "worker1"]
    handler = lambda signum, frame: None  # noqa: E731  (as Lightning's: it only logs)
    before = signal.signal(signal.SIGTERM, handler)
    try:
        with encoding.tokenizer_pool(2, "byte") as pool:
            pool.map(_record_sigterm_action, [str(p) for p in records])
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [p.read_text() for p in records] == ["True", "True"]
