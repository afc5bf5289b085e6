"""Safe reading and writing of model weights (no Lightning imports).

Nothing here unpickles arbitrary code: ``.safetensors`` files hold raw tensors only, and pickle-format
files (Lightning ``.ckpt``, ``.pt``, ``.bin``) go through ``torch.load(weights_only=True)``, torch's
restricted unpickler, which accepts tensors, containers and the few config dataclasses listed in
``safe_globals()``. ``allow_pickle=False`` refuses pickle-format files altogether.

    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    >>> save_safetensors(model, "/tmp/exported")  # doctest: +SKIP
    >>> load_into(model, read_weights("/tmp/exported/model.safetensors"), "/tmp/exported")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.lora import LoRAConfig

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
MODEL_TYPE = "gpt"  # the "model_type" of our config.json (as the strategies' `consolidate` writes it)


def safe_globals() -> list[type]:
    """The only non-tensor types that ``weights_only`` loading of this package's checkpoints accepts:
    plain-value containers of hyper-parameters (our config dataclasses, Lightning's ``AttributeDict``,
    paths). Rebuilding them runs no code of the file's choosing."""
    from lightning.fabric.utilities.data import AttributeDict

    return [GPTConfig, LoRAConfig, AttributeDict, pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath]


def read_weights(path: str | Path, allow_pickle: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file, or the object of a pickle-format file loaded safely."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"weights file {str(path)!r} does not exist; check the path")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:
            raise UserInputError(f"cannot read safetensors file {str(path)!r}: {err}") from err
    return read_pickle(path, allow_pickle)


def read_pickle(path: Path, allow_pickle: bool = True) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, memory-mapped on the CPU."""
    if not allow_pickle:
        raise UserInputError(
            f"{str(path)!r} is a pickle-format checkpoint and allow_pickle is false; convert it to "
            "safetensors (FinetuneModule.export or safetensors.torch.save_file) or set allow_pickle: true "
            "(it is then read with torch.load(weights_only=True), which never runs code from the file)"
        )
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found:
            raise UserInputError(
                f"{str(path)!r} holds Python objects beyond tensors ({found.group(1)}), which safe loading "
                "refuses because unpickling them could run code; re-save its state_dict with "
                "safetensors.torch.save_file, or load it yourself if you trust it"
            ) from err
        raise UserInputError(f"cannot read checkpoint {str(path)!r}: {err}") from err


def load_into(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str | Path) -> None:
    """``model.load_state_dict(state_dict)`` after ``check_keys``; a tied ``lm_head.weight`` may be
    absent (it is the embedding)."""
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    check_keys(expected, state_dict, source, optional={"lm_head.weight"} if tied else set())
    model.load_state_dict(state_dict, strict=False)  # checked above


def check_keys(
    expected: dict[str, torch.Size], state_dict: dict[str, torch.Tensor], source: str | Path,
    optional: set[str] | None = None,
) -> None:
    """Raise one error naming every missing, unexpected or misshapen key of ``state_dict``."""
    missing = [k for k in expected if k not in state_dict and k not in (optional or set())]
    unexpected = [k for k in state_dict if k not in expected]
    misshapen = [
        f"{k} {tuple(state_dict[k].shape)} vs model {tuple(shape)}"
        for k, shape in expected.items()
        if k in state_dict and state_dict[k].shape != shape
    ]
    problems = [
        f"{label}: {_shorten(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
        if keys
    ]
    if problems:
        raise UserInputError(
            f"weights of {str(source)!r} do not fit the model ({'; '.join(problems)}); check that the "
            "config (model.config or the source's config.json) describes the same architecture"
        )


def _shorten(keys: list[str], limit: int = 6) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def save_safetensors(model: GPT, output_dir: str | Path) -> Path:
    """Write ``model.safetensors`` and a ``config.json`` that ``read_gpt_config`` reads back; returns
    the folder. Every key of ``model.state_dict()`` is stored, so a plain strict ``load_state_dict``
    works too (a tied ``lm_head.weight`` as its own copy: safetensors stores no shared tensors)."""
    from safetensors.torch import save_file

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    state_dict = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state_dict, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": MODEL_TYPE, **dataclasses.asdict(model.config)}
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return output_dir


def read_gpt_config(path: str | Path) -> GPTConfig:
    """A ``GPTConfig`` from a config.json written by ``save_safetensors``."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"config file {str(path)!r} does not exist; pass the config.json of the weights")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise UserInputError(f"config file {str(path)!r} is not valid JSON: {err}") from err
    if values.pop("model_type", None) != MODEL_TYPE:
        raise UserInputError(
            f"config file {str(path)!r} is not a lightning_train GPT config (its model_type is not "
            f"{MODEL_TYPE!r}); for a Hugging Face model pass its folder instead"
        )
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise UserInputError(f"config file {str(path)!r} has unknown GPTConfig fields {unknown}")
    try:
        return GPTConfig(**values)
    except (TypeError, ValueError) as err:
        raise UserInputError(f"config file {str(path)!r} is invalid: {err}") from err


@dataclasses.dataclass
class Pretrained:
    """What a weights source provides: the model's config, its tokenizer spec (``"byte"``, a path
    for ``load_tokenizer``, or None when unknown) and a function returning the full state dict in
    our GPT's key names (deferred, so a caller can read the config without loading the weights)."""

    source: str
    config: GPTConfig
    tokenizer: str | None
    read_state_dict: Callable[[], dict[str, torch.Tensor]]

    def build(self) -> GPT:
        """A ``GPT`` with these weights (on the CPU, in eval mode)."""
        model = GPT(self.config)
        load_into(model, self.read_state_dict(), self.source)
        return model.eval()


def open_pretrained(
    source: str | Path, config: GPTConfig | None = None, allow_pickle: bool = True
) -> Pretrained:
    """Resolve ``source``:

    - a Lightning ``.ckpt`` of a PretrainModule/FinetuneModule (config from its hyper-parameters;
      LoRA adapters are merged), or a plain ``.pt`` state dict (needs ``config``);
    - a ``.safetensors`` file with a ``config.json`` beside it (or ``config``), or the folder of both
      (what ``save_safetensors`` writes);
    - a local Hugging Face GPT-2 / Llama folder (``config.json`` + safetensors, ``tokenizer.json``).
    """
    from lightning_train.models.hf import hf_config, is_hf_folder, load_hf_weights

    path = Path(source).expanduser()
    if not path.exists():
        raise UserInputError(
            f"weights source {str(source)!r} does not exist; pass a .ckpt, .safetensors or model folder"
        )
    tokenizer_json = (path if path.is_dir() else path.parent) / "tokenizer.json"
    tokenizer = str(tokenizer_json) if tokenizer_json.is_file() else None
    if path.is_dir() and (path / "model.safetensors").is_file() and _is_our_config(path / "config.json"):
        path = path / "model.safetensors"
    if path.is_dir() and (path / "meta.pt").is_file():
        return _from_sharded_checkpoint(path, config, allow_pickle)
    if path.is_dir():
        if not is_hf_folder(path):
            raise UserInputError(
                f"folder {str(path)!r} holds neither model.safetensors with a lightning_train config.json "
                "nor a Hugging Face model (config.json); pass a file or a model folder"
            )
        config = hf_config(path)
        return Pretrained(str(path), config, tokenizer, lambda: load_hf_weights(path, config, allow_pickle))
    if path.suffix == ".safetensors":
        config = config or read_gpt_config(path.parent / "config.json")
        return Pretrained(str(path), config, tokenizer or _byte_if_fits(config), lambda: read_weights(path))
    if path.suffix not in PICKLE_SUFFIXES:
        raise UserInputError(
            f"{str(source)!r} is not a checkpoint this package reads: use a Lightning .ckpt, "
            f"a .safetensors file with config.json, or a Hugging Face model folder"
        )
    checkpoint = read_pickle(path, allow_pickle)
    if "state_dict" not in checkpoint:  # a bare state dict
        if config is None:
            raise UserInputError(f"{str(source)!r} is a bare state dict; give its model.config to load it")
        return Pretrained(str(path), config, tokenizer or _byte_if_fits(config), lambda: checkpoint)
    return _from_lightning_checkpoint(str(path), checkpoint, config)


def _from_sharded_checkpoint(path: Path, config: GPTConfig | None, allow_pickle: bool) -> Pretrained:
    """A torch.distributed.checkpoint folder of DataParallelStrategy (any world size): ``meta.pt``
    holds the hyper-parameters, the DCP shards the weights, re-sharded on load by DCP."""
    from lightning_train.strategies.checkpoint import is_sharded_checkpoint, load_sharded_model_state

    if not is_sharded_checkpoint(path):
        raise UserInputError(f"{str(path)!r} has meta.pt but no DCP .metadata: an incomplete checkpoint")
    meta = read_pickle(path / "meta.pt", allow_pickle)

    def read_shards(model: nn.Module) -> dict[str, torch.Tensor]:
        load_sharded_model_state(path, model)
        return model.state_dict()

    return _from_lightning_checkpoint(str(path), meta, config, read_shards)


def _from_lightning_checkpoint(
    source: str,
    checkpoint: dict[str, Any],
    config: GPTConfig | None,
    read_shards: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None,
) -> Pretrained:
    hparams = checkpoint.get("hyper_parameters", {})
    saved = hparams.get("config")
    config = config or (GPTConfig(**saved) if isinstance(saved, dict) else saved)
    if not isinstance(config, GPTConfig):
        raise UserInputError(f"checkpoint {source!r} records no GPTConfig; give its model.config to load it")
    tokenizer = hparams.get("tokenizer") or _tokenizer_of_data(checkpoint) or _byte_if_fits(config)
    lora = hparams.get("lora")

    def read_state_dict() -> dict[str, torch.Tensor]:
        from lightning_train.models.lora import apply_lora, merge_lora

        model = GPT(config)
        if lora:
            model = apply_lora(model, LoRAConfig(**lora) if isinstance(lora, dict) else lora)
        if read_shards is not None:
            weights = read_shards(model)
        else:
            state_dict = checkpoint["state_dict"]
            weights = {k.removeprefix("model."): v for k, v in state_dict.items() if k.startswith("model.")}
            weights = {k.replace("_orig_mod.", ""): v for k, v in weights.items()}  # torch.compile'd modules
            if not lora:
                return weights
            load_into(model, weights, source)
        return merge_lora(model).state_dict() if lora else weights

    return Pretrained(source, config, tokenizer, read_state_dict)


def _tokenizer_of_data(checkpoint: dict[str, Any]) -> str | None:
    """The tokenizer of the dataset a PretrainModule was trained on (``meta.json`` of its data_dir)."""
    data = checkpoint.get("datamodule_hyper_parameters", {})
    if "data_dir" not in data:
        return None
    if data["data_dir"] is None:
        return "byte"  # the default corpus
    try:
        return json.loads((Path(data["data_dir"]) / "meta.json").read_text(encoding="utf-8"))["tokenizer"]
    except (OSError, ValueError, KeyError):
        return None


def _byte_if_fits(config: GPTConfig) -> str | None:
    return "byte" if config.vocab_size == 258 else None


def _is_our_config(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False
