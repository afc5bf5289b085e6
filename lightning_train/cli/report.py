"""``python -m lightning_train report RUN_DIR``: PNG plots and report.html of a run's metrics."""

from __future__ import annotations

from lightning_train.cli._parsers import parse_tool_args
from lightning_train.loggers.report import report


def main(args: list[str]) -> None:
    result = report(**parse_tool_args(report, args, "report", positional=True))
    print(f"report: {result['output_dir']}/report.html ({len(result['plots'])} plots)")
