"""Writing exports: a Hugging Face model folder (``save_hf``), the LoRA adapters of a fine-tune as a
peft adapter folder for it (``save_peft_adapter``), or our own format (``save_safetensors``:
``model.safetensors``, the ``GPT.state_dict()``, + ``config.json``, its ``GPTConfig``); the model
folders ``open_pretrained`` reads back. ``consolidate.export`` chooses between them for a checkpoint.

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
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_train.data.bpe import byte_level_bpe
from lightning_train.data.tokenizers import (
    TOKENIZER_FILES,
    ByteTokenizer,
    HFTokenizer,
    is_transformers_folder,
    load_tokenizer,
)
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.hf import hf_config
from lightning_train.models.hf_peft import adapters_to_hf, hf_weight_shapes
from lightning_train.models.hf_weights import state_dict_to_hf
from lightning_train.models.lora import LoRAConfig, adapters
from lightning_train.output_folder import umask

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
MODEL_TYPE = "gpt"  # the "model_type" of our config.json (HF folders name their own architecture)
INDEX_FILE, GENERATION_FILE = "model.safetensors.index.json", "generation_config.json"
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
ADAPTER_CONFIG_FILE, ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"  # peft's names
# In the header of every safetensors file written here: how `export --overwrite` tells an earlier export
# from a user's own model folder. transformers and peft read only the header's "format".
EXPORT_MARK = {"written_by": "lightning_train"}
METADATA = {"format": "pt", **EXPORT_MARK}
# Files an export may have written; --overwrite replaces these and leaves anything else in the folder.
EXPORT_FILES = re.compile(
    r"(config|generation_config|adapter_config)\.json|(model(-\d+-of-\d+)?|adapter_model)\.safetensors"
    r"|model\.safetensors\.index\.json|" + "|".join(map(re.escape, TOKENIZER_FILES))
)


# ---- Hugging Face folders -------------------------------------------------------------------------------
def save_hf(
    model: GPT, output_dir: Path, tokenizer: str | None, max_shard_size: int = 5 * 10**9
) -> list[Path]:
    """Write ``model`` as a Hugging Face folder (see ``export``) with the tokenizer named by
    ``tokenizer`` (``"byte"``, a ``tokenizer.json`` path, or None for none); returns the files."""
    output_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights = state_dict_to_hf(weights, model.config)
    special = _tokenizer_ids(tokenizer)
    config = {**hf_config(model.config), **special, "torch_dtype": _dtype_name(weights)}
    written = _write_weights(weights, output_dir, max_shard_size)
    written.append(_write_json(output_dir / CONFIG_FILE, config))
    generation = {**special, "do_sample": False}
    written.append(_write_json(output_dir / GENERATION_FILE, generation))
    if tokenizer is not None:
        written += save_tokenizer(tokenizer, output_dir, model.config.block_size)
    return sorted(written)


def save_peft_adapter(
    model: nn.Module, config: GPTConfig, lora: LoRAConfig, output_dir: Path, base_model: str | None
) -> list[Path]:
    """Write the unmerged LoRA adapters of ``model`` (our GPT after ``apply_lora``) as a peft adapter
    folder for the Hugging Face model that ``save_hf`` writes of its base: ``adapter_config.json``
    (``base_model_name_or_path`` = ``base_model``) + ``adapter_model.safetensors`` in peft's key names
    (``base_model.model.<module>.lora_A.weight``); returns the files."""
    from peft import LoraConfig

    output_dir.mkdir(parents=True, exist_ok=True)
    hf = adapters_to_hf(adapters(model), config)
    hf_modules = {key.rpartition(".")[0] for key in hf_weight_shapes(config)}
    targets = {module: _peft_target(module, hf_modules, set(hf)) for module in hf}
    ranks = {targets[module]: a.shape[0] for module, (a, _) in hf.items() if a.shape[0] != lora.rank}
    peft_config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=sorted(set(targets.values())),
        # adapters joined on a fused module (GPT-2's c_attn, Phi-3's qkv_proj and gate_up_proj, GPT-NeoX's
        # query_key_value) have their summed rank; alpha keeps each one's scale
        rank_pattern=ranks, alpha_pattern={t: lora.alpha * rank / lora.rank for t, rank in ranks.items()},
        fan_in_fan_out=_hf_flavour_is_gpt2(config), bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )
    peft_config.save_pretrained(str(output_dir))
    weights = {}
    for module, (a, b) in hf.items():
        weights[f"base_model.model.{module}.lora_A.weight"] = a.cpu().contiguous().clone()
        weights[f"base_model.model.{module}.lora_B.weight"] = b.cpu().contiguous().clone()
    return [output_dir / ADAPTER_CONFIG_FILE, _write_safetensors(output_dir / ADAPTER_FILE, weights)]


def _peft_target(module: str, hf_modules: set[str], adapted: set[str]) -> str:
    """The ``target_modules`` entry of ``module``: its last name (``q_proj``), or its last two
    (``attn.c_proj``) where the last one also names a module without an adapter (GPT-2's MLP c_proj)."""
    last = module.rpartition(".")[2]
    namesakes = {m for m in hf_modules if m.rpartition(".")[2] == last}
    return last if namesakes <= adapted else ".".join(module.split(".")[-2:])


def _hf_flavour_is_gpt2(config: GPTConfig) -> bool:
    return hf_config(config)["model_type"] == "gpt2"  # its Conv1D layers store weights as (in, out)


def _dtype_name(weights: dict[str, torch.Tensor]) -> str:
    return str(next(iter(weights.values())).dtype).removeprefix("torch.")


def _write_weights(weights: dict[str, torch.Tensor], output_dir: Path, max_shard_size: int) -> list[Path]:
    """One ``model.safetensors``, or shards filled in key order up to ``max_shard_size`` (a tensor
    larger than that gets a shard of its own) with the index transformers reads."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        return [_write_safetensors(output_dir / MODEL_FILE, weights)]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    written = [_write_safetensors(output_dir / n, shard) for n, shard in zip(names, shards, strict=True)]
    total = sum(t.numel() * t.element_size() for t in weights.values())
    weight_map = {key: n for n, shard in zip(names, shards, strict=True) for key in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return [*written, _write_json(output_dir / INDEX_FILE, index)]


def _tokenizer_ids(tokenizer: str | None) -> dict[str, int]:
    """bos/eos/pad ids for config.json and generation_config.json: a model folder's tokenizer's bos, else
    bos = eos (a document follows an end of text, as in GPT-2)."""
    if tokenizer is None:
        return {}
    loaded = load_tokenizer(tokenizer)
    bos = getattr(loaded, "bos_id", None)  # only a model folder's tokenizer (TransformersTokenizer) has one
    return {"bos_token_id": loaded.eos_id if bos is None else bos, "eos_token_id": loaded.eos_id,
            "pad_token_id": loaded.pad_id}


def save_tokenizer(spec: str, output_dir: Path, block_size: int) -> list[Path]:
    """Write the tokenizer named by ``spec`` so that ``transformers.AutoTokenizer`` loads it from
    ``output_dir``: the byte tokenizer built as a ``tokenizers`` tokenizer; a model folder's tokenizer
    files copied (``TOKENIZER_FILES``: tokenizer.json or tokenizer.model, its config, chat template, ...);
    an HF (or trained BPE) tokenizer.json copied, with its tokenizer_config.json and
    special_tokens_map.json when they sit beside it. Returns the files written."""
    folder = Path(spec).expanduser()
    if spec != "byte" and is_transformers_folder(folder):
        names = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        for name in names:
            shutil.copyfile(folder / name, output_dir / name)
        return [output_dir / name for name in names]
    if spec != "byte" and folder.is_dir():  # a bare tokenizer.json: as its file, with a config written
        spec = str(folder / TOKENIZER_FILE)
    if spec == "byte":
        (output_dir / TOKENIZER_FILE).write_text(byte_tokenizer_json(), encoding="utf-8")
        names = ByteTokenizer.special_tokens
        eos, pad = names[ByteTokenizer.eos_id], names[ByteTokenizer.pad_id]
        written = [output_dir / TOKENIZER_FILE]
    else:
        from tokenizers import Tokenizer

        source = Path(spec).expanduser()
        written = []
        for name in (TOKENIZER_FILE, "special_tokens_map.json", TOKENIZER_CONFIG_FILE):
            if (source.parent / name).is_file() or name == TOKENIZER_FILE:
                shutil.copyfile(source if name == TOKENIZER_FILE else source.parent / name, output_dir / name)
                written.append(output_dir / name)
        if (output_dir / TOKENIZER_CONFIG_FILE).is_file():
            return written
        ours, theirs = HFTokenizer(source), Tokenizer.from_file(str(source))
        eos, pad = theirs.id_to_token(ours.eos_id), theirs.id_to_token(ours.pad_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos, "pad_token": pad,
        "model_max_length": block_size, "clean_up_tokenization_spaces": False,
        # As ours: "<|endoftext|>" written in a text is text; only data preparation inserts the token.
        "split_special_tokens": True,
    }
    return [*written, _write_json(output_dir / TOKENIZER_CONFIG_FILE, config)]


def byte_tokenizer_json() -> str:
    """``ByteTokenizer`` as a ``tokenizers`` tokenizer.json: each byte is one token whose id is the
    byte's value (a byte-level BPE without merges), then ``<|endoftext|>`` and ``<|pad|>``; decoding
    turns ids back into bytes and those into text with invalid UTF-8 replaced, as ours does."""
    return byte_level_bpe([], [], split_words=False).to_str(pretty=True)


def is_byte_tokenizer(path: Path) -> bool:
    """Whether ``path`` is the tokenizer.json ``byte_tokenizer_json`` writes (read back as ``"byte"``)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) == json.loads(byte_tokenizer_json())
    except (OSError, ValueError, ImportError):
        return False


