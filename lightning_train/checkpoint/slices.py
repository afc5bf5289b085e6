"""Pretrained weights read a slice at a time: each rank of a sharded model (fsdp, hsdp, tp, pp, composed)
reads only the part of each weight it keeps, so no rank ever holds the full state dict.

``load_slices(model, slices, config, source)`` asks each parameter for its box of the whole tensor
(``_compat.local_box``: offsets and sizes from the DTensor's placements; a pipeline stage's plain tensors
are their own whole) and has the source fill it, a block of rows at a time. ``open_pretrained`` gives each
source its reader (``Pretrained.slices``):

- a Hugging Face folder of safetensors (one file, or shards named by ``model.safetensors.index.json``)
  and our export: safetensors' ``get_slice``, through the HF -> ours plan of ``models/hf_weights.py``
  (renames, Llama's q/k/v rows one after another, GPT-NeoX's rows per head, GPT-2's transposed Conv1D:
  every reshape there is a set of row runs, so no tensor is read whole); each file is opened per tensor, so
  the pages it maps are let go before the next;
- our sharded folders: DCP reads the boxes (``read_boxes``), through ``sharded.py``'s safe reader;
- our ``.ckpt``, a bare ``.pt`` and HF's ``pytorch_model.bin``: one pickle-format file that cannot be read in
  part; it is memory-mapped (``format.read_checkpoint``) and each rank copies its slices, so a node's ranks
  share one copy of the file in the page cache; a rank's resident memory counts the pages it touched;
- a LoRA fine-tune's (either kind of ours): ``merged_lora_slices`` reads a box of a merged weight as the
  same box of its base weight plus ``alpha / rank`` x its rows of ``B`` times its columns of ``A``, so
  the adapters are folded in a box at a time, as ``models.lora.merge_lora`` folds them in whole.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_train._compat import local_box
from lightning_train.errors import CorruptCheckpointError, UserInputError
from lightning_train.models.config import GPTConfig
from lightning_train.models.hf_weights import Index, Piece, Plan, hf_pieces, read_box
from lightning_train.models.lora import ADAPTER, LoRAConfig, apply_lora, plain_names

Shape = tuple[int, ...]
# what a rank asks for: (our tensor's name, the box's offsets in it, the tensor to fill, of the box's size)
Request = tuple[str, Shape, torch.Tensor]
# a source's reading function: ``read(stack)(key, index)`` reads that index of one of its tensors, its files
# open while ``stack`` is
Reader = Callable[[ExitStack], Callable[[str, Index], torch.Tensor]]
BLOCK_BYTES = 1 << 20  # the most of a slice read into a buffer before it is copied into place


@dataclasses.dataclass
class Slices:
    """A source read in part: the whole shapes of its tensors in our names, and ``fill(requests)``."""

    shapes: dict[str, Shape]
    fill: Callable[[list[Request]], None]


@torch.no_grad()
def load_slices(model: nn.Module, slices: Slices, config: GPTConfig, source: str) -> None:
    """Copy into each parameter of ``model`` (a GPT of ``config``, maybe with LoRA adapters, laid out by a
    strategy) its slice of the weights of ``source``; the adapters are left as they are. The source's
    names and shapes are checked against the whole model's first."""
    from lightning_train.models.gpt import GPT
    from lightning_train.models.weights import check_keys

    with torch.device("meta"):
        expected = {k: v.shape for k, v in GPT(config).state_dict().items()}
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    check_keys(expected, {k: torch.empty(v, device="meta") for k, v in slices.shapes.items()}, source,
               optional=tied)
    params = dict(model.named_parameters())
    requests = []
    for key, (name, row) in plain_names(model).items():
        if key not in params:  # a buffer: derived, not loaded
            continue
        name = "embed.weight" if name in tied else name  # a pipeline stage's own copy of the tied head
        offsets, _ = local_box(params[key])
        local = params[key].to_local() if isinstance(params[key], DTensor) else params[key]
        if local.numel():
            requests.append((name, (offsets[0] + row, *offsets[1:]), local))
    slices.fill(requests)


