"""Run by torchrun on 2 gloo ranks (``tests/test_muon.py``): three Muon steps of a GPT sharded by FSDP2 or
tensor parallelism against an unsharded copy given the same (gathered) gradients, the copy stepped by the
same optimizer in one process's way. Writes ``rank<r>.json``: the largest difference of any weight after each
step, and the placements the Muon matrices had."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_train._compat import end_distributed_process, muon_orthogonalise
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules import PretrainModule
from lightning_train.strategies.parallelize import apply_fsdp
from lightning_train.strategies.tensor_parallel import apply_tensor_parallel

CONFIG = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    module = PretrainModule(GPTConfig(**CONFIG), learning_rate=0.02, decay_steps=10, optimizer="muon")
    module.model = model
    return module.configure_optimizers()["optimizer"]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main(layout: str, out_dir: Path) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**CONFIG))
    sharded = copy.deepcopy(reference)
    if layout == "fsdp":
        apply_fsdp(sharded, mesh, None, torch.float32, True, False)
    else:
        apply_tensor_parallel(sharded, mesh, loss_parallel=False)
    sharded_optimizer, reference_optimizer = optimizer_of(sharded), optimizer_of(reference)
    tokens = torch.randint(0, CONFIG["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(1))
    mine = tokens.chunk(2)[rank] if layout == "fsdp" else tokens  # fsdp: a data-parallel half each
    differences = []
    for _ in range(3):
        logits = sharded(mine[:, :-1])
        torch.nn.functional.cross_entropy(whole(logits).flatten(0, 1), mine[:, 1:].flatten()).backward()
        for (name, param), (ref_name, ref_param) in zip(
            sharded.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert name == ref_name, (name, ref_name)
            ref_param.grad = whole(param.grad).clone()
        sharded_optimizer.step()
        reference_optimizer.step()
        sharded_optimizer.zero_grad()
        reference_optimizer.zero_grad()
        differences.append(max(
            (whole(p.detach()) - r.detach()).abs().max().item()
            for p, r in zip(sharded.parameters(), reference.parameters(), strict=True)
        ))
    muon_group = sharded_optimizer.param_groups[0]
    # What orthogonalising a shard alone would give instead (the error the gathering avoids), on the gradient
    # of one sharded matrix: its difference from this rank's slice of the whole matrix's orthogonalisation.
    whole(sharded(mine[:, :-1])).square().mean().backward()
    matrix = next(p for p in muon_group["params"] if isinstance(p, DTensor) and p.grad is not None)
    alone = muon_orthogonalise(matrix.grad.to_local(), muon_group).float()
    slice_of_whole = distribute_tensor(muon_orthogonalise(matrix.grad.full_tensor(), muon_group).float(),
                                       mesh, matrix.placements, src_data_rank=None).to_local()
    placements = sorted({str(p.placements) for p in muon_group["params"] if isinstance(p, DTensor)})
    moved = max((whole(p.detach()) - r.detach()).abs().max().item()
                for p, r in zip(sharded.parameters(), copy.deepcopy(GPT(GPTConfig(**CONFIG))).parameters(),
                                strict=True))
    (out_dir / f"rank{rank}.json").write_text(json.dumps({
        "differences": differences, "placements": placements, "muon_group": muon_group["name"],
        "muon_matrices": len(muon_group["params"]), "moved": moved,
        "shard_alone_difference": (alone - slice_of_whole).abs().max().item(),
    }))
    end_distributed_process(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]))
