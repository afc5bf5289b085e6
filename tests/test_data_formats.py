"""prepare and SFTDataModule on the formats data is kept in (Parquet, Arrow file and stream, a datasets
folder, .jsonl.gz, .jsonl.zst, CSV): real files written here by their own libraries, read to the same tokens
as the JSONL of the same records; read a batch at a time; a bad row is one error line naming file and row."""

from __future__ import annotations

import csv
import gzip
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
datasets = pytest.importorskip("datasets")

from lightning_train.data import prepare  # noqa: E402
from lightning_train.data.readers import iter_rows  # noqa: E402
from lightning_train.data.sft import SFTDataModule  # noqa: E402
from lightning_train.errors import UserInputError  # noqa: E402
from tests.conftest import run_cli, run_cli_in_process  # noqa: E402
from tests.test_tool_outputs import error_line, snapshot  # noqa: E402


def _table(rows: list[dict]) -> object:
    return pa.Table.from_pylist(rows)


def _parquet(path: Path, rows: list[dict]) -> None:
    pq.write_table(_table(rows), path, row_group_size=7)  # several row groups


def _arrow_file(path: Path, rows: list[dict]) -> None:
    table = _table(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, 9)  # several record batches


def _arrow_stream(path: Path, rows: list[dict]) -> None:
    table = _table(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, 9)


def _datasets_folder(path: Path, rows: list[dict]) -> None:
    datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=3)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _jsonl_gz(path: Path, rows: list[dict]) -> None:
    path.write_bytes(gzip.compress(_jsonl(rows)))


def _jsonl_zst(path: Path, rows: list[dict]) -> None:
    data, compress = _jsonl(rows), zstandard.ZstdCompressor().compress
    path.write_bytes(compress(data[:300]) + compress(data[300:]))  # two frames, as parallel zstd writes


def _csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


WRITERS: dict[str, tuple[str, Callable[[Path, list[dict]], None]]] = {
    "parquet": ("docs.parquet", _parquet),
    "arrow file": ("docs.arrow", _arrow_file),
    "arrow stream": ("docs.arrow", _arrow_stream),
    "datasets folder": ("docs", _datasets_folder),
    "jsonl.gz": ("docs.jsonl.gz", _jsonl_gz),
    "jsonl.zst": ("docs.jsonl.zst", _jsonl_zst),
    "csv": ("docs.csv", _csv),
}
DOCS = [{"id": n, "body": f"document {n}: " + "the quick brown fox, " * (n % 5 + 1) + "\nnext line é"}
        for n in range(40)]


def _write(kind: str, folder: Path, rows: list[dict]) -> Path:
    name, writer = WRITERS[kind]
    writer(folder / name, rows)
    return folder / name


def _shards(output_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(Path(output_dir).iterdir())}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_prepare_reads_each_format_to_the_tokens_of_its_jsonl(tmp_path: Path, kind: str) -> None:
    (tmp_path / "in").mkdir()
    given = _write(kind, tmp_path / "in", DOCS)
    (tmp_path / "docs.jsonl").write_bytes(_jsonl(DOCS))
    options = dict(val_fraction=0.1, text_field="body", num_workers=0)
    reference = prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "reference"), **options)
    prepared = prepare([str(given)], str(tmp_path / "out"), **options)
    assert prepared.total_tokens == reference.total_tokens > 0 and prepared.val_tokens > 0
    assert _shards(prepared.output_dir) == _shards(reference.output_dir)  # meta.json and every token


