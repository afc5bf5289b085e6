"""Initial weights that do not depend on the layout: each tensor is drawn whole from a generator of its
own, seeded by the model's seed and the tensor's name, then each rank keeps its slice.

One process, DDP, FSDP2, tensor and pipeline parallelism therefore start from the same weights, whether
the model was built on the device or on the meta device and materialised shard by shard. DTensor's own
RNG would need no whole draw, but it gives the unsharded values on CUDA only (not on CPU/gloo). The cost
is one whole tensor at a time on each rank: the largest, the embedding, bounds the extra memory.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def draw_seed() -> int:
    """A model's seed, from the process's CPU generator (``torch.manual_seed``/``seed_everything``):
    the one random number a model takes from it, whatever the device it is built on."""
    return int(torch.randint(2**62, (), device="cpu"))


def tensor_seed(model_seed: int, name: str) -> int:
    """The seed of the tensor called ``name`` (the whole model's parameter name)."""
    return (model_seed + zlib.crc32(name.encode())) % 2**63


@torch.no_grad()
def seeded_normal_(param: torch.Tensor, std: float, seed: int) -> None:
    """Fill ``param`` with Normal(0, std) drawn whole on its device from ``seed``; a DTensor (a shard)
    gets its own slice of that draw. A meta tensor is left as it is (materialised later)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.is_meta:
        return
    generator = torch.Generator(local.device).manual_seed(seed)
    whole = torch.empty(param.shape, dtype=torch.float32, device=local.device)
    whole.normal_(0.0, std, generator=generator)
    if isinstance(param, DTensor):  # this rank's slice, cut locally (src_data_rank=None: no communication)
        whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(whole)
