"""Each benchmark script runs once in ``--smoke`` mode (seconds, tiny model) and writes the JSON that
docs/benchmarks.md is built from. No time is asserted: these machines are shared and noisy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules import PretrainModule
from tests.conftest import REPO, cli_env


def run_smoke(script: str, out: Path, *flags: str, timeout: float = 240) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out), *flags],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| " in done.stdout  # the printed table
    return json.loads(out.read_text())


def check_comparison(result: dict, pairs: int, may_be_zero: bool = False) -> None:
    """``may_be_zero``: B's part can measure 0 (a stall is a gap minus the median gap, floored at 0)."""
    for key in ("a_stats", "b_stats", "ratio_b_over_a"):
        stats = result[key]
        floor_ok = stats["min"] >= 0 if may_be_zero and key != "a_stats" else stats["min"] > 0
        assert floor_ok, (key, stats)
        assert stats["min"] <= stats["median"] <= stats["max"], (key, stats)
    assert len(result["pairs"]) == pairs
    a, b = result["pairs"][0]
    assert result["ratio_b_over_a"]["median"] == pytest.approx(b / a)


def test_overhead_smoke(tmp_path: Path) -> None:
    payload = run_smoke("overhead.py", tmp_path / "overhead.json")
    assert payload["benchmark"] == "overhead" and payload["smoke"] is True
    for clock in ("cpu", "wall"):
        check_comparison(payload["results"][clock], pairs=1)
    assert set(payload["setup"]["callbacks"]) == {
        "GradNormMonitor", "ThroughputMonitor", "TimeToQuality", "LossScaleMonitor", "NaNRecovery"
    }
    # Same weights, batches and optimizer on both sides: the same training, to float precision.
    assert payload["max_abs_final_loss_diff"] < 1e-5
    assert payload["machine"]["threads"] == 1 and len(payload["machine"]["load_average_1_5_15"]) == 3


def test_throughput_smoke(tmp_path: Path) -> None:
    payload = run_smoke("throughput.py", tmp_path / "throughput.json")
    assert payload["benchmark"] == "throughput"
    assert len(payload["results"]) == 3  # same block, GPT-2 block, both compiled
    for row, by_clock in payload["results"].items():
        assert payload["setup"]["shapes"][row]["block_size"] == 32
        for result in by_clock.values():
            check_comparison(result, pairs=1)
            assert result["tokens_per_step"] == 4 * 32
    assert set(payload["model_parity_ms"]) == {"lightning_train GPT", "peer, same block", "peer, GPT-2 block"}
    assert all(ms > 0 for ms in payload["model_parity_ms"].values())


def test_gpu_smoke_on_cpu(tmp_path: Path) -> None:
    payload = run_smoke("gpu.py", tmp_path / "gpu.json")
    assert payload["benchmark"] == "gpu"
    assert payload["setup"]["config"] == "configs/gpt2-124m.yaml"
    assert payload["setup"]["flops_per_token"] > 0
    check_comparison(payload["results"]["wall"], pairs=1)
    assert "a_tokens_per_second" in payload["results"]["wall"]
    assert payload["fit_diagnostics"]["syncs"]["syncs_per_step"] is None  # counted on CUDA only


def test_gpu_without_cuda_says_so_and_writes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu import main  # in this process: a new one would spend seconds importing to say one line

    assert main(["--out", str(tmp_path / "gpu.json")]) is None
    assert "not run: no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "gpu.json").exists()


def test_watchdog_overhead_smoke(tmp_path: Path) -> None:
    payload = run_smoke("watchdog_overhead.py", tmp_path / "watchdog_overhead.json")
    assert payload["benchmark"] == "watchdog_overhead" and payload["smoke"] is True
    for clock in ("cpu", "wall"):
        check_comparison(payload["results"][clock], pairs=1)
    assert payload["hooks_cpu_us_per_step"] > 0 and 0 < payload["hooks_share_of_step"] < 0.05


