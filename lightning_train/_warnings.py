"""The one home of this package's console hygiene: known harmless noise of its dependencies is dropped,
every other warning stays visible, and the package's own warnings read ``warning: ...``.

Each filter names one exact message and the module (or logger) that emits it, never a whole category,
so a new or real warning from the same library still shows. Remove a filter once the pinned library
version no longer emits its message.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

# (message regex, category, module regex): Python warnings matched by all three are ignored.
_KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # Lightning's own pytree helper still builds LeafSpec(); torch deprecated the class, not the result.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     r"lightning\.pytorch\.utilities\._pytree$"),
    # torchdata's StatefulDataLoader calls torch.set_vital, which torch made a no-op.
    (r"'set_vital' is deprecated", UserWarning, r"torchdata\.stateful_dataloader\.stateful_dataloader$"),
    # A sharded checkpoint read in one plain process (``consolidate``, ``open_pretrained``) is the intent.
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
     r"single process", UserWarning, r"torch\.distributed\.checkpoint\.utils$"),
)

# (logger name, message regex): log records of that logger matching the regex are dropped.
_KNOWN_LOG_LINES: tuple[tuple[str, str], ...] = (
    # Lightning advertises its cloud products (litlogger, litmodels) at every fit.
    *((name, r"^💡 Tip: .*\blit(logger|models)\b") for name in (
        "lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")),
    # torchao's CUDA-only kernel libraries (Hopper CUTLASS, MX fp8) do not load in a CPU-only torch;
    # float8 training here uses torch._scaled_mm, not these.
    ("torchao", r"^Failed to load \S*torchao/_C_(cutlass_90a|mxfp8)\S*\.so"),
    # torchao registers its Enums as pytree constants; torch now handles Enums natively.
    ("torch.utils._pytree", r"is an Enum subclass .* register_constant\(\) on Enum subclasses is deprecated"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_known_noise() -> None:
    """Install the filters above (idempotent). The CLI does, as it starts; importing the package does not,
    so a library user's warning filters stay theirs."""
    for message, category, module in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    if "SLURM_JOB_ID" not in os.environ:
        # SLURM's client installed (a login node, a workstation) and a fit outside any job: Lightning's hint
        # to prepend srun is noise there; inside a job it may name a real mistake, so it stays
        warnings.filterwarnings(
            "ignore", message=r"The `srun` command is available on your system but is not used",
            category=UserWarning, module=r"lightning\.fabric\.plugins\.environments\.slurm$",
        )
    for name, pattern in _KNOWN_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))


def silence_resumed_checkpoint_dir(dirpath: str | Path) -> None:
    """Drop ModelCheckpoint's "Checkpoint directory DIRPATH exists and is not empty" for this one folder:
    a run that resumes from its own checkpoints finds them there by design. The warning stays for every
    other folder (a new run writing among files it did not make)."""
    message = rf"Checkpoint directory {re.escape(str(dirpath))} exists and is not empty\.$"
    source = r"lightning\.pytorch\.callbacks\.model_checkpoint$"
    warnings.filterwarnings("ignore", message=message, category=UserWarning, module=source)


_PACKAGE_DIR = Path(__file__).resolve().parent
_python_format = warnings.formatwarning


def _format(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            line: str | None = None) -> str:
    if Path(filename).resolve().is_relative_to(_PACKAGE_DIR):
        return f"warning: {message}\n"  # the message names what to do; the source line does not help
    return _python_format(message, category, filename, lineno, line)


def plain_package_warnings() -> None:
    """The CLI's console: this package's warnings print as ``warning: ...`` (like its ``error: ...``
    lines), without the source path and line that Python puts in front; other libraries' keep theirs."""
    warnings.formatwarning = _format
