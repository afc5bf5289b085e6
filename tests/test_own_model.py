"""A user's own model under ParallelStrategy: a transformers ``LlamaForCausalLM`` held by the user's own
LightningModule, or returned by ``PretrainModule.build_model``, gets per-layer FSDP2, tensor parallelism
(the built-in Llama plan or one given in YAML) and pipeline parallelism, on 2 real gloo ranks launched
through the CLI, each matching one process's losses; bad plans are one clear error."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, run_cli, run_torchrun
from tests.test_strategy_multiprocess import ENV, _fit

pytestmark = pytest.mark.slow
STRATEGY = "--trainer.strategy=lightning_train.strategies.ParallelStrategy"


def _config(tmp_path: Path, model: dict, strategy: dict | None = None) -> str:
    config = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "precision": "32-true", "limit_val_batches": 0, "max_steps": 6,
            "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1,
        },
        "model": model,
        "data": {
            "class_path": "strategy_probe.PatternDataModule", "init_args": {"samples": 48, "batch_size": 8}
        },
    }
    if strategy is not None:
        config["trainer"]["strategy"] = strategy
    path = tmp_path / f"config{len(list(tmp_path.glob('config*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


PRETRAIN = {
    "class_path": "hf_llama.LlamaPretrain",
    "init_args": {"config": {"vocab_size": 64}, "learning_rate": 3e-3, "warmup_steps": 2, "decay_steps": 100},
}


def _assert_losses_match(reports: list[dict], single: dict, rtol: float = 1e-5) -> None:
    assert len(single["losses"]) == 6
    for report in reports:
        torch.testing.assert_close(report["losses"], single["losses"], rtol=rtol, atol=0)


def test_own_lightning_module_gets_one_fsdp_unit_per_decoder_layer(tmp_path):
    """The user's LightningModule holding a LlamaForCausalLM: FSDP2 units are its 4 decoder layers (found
    from `_no_split_modules`) and the model as root, each layer checkpointed, losses as one process's
    (each of 2 ranks reading 4 of the 8 sequences)."""
    model = {"class_path": "hf_llama.OwnLlamaModule"}
    [single], _ = _fit(tmp_path, "single", "--config", _config(tmp_path, model), "--trainer.devices=1")
    fsdp, _ = _fit(
        tmp_path, "fsdp", "--config", _config(tmp_path, model), "--trainer.devices=2", STRATEGY,
        "--trainer.strategy.sharding=fsdp", "--trainer.strategy.activation_checkpointing=true",
        "--data.init_args.batch_size=4",
    )
    assert len(fsdp) == 2
    for report in fsdp:
        assert report["fsdp_units"] == ["model", *(f"model.model.layers.{i}" for i in range(4))]
    torch.testing.assert_close(fsdp[0]["losses"], single["losses"], rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def pretrain_single(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("single")
    [report], _ = _fit(tmp_path, "single", "--config", _config(tmp_path, PRETRAIN), "--trainer.devices=1")
    return report


@pytest.mark.parametrize(
    "layout", [["--trainer.strategy.tensor_parallel=2"], ["--trainer.strategy.pipeline_parallel=2"]],
    ids=["tp2", "pp2"],
)
def test_build_model_llama_under_tensor_and_pipeline_parallelism_matches_one_process(
    tmp_path, pretrain_single, layout
):
    """PretrainModule.build_model returning a LlamaForCausalLM: tp=2 (the built-in Llama plan, heads split,
    vocab-parallel loss) and pp=2 (2 decoder layers a stage, 1F1B over 4 microbatches), each on 2 ranks
    reading the whole batch of 8: the one-process losses at each of 6 steps."""
    reports, _ = _fit(
        tmp_path, "parallel", "--config", _config(tmp_path, PRETRAIN), "--trainer.devices=2", STRATEGY,
        *layout,
    )
    assert len(reports) == 2
    _assert_losses_match(reports, pretrain_single)
    if "--trainer.strategy.tensor_parallel=2" in layout:
        split = reports[0]["tp_split_params"]
        assert "model.model.layers.0.self_attn.k_proj.weight" in split and "model.lm_head.weight" in split
    else:  # each stage holds its own layers only, under the whole model's names
        assert len(reports[0]["initial_weights"]) + len(reports[1]["initial_weights"]) == 39


def test_a_plan_given_in_yaml_is_applied(tmp_path, pretrain_single):
    """A tensor_parallel_plan from the YAML config (the MLPs only): exactly those Linears are split, the
    attention stays whole on each rank (replicated), and the losses are one process's."""
    plan = {f"model.layers.*.mlp.{name}_proj": style  # names in the model (LightningModule's self.model)
            for name, style in (("gate", "colwise"), ("up", "colwise"), ("down", "rowwise"))}
    strategy = {"class_path": "lightning_train.strategies.ParallelStrategy",
                "init_args": {"tensor_parallel": 2, "tensor_parallel_plan": plan}}
    reports, _ = _fit(
        tmp_path, "plan", "--config", _config(tmp_path, PRETRAIN, strategy), "--trainer.devices=2"
    )
    _assert_losses_match(reports, pretrain_single)
    assert sorted(reports[0]["tp_split_params"]) == sorted(
        f"model.model.layers.{i}.mlp.{name}_proj.weight" for i in range(4) for name in ("gate", "up", "down")
    )


