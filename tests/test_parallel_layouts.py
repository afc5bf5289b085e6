"""ParallelStrategy layouts beyond tp=2 on real gloo ranks, launched through the CLI as a user would:
dp2 x tp2 (FSDP2 over 2 data-parallel ranks, each a tp=2 pair) and HSDP x tp2 on 4 ranks give the
one-process losses, gradient norms and weights; checkpoints move between layouts (tp=2 <-> 1 process,
fsdp dp=2 -> tp=2, dp2 x tp2 -> tp=2) and continue with the uninterrupted run's losses; ThroughputMonitor
counts each global batch once, not once per tensor-parallel rank.

Every run reads the same global batch of 8 sequences of 16 tokens per step (40 samples: 5 steps an epoch,
the same order every epoch) and checkpoints at steps 5 and 10."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lightning_train.checkpoint import consolidate
from lightning_train.models.gpt import GPT, GPTConfig
from tests.test_strategy_multiprocess import _fit
from tests.test_tensor_parallel import GRAD_NORM_MONITOR, TP, _config, _logged_grad_norms

pytestmark = pytest.mark.slow
STEP_5, STEP_10 = Path("checkpoints") / "epoch=0-step=5.ckpt", Path("checkpoints") / "epoch=1-step=10.ckpt"
PEAK_FLOPS = 1e12
COMMON = [
    "--data.init_args.samples=40",
    "--trainer.callbacks+=ModelCheckpoint",
    "--trainer.callbacks.every_n_train_steps=5",
    "--trainer.callbacks.save_top_k=-1",
    "--trainer.callbacks+=lightning_train.callbacks.ThroughputMonitor",
    f"--trainer.callbacks.peak_flops={PEAK_FLOPS}",
]
DP2 = ["--trainer.devices=4", "--data.init_args.batch_size=4"]  # 2 data-parallel ranks x 4 = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("layouts")
    _config(folder)  # tp.yaml: GQA model, gradient clipping, 10 steps, fp32
    return folder


def _run(root: Path, name: str, *args: str) -> list[dict]:
    reports, _ = _fit(root, name, "--config", str(root / "tp.yaml"), *COMMON, *args)
    return reports


@pytest.fixture(scope="module")
def single(root) -> dict:
    """The reference: one process, the default strategy (its checkpoints are single files)."""
    [report] = _run(root, "single", "--trainer.devices=1", GRAD_NORM_MONITOR)
    return report


@pytest.fixture(scope="module")
def tp2(root) -> list[dict]:
    return _run(root, "tp2", "--trainer.devices=2", *TP)


@pytest.fixture(scope="module")
def dp2_tp2(root) -> list[dict]:
    return _run(root, "dp2_tp2", *DP2, *TP, GRAD_NORM_MONITOR)


def _assert_same_run(reports: list[dict], reference: dict, steps: slice = slice(None)) -> None:
    for report in reports:
        torch.testing.assert_close(report["losses"], reference["losses"][steps], rtol=1e-5, atol=0)


def _metric(root: Path, name: str) -> list[float]:
    with open(root / "version_0" / "metrics.csv") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def _gpt(root: Path) -> GPT:
    config = yaml.safe_load((root / "tp.yaml").read_text())["model"]["init_args"]["config"]
    return GPT(GPTConfig(**config))


def _weights(root: Path, checkpoint: Path) -> list[list[float]]:
    """[sum, norm] of each parameter of the GPT saved in ``checkpoint`` (a file or a sharded folder), in
    the order StrategyProbe records a run's weights at train start (after a resume: what was loaded)."""
    if checkpoint.is_dir():
        export = root / "export" / checkpoint.parent.parent.name  # scratch: the same folder may be read twice
        consolidate(str(checkpoint), str(export), overwrite=True)
        state = load_file(export / "model.safetensors")
    else:
        saved = torch.load(checkpoint, weights_only=False)["state_dict"]
        state = {name.removeprefix("model."): tensor for name, tensor in saved.items()}
    model = _gpt(root)
    model.load_state_dict(state)
    return [[float(w.detach().double().sum()), float(w.detach().double().norm())] for w in model.parameters()]


def _resume(root: Path, name: str, checkpoint: Path, *args: str, flag: str = "--ckpt_path") -> list[dict]:
    """Resume ``checkpoint`` (``flag``: ``--ckpt_path`` or ``--resume``) to step 10 in a run folder of its
    own; every rank's weights at train start are the checkpoint's."""
    reports = _run(root, name, f"{flag}={checkpoint}", *args)
    expected = [value for pair in _weights(root, checkpoint) for value in pair]
    for report in reports:
        loaded = [value for pair in report["initial_weights"] for value in pair]
        assert loaded == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert report["global_step"] == 10 and len(report["losses"]) == 5
    return reports


