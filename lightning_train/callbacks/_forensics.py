"""NaNRecovery's last word: the current state as a checkpoint in the run's checkpoint folder, and a forensic
JSON report next to the logs (``nan_recovery_forensics.json``)."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_train.storage as storage
from lightning_train.callbacks.rng_state import rng_states

FORENSICS_FILE = "nan_recovery_forensics.json"


def save_with_forensics(
    trainer: L.Trainer, name: str, reason: str, state: dict[str, Any], settings: dict[str, Any]
) -> tuple[Path | str, Path]:
    """The current state as checkpoint ``name`` in the run's checkpoint folder (every rank: collective when
    sharded) and the forensic report of ``reason`` from NaNRecovery's ``state`` (its ``state_dict``) and
    ``settings``, written by rank zero."""
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    folder = dirpath or Path(trainer.default_root_dir, "checkpoints")
    # an s3:// folder stays a URL (Path would make it a local s3:/ folder)
    checkpoint = storage.join(str(folder), name) if storage.is_remote(folder) else Path(folder) / name
    forensics = Path(trainer.log_dir or trainer.default_root_dir) / FORENSICS_FILE
    trainer.save_checkpoint(checkpoint, weights_only=False)
    if trainer.is_global_zero:
        forensics.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "step": trainer.global_step, "reason": reason, "checkpoint": str(checkpoint),
            **{key: state[key] for key in ("snapshot_step", "skipped_steps", "spikes", "rollbacks", "reruns",
                                           "bad_steps")},
            "recent_steps": [{"step": step, "loss": loss, "grad_norm": norm}
                             for step, loss, norm in state["recent"]],
            "skipped_data": state["skipped_data"], "tried": state["events"], "rng": rng_states(),
            "settings": settings,
        }
        forensics.write_text(json.dumps(_json_safe(report), indent=2))
    return checkpoint, forensics


def _json_safe(value: Any) -> Any:
    """Non-finite floats as the strings "nan"/"inf"/"-inf" (strict JSON has no NaN), tensors (RNG states) as
    base64 of their bytes."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, torch.Tensor):
        return base64.b64encode(value.numpy().tobytes()).decode()
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value
