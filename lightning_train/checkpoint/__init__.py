"""The one home of checkpoints.

- ``format``: what a checkpoint is on disk (manifest, atomic writes, verification, safe loading);
- ``io``: ``AtomicCheckpointIO``, the Trainer plugin that writes and loads checkpoint files that way;
- ``sharded``: ``torch.distributed.checkpoint`` folders, saved and loaded at any world size;
- ``resume``: ``--resume auto|none|PATH``;
- ``pretrained``: ``open_pretrained``, weights from any source (our checkpoints, exports, HF folders);
- ``export`` (file writing) and ``consolidate`` (``export``/``consolidate``): a Hugging Face folder, or
  ``model.safetensors`` + ``config.json``.
"""

from lightning_train.checkpoint.consolidate import consolidate, export
from lightning_train.checkpoint.export import read_gpt_config, save_safetensors
from lightning_train.checkpoint.format import read_checkpoint, verify_checkpoint
from lightning_train.checkpoint.io import AtomicCheckpointIO
from lightning_train.checkpoint.pretrained import Pretrained, open_pretrained
from lightning_train.checkpoint.resume import (
    checkpoint_mismatch_error,
    find_resume_checkpoint,
    resolve_resume,
)
from lightning_train.checkpoint.sharded import load_sharded_model_state

__all__ = [
    "AtomicCheckpointIO",
    "Pretrained",
    "checkpoint_mismatch_error",
    "consolidate",
    "export",
    "find_resume_checkpoint",
    "load_sharded_model_state",
    "open_pretrained",
    "read_checkpoint",
    "read_gpt_config",
    "resolve_resume",
    "save_safetensors",
    "verify_checkpoint",
]
