"""``TextDataModule``: fixed-length windows over memory-mapped token shards, for pretraining.

A window is ``seq_len + 1`` consecutive tokens of one shard, starting every ``seq_len`` tokens, so every
token is a target once per epoch. Batches are ``{"input_ids": (B, T), "labels": (B, T)}`` int64 tensors,
``labels`` being ``input_ids`` shifted left by one.

The loaders, their world-size-independent data position (resume at any device count) and the jump
``train_loader.sampler.skip_batches(n)`` come from ``data/loading.py``, shared with ``SFTDataModule``.
``mixture={folder: weight, ...}`` draws from several prepared folders in those proportions
(``data/mixture.py``); its batches carry each row's ``"source"`` index.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from lightning_train.data.default_corpus import cache_dir, default_corpus_dir
from lightning_train.data.loading import ResumableDataModule, check_at_least, check_seed, spread
from lightning_train.data.meta import read_meta, tokenizer_spec
from lightning_train.data.mixture import LabeledSources, MixtureWindows
from lightning_train.data.object_storage import local_dataset
from lightning_train.data.tokenizers import Tokenizer, load_tokenizer
from lightning_train.errors import UserInputError
from lightning_train.storage import is_remote


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens over shard files; item ``i`` is the ``i``-th window overall. Shards
    are memory-mapped lazily in each process."""

    def __init__(self, paths: list[Path], dtype: str, seq_len: int) -> None:
        self.paths, self.dtype, self.seq_len = paths, np.dtype(dtype), seq_len
        sizes = [path.stat().st_size // self.dtype.itemsize for path in paths]
        windows = [max(size - 1, 0) // seq_len for size in sizes]
        self.first_window = np.cumsum([0, *windows])  # window id where each shard starts
        self.num_windows = int(self.first_window[-1])
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = int(i)
        shard = int(np.searchsorted(self.first_window, window, side="right")) - 1
        start = (window - int(self.first_window[shard])) * self.seq_len
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self.paths[shard], dtype=self.dtype, mode="r")
        tokens = torch.from_numpy(self._maps[shard][start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # workers open their own maps instead of receiving copies


class TextDataModule(ResumableDataModule):
    """Pretraining data: random windows of ``seq_len`` tokens from a folder made by ``prepare``.

    Args:
        data_dir: the dataset folder; ``None`` uses the default corpus (built once, in seconds).
        seq_len: tokens per training example.
        batch_size: examples per batch on each device.
        global_batch_size: samples per optimizer step over all devices; the Trainer's
            ``accumulate_grad_batches`` becomes ``global_batch_size / (batch_size x data-parallel ranks)``
            at each launch (set by the ``GlobalBatch`` callback, which the CLI adds), so a run resumed
            on fewer or more devices keeps its batch. None: no change.
        seed: seeds the window order; epoch ``e`` uses the permutation for ``(seed, e)``.
        num_workers: data-loading processes per device (0 loads in the training process).
        mixture: instead of ``data_dir``, prepared folders and their weights (``{"data/web": 0.7,
            "data/code": 0.3}``): batches drawn from the sources in those proportions, each source's
            epochs counted (``source_progress``); validation covers every source (``val/<name>/loss``
            beside ``val/loss``), an equal share of the Trainer's ``limit_val_batches`` each. The sources
            must share a tokenizer.

    The validation size is the Trainer's ``limit_val_batches`` (batches a device), spread evenly over the
    val split and the same windows at every validation.

    Example (the default corpus; ``prepare`` makes a dataset folder of your own text):

        >>> import torch
        >>> from lightning_train import TextDataModule
        >>> data = TextDataModule(seq_len=16, batch_size=4)
        >>> data.setup("fit")
        >>> batch = next(iter(data.train_dataloader()))
        >>> batch["input_ids"].shape, batch["input_ids"].dtype
        (torch.Size([4, 16]), torch.int64)
        >>> torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])  # the next token of each position
        True
        >>> data.vocab_size, data.tokenizer.decode(batch["input_ids"][0].tolist()) != ""
        (258, True)
        >>> len(data.val_loader(limit_batches=2))  # Trainer(limit_val_batches=2): the same 2 each time
        2
    """

    def __init__(
        self,
        data_dir: str | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        global_batch_size: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        mixture: dict[str, float] | None = None,
    ) -> None:
        super().__init__()
        check_at_least(
            ("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0),
            ("global_batch_size", 1 if global_batch_size is None else global_batch_size, 1),
        )
        check_seed(seed)
        self.mixture = _check_mixture(mixture, data_dir)
        self.save_hyperparameters()
        self.data_dir, self.seq_len, self.batch_size = data_dir, seq_len, batch_size
        self.global_batch_size = global_batch_size
        self.seed, self.num_workers = seed, num_workers
        self._meta: dict[str, Any] | None = None
        self._metas: dict[str, dict[str, Any]] | None = None  # per mixture source
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    # What the model module checks against its configuration
    @property
    def meta(self) -> dict[str, Any]:
        """The dataset's ``meta.json`` (a mixture's: its first source's, with every source's shards)."""
        if self._meta is None:
            if self.mixture is None:
                self._meta = read_meta(self._resolve_dir())
            else:
                metas = self._source_metas()
                first = next(iter(metas.values()))
                self._meta = {**first, "shards": [s for meta in metas.values() for s in meta["shards"]]}
        return self._meta

    def _source_metas(self) -> dict[str, dict[str, Any]]:
        """Each mixture source's checked ``meta.json``, read once; the sources must agree on tokens."""
        if self._metas is None:
            self._metas = {folder: read_meta(Path(folder).expanduser()) for folder in self.mixture}
            _check_same_tokens(self._metas)
        return self._metas

    @property
    def source_names(self) -> list[str]:
        """A name per source (its folder's name, made unique): ``data/<name>/*``, ``val/<name>/loss``."""
        if self.mixture is None:
            return []
        names: list[str] = []
        for folder in self.mixture:
            name = Path(folder).expanduser().name.replace(".", "_") or "source"
            names.append(name if name not in names else f"{name}_{len(names)}")
        return names

    def source_progress(self) -> dict[str, dict[str, int]]:
        """Per source, after the batches handed out so far: ``tokens_seen`` (targets trained on) and
        ``epoch`` (its passes completed). Empty without a mixture or before training."""
        loader = getattr(self, "_train_loader", None)
        if self.mixture is None or loader is None:
            return {}
        sampler = loader.sampler
        position = sampler.handed_out
        done = self.train_set.progress(position["epoch"], position["consumed"], sampler.epoch_samples)
        return {
            name: {"tokens_seen": draws * self.seq_len, "epoch": epoch}
            for name, draws, epoch in zip(self.source_names, done["draws"], done["epoch"], strict=True)
        }

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.meta["eos_id"]

    @property
    def max_token_id(self) -> int:
        return max(shard["max_token_id"] for shard in self.meta["shards"])

    @property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(tokenizer_spec(self._resolve_dir(), self.meta))  # a trained one: the folder's

    # Lightning hooks
    def prepare_data(self) -> None:
        self._resolve_dir()  # builds the default corpus once per node

    def train_dataloader(self) -> Any:
        self._train_loader = super().train_dataloader()
        return self._train_loader

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.mixture is not None:
            self._setup_mixture()
            return
        folder, meta = self._resolve_dir(), self.meta
        train_set = self._windows(folder, meta, "train")
        if len(train_set) == 0:
            longest = max((s["num_tokens"] for s in meta["shards"] if s["split"] == "train"), default=0)
            raise UserInputError(
                f"seq_len={self.seq_len} is too long for {folder}: its longest train shard has {longest} "
                f"tokens, so use seq_len <= {max(longest - 1, 1)}"
            )
        self.train_set, self.val_set = train_set, self._windows(folder, meta, "val")

    def _setup_mixture(self) -> None:
        train, val = [], []
        for folder, meta in self._source_metas().items():  # checked to agree before anything is read
            path = Path(folder).expanduser()
            windows = self._windows(path, meta, "train")
            if len(windows) == 0:
                raise UserInputError(
                    f"mixture source {folder} has no train window of seq_len={self.seq_len}; lower seq_len "
                    "or drop the source"
                )
            train.append(windows)
            val.append(self._windows(path, meta, "val"))
        self.train_set = MixtureWindows(train, list(self.mixture.values()), self.seed)
        self.val_set = LabeledSources(val)

    def describe_train_set(self) -> str:
        kind = "mixture draws" if self.mixture is not None else "windows"
        return f"{len(self.train_set)} {kind} of seq_len={self.seq_len}"

    def spread_val_set(self, wanted: int) -> Dataset:
        """With a mixture, an equal share of ``wanted`` from each source: each keeps its val loss."""
        if not isinstance(self.val_set, LabeledSources):
            return super().spread_val_set(wanted)
        share = max(wanted // len(self.val_set.sources), 1)
        sources = self.val_set.sources
        return LabeledSources([Subset(s, spread(len(s), min(share, len(s))).tolist()) for s in sources])

    def _resolve_dir(self) -> Path:
        if self.mixture is not None:
            return Path(next(iter(self.mixture))).expanduser()
        if is_remote(self.data_dir):  # s3://: read from a local copy (np.memmap needs files)
            return local_dataset(str(self.data_dir), cache_dir())
        return default_corpus_dir() if self.data_dir is None else Path(self.data_dir).expanduser()

    def _windows(self, folder: Path, meta: dict[str, Any], split: str) -> TokenWindows:
        paths = [folder / shard["file"] for shard in meta["shards"] if shard["split"] == split]
        return TokenWindows(paths, meta["dtype"], self.seq_len)


def _check_mixture(mixture: dict[str, float] | None, data_dir: str | None) -> dict[str, float] | None:
    if mixture is None:
        return None
    if data_dir is not None:
        raise UserInputError("pass data_dir or mixture, not both (a single folder is a mixture of one)")
    if not mixture:
        raise UserInputError("mixture is empty; give prepared folders and weights, e.g. {'data/web': 0.7}")
    for folder, weight in mixture.items():
        if not isinstance(weight, int | float) or not 0 <= weight < math.inf:  # NaN fails too
            raise UserInputError(f"mixture weight {weight!r} of {folder} must be a number >= 0 (and finite)")
        if not Path(folder).expanduser().is_dir():
            raise UserInputError(f"mixture source {folder} is not a folder; make it with `prepare` first")
    if sum(mixture.values()) <= 0:
        raise UserInputError(f"mixture weights {list(mixture.values())} sum to 0; give at least one > 0")
    return dict(mixture)


def _check_same_tokens(metas: dict[str, dict[str, Any]]) -> None:
    """Every source must be tokenized alike: the model reads one vocabulary."""

    def tokenizer_of(folder: str, meta: dict[str, Any]) -> str:
        spec = tokenizer_spec(folder, meta)  # a tokenizer.json is compared by content, wherever it lies
        return spec if spec == "byte" else hashlib.sha256(Path(spec).read_bytes()).hexdigest()

    (first, reference), *others = metas.items()
    for folder, meta in others:
        for key, ours, theirs in (
            ("tokenizer", tokenizer_of(first, reference), tokenizer_of(folder, meta)),
            ("vocab_size", reference.get("vocab_size"), meta.get("vocab_size")),
        ):
            if ours != theirs:
                shown = (reference.get(key), meta.get(key))
                raise UserInputError(
                    f"mixture sources {first} and {folder} differ in {key} ({shown[0]!r} vs {shown[1]!r}); "
                    "prepare them with the same tokenizer"
                )
