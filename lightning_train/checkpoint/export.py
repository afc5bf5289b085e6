"""Our export format: ``model.safetensors`` (the ``GPT.state_dict()``) + ``config.json`` (its ``GPTConfig``).

    >>> import tempfile
    >>> from lightning_train.models.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    >>> folder = save_safetensors(model, Path(tempfile.mkdtemp()) / "export")
    >>> sorted(p.name for p in folder.iterdir()), read_gpt_config(folder / CONFIG_FILE) == model.config
    (['config.json', 'model.safetensors'], True)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
MODEL_TYPE = "gpt"  # the "model_type" of our config.json (HF folders name their own architecture)


def save_safetensors(model: GPT, output_dir: str | Path) -> Path:
    """Write ``model.safetensors`` and a ``config.json`` that ``read_gpt_config`` reads back; returns
    the folder. Every key of ``model.state_dict()`` is stored, so a plain strict ``load_state_dict``
    works too (a tied ``lm_head.weight`` as its own copy: safetensors stores no shared tensors)."""
    from safetensors.torch import save_file

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    state_dict = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state_dict, str(output_dir / MODEL_FILE), metadata={"format": "pt"})
    os.chmod(output_dir / MODEL_FILE, 0o666 & ~_umask())  # safetensors creates it 0600; readable like config
    config = {"model_type": MODEL_TYPE, **dataclasses.asdict(model.config)}
    (output_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return output_dir


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


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


def is_our_export(folder: Path) -> bool:
    """A folder written by ``save_safetensors`` (``model.safetensors`` + our ``config.json``)."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    is_ours = isinstance(config, dict) and config.get("model_type") == MODEL_TYPE
    return is_ours and (folder / MODEL_FILE).is_file()
