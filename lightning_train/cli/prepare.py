"""``python -m lightning_train prepare``: tokenize text files into token shards."""

from __future__ import annotations

from lightning_train.cli._parsers import parse_tool_args
from lightning_train.data import prepare
from lightning_train.data.shards import read_meta


def main(args: list[str]) -> None:
    output = prepare(**parse_tool_args(prepare, args, "prepare"))
    meta = read_meta(output)
    shards = meta["shards"]
    train, val = (sum(s["num_tokens"] for s in shards if s["split"] == split) for split in ("train", "val"))
    files = f"{len(shards)} shard file" + "s" * (len(shards) != 1)
    print(
        f"wrote {output}: {files}, {meta['total_tokens']:,} tokens "
        f"(train {train:,}, val {val:,}), tokenizer {meta['tokenizer']}"
    )
