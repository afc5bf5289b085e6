"""``prepare``'s validation split: a contiguous tail (``val_split="tail"``) or inputs of its own
(``val_inputs``), read back from the shards it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_train.data import prepare, read_meta
from lightning_train.data.tokenizers import ByteTokenizer
from lightning_train.errors import UserInputError
from tests.conftest import run_cli_in_process
from tests.helpers.tiny_runs import read_split

EOS = "<|endoftext|>"


def files(folder: Path, name: str, count: int) -> list[str]:
    """``count`` one-document files of 100 bytes each, sorted as prepare reads a folder."""
    folder.mkdir(parents=True)
    docs = [f"{name} {n:03d} ".ljust(99, "x") + "\n" for n in range(count)]
    for n, doc in enumerate(docs):
        (folder / f"{n:03d}.txt").write_text(doc)
    return docs


def text(folder: Path, split: str) -> str:
    return ByteTokenizer().decode(read_split(folder, split).tolist())


def test_a_tail_holds_out_the_last_documents_contiguously(tmp_path):
    docs = files(tmp_path / "docs", "doc", 20)
    out = prepare([str(tmp_path / "docs")], tmp_path / "data", val_fraction=0.2, val_split="tail",
                  num_workers=0).output_dir
    assert text(out, "train") == EOS.join(docs[:16]) + EOS  # the first 80 % of the bytes, in order
    assert text(out, "val") == EOS.join(docs[16:]) + EOS  # the last 4 documents, nothing of them in train
    assert (read_meta(out)["val_split"], read_meta(out)["val_fraction"]) == ("tail", 0.2)
    spread = prepare([str(tmp_path / "docs")], tmp_path / "spread", val_fraction=0.2, num_workers=0)
    assert text(spread.output_dir, "val") != text(out, "val")  # the default spreads val over the corpus


def test_val_inputs_are_the_validation_split_and_the_inputs_all_train(tmp_path):
    train_docs, val_docs = files(tmp_path / "train", "train", 6), files(tmp_path / "held", "held", 3)
    result = run_cli_in_process("prepare", "--inputs", f"[{tmp_path / 'train'}]", "--val_inputs",
                                f"[{tmp_path / 'held'}]", "--output_dir", str(tmp_path / "data"),
                                "--num_workers", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "data"
    assert text(out, "train") == EOS.join(train_docs) + EOS
    assert text(out, "val") == EOS.join(val_docs) + EOS
    assert (read_meta(out)["val_split"], read_meta(out)["val_fraction"]) == ("inputs", 0.0)


def test_split_options_that_contradict_are_one_clear_error(tmp_path):
    files(tmp_path / "docs", "doc", 2)
    docs = [str(tmp_path / "docs")]
    with pytest.raises(UserInputError, match="val_inputs is the validation split, so val_fraction"):
        prepare(docs, tmp_path / "a", val_inputs=docs, val_fraction=0.1)
    with pytest.raises(UserInputError, match="val_split='end' must be 'spread'"):
        prepare(docs, tmp_path / "b", val_split="end")
    with pytest.raises(UserInputError, match="val_inputs .* contain no text files"):
        (tmp_path / "empty").mkdir()
        prepare(docs, tmp_path / "c", val_inputs=[str(tmp_path / "empty")])
