"""``prepare``'s throughput in MB of input a CPU-second (MB/s per core), beside the ceiling: the
``tokenizers`` library's own ``encode_batch`` and ``encode_batch_fast`` on the same text with the same
tokenizer.json, on one thread.

Corpora: the default corpus (this Python's standard-library sources, what ``prepare`` reads given no inputs)
and a generated Parquet corpus (``--parquet_mb``; documents of random standard-library lines, several row
groups), plus a Parquet corpus a tenth that size, to show ``prepare``'s peak memory flat in the corpus's
size. Each ``prepare`` is a whole CLI process, start-up included; its CPU seconds are its own and its
tokenizer processes' (``--num_workers``; 0: one process, the per-core rate without the pool's hand-offs),
its peak RSS the main process's (Linux, /proc). The tokenizer is a byte-level BPE of 8192 tokens trained
here with the ``tokenizers`` library on the default corpus; the byte tokenizer's throughput is shown too
(it has no ``tokenizers`` ceiling).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prepare_throughput.py --parquet_mb 200   # ~6 CPU-minutes
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, base_parser, machine_info, print_table, write_json

BATCH = 256  # documents an encode_batch call
DOC_LINES = 80  # lines of a generated document (~3 kB)
GROUP_DOCS = 300  # documents a Parquet row group (~1 MB)
# Runs `prepare` in this process and prints its own and its pool's CPU seconds, and its own peak RSS:
# VmHWM, since Linux's ru_maxrss keeps the launching process's peak across exec.
PROBE = """
import json, re, resource, sys
from pathlib import Path
from lightning_train.cli import main
try:
    main(sys.argv[1:])