def test_a_plan_pattern_matching_nothing_is_one_line_exit_2(tmp_path):
    """Checked on the ranks once the model is built; the CLI prints the one error once and exits 2."""
    strategy = {"class_path": "lightning_train.strategies.ParallelStrategy",
                "init_args": {"tensor_parallel": 2,
                              "tensor_parallel_plan": {"model.layer.*.mlp.up_proj": "colwise"}}}
    done = run_cli(
        "fit", "--config", _config(tmp_path, PRETRAIN, strategy), "--trainer.devices=2",
        f"--trainer.default_root_dir={tmp_path / 'bad'}", cwd=tmp_path, env=ENV, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "tensor_parallel_plan pattern 'model.layer.*.mlp.up_proj' matches no module" in errors[0]
    assert "Traceback" not in done.stderr


def _tied_plans_worker(out_dir: str) -> None:
    """Run by torchrun on 2 gloo ranks: a Llama with tied embeddings laid out by the built-in plan (both
    split by vocabulary) and by an MLP-only plan (both replicated): its logits and whether the tie held."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_train._compat import end_distributed_process
    from lightning_train.strategies.plans import apply_plan, builtin_plan
    from tests.helpers.hf_llama import tiny_llama

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    mlp = {f"model.layers.*.mlp.{name}_proj": style
           for name, style in (("gate", "colwise"), ("up", "colwise"), ("down", "rowwise"))}
    report = {}
    for name, plan in (("builtin", None), ("mlp", mlp)):
        torch.manual_seed(0)
        model = tiny_llama()
        model.lm_head.weight = model.model.embed_tokens.weight
        ids = torch.randint(0, 64, (2, 8))
        expected = model(ids).logits
        apply_plan(model, mesh, plan or builtin_plan(model), loss_parallel=False)
        error = (model(ids).logits - expected).abs().max().item()
        report[name] = {"tied": model.lm_head.weight is model.model.embed_tokens.weight, "error": error}
    Path(out_dir, f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    end_distributed_process(0)


def test_tied_embeddings_stay_tied_under_a_plan(tmp_path):
    result = run_torchrun(2, "-m", "tests.test_own_model", str(tmp_path), cwd=REPO, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for plan in ("builtin", "mlp"):
            assert report[plan]["tied"], plan
            assert report[plan]["error"] < 1e-5, plan


if __name__ == "__main__":  # the tied-plans worker, started by torchrun
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _tied_plans_worker(sys.argv[1])
