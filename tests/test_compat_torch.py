"""Tests of ``lightning_train._compat.torch_api``, one a function, against the installed torch: an
upgrade that renames or changes one of its private names fails the test named after it."""

from __future__ import annotations

import copy
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_train import _compat


# ---- torch: GradScaler and optimizers ---------------------------------------------------------------------
def _scaled_step(scaler: torch.amp.GradScaler, grad: float) -> torch.optim.Optimizer:
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler.scale((weight * grad).sum()).backward()
    return optimizer


def test_loss_scale_async():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert _compat.loss_scale_async(scaler) is None  # no scale() yet
    scaler.scale(torch.ones(()))
    scale = _compat.loss_scale_async(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == 1024.0


def test_found_inf_per_device():
    scaler = torch.amp.GradScaler("cpu")
    finite = _scaled_step(scaler, 1.0)
    assert _compat.found_inf_per_device(scaler, finite) == []  # before unscale_
    scaler.unscale_(finite)
    assert sum(_compat.found_inf_per_device(scaler, finite)).item() == 0
    overflow = _scaled_step(scaler, float("inf"))
    scaler.unscale_(overflow)
    assert sum(_compat.found_inf_per_device(scaler, overflow)).item() == 1


def test_handles_amp_scaling():
    params = [nn.Parameter(torch.ones(2))]
    assert _compat.handles_amp_scaling(torch.optim.AdamW(params, fused=True))
    assert not _compat.handles_amp_scaling(torch.optim.AdamW(params))
    assert not _compat.handles_amp_scaling(torch.optim.SGD(params, lr=0.1))


def test_foreach_norm():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([-2.0])]
    for ord in (2.0, 1.0, float("inf")):
        expected = [torch.linalg.vector_norm(t, ord) for t in tensors]
        assert torch.equal(torch.stack(_compat.foreach_norm(tensors, ord)), torch.stack(expected))


def test_foreach_copy():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([-2.0])]
    copies = _compat.foreach_copy(tensors)
    tensors[0].zero_()
    assert [c.tolist() for c in copies] == [[3.0, 4.0], [-2.0]]


def test_foreach_sub_():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([-2.0])]
    _compat.foreach_sub_(tensors, [torch.tensor([1.0, 1.0]), torch.tensor([2.0])])
    assert [t.tolist() for t in tensors] == [[2.0, 3.0], [-4.0]]


# ---- torch.distributed -------------------------------------------------------------------------------------
def test_is_compiled():
    module = nn.Linear(2, 2)
    assert not _compat.is_compiled(module)
    module.compile()
    assert _compat.is_compiled(module)


def test_checkpoint_activations():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    recomputed = copy.deepcopy(plain)
    _compat.checkpoint_activations(recomputed[0])
    batch = torch.randn(3, 4)
    plain(batch).sum().backward()
    recomputed(batch).sum().backward()
    assert [n for n, _ in recomputed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for a, b in zip(plain.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_ddp_comm_hook_name(process_group):
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    assert _compat.ddp_comm_hook_name(model) is None
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert _compat.ddp_comm_hook_name(model) == "fp16_compress_hook"


def test_forward_only_v_schedule(process_group):
    """One rank holding both stages of a V (pp=1): the two neighbouring stages where torch's own V-shaped
    eval fails; the forward-only schedule gives the whole model's logits, twice (its state resets)."""
    from torch.distributed.pipelining import PipelineStage

    from lightning_train.models.gpt import GPT, GPTConfig
    from lightning_train.strategies.pipeline import stage_model

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=8))
    views = [stage_model(model, [0], True, False), stage_model(model, [1], False, True)]
    stages = [PipelineStage(view, index, 2, torch.device("cpu")) for index, view in enumerate(views)]
    schedule = _compat.forward_only_v_schedule(stages, 2)
    tokens = torch.randint(0, 64, (4, 8))
    with torch.no_grad():
        expected = model(tokens)
        for _ in range(2):
            torch.testing.assert_close(schedule.eval(tokens), expected)




def test_end_distributed_process(tmp_path):
    """Exit handlers run, output is flushed, the exit code is kept, and the process ends."""
    script = f"""
import atexit, sys, torch.distributed as dist
from lightning_train._compat import end_distributed_process
atexit.register(lambda: open({str(tmp_path / "handler-ran")!r}, "w").close())
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
print("unflushed", end="")
end_distributed_process(7)
print("never reached")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (7, "unflushed"), result.stderr
    assert (tmp_path / "handler-ran").exists()


def test_process_group_store():
    """The default group's store, shared by its ranks: set, get and a counter; None outside a group."""
    assert _compat.process_group_store() is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = _compat.process_group_store()
        store.set("compat-test", "7")
        assert store.get("compat-test") == b"7" and store.add("compat-counter", 1) == 1
    finally:
        dist.destroy_process_group()


def test_fake_process_group():
    """Rank 5 of 512 ranks in one process: a mesh over all of them, collectives that return without
    peers, and the group gone on leaving."""
    with _compat.fake_process_group(rank=5, world_size=512):
        assert (dist.get_rank(), dist.get_world_size()) == (5, 512)
        mesh = dist.device_mesh.init_device_mesh("cpu", (64, 8), mesh_dim_names=("dp", "tp"))
        assert mesh["tp"].get_local_rank() == 5 and mesh["dp"].get_local_rank() == 0
        dist.all_reduce(torch.ones(2))  # no peer answers, none is waited for
    assert not dist.is_initialized()


# ---- torch: Muon ------------------------------------------------------------------------------------------
def test_muon_orthogonalise_and_adjusted_lr():
    group = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    matrix = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(_compat.muon_orthogonalise(matrix, group).float())
    assert singular.shape == (16,) and singular.min() > 0.5 and singular.max() < 1.5  # ~orthogonal, Muon's
    adjusted = _compat.muon_adjusted_lr(0.01, "match_rms_adamw", torch.Size([96, 32]))
    assert abs(adjusted - 0.002 * 96**0.5) < 1e-12  # 0.2 x sqrt(the larger side) x lr


def test_local_box():
    """Each rank's box of the whole tensor, on a 2 x 2 mesh of torch's fake process group (every rank in
    turn), is exactly what ``distribute_tensor`` keeps there, uneven shards included; a plain tensor is
    its own whole."""
    assert _compat.local_box(torch.zeros(3, 4)) == ((0, 0), (3, 4))
    script = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from lightning_train._compat import local_box
whole = torch.arange(5 * 7.0).view(5, 7)
for rank in range(4):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for placements in [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(0)),
                       (Shard(1), Replicate())]:
        local = distribute_tensor(whole, mesh, placements, src_data_rank=None)
        offsets, sizes = local_box(local)
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(whole[box], local.to_local()), (rank, placements, offsets, sizes)
    dist.destroy_process_group()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
