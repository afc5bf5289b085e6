"""NaNRecovery(rerun=True): a bad step is rerun from the same state to tell a faulty machine from a bad
batch. Faults are injected through the CLI into 2-rank DDP runs on one rank or in one batch, and the
verdict is read back from what a user gets: the exit code, the checkpoint, the forensic report, the
alerts and the callback's saved state."""

from __future__ import annotations

import json
import math

import lightning as L

from lightning_train import GPTConfig, PretrainModule
from lightning_train.callbacks import NaNRecovery
from tests.conftest import REPO, run_cli
from tests.helpers.nan_faults import InjectFault, PatternDataModule

FAULTY_NODE = 77
INJECT = "tests.helpers.nan_faults.InjectFault"


def _fit(tmp_path, *extra, resume=False):
    return run_cli(
        "fit", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=10",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model=lightning_train.PretrainModule", "--model.config.vocab_size=64",
        "--model.config.block_size=16", "--model.config.n_layer=1", "--model.config.n_head=2",
        "--model.config.n_embd=16", "--model.warmup_steps=4",
        "--data=tests.helpers.nan_faults.PatternDataModule", "--data.batch_size=4",
        *(["--resume=auto"] if resume else []),
        "--trainer.callbacks+=lightning_train.callbacks.NaNRecovery", "--trainer.callbacks.rerun=true",
        *extra,
        "--trainer.callbacks+=tests.helpers.nan_faults.DumpState", f"--trainer.callbacks.folder={tmp_path}",
        cwd=REPO, timeout=180,
    )


def _forensics(tmp_path) -> dict:
    return json.loads(next(tmp_path.glob("version_*/nan_recovery_forensics.json")).read_text())


def test_a_step_that_differs_when_rerun_is_a_faulty_machine_and_the_run_resumes_from_before_it(tmp_path):
    """A NaN on rank 1's first computation of step 3 only (silent corruption): the rerun is finite, so
    rank 1 is the suspect, the state before the step is saved and the job exits 77 (exclude the node);
    started again with --resume auto it trains to the end."""
    done = _fit(tmp_path, f"--trainer.callbacks+={INJECT}", "--trainer.callbacks.kind=nan_loss",
                "--trainer.callbacks.steps=[3]", "--trainer.callbacks.rank=1",
                "--trainer.callbacks.once=true")
    assert done.returncode == FAULTY_NODE, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "computed the step differently when it was rerun" in done.stdout + done.stderr
    verdict = _forensics(tmp_path)["bad_steps"][-1]["rerun"]
    assert verdict["kind"] == "transient" and verdict["suspects"] == [1], verdict
    loss, rerun_loss = verdict["numbers"]["loss"], verdict["numbers"]["rerun_loss"]
    assert loss[1] == "nan" and isinstance(rerun_loss[1], float), verdict  # rank 1 alone went wrong
    assert rerun_loss[0] == loss[0]  # rank 0 reran its batch to the same loss
    assert verdict["step"] == 3 and verdict["nodes"] == [0] and len(verdict["hosts"]) == 1
    # saved after Lightning counted the skipped step, which changed nothing: the state before step 3
    assert (tmp_path / "checkpoints" / "faulty-node-step=4.ckpt").is_file()
    alerts = (next(tmp_path.glob("version_*/alerts.jsonl"))).read_text()
    assert "transient fault in step 3 on rank(s) [1]" in alerts and "requeue without host(s)" in alerts

    resumed = _fit(tmp_path, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["global_step"] == 10


def test_the_periodic_check_finds_a_finite_corruption_and_names_the_rank(tmp_path):
    """rerun_every=2: rank 1's step 5 is silently 50x off (finite, no spike yet to judge): the batches
    rerun on the other rank disagree, and a rerun on the same ranks names rank 1 alone."""
    done = _fit(tmp_path, "--trainer.callbacks.rerun_every=2", f"--trainer.callbacks+={INJECT}",
                "--trainer.callbacks.kind=spike", "--trainer.callbacks.steps=[5]",
                "--trainer.callbacks.rank=1", "--trainer.callbacks.once=true")
    assert done.returncode == FAULTY_NODE, done.stderr[-3000:]
    forensics = _forensics(tmp_path)
    bad = forensics["bad_steps"][-1]
    assert bad["step"] == 5 and bad["reason"] == "periodic rerun check", bad
    assert bad["rerun"]["kind"] == "transient" and bad["rerun"]["suspects"] == [1], bad
    assert forensics["reruns"] == 3  # steps 1, 3 and 5 were checked
    assert (tmp_path / "checkpoints" / "faulty-node-step=6.ckpt").is_file()


def test_a_bad_batch_is_data_and_a_fault_of_one_rank_is_persistent(tmp_path):
    """Step 3: rank 1's batch is poisoned, and it fails wherever it is computed: ``data``. Step 7: rank 1
    fails on any batch, again when rerun: ``persistent``, tied to rank 1. Both go on with the ladder
    (skipped), the ranks stay in sync, and the run finishes."""
    done = _fit(tmp_path,
                f"--trainer.callbacks+={INJECT}", "--trainer.callbacks.kind=bad_batch",
                "--trainer.callbacks.steps=[3]", "--trainer.callbacks.rank=1",
                f"--trainer.callbacks+={INJECT}", "--trainer.callbacks.kind=nan_loss",
                "--trainer.callbacks.steps=[7]", "--trainer.callbacks.rank=1")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    for record in ranks:
        assert record["skipped_steps"] == 2 and record["reruns"] == 2
        data, persistent = (step["rerun"] for step in record["bad_steps"])
        assert data["kind"] == "data" and math.isnan(data["numbers"]["moved_loss"][0]), data  # rank 0 ran it
        assert persistent["kind"] == "persistent" and "tied to rank(s) [1]" in persistent["detail"]
    alerts = next(tmp_path.glob("version_*/alerts.jsonl")).read_text()
    assert "rerun: data" in alerts and "rerun: persistent" in alerts
    header = next(tmp_path.glob("version_*/metrics.csv")).read_text().splitlines()[0]
    assert "recovery/reruns" in header.split(",")  # logged when reruns are on (only then)


def test_one_process_cannot_tell_the_data_from_the_machine(tmp_path):
    """With one rank a reproduced NaN is ``persistent`` (no other rank to move the batch to)."""
    recovery = NaNRecovery(rerun=True)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        default_root_dir=tmp_path,
                        callbacks=[recovery, InjectFault(kind="nan_loss", steps=[2])])
    module = PretrainModule(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    trainer.fit(module, PatternDataModule(batch_size=4))
    (bad,) = recovery.state_dict()["bad_steps"]
    assert bad["step"] == 2 and bad["rerun"]["kind"] == "persistent", bad
    assert "no other data-parallel rank" in bad["rerun"]["detail"]
    assert recovery.skipped_steps == 1 and recovery.reruns == 1
    assert all(p.isfinite().all() for p in module.parameters())