def test_dp2_tp2_matches_one_process(root, single, dp2_tp2):
    """FSDP2 over 2 data-parallel ranks x tp=2 on 4 ranks: the one-process losses and pre-clip gradient
    norms (the strategy's and GradNormMonitor's) to 1e-5 at each of 10 steps, the same weights after
    them (consolidated), a quarter of the parameter bytes per rank; ThroughputMonitor counts 8 x 16
    tokens a step (not 4 ranks x 4 x 16) and MFU over the peak of all 4 devices."""
    assert [r["world_size"] for r in dp2_tp2] == [4] * 4
    _assert_same_run(dp2_tp2, single)
    for report in dp2_tp2:
        assert report["initial_weights"] == single["initial_weights"]
        torch.testing.assert_close(report["grad_norms"], single["grad_norms"], rtol=1e-5, atol=0)
    # FSDP2's dp shard of a tp-sharded weight is a strided shard: its squares are summed over dp too
    logged = _logged_grad_norms(root / "dp2_tp2")
    assert len(logged) == 10 and logged == pytest.approx(_logged_grad_norms(root / "single"), rel=1e-5)
    exported = load_file(consolidate(str(root / "dp2_tp2" / STEP_10), str(root / "x")))
    reference = torch.load(root / "single" / STEP_10, weights_only=False)["state_dict"]
    assert set(exported) == {name.removeprefix("model.") for name in reference}
    for name, weight in exported.items():
        torch.testing.assert_close(weight, reference["model." + name], rtol=1e-4, atol=1e-6)
    assert 0.2 < dp2_tp2[0]["memory"]["param_bytes"] / single["memory"]["param_bytes"] < 0.35

    tokens_per_sec = _metric(root / "dp2_tp2", "perf/tokens_per_sec")
    step_time = _metric(root / "dp2_tp2", "perf/step_time")
    assert len(tokens_per_sec) == len(step_time) == 10
    for rate, seconds in zip(tokens_per_sec, step_time, strict=True):
        assert rate * seconds == pytest.approx(8 * 16)
    flops_per_token = _gpt(root).flops_per_token(16)
    mfu = [rate * flops_per_token / (4 * PEAK_FLOPS) for rate in tokens_per_sec]
    assert _metric(root / "dp2_tp2", "perf/mfu") == pytest.approx(mfu)


def test_hsdp_tp2_matches_one_process(root, single):
    """replicate_size=2 x tp=2 on 4 ranks leaves one rank per shard group (dp_shard=1): each replica
    holds its tp half whole, gradients all-reduced over the 2 replicas; the one-process run all the same."""
    reports = _run(root, "hsdp_tp2", *DP2, *TP, "--trainer.strategy.replicate_size=2")
    _assert_same_run(reports, single)
    for report in reports:
        torch.testing.assert_close(report["grad_norms"], single["grad_norms"], rtol=1e-5, atol=0)
    assert 0.45 < reports[0]["memory"]["param_bytes"] / single["memory"]["param_bytes"] < 0.65


def test_tp2_throughput_counts_each_batch_once(root, tp2):
    """Both ranks of the tp=2 pair read the same batch of 8: 8 x 16 tokens a step, not 2 x 8 x 16."""
    tokens_per_sec = _metric(root / "tp2", "perf/tokens_per_sec")
    step_time = _metric(root / "tp2", "perf/step_time")
    assert len(tokens_per_sec) == len(step_time) == 10
    tokens = [rate * seconds for rate, seconds in zip(tokens_per_sec, step_time, strict=True)]
    assert tokens == pytest.approx([8 * 16] * 10)


def test_tp2_checkpoint_resumes_in_one_process(root, tp2):
    """A tp=2 sharded folder resumes in one process with lt_fsdp (or lt_ddp), and with the default
    strategy, which reads it whole: the weights it saved, then the uninterrupted tp=2 run's losses."""
    checkpoint = root / "tp2" / STEP_5
    [one] = _resume(root, "tp2_to_1", checkpoint, "--trainer.devices=1", "--trainer.strategy=lt_fsdp")
    _assert_same_run([one], tp2[0], slice(5, 10))
    [default] = _resume(root, "tp2_to_default", checkpoint, "--trainer.devices=1")
    _assert_same_run([default], tp2[0], slice(5, 10))


def test_one_process_checkpoint_resumes_under_tp2_and_fsdp(root, single):
    """The default strategy's single-file checkpoint resumes under tp=2 and under fsdp on 2 ranks (every
    rank takes its shards of the whole tensors and of AdamW's state): the one-process run's losses from
    step 6 on."""
    checkpoint = root / "single" / STEP_5
    reports = _resume(root, "1_to_tp2", checkpoint, "--trainer.devices=2", *TP, flag="--resume")
    _assert_same_run(reports, single, slice(5, 10))
    fsdp = ["--trainer.devices=2", "--trainer.strategy=lt_fsdp", "--data.init_args.batch_size=4"]
    _assert_same_run(_resume(root, "1_to_fsdp2", checkpoint, *fsdp), single, slice(5, 10))


def test_fsdp_dp2_checkpoint_resumes_under_tp2(root, single):
    """An fsdp folder of 2 data-parallel ranks (each holding half of every tensor along dim 0) resumes
    under tp=2 (halves along heads, columns, rows): the uninterrupted run's losses."""
    fsdp = _run(root, "fsdp2", "--trainer.devices=2", "--trainer.strategy=lt_fsdp", "--trainer.max_steps=5",
                "--data.init_args.batch_size=4")
    _assert_same_run(fsdp, single, slice(0, 5))
    reports = _resume(root, "fsdp2_to_tp2", root / "fsdp2" / STEP_5, "--trainer.devices=2", *TP)
    _assert_same_run(reports, single, slice(5, 10))


def test_dp2_tp2_checkpoint_resumes_on_tp2(root, dp2_tp2):
    """A 4-rank dp2 x tp2 folder resumes on 2 ranks with tp=2 (one data-parallel rank reading all 8):
    the uninterrupted 4-rank run's losses."""
    checkpoint = root / "dp2_tp2" / STEP_5
    reports = _resume(root, "dp2_tp2_to_tp2", checkpoint, "--trainer.devices=2", *TP, flag="--resume")
    _assert_same_run(reports, dp2_tp2[0], slice(5, 10))
