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
    """The alerts a run wrote, oldest first (empty when there were none)."""
    path = Path(log_dir) / ALERTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
