"""``python -m lightning_train dashboard``: the W&B workspace view and its local JSON spec."""

from __future__ import annotations

from pathlib import Path

from lightning_train.cli._parsers import parse_tool_args
from lightning_train.loggers.dashboard import SPEC_FILE, dashboard


def main(args: list[str]) -> None:
    kwargs = parse_tool_args(dashboard, args, "dashboard")
    spec = dashboard(**kwargs)
    print(f"dashboard spec: {Path(kwargs['run_dir'] or '.') / SPEC_FILE}")
    if spec["url"]:
        print(f"W&B workspace: {spec['url']}")
