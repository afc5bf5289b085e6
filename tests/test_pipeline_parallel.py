"""ParallelStrategy's pipeline parallelism on real gloo ranks, launched through the CLI as a user would:
pp=2 under each schedule (the zero-bubble ones too), tp2 x pp2 and dp2 x pp2 on 4 ranks give the
one-process losses, gradient norms and weights; checkpoints move between pipeline and other layouts; bad
layouts are refused with one line."""

import csv
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lightning_train.checkpoint import consolidate
from tests.conftest import run_cli_in_process
from tests.test_strategy_multiprocess import _fit

pytestmark = pytest.mark.slow
PARALLEL = "--trainer.strategy=lightning_train.strategies.ParallelStrategy"
GRAD_NORM_MONITOR = "--trainer.callbacks+=lightning_train.callbacks.GradNormMonitor"
GLOBAL_BATCH = 8


def _config(folder: Path) -> str:
    """4 blocks (2 per stage, or 1 per virtual stage), GQA, tied embeddings (the default: the first and
    last stage share one), validation every 5 steps, gradient norms above the clipping threshold."""
    config = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "precision": "32-true", "max_steps": 10, "limit_val_batches": 2,
            "val_check_interval": 5, "enable_progress_bar": False, "enable_model_summary": False,
            "gradient_clip_val": 0.5, "log_every_n_steps": 1,
        },
        "model": {
            "class_path": "lightning_train.PretrainModule",
            "init_args": {
                "config": {"block_size": 16, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 32},
                "learning_rate": 3e-3, "warmup_steps": 2, "decay_steps": 100,
            },
        },
        "data": {
            "class_path": "lightning_train.TextDataModule",
            # limit_val_batches=2 batches a device, spread over the val split: the same windows whenever the
            # batch over all data-parallel devices is the same
            "init_args": {"seq_len": 16, "batch_size": GLOBAL_BATCH},
        },
    }
    path = folder / "pp.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _logged(root: Path, name: str) -> list[float]:
    with open(root / "version_0" / "metrics.csv") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def _weights(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    if checkpoint.is_dir():
        consolidate(str(checkpoint), str(out))
        return load_file(out / "model.safetensors")
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    return {name.removeprefix("model."): weight for name, weight in state.items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("single")
    [report], _ = _fit(folder, "run", "--config", _config(folder), "--trainer.devices=1", GRAD_NORM_MONITOR)
    return folder, report


LAYOUTS = {
    "pp2-1F1B": (2, ["--trainer.strategy.pipeline_parallel=2"]),
    "pp2-GPipe-8-microbatches": (
        2, ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.pipeline_schedule=GPipe",
            "--trainer.strategy.microbatches=8"],
    ),
    "pp2-Interleaved1F1B": (
        2, ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.pipeline_schedule=Interleaved1F1B",
            "--trainer.strategy.virtual_stages=2"],
    ),
    # zero bubble: the backward split into input and weight gradients, the latter filling the bubble
    "pp2-InterleavedZeroBubble": (
        2, ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.virtual_stages=2",
            "--trainer.strategy.pipeline_schedule=InterleavedZeroBubble"],
    ),
    # V-shaped: rank 0 runs stages 0 and 3 (the embedding and the head: one tied embedding, no copy)
    "pp2-ZBVZeroBubble": (
        2, ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.pipeline_schedule=ZBVZeroBubble",
            "--trainer.strategy.virtual_stages=2"],
    ),
    "pp2-DualPipeV": (
        2, ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.pipeline_schedule=DualPipeV",
            "--trainer.strategy.virtual_stages=2"],
    ),
    "tp2xpp2": (4, ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.tensor_parallel=2"]),
    # 2 data-parallel ranks (FSDP2 over them) read half the global batch each
    "dp2xpp2": (
        4, ["--trainer.strategy.pipeline_parallel=2", f"--data.init_args.batch_size={GLOBAL_BATCH // 2}"],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layouts_match_one_process(tmp_path, single, layout):
    """For 10 steps: losses (the mean over the global batch, on every rank) and gradient norms (the
    strategy's, over all stages, and GradNormMonitor's logged ones) to a relative 1e-5, validation loss
    too, and the weights after 10 steps (the sharded checkpoint, consolidated) to 1e-5 of each tensor's
    norm."""
    devices, args = LAYOUTS[layout]
    single_root, reference = single
    reports, _ = _fit(
        tmp_path, "run", "--config", _config(tmp_path), f"--trainer.devices={devices}", PARALLEL, *args,
        GRAD_NORM_MONITOR,
    )
    assert [r["world_size"] for r in reports] == [devices] * devices
    assert min(reference["grad_norms"]) > 0.5  # clipping is real
    for report in reports:
        torch.testing.assert_close(report["losses"], reference["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(report["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0)
    run, reference_run = tmp_path / "run", single_root / "run"
    total = "health/grad_norm"
    assert _logged(run, total) == pytest.approx(_logged(reference_run, total), rel=1e-5)
    for group in ("embeddings", "block.0", "block.3", "head"):  # groups of the first and the last stage
        name = f"health/grad_norm/{group}"
        # a small group's norm shows fp32 rounding of gradients summed over microbatches in another order
        assert _logged(run, name) == pytest.approx(_logged(reference_run, name), rel=1e-4)
    assert len(_logged(run, "val/loss")) == 2
    assert _logged(run, "val/loss") == pytest.approx(_logged(reference_run, "val/loss"), rel=1e-5)
    weights = _weights(run / "checkpoints" / "last.ckpt", tmp_path / "export")
    expected = _weights(reference_run / "checkpoints" / "last.ckpt", tmp_path / "unused")
    assert set(weights) == set(expected)
    for name, weight in weights.items():  # per tensor, against its norm: AdamW makes a near-zero gradient
        # element's fp32 rounding (another summation order, e.g. the vocab-parallel loss's) a whole step
        difference = (weight - expected[name]).norm() / expected[name].norm()
        assert difference < 1e-5, f"{name}: {difference:.1e}"


def test_pipeline_under_amp_accumulation_and_activation_checkpointing(tmp_path):
    """fp16 with AmpPrecision's loss scale (each microbatch's loss scaled before its backward), 2
    accumulated batches a step (the tied embedding's copies summed once a step), activation checkpointing
    and NaNRecovery under pp=2: the one-process losses and norms, to fp16's rounding."""
    config = _config(tmp_path)
    shared = ["--config", config, "--trainer.precision=16-mixed", "--trainer.accumulate_grad_batches=2",
              "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery"]
    [reference], _ = _fit(tmp_path, "one", *shared, "--trainer.devices=1")
    reports, _ = _fit(
        tmp_path, "pp", *shared, "--trainer.devices=2", PARALLEL, "--trainer.strategy.pipeline_parallel=2",
        "--trainer.strategy.activation_checkpointing=true",
    )
    for report in reports:
        torch.testing.assert_close(report["losses"], reference["losses"], rtol=1e-4, atol=0)
        torch.testing.assert_close(report["grad_norms"], reference["grad_norms"], rtol=1e-3, atol=0)


def test_nan_recovery_judges_the_norm_of_all_stages(tmp_path, single):
    """NaNRecovery alone under pp=2 (no GradNormMonitor to share a measurement with): the gradient norm it
    judges each step is the whole model's, the one-process run's, not one stage's."""
    _, reference = single
    reports, _ = _fit(
        tmp_path, "pp", "--config", _config(tmp_path), "--trainer.devices=2", PARALLEL,
        "--trainer.strategy.pipeline_parallel=2",
        "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery",
    )
    for report in reports:
        assert len(report["judged_grad_norms"]) == len(reference["grad_norms"]) == 10
        torch.testing.assert_close(report["judged_grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0)


def test_pipeline_checkpoints_move_between_layouts(tmp_path):
    """A pp=2 checkpoint at step 10 resumes under pp=2, on tp=2 and in one process, and a one-process
    checkpoint resumes under pp=2: each trains steps 10..14 with the losses of an uninterrupted one-process
    run."""
    config = _config(tmp_path)
    pp = [PARALLEL, "--trainer.strategy.pipeline_parallel=2"]
    _fit(tmp_path, "pp", "--config", config, "--trainer.devices=2", *pp)
    _fit(tmp_path, "one", "--config", config, "--trainer.devices=1")
    _fit(tmp_path, "long", "--config", config, "--trainer.devices=1", "--trainer.max_steps=15")
    expected = _logged(tmp_path / "long", "train/loss")[10:]
    pp_checkpoint = f"--ckpt_path={tmp_path / 'pp' / 'checkpoints' / 'last.ckpt'}"
    one_checkpoint = f"--ckpt_path={tmp_path / 'one' / 'checkpoints' / 'last.ckpt'}"
    resumes = {
        "pp_to_pp": ["--trainer.devices=2", *pp, pp_checkpoint],  # the same layout: exact resume
        "pp_to_tp": ["--trainer.devices=2", PARALLEL, "--trainer.strategy.tensor_parallel=2", pp_checkpoint],
        # a sharded folder in one process: lt_fsdp (the default strategy refuses it with one line naming it)
        "pp_to_one": ["--trainer.devices=1", "--trainer.strategy=lt_fsdp", pp_checkpoint],
        "one_to_pp": ["--trainer.devices=2", *pp, one_checkpoint],
    }
    for name, args in resumes.items():
        _fit(tmp_path, name, "--config", config, "--trainer.max_steps=15", *args)
        resumed = _logged(tmp_path / name, "train/loss")
        assert len(resumed) == 5, name
        assert resumed == pytest.approx(expected, rel=1e-5), name


# one refusal of each moment the CLI checks a layout (its sizes, then the model and batch they split),
# as real processes; every message of check_pipeline and check_stages: tests/test_pipeline_units.py
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.pipeline_parallel=3"], "pipeline_parallel=3 does not divide the world size 2"),
        (
            ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.microbatches=3"],
            "a batch of 8 sequences does not split into microbatches=3",
        ),
        (
            ["--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.pipeline_schedule=ZBVZeroBubble",
             "--trainer.strategy.virtual_stages=2", "--trainer.strategy.activation_checkpointing=true"],
            "pipeline_schedule='ZBVZeroBubble' does not work with activation_checkpointing",
        ),
    ],
)
def test_bad_pipeline_layout_is_one_line_exit_2(tmp_path, args, message):
    """Refused before any process starts, so asked in this process (a new one spends seconds importing)."""
    done = run_cli_in_process(
        "fit", "--config", _config(tmp_path), "--trainer.devices=2", PARALLEL, *args,
        f"--trainer.default_root_dir={tmp_path / 'bad'}", cwd=tmp_path,
    )
    assert not torch.distributed.is_initialized()  # no process group: nothing was launched
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
