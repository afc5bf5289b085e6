"""Which checkpoint to resume from: ``--resume auto|none|PATH``.

``auto`` picks the newest *valid* checkpoint in the run's ``checkpoints/`` folder — newest by the global
step its manifest records, then by modification time — verifying each candidate against its manifest and
skipping (with a warning) the ones that are truncated or corrupt. A job script can therefore simply rerun
the same command after a crash or a preemption. With no checkpoint it starts fresh and says so.

Example (the newest of two checkpoints is truncated, as a crash during a copy would leave it)::

    >>> import os
    >>> import tempfile
    >>> import lightning as L
    >>> from lightning.pytorch.callbacks import ModelCheckpoint
    >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
    >>> from lightning_train.checkpoint import AtomicCheckpointIO, resolve_resume
    >>> folder = tempfile.mkdtemp()
    >>> trainer = L.Trainer(
    ...     max_steps=4, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
    ...     enable_model_summary=False, plugins=[AtomicCheckpointIO()],
    ...     callbacks=[ModelCheckpoint(folder, "{step}", every_n_train_steps=2, save_top_k=-1)],
    ... )
    >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
    >>> os.path.basename(resolve_resume("auto", folder))
    'step=4.ckpt'
    >>> os.truncate(f"{folder}/step=4.ckpt", 100)
    >>> os.path.basename(resolve_resume("auto", folder))  # verified against its manifest: skipped
    'step=2.ckpt'
    >>> resolve_resume("auto", tempfile.mkdtemp()) is None  # no checkpoint: start fresh
    True
    >>> resolve_resume("none", folder) is None
    True

A named PATH must exist: a checkpoint file is verified and read safely, a checkpoint folder verified
(a corrupt or unsafe one is an error, never silently replaced by another); a folder of checkpoints
resolves to its newest valid one.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import lightning_train.storage as storage
from lightning_train.checkpoint.format import (
    DCP_METADATA,
    FOLDER_MANIFEST,
    MANIFEST_SUFFIX,
    manifest_path,
    read_checkpoint,
    read_manifest,
    recorded_step,
    verify_checkpoint,
    verify_zip,
)
from lightning_train.errors import CorruptCheckpointError, UserInputError

RESUME_CHOICES = "auto, none or the path of a checkpoint (or of a folder of checkpoints)"


def resolve_resume(resume: str | None, checkpoint_dir: str | Path) -> str | None:
    """The checkpoint path to pass to ``Trainer.fit(ckpt_path=...)``, or None to start fresh."""
    if resume is None or resume.lower() == "none":
        return None
    if resume.lower() == "auto":
        found = find_resume_checkpoint(checkpoint_dir)
        if found is None:
            if not checkpoints_newest_first(checkpoint_dir):  # else the caller refuses to overwrite
                rank_zero_info(f"--resume auto: no checkpoint in {checkpoint_dir}, starting fresh")
            return None
        rank_zero_info(f"--resume auto: resuming from {found}")
        return str(found)
    if storage.is_remote(resume):
        return _resolve_remote(resume)
    path = Path(resume)
    if not path.exists():
        raise UserInputError(f"--resume {resume}: no such file or folder; pass {RESUME_CHOICES}")
    if path.is_file():
        read_checkpoint(path)  # verified and safely loadable (memory-mapped: the tensors are not read)
        return str(path)
    if _is_checkpoint_folder(path):
        verify_checkpoint(path)
        return str(path)
    found = find_resume_checkpoint(path)
    if found is None:
        raise UserInputError(f"--resume {resume}: no valid checkpoint in this folder; pass {RESUME_CHOICES}")
    rank_zero_info(f"--resume {resume}: resuming from {found}")
    return str(found)


def _resolve_remote(resume: str) -> str:
    """``--resume s3://...``: a checkpoint (verified) or a folder of checkpoints (its newest valid one)."""
    import lightning_train.checkpoint.remote as remote

    if remote.is_checkpoint(resume):
        verify_checkpoint(resume)
        return resume
    found = find_resume_checkpoint(resume)
    if found is None:
        raise UserInputError(f"--resume {resume}: no valid checkpoint there; pass {RESUME_CHOICES}")
    rank_zero_info(f"--resume {resume}: resuming from {found}")
    return str(found)


def find_resume_checkpoint(folder: str | Path) -> Path | str | None:
    """The newest checkpoint in ``folder`` that passes verification, or None when there is none.

    Never passes over a newer checkpoint without a word: each one skipped is named in a warning with
    the reason (truncated, altered, unfinished, its manifest unreadable); one without a manifest
    (written by plain Lightning, or cut short between its two renames) is used when its file passes
    torch's zip CRCs, and said so. A checkpoint written by a newer, incompatible format stops the search
    with an error (resuming from an older one would silently throw that progress away)."""
    ranked = _ranked(folder)
    for index, (candidate, _) in enumerate(ranked):
        try:
            manifest = verify_checkpoint(candidate)
        except CorruptCheckpointError as error:
            rank_zero_warn(f"skipping checkpoint {candidate}: {error}{_rescue(candidate)}")
            continue
        if manifest is None and not storage.is_remote(candidate):
            rank_zero_warn(f"checkpoint {candidate} has no manifest; its files pass the "
                           "checks they carry (zip CRCs, DCP's .metadata), so it is resumed from")
        _name_unranked(ranked[index + 1:])
        return candidate
    return None  # every one was tried, and named