# ---- the readers ------------------------------------------------------------------------------------
def plan_reader(plan: Plan, shapes: dict[str, Shape], read: Reader) -> Slices:
    """Slices of a source whose tensors are ``plan``'s pieces, read with ``read``; the files a request
    opened are closed after it."""

    def fill(requests: list[Request]) -> None:
        for name, offsets, local in requests:
            row_bytes = local[0].numel() * local.element_size()
            step = max(1, BLOCK_BYTES // row_bytes)
            with ExitStack() as stack:
                read_from = read(stack)
                for first in range(0, len(local), step):  # a block of rows at a time: a bounded buffer
                    block, at = local[first : first + step], (offsets[0] + first, *offsets[1:])
                    block.copy_(read_box(plan[name], at, block.shape, read_from))

    return Slices(shapes, fill)


def hf_slices(
    files: list[Path], config: GPTConfig, source: str, read_file: Callable[[Path], Mapping[str, torch.Tensor]]
) -> Slices:
    """An HF folder's weight ``files`` (safetensors, or pickle-format ones read by ``read_file``, memory-
    mapped), through the HF -> ours plan."""
    if all(file.suffix == ".safetensors" for file in files):
        where, shapes = _safetensors_headers(files)
        read = _safetensors_read(where)
    else:
        tensors = {key: value for file in files for key, value in read_file(file).items()}
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        read = _mapped_read(tensors)
    plan = hf_pieces(shapes, config, source)
    return plan_reader(plan, {name: _shape(pieces, shapes) for name, pieces in plan.items()}, read)


def safetensors_slices(path: Path) -> Slices:
    """Our ``model.safetensors``: our names already."""
    where, shapes = _safetensors_headers([path])
    plan = {key: [Piece(key, 0, shape[0])] for key, shape in shapes.items()}
    return plan_reader(plan, shapes, _safetensors_read(where))


def state_dict_slices(weights: Mapping[str, torch.Tensor]) -> Slices:
    """A state dict in our names, memory-mapped from a pickle-format file (``format.read_checkpoint``)."""
    shapes = {key: tuple(tensor.shape) for key, tensor in weights.items()}
    plan = {key: [Piece(key, 0, shape[0])] for key, shape in shapes.items()}
    return plan_reader(plan, shapes, _mapped_read(weights))


def merged_lora_slices(adapted: Slices, config: GPTConfig, lora: LoRAConfig) -> Slices:
    """The merged weights of a LoRA fine-tune in a plain ``GPT``'s names, from ``adapted``, its saved
    tensors in the LoRA model's names (``<layer>.base_layer.weight``, ``<layer>.lora_A.default.weight``,
    q, k and v split from the fused qkv): each box is its base weight's box plus
    ``(B[rows] @ A[:, columns]) x alpha / rank``, computed in float32 as peft merges."""
    from lightning_train.models.gpt import GPT

    with torch.device("meta"):
        model = apply_lora(GPT(config), lora)
    parts: dict[str, list[tuple[str, int, int]]] = {}  # plain name: (adapted key, first row, rows) each
    for key, (plain, row) in plain_names(model).items():
        if key in adapted.shapes:
            parts.setdefault(plain, []).append((key, row, adapted.shapes[key][0]))
    shapes = {plain: (sum(rows for *_, rows in runs), *adapted.shapes[runs[0][0]][1:])
              for plain, runs in parts.items()}
    scale = lora.alpha / lora.rank

    def fill(requests: list[Request]) -> None:
        reads: list[Request] = []
        updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (box, B rows, A columns)
        factors: dict[tuple[str, Shape, Shape], torch.Tensor] = {}  # boxes of A and B, each read once

        def factor(key: str, offsets: Shape, shape: Shape, device: torch.device) -> torch.Tensor:
            if (key, offsets, shape) not in factors:
                factors[key, offsets, shape] = torch.empty(shape, dtype=torch.float32, device=device)
                reads.append((key, offsets, factors[key, offsets, shape]))
            return factors[key, offsets, shape]

        for name, offsets, local in requests:
            start, stop = offsets[0], offsets[0] + len(local)
            for key, first, rows in parts[name]:
                low, high = max(start, first), min(stop, first + rows)
                if low >= high:
                    continue
                box = local[low - start : high - start]  # a view: the reader fills it in place
                reads.append((key, (low - first, *offsets[1:]), box))
                layer, base, kind = key.rpartition(".base_layer.")
                a_key, b_key = (f"{layer}.lora_{side}.{ADAPTER}.weight" for side in "AB")
                if base and kind == "weight" and a_key in adapted.shapes:
                    rank = adapted.shapes[a_key][0]
                    a = factor(a_key, (0, offsets[1]), (rank, box.shape[1]), box.device)
                    b = factor(b_key, (low - first, 0), (len(box), rank), box.device)
                    updates.append((box, b, a))
        adapted.fill(reads)
        for box, b, a in updates:
            box.add_(((b @ a) * scale).to(box.dtype))

    return Slices(shapes, fill)


def sharded_slices(path: Path, prefix: str) -> Slices:
    """Our sharded checkpoint folder: DCP reads each box from the shards that hold it."""
    from lightning_train.checkpoint.sharded import checkpoint_tensor_shapes

    saved = checkpoint_tensor_shapes(path)
    shapes = {key.removeprefix(prefix): shape for key, shape in saved.items() if key.startswith(prefix)}
    return Slices(shapes, lambda requests: read_boxes(path, [(prefix + n, o, t) for n, o, t in requests]))


def read_boxes(path: Path, requests: list[Request]) -> None:
    """Fill each ``(name, offsets, tensor)`` of ``requests`` with the box at ``offsets`` of the saved
    LightningModule tensor ``name``: DCP reads only the parts of the shards that hold it. Each rank reads
    on its own (no collective), so pipeline stages may ask for different tensors."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from lightning_train.checkpoint.sharded import _load, _local, _SafeLoadPlanner  # the safe reader, planner

    boxes: dict[str, dict[Shape, torch.Tensor]] = {}
    for name, offsets, tensor in requests:
        boxes.setdefault(f"state_dict.{name}", {})[tuple(offsets)] = tensor

    class BoxPlanner(_SafeLoadPlanner):  # DCP's planner for the boxes instead of a state dict's tensors
        def create_local_plan(self) -> LoadPlan:
            saved = self.metadata.state_dict_metadata
            return LoadPlan([
                item for name, into in boxes.items() for item in create_read_items_for_chunk_list(
                    name, saved[name], [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in into.items()]
                )
            ])

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return boxes[index.fqn][tuple(index.offset)]

    with warnings.catch_warnings():  # no_dist=True is asked for: DCP's note that it assumes so is noise
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        _load({}, _local(path), no_dist=True, planner=BoxPlanner(path))


def _opened(file: Path, safe_open: Any) -> Any:
    if not file.is_file():
        raise UserInputError(f"weights file {str(file)!r} does not exist; the folder is incomplete")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors raises its own SafetensorError, or OSError
        raise CorruptCheckpointError(
            f"cannot read safetensors file {str(file)!r} ({err}); it is truncated or not a safetensors file"
        ) from err


def _safetensors_headers(files: list[Path]) -> tuple[dict[str, Path], dict[str, Shape]]:
    """Each tensor's file and shape, from the files' headers."""
    from safetensors import safe_open

    where, shapes = {}, {}
    for file in files:
        with _opened(file, safe_open) as opened:
            for key in opened.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                where[key], shapes[key] = file, tuple(opened.get_slice(key).get_shape())
    return where, shapes


def _safetensors_read(files: Mapping[str, Path]) -> Reader:
    """Reads through ``get_slice``, each file opened once a request (and closed with its stack)."""
    from safetensors import safe_open

    def read_with(stack: ExitStack) -> Callable[[str, Index], torch.Tensor]:
        handles: dict[Path, Any] = {}

        def read(key: str, index: Index) -> torch.Tensor:
            file = files[key]
            if file not in handles:
                handles[file] = stack.enter_context(_opened(file, safe_open))
            return handles[file].get_slice(key)[index]

        return read

    return read_with


def _mapped_read(tensors: Mapping[str, torch.Tensor]) -> Reader:
    return lambda stack: lambda key, index: tensors[key][index]


def _shape(pieces: list[Piece], shapes: Mapping[str, Shape]) -> Shape:
    """The whole shape of the tensor ``pieces`` make up."""
    shape = shapes[pieces[0].key]
    return (sum(piece.rows for piece in pieces), *(shape[:-1] if pieces[0].transposed else shape[1:]))
