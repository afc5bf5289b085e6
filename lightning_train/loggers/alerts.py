"""Alert events: one way for callbacks to tell people that training needs attention.

A callback calls ``send_alert(trainer, title, text, level)``. The alert is warned once on rank zero,
appended to ``alerts.jsonl`` in the run's log folder when the Trainer has a logger (so reports can
show it), and handed to every
logger of the Trainer that has a ``log_alert(title, text, level, step)`` method (the W&B preset
turns it into a W&B alert). Loggers without that method are left alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lightning_train.errors import UserInputError

if TYPE_CHECKING:
    import lightning as L

AlertLevel = Literal["INFO", "WARN", "ERROR"]
ALERTS_FILE = "alerts.jsonl"


def send_alert(trainer: L.Trainer, title: str, text: str, level: AlertLevel = "WARN") -> None:
    """Raise an alert at the current optimizer step. Call it on every rank; only rank zero writes."""
    log_dir = trainer.log_dir  # a collective (Lightning broadcasts it): read it on every rank
    if not trainer.is_global_zero:
        return
    step = trainer.global_step
    from lightning.pytorch.utilities import rank_zero_warn  # here, not at the top: `report` reads alerts

    rank_zero_warn(f"[{level}] {title} (step {step}): {text}")
    if trainer.loggers and log_dir is not None:  # logger=False: the user asked for no files
        path = Path(log_dir) / ALERTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"time": time.time(), "step": step, "level": level, "title": title, "text": text}
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    for logger in trainer.loggers:
        log_alert = getattr(logger, "log_alert", None)
        if callable(log_alert):
            log_alert(title=title, text=text, level=level, step=step)


def read_alerts(log_dir: str | Path) -> list[dict]:
    """The alerts a run wrote, oldest first (empty when there were none); a file that cannot be read as
    one (a folder, bytes that are not UTF-8, a line that is not an alert's JSON) is one error line naming
    it."""
    path = Path(log_dir) / ALERTS_FILE
    try:
        content = path.read_bytes()  # split before decoding, so an error can name its line
    except FileNotFoundError:
        return []
    except IsADirectoryError as error:
        raise UserInputError(f"{path} is a folder, not the run's alerts file; {_fix(path)}") from error
    except OSError as error:
        raise UserInputError(f"cannot read {path} ({error.strerror or error}); {_fix(path)}") from error
    return [_alert(line, path, number) for number, line in enumerate(content.splitlines(), 1) if line.strip()]


def _alert(line: bytes, path: Path, number: int) -> dict:
    """Line ``number`` of ``path``: one alert, as ``send_alert`` wrote it."""
    try:
        alert = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        byte = line[error.start]
        raise UserInputError(f"{path} line {number} holds byte 0x{byte:02x}, which is not UTF-8; "
                             f"{_fix(path)}") from error
    except json.JSONDecodeError as error:
        raise UserInputError(f"{path} line {number} is not JSON ({error.msg} at column {error.colno}); "
                             f"{_fix(path)}") from error
    # the four fields a report shows: without them it would fail later, with a traceback
    if not (isinstance(alert, dict) and isinstance(alert.get("step"), int)
            and all(isinstance(alert.get(key), str) for key in ("level", "title", "text"))):
        raise UserInputError(f"{path} line {number} is not an alert (an object with step, level, title and "
                             f"text); {_fix(path)}")
    return alert


def _fix(alerts_file: Path) -> str:
    return (f"restore the file the run wrote, or move it out of {alerts_file.parent} to leave that launch's "
            "alerts out")
