"""Two nodes on one machine: two torchrun agents (``--nnodes=2 --nproc_per_node=2``, the c10d rendezvous
on 127.0.0.1), so the code sees real node ranks, local ranks and a node-level mesh.

- HSDP (``replicate_size="nodes"``: replicate across the nodes, shard inside each) and tensor parallelism
  inside a node x FSDP across the nodes give the one-process losses (rel 1e-5) and resume bitwise: a run
  resumed from its step-5 checkpoint on the two nodes takes the uninterrupted run's losses and ends with
  its weights, bit for bit.
- ``trainer.devices`` other than torchrun's processes per node is one error line on each node.

The model and data of test_parallel_layouts: a global batch of 8 sequences a step (40 samples: 5 steps an
epoch), checkpoints every 5 steps, 10 steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_train.checkpoint import consolidate
from tests.conftest import REPO
from tests.helpers.multinode import run_nodes
from tests.test_strategy_multiprocess import _fit
from tests.test_tensor_parallel import _config

pytestmark = pytest.mark.slow
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "helpers")])}  # strategy_probe
COMMON = [
    "--data.init_args.samples=40",
    "--trainer.callbacks+=ModelCheckpoint",
    "--trainer.callbacks.every_n_train_steps=5",
    "--trainer.callbacks.save_top_k=-1",
]
STEP_5, LAST = Path("checkpoints") / "epoch=0-step=5.ckpt", Path("checkpoints") / "epoch=1-step=10.ckpt"
LAYOUTS = {  # the strategy, and the sequences per data-parallel rank that make a global batch of 8
    "hsdp": ["--trainer.strategy=lightning_train.strategies.DataParallelStrategy",
             "--trainer.strategy.sharding=fsdp", "--trainer.strategy.replicate_size=nodes",
             "--data.init_args.batch_size=2"],
    "tp_in_node": ["--trainer.strategy=lightning_train.strategies.ParallelStrategy",
                   "--trainer.strategy.tensor_parallel=2", "--data.init_args.batch_size=4"],
}
# the global rank's groups on 2 nodes of 2 ranks (node n holds ranks 2n, 2n + 1)
MESHES = {
    "hsdp": lambda r: {"pp": [r], "dp_replicate": [r % 2, r % 2 + 2], "dp_shard": [r - r % 2, r - r % 2 + 1],
             "tp": [r]},
    "tp_in_node": lambda r: {"pp": [r], "dp_replicate": [r], "dp_shard": [r % 2, r % 2 + 2],
                             "tp": [r - r % 2, r - r % 2 + 1]},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("multinode")
    _config(folder)  # tp.yaml: GQA model, gradient clipping, 10 steps, fp32
    return folder


@pytest.fixture(scope="module")
def single(root: Path) -> dict:
    """The reference: one process, a batch of 8."""
    [report], _ = _fit(root, "single", "--config", str(root / "tp.yaml"), *COMMON, "--trainer.devices=1")
    return report


def two_nodes(root: Path, name: str, *args: str) -> tuple[list[dict], list[str]]:
    """``fit`` on two torchrun nodes of 2 ranks; every rank's StrategyProbe report
    (by global rank) and each node's log."""
    probe = root / "probe" / name
    logs = run_nodes(root / "launch" / name, [
        "--config", str(root / "tp.yaml"), *COMMON,
        f"--trainer.default_root_dir={root / name}", "--trainer.callbacks+=strategy_probe.StrategyProbe",
        f"--trainer.callbacks.output_dir={probe}", *args,
    ], env=ENV)
    return [json.loads((probe / f"rank{rank}.json").read_text()) for rank in range(4)], logs


def consolidated(root: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(consolidate(str(checkpoint), str(root / "export" / checkpoint.parent.parent.name)))


@pytest.mark.parametrize("layout", ["hsdp", "tp_in_node"])
def test_two_nodes_match_one_process_and_resume_bitwise(root: Path, single: dict, layout: str) -> None:
    args = LAYOUTS[layout]
    reports, _ = two_nodes(root, layout, *args)
    for rank, report in enumerate(reports):
        assert (report["world_size"], report["node_rank"], report["local_rank"]) == (4, rank // 2, rank % 2)
        assert report["mesh_groups"] == MESHES[layout](rank)
        assert report["initial_weights"] == single["initial_weights"]
        torch.testing.assert_close(report["losses"], single["losses"], rtol=1e-5, atol=0)

    resumed, _ = two_nodes(root, f"{layout}_resumed", *args, f"--ckpt_path={root / layout / STEP_5}")
    for report in resumed:
        assert report["losses"] == reports[0]["losses"][5:]  # bitwise: the same layout, the same batches
    uninterrupted = consolidated(root, root / layout / LAST)
    again = consolidated(root, root / f"{layout}_resumed" / LAST)
    assert again.keys() == uninterrupted.keys()
    for name, weight in uninterrupted.items():
        assert torch.equal(again[name], weight), name


def test_devices_other_than_torchruns_processes_is_one_error_line_on_each_node(tmp_path: Path) -> None:
    logs = run_nodes(tmp_path / "launch", [
        "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.devices=1",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    ], expect=1)  # torchrun's own code for failed workers
    for log in logs:
        assert [line for line in log.splitlines() if line.startswith("error:")] == [
            "error: --trainer.devices=1 does not match torchrun's --nproc_per_node=2 (the processes it "
            "started on this node, one device each); pass --trainer.devices=2 (or auto), or start torchrun "
            "with --nproc_per_node=1"], log[-3000:]
    assert not (tmp_path / "run").exists()
