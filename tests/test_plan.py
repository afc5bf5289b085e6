"""``python -m lightning_train plan``: one rank of a config's full layout laid out on the meta device over
torch's fake process group; its memory agrees with the planner's estimate, and a layout that does not fit
the model or the cluster is one error line. Also configs/llama3-70b-3d.yaml and configs/llama3-405b-3d.yaml,
which run here only as plans and ``--print_config`` (they need 512 and 2,048 GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_train.cli.plan import _build, _read_config
from lightning_train.strategies.dry_run import dry_run
from tests.conftest import REPO, run_cli_in_process, run_main

CONFIGS = REPO / "configs"
# config: (world size, the rank the planner counts fullest, the model's parameters)
LAYOUTS = {
    "llama3-8b-3d.yaml": (32, 16, 8_030_261_248),
    "llama3-70b-3d.yaml": (512, 384, 70_553_706_496),
    "llama3-405b-3d.yaml": (2048, 128, 405_853_388_800),
}


def _dry_run(name: str, rank: int | None = None):
    path = CONFIGS / name
    sections = _read_config(path)
    module, strategy, data = _build(path, sections)
    trainer = sections["trainer"]
    world_size = trainer["devices"] * trainer["num_nodes"]
    result = dry_run(
        module, strategy, world_size, trainer["devices"], rank, data["batch_size"], data["seq_len"],
        trainer["precision"],
    )
    return result, module


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_rank_of_the_full_layout_agrees_with_the_planner(name):
    world_size, fullest, num_params = LAYOUTS[name]
    result, module = _dry_run(name)
    assert (result.world_size, result.rank, result.num_params) == (world_size, fullest, num_params)
    assert all(p.device.type == "meta" for p in module.parameters())  # nothing was allocated
    estimate = result.estimate
    assert estimate.pipeline_rank == result.coordinates["pp"]
    # the states are the real shards' bytes; the planner counts matrices split by tp, norms whole
    assert result.state_bytes == pytest.approx(estimate.state_bytes, rel=0.02)
    assert result.grad_bytes == result.param_bytes and result.optimizer_bytes == 2 * result.param_bytes
    assert abs(result.difference()) <= 0.10
    assert result.total_bytes < 0.8 * 80 * 10**9  # fits an 80 GB GPU with the planner's margin


def test_every_rank_holds_its_share_of_the_model():
    """Over the ranks of one tensor-parallel group and the stages of a pipeline, the parameters add up to
    the whole model split over the data-parallel ranks (FSDP's padding aside); the default rank is the
    first of the stage the planner counts fullest."""
    first, _ = _dry_run("llama3-8b-3d.yaml", 0)  # pipeline ranks 0 and 1: tp 8 x dp 2 ranks a stage
    last, _ = _dry_run("llama3-8b-3d.yaml", 16)
    assert first.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert last.coordinates == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert (first.param_bytes + last.param_bytes) * 8 * 2 == pytest.approx(4 * 8_030_261_248, rel=0.001)
    assert first.held == "embed, blocks 0-15 of 32" and last.held == "blocks 16-31 of 32, norm, lm_head"
    assert first.estimate.total_bytes < last.estimate.total_bytes and LAYOUTS["llama3-8b-3d.yaml"][1] == 16
    assert not torch.distributed.is_initialized()  # the fake group is left behind


def test_the_405b_plan_prints_the_rank_beside_the_planner():
    # run from the repository as the docs show it (plan writes nothing)
    result = run_cli_in_process("plan", "--config", "configs/llama3-405b-3d.yaml", cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("rank 128 of 2048 (pp 1, dp_replicate 0, dp_shard 0, tp 0)")
    assert lines[1].split(None, 1) == ["layout", "fsdp over 16 x tp 8 x pp 16 (1F1B, 64 microbatches)"]
    assert "405.85B parameters" in lines[2] and lines[2].endswith("blocks 7-14 of 126")
    rows = {line[:27].strip(): line[27:].split("iB") for line in lines[4:11]}
    assert list(rows) == [
        "parameters", "gradients", "optimizer state (AdamW)", "model states", "FSDP buffers",
        "activations (estimated)", "total",
    ]
    assert len(rows["total"]) == 3  # this rank's and the planner's
    assert lines[-1].startswith("  the planner's total is ")
    docs = (REPO / "docs" / "strategies.md").read_text()
    assert f"```text\n{result.stdout}```" in docs  # docs/strategies.md shows this printout as it is


@pytest.mark.parametrize("name", ["llama3-70b-3d.yaml", "llama3-405b-3d.yaml"])
def test_print_config_resolves_the_3d_strategy(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main("fit", "--config", str(CONFIGS / name), "--print_config")
    assert code == 0, err[-2000:]
    resolved = yaml.safe_load(out)
    options = resolved["trainer"]["strategy"]["init_args"]
    given = yaml.safe_load((CONFIGS / name).read_text())["trainer"]["strategy"]["init_args"]
    assert {key: options[key] for key in given} == given
    assert resolved["trainer"]["precision"] == "bf16-mixed"


def _config(tmp_path: Path, **strategy: object) -> Path:
    """configs/llama3-8b-3d.yaml with some strategy options changed."""
    config = yaml.safe_load((CONFIGS / "llama3-8b-3d.yaml").read_text())
    config["trainer"]["strategy"]["init_args"].update(strategy)
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(("strategy", "arguments", "says"), [
    ({"tensor_parallel": 3}, ["--world_size", "48", "--devices_per_node", "6"], "n_head"),
    ({"pipeline_parallel": 64, "microbatches": 64}, ["--world_size", "512"], "n_layer"),
    ({"pipeline_parallel": 8}, [], "pipeline_parallel=8 does not divide the world size 32"),
    ({}, ["--world_size", "36"], "world_size=36 is not a whole number of nodes"),
    ({}, ["--rank", "32"], "rank=32 is not a rank of world_size=32"),
    ({"tensor_parallel": "auto", "pipeline_parallel": 1, "sharding": "auto"}, [], "'auto' is chosen"),
], ids=["heads", "stages", "world", "nodes", "rank", "auto"])
def test_a_layout_that_does_not_fit_is_one_error_line(strategy, arguments, says, tmp_path):
    config = str(_config(tmp_path, **strategy))
    result = run_cli_in_process("plan", "--config", config, *arguments, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], result.stderr
    assert result.stdout == ""


def test_a_data_parallel_config_plans_too(tmp_path):
    """configs/pretrain-tiny-fsdp.yaml (FSDP2 over 2 CPU ranks, no model parallelism): each rank holds half
    the model's states; the planner agrees."""
    result = run_cli_in_process("plan", "--config", str(CONFIGS / "pretrain-tiny-fsdp.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2" in result.stdout and "fsdp over 2" in result.stdout
    difference = result.stdout.splitlines()[-1].split()[-4]
    assert abs(float(difference.rstrip("%"))) <= 10
