"""Opening pretrained weights from any source: ``open_pretrained``.

Sources: a Lightning ``.ckpt`` of a PretrainModule/FinetuneModule, a sharded checkpoint folder (any
world size), a plain ``.pt`` state dict, our export (``model.safetensors`` + ``config.json``), or a
local Hugging Face GPT-2 / Llama folder. What the model is and how it is named comes from
``lightning_train.models``; this module knows the files: where a LightningModule keeps its network
(``model.`` in its state dict) and its hyper-parameters (``config``, ``tokenizer``, ``lora``).

Nothing here unpickles arbitrary code: ``.safetensors`` files hold raw tensors only, and pickle-format
files (``.ckpt``, ``.pt``, ``.bin``) are verified, then read with ``torch.load(weights_only=True)``
(``format.read_checkpoint``). ``allow_pickle=False`` refuses pickle-format files altogether.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lightning_train.checkpoint.remote as remote
import lightning_train.storage as storage
from lightning_train.checkpoint.format import is_sharded_checkpoint, read_checkpoint
from lightning_train.checkpoint.model_folder import (
    CONFIG_FILE,
    MODEL_FILE,
    is_byte_tokenizer,
    is_our_export,
    read_gpt_config,
)
from lightning_train.checkpoint.slices import (
    Slices,
    hf_slices,
    merged_lora_slices,
    safetensors_slices,
    sharded_slices,
    state_dict_slices,
)
from lightning_train.data.meta import tokenizer_spec
from lightning_train.data.tokenizers import ByteTokenizer, folder_tokenizer
from lightning_train.errors import CorruptCheckpointError, UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.hf import config_from_hf
from lightning_train.models.hf_weights import state_dict_from_hf
from lightning_train.models.lora import LoRAConfig, apply_lora, merge_lora
from lightning_train.models.weights import load_into

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
MODULE_PREFIX = "model."  # where PretrainModule/FinetuneModule keep the network in their state dict
StateDict = dict[str, torch.Tensor]


@dataclasses.dataclass
class Pretrained:
    """What a weights source provides: the model's config, its tokenizer spec (``"byte"``, a path
    for ``load_tokenizer``, or None when unknown) and a function returning the full state dict in
    our GPT's key names (deferred, so a caller can read the config without loading the weights), LoRA
    adapters merged; for a LoRA fine-tune also its ``LoRAConfig`` and the unmerged model.

    Example (from the ``.ckpt`` of a short pretraining run):

        >>> import tempfile
        >>> import lightning as L
        >>> import torch
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.checkpoint import open_pretrained
        >>> trainer = L.Trainer(
        ...     max_steps=2, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> checkpoint = f"{tempfile.mkdtemp()}/last.ckpt"
        >>> trainer.save_checkpoint(checkpoint)
        >>> pretrained = open_pretrained(checkpoint)
        >>> pretrained.config == module.config, pretrained.tokenizer
        (True, 'byte')
        >>> model = pretrained.build()  # a plain GPT on the CPU, in eval mode
        >>> tokens = torch.tensor([[1, 2, 3]])
        >>> torch.equal(model(tokens), module.model.eval()(tokens))
        True
    """

    source: str
    config: GPTConfig
    tokenizer: str | None
    read_state_dict: Callable[[], StateDict]
    slices: Callable[[], Slices]  # the same weights read in part (checkpoint/slices.py)
    lora: LoRAConfig | None = None
    read_adapted: Callable[[], nn.Module] | None = None

    def build(self) -> GPT:
        """A ``GPT`` with these weights, in their dtype (on the CPU, in eval mode): a bf16 folder gives
        a bf16 model, so its export is bf16 too."""
        model, weights = GPT(self.config), self.read_state_dict()
        load_into(model, weights, self.source)
        dtypes = {tensor.dtype for tensor in weights.values() if tensor.is_floating_point()}
        return (model.to(dtypes.pop()) if len(dtypes) == 1 else model).eval()

    def build_adapted(self) -> nn.Module:
        """A LoRA fine-tune's ``GPT`` with its adapters unmerged (on the CPU, in eval mode)."""
        if self.read_adapted is None:
            raise UserInputError(f"{self.source!r} holds no LoRA adapters")
        return self.read_adapted().eval()


def open_pretrained(
    source: str | Path, config: GPTConfig | None = None, allow_pickle: bool = True
) -> Pretrained:
    """Resolve ``source``:

    - a Lightning ``.ckpt`` of a PretrainModule/FinetuneModule (config from its hyper-parameters;
      LoRA adapters are merged), a sharded checkpoint folder of one, or a plain ``.pt`` state dict
      (needs ``config``);
    - a ``.safetensors`` file with a ``config.json`` beside it (or ``config``), or the folder of both
      (what ``save_safetensors`` writes);
    - a local Hugging Face folder of a family in docs/models.md (``config.json`` + safetensors, its
      tokenizer: ``tokenizer.json`` or ``tokenizer.model``);
    - an ``s3://`` URL of one of our checkpoints (file or folder): downloaded once and verified against its
      manifest (``remote.local_checkpoint``).
    """
    if storage.is_remote(source):
        storage.check_access(str(source))
        source = remote.local_checkpoint(str(source))
    path = Path(source).expanduser()
    if not path.exists():
        raise UserInputError(
            f"weights source {str(source)!r} does not exist; pass a .ckpt, .safetensors or model folder"
        )
    folder = path if path.is_dir() else path.parent
    # a Hugging Face model's folder: its tokenizer (with its chat template) as transformers reads it
    hf_model = path.is_dir() and not is_our_export(path) and not is_sharded_checkpoint(path)
    tokenizer = folder_tokenizer(folder, hf_model)
    if tokenizer and is_byte_tokenizer(folder / "tokenizer.json"):  # our byte tokenizer, exported: "byte"
        tokenizer = "byte"
    if path.is_dir() and is_our_export(path):
        path = path / MODEL_FILE
    if path.is_dir() and is_sharded_checkpoint(path):
        # torch.distributed.checkpoint takes a second to import: only for folders (export, generate).
        from lightning_train.checkpoint.sharded import read_metadata

        _refuse_pickle(path, allow_pickle)
        return _from_lightning_checkpoint(path, read_metadata(path), config, _sharded_reader(path))
    if path.is_dir():
        return _from_hf_folder(path, tokenizer, allow_pickle)
    if path.suffix == ".safetensors":
        config = config or read_gpt_config(path.parent / CONFIG_FILE)
        tokenizer = tokenizer or _byte_if_fits(config)
        return Pretrained(
            str(path), config, tokenizer, lambda: read_safetensors(path), lambda: safetensors_slices(path),
        )
    if path.suffix not in PICKLE_SUFFIXES:
        raise UserInputError(
            f"{str(source)!r} is not a checkpoint this package reads: use a Lightning .ckpt, "
            f"a .safetensors file with config.json, or a Hugging Face model folder"
        )
    _refuse_pickle(path, allow_pickle)
    checkpoint = read_checkpoint(path)
    if "state_dict" not in checkpoint:  # a bare state dict
        if config is None:
            raise UserInputError(f"{str(source)!r} is a bare state dict; give its model.config to load it")
        return Pretrained(
            str(path), config, tokenizer or _byte_if_fits(config), lambda: checkpoint,
            lambda: state_dict_slices(checkpoint),
        )
    return _from_lightning_checkpoint(path, checkpoint, config)


def read_safetensors(path: Path) -> StateDict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CorruptCheckpointError(
            f"cannot read safetensors file {str(path)!r} ({err}); it is truncated or not a safetensors file"
        ) from err


def _refuse_pickle(path: Path, allow_pickle: bool) -> None:
    if not allow_pickle:
        raise UserInputError(
            f"{str(path)!r} is a pickle-format checkpoint and allow_pickle is false; convert it to "
            "safetensors (`python -m lightning_train consolidate`) or set allow_pickle: true "
            "(it is then read with torch.load(weights_only=True), which never runs code from the file)"
        )


# ---- checkpoints of our LightningModules ----------------------------------------------------------------
def _sharded_reader(path: Path) -> Callable[[nn.Module], StateDict]:
    def read_shards(model: nn.Module) -> StateDict:
        from lightning_train.checkpoint.sharded import load_sharded_model_state

        load_sharded_model_state(path, model, prefix=MODULE_PREFIX)
        return model.state_dict()

    return read_shards


def _refuse_another_model(source: str, names: list[str]) -> None:
    """A checkpoint whose module holds no GPT (weights named ``blocks.<i>...``) is refused by name: its
    model, a user's own, is not one these tools can build."""
    if any(part == "blocks" for name in names for part in name.split(".")[:3]):
        return
    example = next((name for name in names if "." in name), names[0] if names else "nothing")
    raise UserInputError(
        f"checkpoint {source!r} holds a model of its own, not this package's GPT (its weights are named "
        f"like {example!r}, not model.blocks.<i>...), so export, generate and init_from cannot rebuild it; "
        "load it into its LightningModule (YourModule.load_from_checkpoint, or a sharded folder with "
        "lightning_train.checkpoint.load_sharded_model_state) and save the model from there: a transformers "
        "model with module.model.save_pretrained(folder), which from_pretrained and init_from then read"
    )


def _from_lightning_checkpoint(
    path: Path,
    checkpoint: dict[str, Any],
    config: GPTConfig | None,
    read_shards: Callable[[nn.Module], StateDict] | None = None,
) -> Pretrained:
    source = str(path)
    if read_shards is not None:
        from lightning_train.checkpoint.sharded import checkpoint_tensor_shapes

        _refuse_another_model(source, list(checkpoint_tensor_shapes(path)))
    else:
        _refuse_another_model(source, list(checkpoint.get("state_dict", {})))
    hparams = checkpoint.get("hyper_parameters", {})
    saved = hparams.get("config")
    config = config or (GPTConfig(**saved) if isinstance(saved, dict) else saved)
    if not isinstance(config, GPTConfig):
        raise UserInputError(f"checkpoint {source!r} records no GPTConfig; give its model.config to load it")
    tokenizer = hparams.get("tokenizer") or _tokenizer_of_data(checkpoint) or _byte_if_fits(config)
    lora = hparams.get("lora") or None
    if lora is not None:  # FinetuneModule saves its LoRAConfig as a dict
        lora = LoRAConfig(**lora)

    def network_weights() -> StateDict:
        if read_shards is not None:
            return read_shards(GPT(config))
        module_state = checkpoint["state_dict"].items()
        weights = {k.removeprefix(MODULE_PREFIX): v for k, v in module_state if k.startswith(MODULE_PREFIX)}
        return {k.replace("_orig_mod.", ""): v for k, v in weights.items()}  # torch.compile'd modules

    def read_adapted() -> nn.Module:
        model = apply_lora(GPT(config), lora)
        if read_shards is not None:
            read_shards(model)
        else:
            load_into(model, network_weights(), source)
        return model

    def read_state_dict() -> StateDict:
        return merge_lora(read_adapted()).state_dict() if lora else network_weights()

    def slices() -> Slices:
        saved = (sharded_slices(path, MODULE_PREFIX) if read_shards is not None
                 else state_dict_slices(network_weights()))  # memory-mapped
        return merged_lora_slices(saved, config, lora) if lora else saved

    adapted = read_adapted if lora else None
    return Pretrained(source, config, tokenizer, read_state_dict, slices, lora, adapted)


def _tokenizer_of_data(checkpoint: dict[str, Any]) -> str | None:
    """The tokenizer of the dataset a PretrainModule was trained on (``meta.json`` of its data_dir)."""
    data = checkpoint.get("datamodule_hyper_parameters", {})
    if "data_dir" not in data:
        return None
    if data["data_dir"] is None:
        return "byte"  # the default corpus
    folder = Path(data["data_dir"])
    try:
        return tokenizer_spec(folder, json.loads((folder / "meta.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError):
        return None


def _byte_if_fits(config: GPTConfig) -> str | None:
    """A source that names no tokenizer: the byte tokenizer when the vocabulary is exactly its size."""
    return "byte" if config.vocab_size == ByteTokenizer.vocab_size else None


# ---- Hugging Face folders -------------------------------------------------------------------------------
def _from_hf_folder(path: Path, tokenizer: str | None, allow_pickle: bool) -> Pretrained:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise UserInputError(
            f"folder {str(path)!r} holds neither model.safetensors with a lightning_train config.json, "
            "a sharded checkpoint, nor a Hugging Face model (config.json); pass a file or a model folder"
        )
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise UserInputError(f"{str(config_path)!r} is not valid JSON: {err}") from err
    config = config_from_hf(hf, str(path))

    def read_file(file: Path) -> StateDict:
        return _read_weights_file(file, allow_pickle)

    def read_state_dict() -> StateDict:
        weights = {k: v for file in _hf_weight_files(path) for k, v in read_file(file).items()}
        return state_dict_from_hf(weights, config, str(path))

    return Pretrained(
        str(path), config, tokenizer, read_state_dict,
        lambda: hf_slices(_hf_weight_files(path), config, str(path), read_file),
    )


def _hf_weight_files(path: Path) -> list[Path]:
    """The folder's weight files: ``model.safetensors``, its shards, or (pickle) ``pytorch_model.bin``."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            return [path / name for name in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
    raise UserInputError(f"{str(path)!r} has no model.safetensors (or pytorch_model.bin); nothing to load")


def _read_weights_file(path: Path, allow_pickle: bool) -> StateDict:
    if not path.is_file():
        raise UserInputError(f"weights file {str(path)!r} does not exist; the folder is incomplete")
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    _refuse_pickle(path, allow_pickle)
    return read_checkpoint(path)