@pytest.mark.parametrize("rerun", [False, True], ids=["recovery", "rerun"])
def test_recovery_overhead_smoke(tmp_path: Path, rerun: bool) -> None:
    payload = run_smoke("recovery_overhead.py", tmp_path / "recovery.json", *(["--rerun"] if rerun else []))
    assert payload["benchmark"] == ("recovery_rerun_overhead" if rerun else "recovery_overhead")
    for clock in ("cpu", "wall"):
        check_comparison(payload["results"][clock], pairs=1)
    if rerun:  # NaNRecovery's own hooks, timed inside the run, on both sides
        check_comparison(payload["results"]["hooks_cpu"], pairs=1)
        assert -1 < payload["results"]["rerun_share_of_step"]["median"] < 1


def test_async_checkpoint_smoke(tmp_path: Path) -> None:
    payload = run_smoke("async_checkpoint.py", tmp_path / "async_checkpoint.json")
    [result] = payload["results"].values()  # --smoke: the tiny model only
    check_comparison(result["blocked"], pairs=1)
    assert result["state_bytes"] > 0 and result["step_time"]["steps_during"] >= 1


def test_goodput_overhead_smoke(tmp_path: Path) -> None:
    payload = run_smoke("goodput_overhead.py", tmp_path / "goodput_overhead.json")
    assert payload["benchmark"] == "goodput_overhead" and payload["smoke"] is True
    for clock in ("cpu", "wall"):
        check_comparison(payload["results"][clock], pairs=1)
    assert payload["hooks_cpu_us_per_step"]["median"] > 0


@pytest.mark.slow  # six 1- and 2-rank launches
def test_pipeline_bubble_smoke(tmp_path: Path) -> None:
    payload = run_smoke("pipeline_bubble.py", tmp_path / "pipeline_bubble.json")
    assert payload["benchmark"] == "pipeline_bubble" and payload["smoke"] is True
    results = payload["results"]
    assert list(results) == ["2", "4"]  # --smoke: 1F1B at two counts, and the V-shaped ZBV once
    [v_shaped] = payload["schedules"]["ZBVZeroBubble"].values()
    [one], [pp] = v_shaped["one_process_step_s"], v_shaped["pipeline_step_s"]
    assert v_shaped["bubble_ideal"] == 0 and v_shaped["bubble_measured"] == pytest.approx(1 - (one / 2) / pp)
    for microbatches, result in results.items():
        [one], [pp] = result["one_process_step_s"], result["pipeline_step_s"]  # --smoke: one pair
        assert one > 0 and pp > 0
        assert result["bubble_ideal"] == pytest.approx(1 / (int(microbatches) + 1))  # (p-1)/(m+p-1), p=2
        assert result["bubble_measured"] == pytest.approx(1 - (one / 2) / pp)
        [chunked] = result["one_process_chunked_step_s"]
        expected = chunked / 2 * (int(microbatches) + 1) / int(microbatches)  # T1(m)/p * (m+p-1)/m
        assert result["pipeline_over_expected"] == pytest.approx(pp / expected)


@pytest.mark.slow  # three 1- and 2-rank launches
def test_model_parallel_smoke(tmp_path: Path) -> None:
    payload = run_smoke("model_parallel.py", tmp_path / "model_parallel.json")
    assert payload["benchmark"] == "model_parallel" and payload["smoke"] is True
    assert payload["setup"]["ranks"] == {"single": 1, "fsdp": 2, "tp": 2}
    assert payload["setup"]["per_rank_batch"] == {"single": 2, "fsdp": 1, "tp": 2}  # one global batch
    state, activations = payload["memory"]["model_state_bytes"], payload["memory"]["activation_bytes"]
    assert 0.5 <= state["tp_over_single"] <= 0.55
    assert state["fsdp_over_single"] == pytest.approx(0.5, abs=1e-3)
    assert payload["goal_met"]["model_state_bytes"] is True
    # fsdp's ranks each run half the batch; tp's run all of it, split by heads, width and sequence
    assert activations["fsdp"] < activations["tp"] < activations["single"]
    tp_ranks = payload["per_rank"]["tp"]
    assert tp_ranks[0]["activation_bytes"] == tp_ranks[1]["activation_bytes"]
    # sequence parallelism: each tp rank normalises half of the positions
    norms = {layout: parts["norms"] for layout, parts in payload["activation_bytes_by_part"].items()}
    assert 2 * norms["tp"] == norms["single"]


