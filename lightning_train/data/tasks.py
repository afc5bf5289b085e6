"""The default fine-tuning task, generated locally: snake_case function names of the Python standard
library to CamelCase.

It suits the default pretrained model (byte-level, trained on those very sources): the names are familiar,
the rule is exact, so greedy generations can be scored by exact match, and a tiny model learns it in
minutes on a CPU. Train and val names are disjoint, so val exact match measures the rule, not memory.

    {"prompt": "read_file_lines in CamelCase: ", "response": "ReadFileLines"}
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import zlib
from pathlib import Path

from lightning_train.data.default_corpus import cache_dir
from lightning_train.data.sources import stdlib_sources

TASK_VERSION = 2
PROMPT = "{} in CamelCase: "
NAME = re.compile(rb"^\s*def ([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\(", re.MULTILINE)


def snake_to_camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def default_task_dir(val_fraction: float = 0.1, max_len: int = 24) -> Path:
    """Folder with ``train.jsonl`` and ``val.jsonl`` of the default task, built on first use (seconds)."""
    out = cache_dir() / f"sft-snake-to-camel-v{TASK_VERSION}"
    if (out / "val.jsonl").is_file():
        return out
    names = sorted({m.decode() for path in stdlib_sources() for m in NAME.findall(path.read_bytes())})
    names = [n for n in names if len(n) <= max_len]
    random.Random(0).shuffle(names)
    # The split depends on the name only, so it is stable however the list changes.
    is_val = {n: zlib.crc32(n.encode()) % 1000 < val_fraction * 1000 for n in names}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    for split, wanted in (("train", False), ("val", True)):
        rows = [
            {"prompt": PROMPT.format(n), "response": snake_to_camel(n)} for n in names if is_val[n] == wanted
        ]
        (tmp / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    try:
        os.rename(tmp, out)
    except OSError:  # another process built it first
        for file in tmp.iterdir():
            file.unlink()
        tmp.rmdir()
    return out