finally:
    own, pool = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_kb = int(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
    print(json.dumps({"cpu": own.ru_utime + own.ru_stime + pool.ru_utime + pool.ru_stime,
                      "peak_rss_mb": peak_kb / 1024}), file=sys.stderr)
"""


def default_corpus(limit: int | None) -> list[Path]:
    from lightning_train.data.sources import MAX_BYTES, stdlib_sources

    return stdlib_sources(limit or MAX_BYTES)


def train_tokenizer(files: list[Path], path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path))
    return path


def write_parquet(path: Path, lines: list[str], megabytes: float, seed: int) -> int:
    """Documents of random lines, written a row group at a time; returns the text's bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, written = random.Random(seed), 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        while written < megabytes * 1e6:
            docs = ["".join(rng.choices(lines, k=DOC_LINES)) for _ in range(GROUP_DOCS)]
            writer.write_table(pa.table({"text": docs}))
            written += sum(len(doc.encode()) for doc in docs)
    return written


def run_prepare(inputs: list[str], tokenizer: str, workers: int, work: Path) -> dict[str, float]:
    out = work / "out"
    command = [sys.executable, "-c", PROBE, "prepare", "--output_dir", str(out), "--tokenizer", tokenizer,
               "--num_workers", str(workers), "--overwrite", "true",
               *(["--inputs", json.dumps(inputs)] if inputs else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"prepare failed:\n{done.stderr[-3000:]}")
    reading = json.loads(done.stderr.strip().splitlines()[-1])
    meta = json.loads((out / "meta.json").read_text())
    return {**reading, "wall": wall, "tokens": meta["total_tokens"]}


def encode_ceiling(texts_in_batches: Any, tokenizer: Path) -> dict[str, Any]:
    """CPU seconds of ``encode_batch`` and of ``encode_batch_fast`` (no offsets) over every batch, each batch
    through both back to back (so the machine's load falls on both alike), and the bytes encoded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    cpu, nbytes, tokens = {"encode_batch": 0.0, "encode_batch_fast": 0.0}, 0, 0
    for texts in texts_in_batches:
        for name in cpu:
            started = time.process_time()
            encoded = getattr(tok, name)(texts, add_special_tokens=False)
            cpu[name] += time.process_time() - started
        nbytes += sum(len(text.encode()) for text in texts)
        tokens += sum(len(e.ids) for e in encoded)
    return {"cpu": cpu, "bytes": nbytes, "tokens": tokens,
            "mb_per_cpu_s": {name: nbytes / 1e6 / seconds for name, seconds in cpu.items()}}


def file_batches(files: list[Path]) -> Any:
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in files]
    for start in range(0, len(texts), BATCH):
        yield texts[start:start + BATCH]


def parquet_batches(path: Path) -> Any:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=["text"]):
        yield batch.column(0).to_pylist()


def main() -> None:
    parser = base_parser("prepare_throughput", __doc__.split("\n\n")[0])
    parser.add_argument("--parquet_mb", type=float, default=200, help="the generated Parquet corpus's MB")
    parser.add_argument("--num_workers", type=int, default=0, help="prepare's tokenizer processes")
    args = parser.parse_args()
    # One thread for encode_batch (and all else): a per-core ceiling. With a thread a core, rayon's idle
    # threads spin and count CPU time, which made encode_batch look 1.3x-1.6x slower a CPU-second than
    # prepare's one-document encode calls on this shared machine.
    os.environ["RAYON_NUM_THREADS"] = "1"
    parquet_mb, limit = (2, 1_000_000) if args.smoke else (args.parquet_mb, None)
    info = machine_info(args.threads)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        stdlib = default_corpus(limit)
        tokenizer = train_tokenizer(stdlib, work / "tokenizer.json")
        lines = [line for path in stdlib for line in path.read_text(encoding="utf-8", errors="replace")
                 .splitlines(keepends=True)]
        corpora: dict[str, tuple[list[str], int, Any]] = {
            "default corpus": ([] if limit is None else [str(p) for p in stdlib],
                               sum(p.stat().st_size for p in stdlib), lambda: file_batches(stdlib))}
        for name, megabytes, seed in (("small", parquet_mb / 10, 1), ("generated", parquet_mb, 2)):
            path = work / f"{name}.parquet"
            text_bytes = write_parquet(path, lines, megabytes, seed)
            corpora[f"Parquet {text_bytes / 1e6:.0f} MB"] = ([str(path)], text_bytes,
                                                            lambda path=path: parquet_batches(path))
        for corpus, (inputs, text_bytes, batches) in corpora.items():
            ceiling = encode_ceiling(batches(), tokenizer)
            for tok_name, spec in (("bpe 8192", str(tokenizer)), ("byte", "byte")):
                run = run_prepare(inputs, spec, args.num_workers, work)
                rate = text_bytes / 1e6 / run["cpu"]
                cells = {"prepare_mb_per_cpu_s": rate, "peak_rss_mb": run["peak_rss_mb"], **run}
                if tok_name == "byte":
                    rows.append([corpus, text_bytes / 1e6, tok_name, rate, run["peak_rss_mb"], "—", "—", "—"])
                else:
                    top = max(ceiling["mb_per_cpu_s"].values())
                    cells.update(ceiling_mb_per_cpu_s=top, ceiling=ceiling)
                    rows.append([corpus, text_bytes / 1e6, tok_name, rate, run["peak_rss_mb"],
                                 ceiling["mb_per_cpu_s"]["encode_batch"],
                                 ceiling["mb_per_cpu_s"]["encode_batch_fast"], f"{rate / top:.2f}x"])
                results[f"{corpus}, {tok_name}"] = cells
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    table = print_table(["corpus", "MB", "tokenizer", "prepare MB/s per core", "prepare peak RSS MB",
                         "encode_batch MB/s per core", "encode_batch_fast MB/s per core",
                         "prepare / the faster"], rows)
    write_json(args.out, {"benchmark": "prepare_throughput", "smoke": args.smoke, "machine": info,
                          "setup": {"parquet_mb": parquet_mb, "num_workers": args.num_workers},
                          "results": results, "table": table})


if __name__ == "__main__":
    main()
