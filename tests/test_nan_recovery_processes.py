"""NaNRecovery in real processes: the CLI's abort (exit code 3, one line naming the files) and 2-rank
DDP/FSDP2 runs whose ranks skip, roll back and pass over data together."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli_env, run_cli


def _cli_args(tmp_path, *extra):
    return (
        "fit", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=14", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--model=lightning_train.PretrainModule",
        "--model.config.vocab_size=64", "--model.config.block_size=16", "--model.config.n_layer=1",
        "--model.config.n_head=2", "--model.config.n_embd=16", "--model.warmup_steps=4",
        "--data=tests.helpers.nan_faults.PatternDataModule", "--data.batch_size=4",
        *extra,
    )


def test_cli_abort_exits_non_zero_with_one_line_naming_the_files(tmp_path):
    result = run_cli(*_cli_args(
        tmp_path,
        "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery",
        "--trainer.callbacks.snapshot_every=4", "--trainer.callbacks.max_consecutive_skips=2",
        "--trainer.callbacks.skip_batches=2", "--trainer.callbacks.max_rollbacks=1",
        "--trainer.callbacks+=tests.helpers.nan_faults.InjectFault", "--trainer.callbacks.from_step=5",
    ), cwd=REPO, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training aborted at step" in errors[0], result.stderr[-3000:]
    checkpoint = next(tmp_path.glob("checkpoints/nan-recovery-abort-step=*.ckpt"))
    forensics = next(tmp_path.glob("version_*/nan_recovery_forensics.json"))
    assert str(checkpoint) in errors[0] and str(forensics) in errors[0]


STRATEGIES = {
    "ddp": ["--trainer.strategy=ddp"],
    "fsdp": ["--trainer.strategy=lightning_train.strategies.DataParallelStrategy",
             "--trainer.strategy.sharding=fsdp"],
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nan_on_one_rank_of_two_skips_on_both_and_keeps_them_in_sync(tmp_path, strategy):
    result = run_cli(*_cli_args(
        tmp_path, "--trainer.devices=2", *STRATEGIES[strategy],
        "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery",
        "--trainer.callbacks+=tests.helpers.nan_faults.InjectFault", "--trainer.callbacks.kind=nan_loss",
        "--trainer.callbacks.steps=[3]", "--trainer.callbacks.rank=1",
        # after backward, only rank 1's (already reduced) gradients turn inf: only the shared flag
        # makes rank 0 skip too
        "--trainer.callbacks+=tests.helpers.nan_faults.InjectFault", "--trainer.callbacks.kind=inf_grad",
        "--trainer.callbacks.steps=[7]", "--trainer.callbacks.rank=1",
        "--trainer.callbacks+=tests.helpers.nan_faults.DumpState", f"--trainer.callbacks.folder={tmp_path}",
    ), cwd=REPO, timeout=150, env=cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    if strategy == "ddp":
        assert ranks[0]["digest"] == ranks[1]["digest"]  # parameters and AdamW state identical
    for record in ranks:
        assert record["skipped_steps"] == 2 and [b["step"] for b in record["bad_steps"]] == [3, 7]
        assert record["global_step"] == 14 and record["last_epoch"] == 12
        assert record["losses"] == ranks[0]["losses"]  # the same window on every rank


@pytest.mark.slow
def test_a_rollback_on_two_ranks_passes_over_the_same_batches_on_both(tmp_path):
    result = run_cli(*_cli_args(
        tmp_path, "--trainer.devices=2", *STRATEGIES["ddp"],
        "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery", "--trainer.callbacks.snapshot_every=4",
        "--trainer.callbacks.max_consecutive_skips=2", "--trainer.callbacks.skip_batches=3",
        "--trainer.callbacks+=tests.helpers.nan_faults.InjectFault", "--trainer.callbacks.kind=nan_loss",
        "--trainer.callbacks.steps=[6, 7]", "--trainer.callbacks.rank=1",  # NaN on rank 1 only
        "--trainer.callbacks+=tests.helpers.nan_faults.DumpState", f"--trainer.callbacks.folder={tmp_path}",
    ), cwd=REPO, timeout=150, env=cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["digest"] == ranks[1]["digest"]  # rolled back together: parameters and AdamW state
    for record in ranks:
        assert record["rollbacks"] == 1 and record["skipped_data"] == [[8, 3]]
        # 14 steps computed; the schedule restored to step 4 at the rollback, then 6 real steps
        assert record["global_step"] == 14 and record["last_epoch"] == 10
