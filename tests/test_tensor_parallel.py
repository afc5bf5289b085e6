"""ParallelStrategy's tensor parallelism on 2 real gloo ranks, launched through the CLI as a user would:
the same losses and gradient norms as one process, and bad layouts refused with one line."""

import copy
import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lightning_train._compat import end_distributed_process
from lightning_train.checkpoint import consolidate, save_safetensors
from lightning_train.models.gpt import GPT, GPTConfig
from tests.conftest import REPO, run_cli, run_cli_in_process, run_torchrun
from tests.test_strategy_multiprocess import ENV, HELPERS, _fit

pytestmark = pytest.mark.slow
TP = [
    "--trainer.strategy=lightning_train.strategies.ParallelStrategy",
    "--trainer.strategy.tensor_parallel=2",
]
GRAD_NORM_MONITOR = "--trainer.callbacks+=lightning_train.callbacks.GradNormMonitor"


def _logged_grad_norms(root: Path) -> list[float]:
    with open(root / "version_0" / "metrics.csv") as f:
        return [float(row["health/grad_norm"]) for row in csv.DictReader(f) if row.get("health/grad_norm")]


def _config(tmp_path: Path) -> str:
    """GQA (4 query heads, 2 key/value heads) so the fused qkv split by heads is exercised; norms above
    gradient_clip_val, so clipping is real."""
    config = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "precision": "32-true", "limit_val_batches": 0, "max_steps": 10,
            "enable_progress_bar": False, "enable_model_summary": False, "gradient_clip_val": 0.5,
            "log_every_n_steps": 1,
        },
        "model": {
            "class_path": "lightning_train.PretrainModule",
            "init_args": {
                "config": {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                           "n_embd": 32},
                "learning_rate": 3e-3, "warmup_steps": 2, "decay_steps": 100,
            },
        },
        "data": {
            "class_path": "strategy_probe.PatternDataModule", "init_args": {"samples": 80, "batch_size": 8}
        },
    }
    (tmp_path / "tp.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "tp.yaml")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[Path, dict]:
    """The one-process reference run: its folder and its probe report."""
    tmp_path = tmp_path_factory.mktemp("single")
    config = _config(tmp_path)
    [report], _ = _fit(tmp_path, "single", "--config", config, "--trainer.devices=1", GRAD_NORM_MONITOR)
    return tmp_path / "single", report


@pytest.mark.parametrize("loss_parallel", [True, False], ids=["vocab-parallel-loss", "gathered-logits"])
def test_tensor_parallel_matches_one_process(tmp_path, single, loss_parallel):
    """tp=2 on 2 ranks, both reading the whole global batch of 8: the one-process losses to 1e-5 and
    gradient norms (strategy.clip_grad_norm_, what clipping uses, and GradNormMonitor's logged
    health/grad_norm) to 1e-5 at each of 10 steps, and its sharded checkpoint consolidates to the
    one-process weights. With loss_parallel (the default) each rank holds only its half of the
    vocabulary's logits; without, the whole logits."""
    config = _config(tmp_path)
    single_root, single = single
    tp, _ = _fit(
        tmp_path, "tp", "--config", config, "--trainer.devices=2", *TP, GRAD_NORM_MONITOR,
        f"--trainer.strategy.loss_parallel={str(loss_parallel).lower()}",
    )
    assert [r["world_size"] for r in tp] == [2, 2] and min(single["grad_norms"]) > 0.5
    whole = [8, 16, 64]  # batch, sequence, vocabulary
    for report in tp:
        expected = {"dtensor": True, "shape": whole, "local_shape": [8, 16, 32], "placements": ["S(2)"]}
        assert report["logits"] == (expected if loss_parallel else {
            "dtensor": False, "shape": whole, "local_shape": whole, "placements": []
        })
        assert report["initial_weights"] == single["initial_weights"]
        torch.testing.assert_close(report["losses"], single["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(report["grad_norms"], single["grad_norms"], rtol=1e-5, atol=0)
    # the sequence-parallel norms' Partial gradients are summed before the callbacks read them
    logged = _logged_grad_norms(tmp_path / "tp")
    assert len(logged) == 10
    assert logged == pytest.approx(_logged_grad_norms(single_root), rel=1e-5)
    # the sharded checkpoint of the tp run (DCP, canonical names and layout) holds the one-process weights
    consolidate(str(tmp_path / "tp" / "checkpoints" / "last.ckpt"), str(tmp_path / "export"))
    exported = load_file(tmp_path / "export" / "model.safetensors")
    single_file = single_root / "checkpoints" / "last.ckpt"
    reference = torch.load(single_file, weights_only=False)["state_dict"]
    assert set(exported) == {name.removeprefix("model.") for name in reference}
    for name, weight in exported.items():
        torch.testing.assert_close(weight, reference["model." + name], rtol=1e-4, atol=1e-6)
    # each rank holds half of the sharded weights: the parameter bytes are about half of one process's
    assert 0.45 < tp[0]["memory"]["param_bytes"] / single["memory"]["param_bytes"] < 0.65


def test_tensor_parallel_under_amp_accumulation_and_activation_checkpointing(tmp_path):
    """fp16 with AmpPrecision's loss scale (the vocab-parallel loss scaled, found_inf agreed over the tp
    ranks), 2 accumulated batches a step, activation checkpointing and NaNRecovery under tp=2: the
    one-process losses and norms with the same settings, to fp16's rounding."""
    config = _config(tmp_path)
    shared = ["--config", config, "--trainer.precision=16-mixed", "--trainer.accumulate_grad_batches=2",
              "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery", "--data.init_args.batch_size=4"]
    [reference], _ = _fit(tmp_path, "one", *shared, "--trainer.devices=1")
    reports, _ = _fit(
        tmp_path, "tp", *shared, "--trainer.devices=2", *TP,
        "--trainer.strategy.activation_checkpointing=true",
    )
    assert len(reference["losses"]) == 10
    for report in reports:
        torch.testing.assert_close(report["losses"], reference["losses"], rtol=1e-4, atol=0)
        torch.testing.assert_close(report["grad_norms"], reference["grad_norms"], rtol=1e-3, atol=0)


def test_a_loss_vocab_parallel_cannot_take_is_one_line_naming_loss_parallel_false(tmp_path):
    """Label smoothing (docs/pretraining.md's subclass) on logits sharded by vocabulary: one error line,
    exit 2, naming the fix; with loss_parallel=false the same module trains on the gathered logits."""
    config = _config(tmp_path)
    args = [
        "fit", "--config", config, "--trainer.devices=2", *TP, "--trainer.max_steps=2",
        "--model.class_path=strategy_probe.LabelSmoothedPretrain",
    ]
    bad = tmp_path / "bad"
    done = run_cli(*args, f"--trainer.default_root_dir={bad}", cwd=tmp_path, env=ENV, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = {line for line in done.stderr.splitlines() if line.startswith("error:")}  # the same on each rank
    assert len(errors) == 1, done.stderr[-3000:]
    assert "LabelSmoothedPretrain.compute_loss failed on logits sharded by vocabulary" in errors.pop()
    assert "trainer.strategy.loss_parallel=false" in done.stderr and "Traceback" not in done.stderr
    done = run_cli(
        *args, "--trainer.strategy.loss_parallel=false", f"--trainer.default_root_dir={tmp_path / 'good'}",
        cwd=tmp_path, env=ENV, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_finetune_validates_and_generates_under_tensor_and_pipeline_parallelism_as_one_process(tmp_path):
    """FinetuneModule under tp=2 and pp=2 (its batches padded to seq_len, the one shape the stages take):
    the vocab-parallel val/loss, the token accuracy (its argmax
    gathers the logits) and val/exact_match (greedy generation on the sharded model) equal one process's;
    the greedy and the seeded sampled completions of the held-out prompts, generated where the model
    trains (GenerationProbe: ParallelStrategy.generator()), are one process's token for token, and
    exact_match under the layout scores one process's greedy completions as the responses they are (the
    logged val/exact_match of these random weights is 0 everywhere)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=258, block_size=64, n_layer=2, n_head=2, n_embd=32, init_std=0.4)
    start = save_safetensors(GPT(config), tmp_path / "start")  # large weights: varied generations
    args = [
        "fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"), "--model.init_from", str(start),
        "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2",
        "--data.eval_prompts=4", "--data.batch_size=8",
        "--trainer.callbacks+=generation_probe.GenerationProbe",
    ]
    layouts = {
        "single": ["--trainer.devices=1"],
        "tp": ["--trainer.devices=2", *TP],
        "pp": ["--trainer.devices=2", TP[0], "--trainer.strategy.pipeline_parallel=2"],
    }
    metrics, completions = {}, {}
    reference_file = tmp_path / "single" / "completions-rank0.json"
    for name, layout in layouts.items():
        # FinetuneModule.exact_match under the layout, of one process's greedy completions as responses
        check = [] if name == "single" else [f"--trainer.callbacks.reference={reference_file}"]
        done = run_cli(*args, *layout, *check, f"--trainer.default_root_dir={tmp_path / name}", cwd=tmp_path,
                       env=ENV, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(tmp_path / name / "version_0" / "metrics.csv") as f:
            metrics[name] = [row for row in csv.DictReader(f) if row.get("val/loss")][-1]
        files = sorted((tmp_path / name).glob("completions-rank*.json"))
        completions[name] = [json.loads(path.read_text()) for path in files]
        assert len(completions[name]) == (1 if name == "single" else 2)
    [reference] = completions.pop("single")
    assert not reference["sharded"] and reference["greedy"] != reference["sampled"]
    assert len({token for row in reference["greedy"] for token in row}) > 4  # not one token repeated
    for name, ranks in completions.items():
        for rank in ranks:
            assert rank["sharded"] and rank["greedy"] == reference["greedy"], name
            assert rank["sampled"] == reference["sampled"], name
            assert rank["exact_match"] == 0.5, name  # every second response was cut short
        for key in ("val/loss", "val/token_accuracy", "val/exact_match"):
            expected = float(metrics["single"][key])
            assert float(metrics[name][key]) == pytest.approx(expected, rel=1e-5), (name, key)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.tensor_parallel=3"], "tensor_parallel=3 does not divide the world size 2"),
        (
            ["--model.init_args.config.n_head=2", "--model.init_args.config.n_kv_head=1"],
            "tensor_parallel=2 does not divide the model's heads (n_head=2, n_kv_head=1)",
        ),
        (
            ["--trainer.strategy.replicate_size=2"],
            "replicate_size=2 does not divide the data-parallel size 1 (world size 2 / tensor_parallel=2 / "
            "pipeline_parallel=1)",
        ),
    ],
)
def test_bad_layout_is_one_line_exit_2(tmp_path, monkeypatch, args, message):
    """Refused before any process starts, so asked in this process (a new one spends seconds importing)."""
    monkeypatch.syspath_prepend(HELPERS)  # the config's strategy_probe.PatternDataModule
    done = run_cli_in_process(
        "fit", "--config", _config(tmp_path), "--trainer.devices=2", *TP, *args,
        f"--trainer.default_root_dir={tmp_path / 'bad'}", cwd=tmp_path,
    )
    assert not torch.distributed.is_initialized()  # no process group: nothing was launched
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


# ---- reduce_partial_grads: the norms' Partial gradients in one all-reduce ------------------------
def _partial_grads_worker(out_dir: str) -> None:
    """Run by torchrun on 2 gloo ranks: a tp=2 GPT (n_layer=2) and a one-process copy take a forward and
    backward of the same tokens; the collectives of reduce_partial_grads and of one redistribute per
    Partial gradient (the per-tensor reduction it replaces) are counted, and the gradients saved."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_train.strategies.tensor_parallel import (
        apply_tensor_parallel,
        reduce_partial_grads,
        vocab_parallel_loss,
    )

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    single = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    model = copy.deepcopy(single)
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)))
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))  # the same on both

    def loss(net: torch.nn.Module) -> torch.Tensor:
        logits = net(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    loss(single).backward()
    with vocab_parallel_loss():
        loss(model).backward()
    partial = {name: p.grad for name, p in model.named_parameters() if p.grad.placements == (Partial(),)}
    with CommDebugMode() as per_tensor_comm:
        per_tensor = {name: grad.redistribute(grad.device_mesh, [Replicate()])
                      for name, grad in partial.items()}
    with CommDebugMode() as bucketed_comm:
        reduce_partial_grads(model)
    grads = dict(model.named_parameters())
    torch.save({
        "partial": sorted(partial),
        "per_tensor_collectives": per_tensor_comm.get_total_counts(),
        "bucketed_collectives": {str(op): n for op, n in bucketed_comm.get_comm_counts().items() if n},
        "per_tensor": {name: grad.to_local() for name, grad in per_tensor.items()},
        "bucketed": {name: grads[name].grad.to_local() for name in partial},
        "single": {name: single.get_parameter(name).grad for name in partial},
        "placements": {name: str(grads[name].grad.placements) for name in partial},
        "mismatched": [n for n, p in grads.items() if isinstance(p.grad, DTensor) and
                       p.grad.placements != p.placements],
    }, Path(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()  # no rank tears gloo down while the other is still in a collective
    end_distributed_process(0)


def test_partial_grads_are_reduced_in_one_all_reduce_as_one_process(tmp_path):
    """The 2 * n_layer + 1 = 5 sequence-parallel norms' Partial gradients: one all-reduce (not 5), and the
    result is what one all-reduce per gradient gives (exactly) and one process's gradients, Replicate."""
    result = run_torchrun(2, "-m", "tests.test_tensor_parallel", str(tmp_path), cwd=REPO, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    blocks = [f"blocks.{i}.{kind}.weight" for i in (0, 1) for kind in ("attn_norm", "mlp_norm")]
    norms = ["norm.weight", *blocks]  # 2 * n_layer + 1
    for rank in (0, 1):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert report["partial"] == sorted(norms)
        assert report["per_tensor_collectives"] == 5  # one each, as a redistribute per gradient did
        assert report["bucketed_collectives"] == {"c10d.allreduce_": 1}
        assert report["mismatched"] == []  # every gradient now has its parameter's placement
        for name in norms:
            assert report["placements"][name] == "(Replicate(),)"
            torch.testing.assert_close(report["bucketed"][name], report["per_tensor"][name], rtol=0, atol=0)
            torch.testing.assert_close(report["bucketed"][name], report["single"][name], rtol=1e-5, atol=1e-7)


if __name__ == "__main__":  # the reduce_partial_grads worker, started by torchrun
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _partial_grads_worker(sys.argv[1])
