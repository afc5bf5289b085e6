"""Each benchmark script runs once in ``--smoke`` mode (seconds, tiny model) and writes the JSON that
docs/benchmarks.md is built from. No time is asserted: these machines are shared and noisy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, cli_env


def run_smoke(script: str, out: Path, timeout: float = 240) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out)],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| " in done.stdout  # the printed table
    return json.loads(out.read_text())


def check_comparison(result: dict, pairs: int) -> None:
    for key in ("a_stats", "b_stats", "ratio_b_over_a"):
        stats = result[key]
        assert 0 < stats["min"] <= stats["median"] <= stats["max"]
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


def test_gpu_without_cuda_says_so_and_writes_nothing(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--out", str(tmp_path / "gpu.json")],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0
    assert "not run: no CUDA device" in done.stdout
    assert not (tmp_path / "gpu.json").exists()


def test_watchdog_overhead_smoke(tmp_path: Path) -> None:
    payload = run_smoke("watchdog_overhead.py", tmp_path / "watchdog_overhead.json")
    assert payload["benchmark"] == "watchdog_overhead" and payload["smoke"] is True
    for clock in ("cpu", "wall"):
        check_comparison(payload["results"][clock], pairs=1)
    assert payload["hooks_cpu_us_per_step"] > 0 and 0 < payload["hooks_share_of_step"] < 0.05


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
