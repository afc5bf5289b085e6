"""RNGStateKeeper: put the random number generator states of every rank into checkpoints, so a resumed
run draws the same dropout masks and random numbers as the run that was interrupted.

Lightning's checkpoints carry no RNG state, and only rank zero writes the checkpoint; this callback
gathers the states of all ranks (torch CPU, CUDA when present, numpy, Python's ``random``) into the
checkpoint and gives each rank its own back when training restarts. The states are stored as tensors
and plain lists, so the checkpoint still loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn


class RNGStateKeeper(L.Callback):
    """Saves every rank's RNG states in each checkpoint and restores them when training starts from one.

    The states are captured when the checkpoint is written (the end of a training step) and restored at
    ``on_train_start``, after the data loaders were rebuilt, so the next training step sees exactly the
    random numbers the uninterrupted run saw. Resuming with another number of ranks keeps the fresh
    seeds (with a warning): exact continuation is impossible then anyway.

    Example (a run resumed from its step-2 checkpoint draws what the uninterrupted run drew):

        >>> import tempfile
        >>> import lightning as L
        >>> import torch
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> from lightning_train import PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import RNGStateKeeper
        >>> class RecordDraws(L.Callback):  # one random number a step, as dropout would draw
        ...     def __init__(self):
        ...         self.draws = []
        ...     def on_train_batch_start(self, *args):
        ...         self.draws.append(round(torch.rand(1).item(), 6))
        >>> def train(max_steps, draws, ckpt_path=None):
        ...     every_two_steps = ModelCheckpoint(folder, "{step}", every_n_train_steps=2, save_top_k=-1)
        ...     trainer = L.Trainer(
        ...         max_steps=max_steps, accelerator="cpu", limit_val_batches=0, logger=False,
        ...         enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder,
        ...         callbacks=[RNGStateKeeper(), draws, every_two_steps],
        ...     )
        ...     module = PretrainModule(dict(n_layer=1, n_head=2, n_embd=32, block_size=16))
        ...     trainer.fit(module, TextDataModule(seq_len=16, batch_size=4), ckpt_path=ckpt_path)
        >>> folder = tempfile.mkdtemp()
        >>> uninterrupted, resumed = RecordDraws(), RecordDraws()
        >>> train(4, uninterrupted)
        >>> _ = torch.manual_seed(0)  # a new process: other seeds
        >>> train(4, resumed, ckpt_path=f"{folder}/step=2.ckpt")
        >>> resumed.draws == uninterrupted.draws[2:]
        True
    """

    def __init__(self) -> None:
        self._to_restore: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        local = rng_states()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank writes the checkpoint dict; all of them take part so rank zero gets all states
            per_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, local)
        else:
            per_rank = [local]
        return {"per_rank": per_rank}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per_rank = state_dict["per_rank"]
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(per_rank) != world_size:
            rank_zero_warn(
                f"the checkpoint holds RNG states of {len(per_rank)} ranks but this run has {world_size}; "
                "keeping fresh seeds (the resumed run will not repeat the interrupted one exactly)"
            )
            return
        self._to_restore = per_rank[dist.get_rank() if world_size > 1 else 0]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._to_restore is not None:
            _restore(self._to_restore)
            self._to_restore = None


def rng_states() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA when present, numpy, Python's ``random``) as tensors and
    plain lists; ``NaNRecovery``'s forensic report holds them too."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, python_state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian],
        "python": [version, list(python_state), gauss],
    }


def _restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state), gauss))