def test_prepare_cli_reads_a_folder_of_every_format(tmp_path: Path) -> None:
    """A folder holding every format (a datasets folder among them: its Arrow files, not its JSON)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for n, kind in enumerate(WRITERS):
        (corpus / str(n)).mkdir()
        _write(kind, corpus / str(n), DOCS)
    result = run_cli("prepare", "--inputs", f"[{corpus}]", "--output_dir", str(tmp_path / "out"),
                     "--text_field", "body", "--num_workers", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    one_pass = sum(len(row["body"].encode()) + 1 for row in DOCS)  # bytes and one end token a document
    assert meta["total_tokens"] == len(WRITERS) * one_pass
    assert f"tokens from {len(WRITERS) + 2} files" in result.stdout  # the datasets folder is 3 Arrow files


def test_parquet_is_read_a_batch_at_a_time(tmp_path: Path) -> None:
    """One row group of 20 MB of text: the reader holds a few MB of Arrow memory at any time, not the table
    (memory flat in the corpus's size; docs/benchmarks.md measures prepare's peak RSS)."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghij", k=6)) for _ in range(2000)]
    docs = [" ".join(rng.choices(words, k=300)) for _ in range(10_000)]  # 21 MB, compresses little
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path, row_group_size=len(docs))
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    peak, rows = 0, 0
    for rows, row, _ in iter_rows(path, ["text"]):  # noqa: B007
        if rows % 100 == 0:
            peak = max(peak, pa.total_allocated_bytes())
        assert row["text"] == docs[rows - 1]
    assert rows == len(docs)
    assert peak < 10e6 < sum(map(len, docs)) / 2, peak


# ---- bad rows: one error line naming the file and the row, exit 2, nothing written -----------------------


def _truncated(kind: str, rows: list[dict] = DOCS) -> Callable[[Path], Path]:
    def setup(folder: Path) -> Path:
        path = _write(kind, folder, rows * 20)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return path

    return setup


def _rows(kind: str, rows: list[dict]) -> Callable[[Path], Path]:
    return lambda folder: _write(kind, folder, rows)


def _corrupt_gzip(folder: Path) -> Path:
    path = _write("jsonl.gz", folder, DOCS * 20)
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))
    return path