def run_gpu_plan(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "model_parallel_gpu.py"), *args],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "error: no CUDA device here: benchmarks/model_parallel_gpu.py trains on GPUs"),
        (["--dry-run", "--gpus", "4", "--tp", "3"],
         "error: tensor_parallel=3 does not divide the model's heads (n_head=32, n_kv_head=8)"),
        (["--dry-run", "--gpus", "2", "--tp", "1,4"], "error: --tp 4 needs 4 GPUs, there are 2"),
    ],
)
def test_model_parallel_gpu_refuses_with_one_line(
    tmp_path: Path, monkeypatch, capsys, args: list[str], message: str
) -> None:
    if not args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from model_parallel_gpu import main  # in this process: the refusal comes before any launch

    assert main([*args, "--out", str(tmp_path / "gpu.json")]) == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith(message)
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow  # torchrun and 2 ranks
def test_model_parallel_gpu_dry_run_shards_the_llama3_stack(tmp_path: Path) -> None:
    """torchrun, 2 gloo ranks, the Llama-3-8B-shaped stack on the meta device: each rank holds half of
    every weight but the (replicated, sequence-parallel) norms."""
    out = tmp_path / "plan.json"
    done = run_gpu_plan("--dry-run", "--gpus", "2", "--tp", "2", "--layers", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 2 |" in done.stdout
    [result] = json.loads(out.read_text())["results"]
    config = GPTConfig(vocab_size=128256, block_size=4096, n_layer=2, n_head=32, n_kv_head=8, n_embd=4096,
                       intermediate_size=14336, rope_theta=500000.0, tie_embeddings=False)
    with torch.device("meta"):
        model = GPT(config)
    params, norms = model.num_params(), (2 * config.n_layer + 1) * config.n_embd
    assert result["num_params"] == params
    assert result["param_bytes"] == 4 * ((params - norms) // 2 + norms)
    assert result["flops_per_token"] == model.flops_per_token(4096)  # the whole model's, for MFU


def test_startup_smoke(tmp_path: Path) -> None:
    payload = run_smoke("startup.py", tmp_path / "startup.json")
    assert payload["benchmark"] == "startup" and payload["smoke"] is True
    for name in ("--help (top level)", "prepare --help", "fit pretrain-tiny.yaml, to its first step"):
        for clock in ("cpu", "wall"):
            check_comparison(payload["results"][name][clock], pairs=1)


def test_whole_process_smoke(tmp_path: Path) -> None:
    payload = run_smoke("whole_process.py", tmp_path / "whole_process.json", timeout=600)
    assert payload["benchmark"] == "whole_process" and payload["smoke"] is True
    rows = {"nanogpt, same block", "nanogpt, GPT-2 block"}
    assert set(payload["results"]) == rows  # no --baseline: no release row; --smoke: no compiled row
    for row in payload["results"].values():
        for part in ("wall", "cpu", "startup", "step", "validation", "checkpoint"):
            # our checkpoint part is GoodputMonitor's stall: a save's gap less the median gap, at least 0
            check_comparison(row[part], pairs=1, may_be_zero=part == "checkpoint")
        assert row["tokens_per_s"]["a"] > 0 and row["tokens_per_s"]["b"] > 0
    assert Path(payload["setup"]["imported"]["tree"]).is_relative_to(REPO)



def test_muon_smoke(tmp_path: Path) -> None:
    payload = run_smoke("muon.py", tmp_path / "muon.json")
    assert payload["benchmark"] == "muon" and payload["smoke"] is True
    for row in ("optimizer step", "training step"):
        for clock in ("cpu", "wall"):
            check_comparison(payload["results"][row][clock], pairs=1)


LITGPT_PYTHON = Path("/work/venv-litgpt/bin/python")  # time_to_quality.py's default


def check_time_to_quality(payload: dict, systems: set[str]) -> None:
    assert payload["benchmark"] == "time_to_quality" and payload["smoke"] is True
    setup = payload["setup"]
    assert (setup["val_batches"], setup["eval_every"], setup["lengths"]) == (2, 2, [2, 4])
    assert set(payload["runs"]) == systems
    n1, n2 = setup["lengths"]
    tokens = setup["shape"]["batch_size"] * setup["shape"]["block_size"]
    for name, [run] in payload["runs"].items():  # --smoke: one repeat
        assert run["short"]["cpu"] > 0 and run["long"]["cpu"] > 0
        assert run["cpu_per_step"] == pytest.approx((run["long"]["cpu"] - run["short"]["cpu"]) / (n2 - n1))
        assert run["tokens_per_cpu_s"] == pytest.approx(tokens / run["cpu_per_step"])
        assert not run["short"]["val"] and not run["long"]["val"]  # no validation in the throughput runs
        steps = [step for step, _ in run["quality"]["val"]]
        assert steps and steps == list(range(2, 2 * len(steps) + 1, 2)), (name, steps)  # every 2 steps
        reached = [step for step, loss in run["quality"]["val"] if loss <= setup["target"]]
        assert run["steps_to_target"] == (reached[0] if reached else None)
        if name != "litgpt":  # ours and nanoGPT's loop stop at the target
            assert steps[-1] == (reached[0] if reached else setup["max_steps"][name])
    ours = payload["runs"]["lightning_train"][0]
    for name, ratios in payload["results"]["ratios"].items():
        theirs = payload["runs"][name][0]
        assert ratios["tokens_per_cpu_s"]["median"] == pytest.approx(
            ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"])


@pytest.mark.slow  # ten processes: two throughput runs and a quality run of each system
def test_time_to_quality_smoke_without_litgpt(tmp_path: Path) -> None:
    """Ours and nanoGPT's loop, as on a machine without LitGPT's venv (CI)."""
    out = tmp_path / "time_to_quality.json"
    payload = run_smoke("time_to_quality.py", out, "--litgpt-python", str(tmp_path / "none"), timeout=600)
    assert payload["setup"]["litgpt"] is False
    check_time_to_quality(payload, {"lightning_train", "nanogpt, GPT-2 block", "nanogpt, same block"})


@pytest.mark.slow  # thirteen processes
def test_time_to_quality_smoke_with_litgpt(tmp_path: Path) -> None:
    if not LITGPT_PYTHON.exists():
        pytest.skip(f"no LitGPT venv at {LITGPT_PYTHON}: benchmarks/README.md says how to make one")
    payload = run_smoke("time_to_quality.py", tmp_path / "time_to_quality.json", timeout=600)
    systems = {"lightning_train", "litgpt", "nanogpt, GPT-2 block", "nanogpt, same block"}
    check_time_to_quality(payload, systems)
    # LitGPT pads the byte vocabulary (258) to 512 columns, all in its softmax: it starts near ln(512) = 6.24
    first_loss = payload["runs"]["litgpt"][0]["quality"]["val"][0][1]
    assert 5.8 < first_loss < 6.3


def test_prepare_throughput_smoke(tmp_path: Path) -> None:
    payload = run_smoke("prepare_throughput.py", tmp_path / "prepare_throughput.json")
    assert payload["benchmark"] == "prepare_throughput" and payload["smoke"] is True
    corpora = {name.rsplit(", ", 1)[0] for name in payload["results"]}
    assert len(corpora) == 3 and "default corpus" in corpora  # and two Parquet corpora of two sizes
    for name, result in payload["results"].items():
        assert result["prepare_mb_per_cpu_s"] > 0 and result["peak_rss_mb"] > 0 and result["tokens"] > 0
        if name.endswith("bpe 8192"):
            assert set(result["ceiling"]["mb_per_cpu_s"]) == {"encode_batch", "encode_batch_fast"}
            assert result["ceiling_mb_per_cpu_s"] == max(result["ceiling"]["mb_per_cpu_s"].values()) > 0


def test_packing_smoke(tmp_path: Path) -> None:
    payload = run_smoke("packing.py", tmp_path / "packing.json")
    assert payload["benchmark"] == "packing" and payload["smoke"] is True
    padded = payload["results"].pop(payload["padded"])
    assert 0.1 < padded["padding_fraction"] < 0.6  # padded to each batch's longest example
    assert len(payload["results"]) == 2
    for result in payload["results"].values():
        assert 0 <= result["padding_fraction"] < 0.5
        for clock in ("cpu", "wall"):
            check_comparison(result["real_tokens_per_s"][clock], pairs=1)
    rows_of_128 = payload["results"]["packed, rows of 128, 16 rows a batch"]
    assert rows_of_128["padding_fraction"] < padded["padding_fraction"] / 1.5


def test_recipes_smoke(tmp_path: Path) -> None:
    payload = run_smoke("recipes.py", tmp_path / "recipes.json")
    assert payload["benchmark"] == "recipes" and payload["smoke"] is True
    setup = payload["setup"]
    assert (setup["target"], setup["max_steps"], setup["val_every"]) == (5.5, 6, 2)
    baseline, *variants = payload["results"]
    assert baseline["flags"] == [] and baseline["name"].startswith("baseline")
    assert [v["name"] for v in variants[:2]] == ["lr 4e-3, min_lr 4e-4", "z-loss 1e-4"]
    for result in payload["results"]:
        steps = [step for step, _ in result["val"]]
        assert steps == list(range(2, 2 * len(steps) + 1, 2)), steps  # every 2 steps
        reached = [step for step, loss in result["val"] if loss <= setup["target"]]
        assert result["steps_to_target"] == (reached[0] if reached else None)
        assert steps[-1] == (reached[0] if reached else setup["max_steps"])  # TimeToQuality stopped it
        assert result["cpu"] > 0
        assert result["cpu_per_step"] == pytest.approx(result["cpu"] / result["steps_run"])
    for variant in variants:  # its flags reached the fit: it trained differently from the baseline
        assert variant["val"][0][1] != baseline["val"][0][1], variant["name"]


def test_recipes_combines_the_best_two_winners_of_different_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from recipes import VARIANTS, best_two

    def result(name: str, steps: int | None, cpu: float) -> dict:
        return {"name": name, "flags": VARIANTS.get(name, []), "steps_to_target": steps, "cpu_to_target": cpu}

    baseline = result("baseline", 500, 100.0)
    lr3, lr4 = result("lr 3e-3, min_lr 3e-4", 450, 90.0), result("lr 4e-3, min_lr 4e-4", 400, 80.0)
    warmup, qk = result("warmup 25", 475, 95.0), result("QK-norm per head", 450, 101.0)  # qk: more CPU
    # both learning rates set learning_rate: the best (4e-3) goes with the next winner of another setting
    assert [r["name"] for r in best_two([baseline, lr3, lr4, warmup, qk])] == [lr4["name"], warmup["name"]]
    assert best_two([baseline, lr3, lr4, qk]) == []  # one setting wins, twice: nothing to combine


def test_z_loss_adds_the_squared_log_normaliser_in_training_only() -> None:
    from benchmarks.z_loss import ZLossPretrainModule

    module = ZLossPretrainModule(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8), z_loss=0.5)
    logits = torch.randn(2, 3, 8) * 3
    labels = torch.tensor([[1, 2, -100], [3, -100, 4]])
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    log_normaliser = torch.logsumexp(logits, dim=-1)[labels != -100]  # the 4 predicted tokens only
    z_loss = 0.5 * log_normaliser.square().mean()
    torch.testing.assert_close(module.compute_loss(logits, labels), cross_entropy + z_loss)
    module.eval()  # validation: the cross-entropy alone, comparable with the default's val/loss
    torch.testing.assert_close(module.compute_loss(logits, labels), cross_entropy)


def test_batch_warmup_trains_on_the_ramps_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from benchmarks.batch_warmup import BatchWarmupPretrainModule

    module = BatchWarmupPretrainModule(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8), ramp_steps=100)
    assert [module.rows_at(step, 16) for step in (0, 33, 34, 67, 99, 100, 500)] == [4, 4, 8, 12, 12, 16, 16]
    seen = []
    monkeypatch.setattr(PretrainModule, "training_step", lambda self, batch, batch_idx: seen.append(batch))
    monkeypatch.setattr(BatchWarmupPretrainModule, "trainer", SimpleNamespace(global_step=50))
    batch = {"input_ids": torch.arange(32).view(16, 2), "labels": torch.arange(32).view(16, 2)}
    module.training_step(batch, 0)
    assert {name: value.tolist() for name, value in seen[0].items()} == {
        name: value[:8].tolist() for name, value in batch.items()
    }
