"""The one home of checkpoints.

- ``format``: what a checkpoint is on disk (manifest, atomic writes, verification, safe loading);
- ``io``: ``AtomicCheckpointIO``, the Trainer plugin that writes and loads checkpoint files that way;
- ``sharded``: ``torch.distributed.checkpoint`` folders, saved and loaded at any world size;
- ``resume``: ``--resume auto|none|PATH``;
- ``remote``: the same protocol on object storage (``s3://``: committed by the manifest, verified downloads);
- ``pretrained``: ``open_pretrained``, weights from any source (our checkpoints, exports, HF folders);
- ``model_folder`` (writing model folders) and ``consolidate`` (``export``/``consolidate``): a Hugging Face
  folder, or ``model.safetensors`` + ``config.json``.

The other names are imported on first use (``_lazy.py``); none of the tools' path imports Lightning.
"""

from lightning_train._lazy import lazy_exports

# Eager: ``consolidate`` shares its name with its submodule, which would shadow it once imported (the module
# imports torch only when a function of it runs, so this face stays as cheap as the others).
from lightning_train.checkpoint.consolidate import consolidate, export

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
__getattr__, __dir__ = lazy_exports(globals(), {
    "AtomicCheckpointIO": "lightning_train.checkpoint.io",
    "Pretrained": "lightning_train.checkpoint.pretrained",
    "checkpoint_mismatch_error": "lightning_train.checkpoint.resume",
    "find_resume_checkpoint": "lightning_train.checkpoint.resume",
    "load_sharded_model_state": "lightning_train.checkpoint.sharded",
    "open_pretrained": "lightning_train.checkpoint.pretrained",
    "read_checkpoint": "lightning_train.checkpoint.format",
    "read_gpt_config": "lightning_train.checkpoint.model_folder",
    "resolve_resume": "lightning_train.checkpoint.resume",
    "save_safetensors": "lightning_train.checkpoint.model_folder",
    "verify_checkpoint": "lightning_train.checkpoint.format",
})