def _name_unranked(rest: list[tuple[Path | str, int | None]]) -> None:
    """Warn about each checkpoint passed over whose step cannot be read: it may be the newest."""
    for candidate, step in rest:
        if step is None:
            try:
                verify_checkpoint(candidate)
                why = "it records no global step"
            except CorruptCheckpointError as error:
                why = str(error)
            rank_zero_warn(f"skipping checkpoint {candidate}, whose step cannot be read: {why}")


def _rescue(candidate: Path | str) -> str:
    """For a local checkpoint file whose manifest alone is bad, how to resume from it anyway."""
    if storage.is_remote(candidate) or not Path(candidate).is_file():
        return ""
    try:
        read_manifest(candidate)
    except CorruptCheckpointError:
        try:
            verify_zip(Path(candidate))
        except CorruptCheckpointError:
            return ""
        return (f"; its file passes torch's zip CRCs: delete {manifest_path(candidate)} to resume from it "
                "with that check alone")
    return ""


def checkpoints_newest_first(folder: str | Path) -> list[Path] | list[str]:
    """The checkpoint files and folders in ``folder``, unverified, newest (highest step) first. On object
    storage only those with a manifest count (it is their commit point), newest by its step."""
    return [path for path, _ in _ranked(folder)]  # type: ignore[return-value]


def _ranked(folder: str | Path) -> list[tuple[Path | str, int | None]]:
    """``checkpoints_newest_first`` with each one's step (None where it cannot be read: those rank last)."""
    if storage.is_remote(folder):
        return _remote_newest_first(str(folder))
    folder = Path(folder)
    if not folder.is_dir():
        return []
    seen: dict[Path, Path] = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):  # .partial leftovers of interrupted writes
            continue
        is_file_checkpoint = entry.is_file() and entry.suffix == ".ckpt"
        if is_file_checkpoint or _is_checkpoint_folder(entry):
            seen.setdefault(entry.resolve(), entry)  # a symlinked last.ckpt is its target
    keyed = []
    for path in seen.values():
        try:
            modified = path.stat().st_mtime
        except FileNotFoundError:  # removed since the listing: a writer's retention running meanwhile
            continue
        keyed.append((path, _step(path), modified))
    keyed.sort(key=lambda item: (-1 if item[1] is None else item[1], item[2]), reverse=True)
    return [(path, step) for path, step, _ in keyed]


def _remote_newest_first(folder: str) -> list[tuple[str, int | None]]:
    import lightning_train.checkpoint.remote as remote

    steps: dict[str, int | None] = {}
    for name in storage.list_names(folder):
        url = storage.join(folder, name)
        if name.startswith(".") or name.endswith(MANIFEST_SUFFIX) or not remote.is_checkpoint(url):
            continue
        try:
            step = (remote.read_manifest(url) or {}).get("global_step")
        except CorruptCheckpointError:
            step = None
        steps[url] = step if isinstance(step, int) else None
    # a step's last.ckpt is written after its step=N checkpoint (and knows of it): it wins the tie, as
    # the newer file does on local disk
    ranked = sorted(steps, key=lambda url: (-1 if steps[url] is None else steps[url],
                                            storage.name(url).startswith("last")), reverse=True)
    return [(url, steps[url]) for url in ranked]


def _is_checkpoint_folder(path: Path) -> bool:
    """A sharded (torch.distributed.checkpoint) save: ours carry a manifest, DCP writes ``.metadata``."""
    return path.is_dir() and ((path / FOLDER_MANIFEST).exists() or (path / DCP_METADATA).exists())


def _step(path: Path) -> int | None:
    """The step of a checkpoint: its manifest's, else (no readable manifest) the one the checkpoint
    records itself, so that a newer checkpoint whose manifest is lost still sorts as newer and is named
    when it does not verify; None when neither can be read."""
    try:
        manifest = read_manifest(path)
    except CorruptCheckpointError:
        manifest = None
    step = manifest.get("global_step") if manifest else recorded_step(path)
    return step if isinstance(step, int) else None


def checkpoint_mismatch_error(error: BaseException, checkpoint: str | None) -> UserInputError | None:
    """A one-line ``UserInputError`` for torch's "Error(s) in loading state_dict" when the checkpoint was
    written by a model of another shape (names the mismatched keys and shapes); None for other errors.

    Example:

        >>> from lightning_train import GPT, GPTConfig
        >>> from lightning_train.checkpoint import checkpoint_mismatch_error
        >>> small = GPT(GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=32))
        >>> wide = GPT(GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=64))
        >>> try:
        ...     small.load_state_dict(wide.state_dict())
        ... except RuntimeError as error:
        ...     message = str(checkpoint_mismatch_error(error, "last.ckpt"))
        >>> message.startswith("checkpoint last.ckpt does not fit this model (size mismatch for embed.weight")
        True
        >>> checkpoint_mismatch_error(ValueError("something else"), "last.ckpt") is None
        True
    """
    text = str(error)
    if not checkpoint or not text.startswith("Error(s) in loading state_dict"):
        return None
    problems = [line.strip().rstrip(".") for line in text.splitlines()[1:] if line.strip()]
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    return UserInputError(
        f"checkpoint {checkpoint} does not fit this model ({shown}); resume from a checkpoint of the same "
        "model configuration, or start fresh with --resume none and another trainer.default_root_dir"
    )
