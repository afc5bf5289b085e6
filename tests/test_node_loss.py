"""A node lost and regained: an elastic job of two torchrun nodes (``--nnodes=1:2 --max-restarts=3``, the
c10d rendezvous on 127.0.0.1) loses one node (its agent and workers SIGKILLed after step 7), goes on with
the remaining node from its newest checkpoint (step 6), and takes the node back when a new agent joins
(the one-node group is stopped at step 9, checkpoints and exits 75, and the two-node group resumes there).

HSDP with ``replicate_size="nodes"`` (2 x 2, then 1 x 2, then 2 x 2) and ``global_batch_size=8`` with 2
sequences per rank: 1 micro-batch a step on 4 ranks, 2 accumulated on 2. Every step's loss, in every
launch, equals the one-process run's (rel 1e-5): the data position is exact and the global batch kept.
Goodput counts the step the lost node's launch trained past its last checkpoint as lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.helpers.multinode import free_port, read_step_losses, start_node, stop, wait, wait_for
from tests.helpers.node_faults import LOSE_NODE_ENV

pytestmark = pytest.mark.slow
LOST_AT, HELD_AT, MAX_STEPS = 7, 9, 12


def write_config(folder: Path, data_dir: Path, callbacks: tuple[dict, ...] = ()) -> Path:
    faults = "tests.helpers.node_faults"
    config = {
        "seed_everything": 1234,
        "trainer": {
            "default_root_dir": str(folder / "run"), "accelerator": "cpu", "max_steps": MAX_STEPS,
            "limit_val_batches": 0, "log_every_n_steps": 1, "gradient_clip_val": 0.5,
            "enable_progress_bar": False, "enable_model_summary": False,
            "strategy": {"class_path": "lightning_train.strategies.DataParallelStrategy",
                         "init_args": {"sharding": "fsdp", "replicate_size": "nodes"}},
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                    "every_n_train_steps": 3, "save_last": True, "monitor": "step", "mode": "max",
                    "save_top_k": -1}},
                {"class_path": f"{faults}.StepLoss", "init_args": {"path": str(folder / "losses.txt")}},
                {"class_path": f"{faults}.LoseNode", "init_args": {"at_step": LOST_AT}},
                *callbacks,
            ],
        },
        "model": {"class_path": "lightning_train.PretrainModule", "init_args": {
            "config": {"vocab_size": 258, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16},
            "warmup_steps": 2, "learning_rate": 0.01}},
        "data": {"class_path": "lightning_train.TextDataModule", "init_args": {
            "data_dir": str(data_dir), "seq_len": 16, "batch_size": 2, "global_batch_size": 8}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder / "config.yaml"


def test_a_lost_node_and_a_regained_one_keep_the_run_exact(tmp_path: Path, data_dir: Path) -> None:
    reference = tmp_path / "one_process"
    result = run_cli("fit", "--config", str(write_config(reference, data_dir)), "--trainer.devices=1",
                     "--trainer.strategy=auto", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {step: loss for step, loss, _ in read_step_losses(reference / "losses.txt")}
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))

    folder = tmp_path / "elastic"
    # only the one-node launch reaches step 9: the first is lost before it, the last resumes after it
    held = {"class_path": "tests.helpers.preemption_wait.WaitForPreemption",
            "init_args": {"step": HELD_AT, "marker_dir": str(folder / "markers")}}
    config = write_config(folder, data_dir, callbacks=(held,))
    port, logs = free_port(), [folder / "node_a.log", folder / "node_b.log", folder / "node_b_again.log"]
    args = ["--config", str(config), "--trainer.devices=2"]
    elastic = {"nnodes": "1:2", "max_restarts": 3}
    stays = start_node(logs[0], port, "elastic", host=True, fit_args=args, **elastic)
    lost = start_node(logs[1], port, "elastic", host=False, fit_args=args, env={LOSE_NODE_ENV: "1"},
                      **elastic)
    agents = [stays, lost]
    try:
        wait_for(lambda: lost.poll() is not None, "the lost node's agent to be killed", agents)
        assert lost.returncode == -9, logs[1].read_text()[-3000:]
        losses = folder / "losses.txt"
        wait_for(lambda: any(step == HELD_AT and world == 2 for step, _, world in read_step_losses(losses)),
                 "the one-node group to reach the step where it waits", agents)
        back = start_node(logs[2], port, "elastic", host=False, fit_args=args, **elastic)
        agents.append(back)
        assert wait([stays, back]) == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    finally:
        stop(agents)

    records = read_step_losses(folder / "losses.txt")
    # launch 1 on 4 ranks to step 7; launch 2 on 2 ranks from the checkpoint of step 6 to 9; launch 3 on
    # 4 ranks from the checkpoint of step 9 to the end
    assert [(step, world) for step, _, world in records] == (
        [(step, 4) for step in range(1, LOST_AT + 1)] + [(step, 2) for step in range(LOST_AT, HELD_AT + 1)]
        + [(step, 4) for step in range(HELD_AT + 1, MAX_STEPS + 1)])
    for step, loss, world in records:
        assert loss == pytest.approx(expected[step], rel=1e-5), (step, world)

    output = logs[0].read_text()
    for ranks, accumulated in ((4, 1), (2, 2)):
        assert (f"global_batch_size=8: {ranks} data-parallel ranks x batch_size=2 x {accumulated} "
                "accumulated micro-batches a step") in output
    assert "resuming as with --resume auto" in output
    assert (folder / "run" / "checkpoints" / "preempted.ckpt").exists()  # where the node came back

    [last_launch] = sorted((folder / "run").glob("version_*"))[-1:]
    goodput = json.loads((last_launch / "goodput.json").read_text())
    # launch 1 ended as rank 0 saw it: killed with the lost node, or stopped by the failed collective
    states = [launch["state"] for launch in goodput["launches"]]
    assert states[0] in ("killed", "stopped") and states[1:] == ["stopped", "finished"]
    assert goodput["steps"]["lost"] == 1 and goodput["seconds"]["lost"] > 0  # step 7 of launch 1
    assert goodput["between_launches_sec"] > 0  # the rendezvous of each restart
