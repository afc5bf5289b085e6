"""``python -m lightning_train SUBCOMMAND``: LightningCLI's fit/validate/test/predict, plus tools.

    python -m lightning_train fit --config configs/pretrain-tiny.yaml
    python -m lightning_train fit --config configs/pretrain-tiny.yaml --print_config
    python -m lightning_train prepare --inputs '[corpus/]' --output_dir data/corpus

``trainer.py`` holds ``LightningTrainCLI`` (the Trainer subcommands and the run layout); each tool is
one file here (``prepare.py``, ``generate.py``, ...) that parses its arguments, calls the library
and prints. Library modules never import this package. Only the Trainer subcommands import Lightning
(seconds): the top-level help and the tools answer without it.
"""

from __future__ import annotations

import atexit
import importlib
import sys
from typing import Any

from lightning_train._lazy import lazy_exports
from lightning_train._warnings import plain_package_warnings, silence_known_noise
from lightning_train.cli._failure import (
    claim_report,
    clear_progress_bars,
    peer_failure_code,
    print_error_line,
    reported_cause,
)
from lightning_train.cli._parsers import PROG, SUBCOMMANDS, TOOLS, top_level_help
from lightning_train.errors import TrainingAborted, UserInputError

__all__ = ["LightningTrainCLI", "main"]
__getattr__, __dir__ = lazy_exports(globals(), {"LightningTrainCLI": "lightning_train.cli.trainer"})


def main(argv: list[str] | None = None) -> None:
    """Run a subcommand or a tool. As the process's entry point (``argv`` None: ``python -m
    lightning_train``, the ``lightning-train`` script), a process that joined a process group ends
    through ``end_distributed_process``, its exit code kept."""
    if argv is not None:
        _main(argv)
        return
    try:
        _main(None)
        code = 0
    except SystemExit as exit:  # Preempted (75, 130), bad input (2), an abort (3), --help (0)
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    if _joined_process_group():
        from lightning_train._compat import end_distributed_process

        end_distributed_process(code)
    sys.exit(code)


def _joined_process_group() -> bool:
    """Whether this process ran a process group (only a Trainer subcommand can: torch is loaded then)."""
    torch: Any = sys.modules.get("torch")
    return torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def _main(argv: list[str] | None) -> None:
    args = sys.argv[1:] if argv is None else argv
    silence_known_noise()  # the CLI's console, not the package's import: a library user's filters stay theirs
    try:
        if not args or not (args[0].startswith("-") or args[0] in TOOLS or args[0] in SUBCOMMANDS):
            given = f"unknown subcommand {args[0]!r}" if args else "no subcommand given"
            raise UserInputError(
                f"{given}; use one of {', '.join([*SUBCOMMANDS, *TOOLS])} (see `{PROG} --help`)"
            )
        if args[0] in TOOLS:
            tool = importlib.import_module(f"lightning_train.cli.{args[0]}")
            plain_package_warnings()
            tool.main(args[1:])
        elif {"-h", "--help"} & set(args) and not set(SUBCOMMANDS) & set(args):
            print(top_level_help(), end="")
        else:
            from lightning_train._compat import (
                object_storage_check_without_imports,
                torchmetrics_without_heavy_extras,
            )

            torchmetrics_without_heavy_extras()  # before Lightning's import, which imports torchmetrics
            from lightning_train.cli.trainer import LightningTrainCLI

            object_storage_check_without_imports()
            from lightning_train.strategies.processes import leave_process_group

            atexit.register(leave_process_group)  # whatever the strategy: see leave_process_group
            plain_package_warnings()  # after Lightning's import, which installs a warning format of its own
            LightningTrainCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except Exception as error:
        cause = reported_cause(error)
        if cause is None:
            peer_code = peer_failure_code()
            if peer_code is None:
                raise
            clear_progress_bars()
            sys.exit(peer_code)  # a peer rank reported the failure; this rank only lost it
        code = 3 if isinstance(cause, TrainingAborted) else 2
        if claim_report(code):  # one line per failure, not one per rank that found it
            print_error_line(str(cause))
        sys.exit(code)