def _file(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


BAD = {
    "parquet without the text column": (_rows("parquet", [{"id": 1, "text": "x"}]),
                                        "docs.parquet row 1 has no string field 'body' (missing or null)"),
    "parquet with an int column": (_rows("parquet", [{"body": 1}, {"body": 2}]),
                                   "docs.parquet row 1 has no string field 'body' (of type int)"),
    "arrow with a null": (_rows("arrow file", [{"body": "a"}, {"body": None}, {"body": "c"}]),
                          "docs.arrow row 2 has no string field 'body' (missing or null)"),
    "csv row without the column": (lambda folder: _file(folder / "docs.csv", b"id,body\n1,a\n2\n"),
                                   "docs.csv row 2 has no string field 'body' (missing or null)"),
    "csv that is not UTF-8": (lambda folder: _file(folder / "docs.csv", b"body\nok\ncaf\xe9\n"),
                              "docs.csv row 2: byte 0xe9 is not UTF-8"),
    "truncated jsonl.gz": (_truncated("jsonl.gz"), "the gzip data is broken"),
    "corrupt jsonl.gz": (_corrupt_gzip, "the gzip data is broken"),
    "truncated jsonl.zst": (_truncated("jsonl.zst"), "the zstd data is broken (the file ends inside a zstd"),
    "truncated parquet": (_truncated("parquet"), "docs.parquet row 1: cannot read it as Parquet"),
    "truncated arrow stream": (_truncated("arrow stream"), "cannot read it as Arrow"),
}


@pytest.mark.parametrize("setup, expected", BAD.values(), ids=list(BAD))
def test_a_bad_row_is_one_error_line_naming_file_and_row(tmp_path: Path, setup, expected: str) -> None:
    (tmp_path / "in").mkdir()
    path = setup(tmp_path / "in")
    before = snapshot(tmp_path)
    result = run_cli_in_process("prepare", "--inputs", f"[{path}]", "--output_dir", "out",
                                "--text_field", "body", "--num_workers", "0", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    line = error_line(result)
    assert str(path) in line and expected in line, line
    assert snapshot(tmp_path) == before  # no output folder, no staging folder left


def test_a_broken_stream_names_the_line_it_reached(tmp_path: Path) -> None:
    """A truncated .jsonl.gz fails at the line after the last one it could read whole."""
    path = _truncated("jsonl.gz")(tmp_path)
    whole = 0
    with gzip.open(path) as lines, pytest.raises(EOFError):
        for whole, _ in enumerate(lines, start=1):  # noqa: B007
            pass
    with pytest.raises(UserInputError, match=rf"{path}:{whole + 1}: the gzip data is broken"):
        prepare([str(path)], str(tmp_path / "out"), text_field="body", num_workers=0)


# ---- SFTDataModule --------------------------------------------------------------------------------------

PAIRS = [{"question": f"{n} + 1 = ", "answer": str(n + 1)} for n in range(30)]


@pytest.mark.parametrize("kind", list(WRITERS))
def test_sft_reads_each_format_with_its_field_names(tmp_path: Path, kind: str) -> None:
    (tmp_path / "in").mkdir()
    given = _write(kind, tmp_path / "in", PAIRS)
    (tmp_path / "pairs.jsonl").write_bytes(_jsonl([{"prompt": r["question"], "response": r["answer"]}
                                                   for r in PAIRS]))
    sets = []
    for train, fields in ((tmp_path / "pairs.jsonl", {}),
                          (given, {"prompt_field": "question", "response_field": "answer"})):
        data = SFTDataModule(str(train), str(train), tokenizer="byte", seq_len=32, **fields)
        data.setup("fit")
        sets.append((data.train_set.rows, data.val_set.rows))
    assert sets[0] == sets[1] and len(sets[0][0]) == len(PAIRS)


def test_sft_reads_chats_from_a_parquet_list_column(tmp_path: Path) -> None:
    chats = [[{"role": "user", "content": f"say {n}"}, {"role": "assistant", "content": str(n)}]
             for n in range(10)]
    pq.write_table(pa.table({"turns": chats}), tmp_path / "chats.parquet")
    (tmp_path / "chats.jsonl").write_bytes(_jsonl([{"messages": chat} for chat in chats]))
    rows = []
    for train, fields in ((tmp_path / "chats.jsonl", {}),
                          (tmp_path / "chats.parquet", {"messages_field": "turns"})):
        data = SFTDataModule(str(train), str(train), tokenizer="byte", seq_len=64, **fields)
        data.setup("fit")
        rows.append(data.val_set.rows)
    assert rows[0] == rows[1] and len(rows[0]) == 10


def test_sft_bad_rows_name_file_and_row(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["x", None]}), tmp_path / "bad.parquet")
    with pytest.raises(UserInputError, match=r"bad.parquet row 2: expected .*keys \['prompt', 'response'\]"):
        SFTDataModule(str(tmp_path / "bad.parquet"), tokenizer="byte").setup("fit")
    _truncated("jsonl.zst", PAIRS)(tmp_path)
    with pytest.raises(UserInputError, match=r"docs.jsonl.zst:\d+: the zstd data is broken"):
        SFTDataModule(str(tmp_path / "docs.jsonl.zst"), tokenizer="byte", prompt_field="question",
                      response_field="answer").setup("fit")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserInputError, match="is a folder \\(not a datasets save_to_disk folder\\)"):
        SFTDataModule(str(tmp_path / "folder"), tokenizer="byte").setup("fit")


@pytest.mark.parametrize("kind, package", [("parquet", "pyarrow"), ("jsonl.zst", "zstandard")])
def test_a_missing_extra_is_one_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                                package: str) -> None:
    path = _write(kind, tmp_path, DOCS)
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: its import raises ImportError
    result = run_cli_in_process("prepare", "--inputs", f"[{path}]", "--output_dir", "out",
                                "--text_field", "body", "--num_workers", "0", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == (f"error: reading {path} needs the {package} package: "
                                  "pip install 'lightning_train[formats]'")
    assert not (tmp_path / "out").exists()


def test_a_dataset_dict_folder_asks_for_one_split(tmp_path: Path) -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(DOCS),
                                   "test": datasets.Dataset.from_list(DOCS[:5])})
    splits.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(UserInputError, match=r"holds a datasets DatasetDict \(splits \['test', 'train'\]\); "
                                             r"pass one split's folder, e.g. .*hf/test"):
        prepare([str(tmp_path / "hf")], str(tmp_path / "out"), text_field="body", num_workers=0)
    prepared = prepare([str(tmp_path / "hf" / "train")], str(tmp_path / "out"), text_field="body",
                       num_workers=0)
    assert prepared.total_tokens == sum(len(row["body"].encode()) + 1 for row in DOCS)