def _write_json(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")
    return path


def _write_safetensors(path: Path, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(weights, str(path), metadata=METADATA)
    except SafetensorError as error:  # its writer reports an OSError as text: "... (os error 28)"
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found is None:
            raise
        number = int(found.group(1))
        raise OSError(number, os.strerror(number), str(path)) from error
    _metadata_in_order(path)
    os.chmod(path, 0o666 & ~umask())  # safetensors creates it 0600; readable like the json files
    return path


def _metadata_in_order(path: Path) -> None:
    """Put the header's metadata in ``METADATA``'s order, so that an export is the same bytes every time:
    safetensors writes it in hash order, which changes from one write to the next. The same keys in
    another order have the same length, so the header is rewritten in place."""
    ordered = json.dumps(METADATA, separators=(",", ":")).encode()
    swapped = json.dumps(dict(reversed(METADATA.items())), separators=(",", ":")).encode()
    with open(path, "r+b") as file:
        header = file.read(int.from_bytes(file.read(8), "little"))  # after its 8-byte length
        if swapped in header:
            file.seek(8)
            file.write(header.replace(swapped, ordered, 1))


# ---- our own format -------------------------------------------------------------------------------------
def save_safetensors(model: GPT, output_dir: str | Path) -> Path:
    """Write ``model.safetensors`` and a ``config.json`` that ``read_gpt_config`` reads back; returns
    the folder. Every key of ``model.state_dict()`` is stored, so a plain strict ``load_state_dict``
    works too (a tied ``lm_head.weight`` as its own copy: safetensors stores no shared tensors)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    state_dict = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    _write_safetensors(output_dir / MODEL_FILE, state_dict)
    _write_json(output_dir / CONFIG_FILE, {"model_type": MODEL_TYPE, **dataclasses.asdict(model.config)})
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


def is_our_export(folder: Path) -> bool:
    """A folder written by ``save_safetensors`` (``model.safetensors`` + our ``config.json``)."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    is_ours = isinstance(config, dict) and config.get("model_type") == MODEL_TYPE
    return is_ours and (folder / MODEL_FILE).is_file()


def written_by_export(folder: Path) -> bool:
    """Whether ``folder`` holds an export of this package: weights whose safetensors header carries
    ``EXPORT_MARK``. ``export --overwrite`` replaces no other folder's files."""
    from safetensors import SafetensorError, safe_open

    for path in folder.glob("*.safetensors"):
        try:
            with safe_open(str(path), framework="numpy") as weights:
                metadata = weights.metadata() or {}
        except (OSError, SafetensorError):  # unreadable, or not a safetensors file: not ours
            continue
        if EXPORT_MARK.items() <= metadata.items():
            return True
    return False
