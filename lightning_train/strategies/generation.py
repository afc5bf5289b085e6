"""Generation on a model as ``ParallelStrategy`` laid it out, on every rank together, with the KV cache.

``ShardedGenerator.generate`` has ``GPT.generate``'s arguments and result and runs its loop
(``models.generate.decode``); every rank calls it with the same prompts and gets the same tokens:

- tensor parallelism: the blocks run as they train (each rank computes its heads and keeps their KV
  cache). Sequence parallelism splits positions over the ``tp`` ranks, so a forward takes a multiple of
  ``tp`` positions: a decode step feeds the last ``tp`` tokens (the ``tp - 1`` already cached are cut from
  the cache and computed again), and a sequence shorter than that is padded at its end (causal attention:
  the padding changes no real position, and the cache is cut back after). A decode step reads every
  weight once however many of its ``tp`` positions it computes, so on a GPU this costs little.
- LongRoPE (Phi-3): the whole cache is computed again at the switch, as in ``GPT.generate``
  (``models.rope.cache_needs_recompute``). The end padding counts in the length that picks its tables, so
  the tokens are one process's where ``tp`` divides ``original_max_position_embeddings`` (Phi-3's 4096).
- pipeline parallelism: each forward runs the stages in order, passing activations stage to stage with
  ``torch.distributed`` send/recv on the pipeline group (the training schedules are made for
  microbatches, not for a cache); each stage keeps the KV cache of its own blocks. A rank may run two
  stages (the interleaved loop, the V-shaped placement: its two stages meet at the V's turn).
- the token: the head's vocab-parallel logits are gathered, the token picked on one rank (the last
  stage's first tensor-parallel rank of the first pipeline) and broadcast to every rank. Sampling draws
  from that rank's default generator, so with the seed one process had it draws that process's tokens.

``ShardedGenerator.logits`` is a forward of every position (lm_eval's log-likelihoods), its logits on
every rank. ``shard_for_generation`` lays out a whole ``GPT`` for generation without Lightning (tests,
scripts); ``shard_under_torchrun`` does so over the ranks torchrun started (the ``generate`` and
``evaluate`` tools).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_train.errors import UserInputError
from lightning_train.models.generate import decode
from lightning_train.models.gpt import KVCache
from lightning_train.models.rope import cache_needs_recompute
from lightning_train.strategies.parallelize import build_mesh
from lightning_train.strategies.pipeline import (
    check_zero_bubble,
    pipeline_stage_ids,
    split_blocks,
    stage_model,
)
from lightning_train.strategies.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # of the activations sent


class ShardedGenerator:
    """Generates with one rank's part of a tensor- and/or pipeline-parallel ``GPT`` (module doc).

    Args:
        stages: this rank's pipeline stages by stage index (``pipeline.stage_model``), or ``{0: model}``
            without pipeline parallelism; tensor-parallel (and FSDP-sharded) as they train.
        mesh: the device mesh, ``pp`` its first dimension and ``tp`` one of the others.
        schedule, virtual_stages: the pipeline schedule and stages per rank: where each stage runs.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        mesh: DeviceMesh,
        schedule: str = "1F1B",
        virtual_stages: int = 1,
    ) -> None:
        self.stages = dict(stages)
        pp = mesh["pp"].size()
        self.owners = [0] * (pp * virtual_stages)  # the pipeline rank running each stage
        for pp_rank in range(pp):
            for stage in pipeline_stage_ids(pp_rank, pp, virtual_stages, schedule):
                self.owners[stage] = pp_rank
        self.pp_group, self.pp_rank = mesh.get_group("pp"), mesh["pp"].get_local_rank()
        self.tp = mesh["tp"].size()
        self.source = int(mesh.mesh[self.owners[-1]].flatten()[0])  # the global rank that picks tokens
        first = self.stages[min(self.stages)]
        self.config = first.config
        self.layer = next(iter(first.blocks)).attn.layer  # a block this rank runs: its cache's length
        self._told: set[int] = set()  # pipeline ranks sent the activations' dtype in this generate call
        self._heard: dict[int, torch.dtype] = {}

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, use_cache: bool = True, **sampling: Any) -> Tensor:
        """``GPT.generate`` on the sharded model; call it on every rank with the same ``idx``. ``sampling``:
        ``GPT.generate``'s ``temperature``, ``top_k``, ``eos_id`` and ``tokenizer_vocab_size``."""
        self._told, self._heard = set(), {}
        cache = KVCache(self.config.n_layer) if use_cache else None
        return decode(
            self._last_logits, idx, max_new_tokens, self.config.block_size, cache,
            share=self._share, **sampling,
        )

    @torch.no_grad()
    def logits(self, idx: Tensor) -> Tensor:
        """The float32 logits (B, T, vocab) of every position of ``idx`` (B, T), on every rank: a ``GPT``
        forward's on the sharded model; call it on every rank with the same ``idx``."""
        self._told, self._heard = set(), {}
        total = idx.shape[1]
        hidden = self._run_stages(self._window(idx, 0), None)
        if hidden is None:  # not the last stage: filled by the broadcast below
            logits = torch.empty(idx.shape[0], total, self.config.vocab_size, device=idx.device)
        else:  # gathered by vocabulary on every tp rank of the last stage
            logits = (hidden.full_tensor() if isinstance(hidden, DTensor) else hidden)[:, :total].float()
        if len(set(self.owners)) > 1:
            # every rank called with the same idx (replicas too), so one broadcast from the rank that picks
            # tokens is enough; float32 fixes the dtype the receivers allocate
            dist.broadcast(logits, src=self.source)
        return logits

    def _window(self, idx: Tensor, start: int) -> Tensor:
        """``idx[:, start:]`` padded at its end to a multiple of ``tp`` positions (causal attention: the
        padding changes no real position); a window past ``block_size`` is refused."""
        total = idx.shape[1]
        width = _round_up(total - start, self.tp)
        if start + width > self.config.block_size:
            raise UserInputError(
                f"{total} tokens padded to {width} for tensor_parallel={self.tp} exceed the model's "
                f"block_size={self.config.block_size}; generate with use_cache=True, or use a block_size "
                f"divisible by {self.tp}"
            )
        return F.pad(idx[:, start:], (0, start + width - total))

    def _last_logits(self, idx: Tensor, cache: KVCache | None) -> Tensor | None:
        """The last position's logits on the source rank (None elsewhere), computing the positions the
        cache lacks in a window of a multiple of ``tp`` positions (module doc)."""
        total = idx.shape[1]
        cached = cache.past_length(self.layer) if cache is not None else 0
        if cache_needs_recompute(self.config.rope_scaling, cached, total):
            cached = 0
        start = max(total - _round_up(total - cached, self.tp), 0)
        tokens = self._window(idx, start)
        if cache is not None:
            cache.crop(start)
        hidden = self._run_stages(tokens, cache)
        if cache is not None:
            cache.crop(total)
        if hidden is None:  # not the last stage
            return None
        logits = hidden[:, total - 1 - start]
        if isinstance(logits, DTensor):  # sharded by vocabulary: every tp rank of the last stage gathers
            logits = logits.full_tensor()
        return logits if dist.get_rank() == self.source else None

    def _run_stages(self, tokens: Tensor, cache: KVCache | None) -> Tensor | None:
        """This rank's stages, in pipeline order, on what the stage before sent; the last stage's output
        (logits) on its ranks, None on the others."""
        x, (batch, width) = tokens, tokens.shape
        shape = (batch, width // self.tp, self.config.n_embd)  # sequence parallelism: tp-th of the positions
        for stage, owner in enumerate(self.owners):
            if owner != self.pp_rank:
                continue
            if stage > 0 and self.owners[stage - 1] != owner:
                x = self._recv(shape, self.owners[stage - 1], tokens.device)
            x = self.stages[stage](x, cache)
            if stage + 1 < len(self.owners) and self.owners[stage + 1] != owner:
                self._send(x, self.owners[stage + 1])
        return x if self.owners[-1] == self.pp_rank else None

    def _send(self, x: Tensor, peer: int) -> None:
        if peer not in self._told:  # the dtype once a call and peer: it follows the precision in use
            code = torch.tensor([DTYPES.index(x.dtype)], device=x.device)
            dist.send(code, group=self.pp_group, group_dst=peer)
            self._told.add(peer)
        dist.send(x.contiguous(), group=self.pp_group, group_dst=peer)

    def _recv(self, shape: tuple[int, ...], peer: int, device: torch.device) -> Tensor:
        if peer not in self._heard:
            code = torch.zeros(1, dtype=torch.long, device=device)
            dist.recv(code, group=self.pp_group, group_src=peer)
            self._heard[peer] = DTYPES[int(code)]
        x = torch.empty(shape, dtype=self._heard[peer], device=device)
        dist.recv(x, group=self.pp_group, group_src=peer)
        return x

    def _share(self, next_id: Tensor | None, idx: Tensor) -> Tensor:
        """The source rank's tokens, on every rank."""
        if next_id is None:
            next_id = torch.empty(idx.shape[0], 1, dtype=torch.long, device=idx.device)
        dist.broadcast(next_id, src=self.source)
        return next_id


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shard_for_generation(
    model: nn.Module,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    schedule: str = "1F1B",
    virtual_stages: int = 1,
    device: torch.device | str = "cpu",
) -> ShardedGenerator:
    """Lay out a whole ``GPT`` (the same weights on every rank) as ``ParallelStrategy`` does, on its mesh
    over the default process group (the data-parallel ranks: replicas that generate the same tokens), and
    return its generator; this rank keeps its stages only. Call it on every rank."""
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise UserInputError(
            f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} does not divide the "
            f"world size {world}; use sizes whose product divides it"
        )
    check_tensor_parallel(tensor_parallel, model.config)
    mesh = build_mesh(torch.device(device).type, world, tensor_parallel, pipeline_parallel)
    # a V-shaped rank 0 would shard a tied embedding twice: refused as for training
    check_zero_bubble(schedule, 1, tensor_parallel, model.config.tie_embeddings, False, False)
    num_stages = pipeline_parallel * virtual_stages
    splits = split_blocks(model, num_stages)
    ids = pipeline_stage_ids(mesh["pp"].get_local_rank(), pipeline_parallel, virtual_stages, schedule)
    stages = {i: stage_model(model, splits[i], i == 0, i == num_stages - 1) for i in ids}
    for stage in stages.values():
        if tensor_parallel > 1:
            apply_tensor_parallel(stage, mesh["tp"])
        stage.to(device)
    return ShardedGenerator(stages, mesh, schedule, virtual_stages)


def shard_under_torchrun(
    model: nn.Module, tensor_parallel: int, pipeline_parallel: int, tool: str
) -> ShardedGenerator:
    """``model`` (read whole on every rank) laid out over the ranks torchrun started, each on its
    ``LOCAL_RANK``'s GPU (NCCL) or the CPU (gloo); outside torchrun, one error naming ``tool``'s launch."""
    if "WORLD_SIZE" not in os.environ:
        ranks = tensor_parallel * pipeline_parallel
        raise UserInputError(
            f"--tensor_parallel {tensor_parallel} --pipeline_parallel {pipeline_parallel} runs on {ranks} "
            f"ranks; start it with torchrun --nproc_per_node={ranks} -m lightning_train {tool} ..."
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return shard_for_generation(model.eval(), tensor_parallel, pipeline_parallel, device=device)
