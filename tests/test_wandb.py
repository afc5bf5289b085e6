"""The W&B preset against the real wandb package, offline: what it writes is read back from the run file."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import wandb
import yaml

from lightning_train import PretrainModule
from lightning_train.loggers import WandbLogger
from lightning_train.loggers.alerts import send_alert
from lightning_train.loggers.dashboard import NAMESPACES, STEP_METRIC
from lightning_train.loggers.wandb import REDACTED, redact_secrets
from tests.conftest import REPO, cli_env, run_cli
from tests.helpers.tiny_runs import WithValidation
from tests.helpers.wandb_offline import find_run_files, read_run

FAKE_API_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 characters, like a real W&B key
FAKE_TOKEN = "hf_fakeTokenValue9876543210"


class PerfAndAlert(L.Callback):
    """Logs a perf/ metric each step and raises one alert at step 3, like the health callbacks do."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("perf/tokens_per_sec", 1000.0 + trainer.global_step)
        if trainer.global_step == 3:
            send_alert(trainer, "Loss scale collapsed", "amp/loss_scale fell to 1e-4", "ERROR")


def test_offline_run_file_holds_dashboard_history_config_and_alerts(tmp_path, monkeypatch, tiny_config):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)  # present in the environment, never written
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # wandb.init sets it; gone again after the test
    logger = WandbLogger(project="tests", save_dir=str(tmp_path), offline=True, tags=["unit"],
                         config={"api_key": FAKE_API_KEY, "note": f"uses {FAKE_TOKEN}", "pad_token": "<pad>"})
    trainer = L.Trainer(
        max_steps=6, logger=logger, callbacks=[PerfAndAlert()], log_every_n_steps=1, val_check_interval=3,
        limit_val_batches=2, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )
    trainer.fit(PretrainModule(tiny_config, warmup_steps=2), WithValidation(val_rows=64))
    wandb.finish()

    (run_file,) = find_run_files(tmp_path / "wandb")
    run = read_run(run_file, timeout=30)
    expected = {"train/loss", "train/lr", "val/loss", "val/ppl", "perf/tokens_per_sec", STEP_METRIC}
    assert expected <= run.history_keys()
    assert [row[STEP_METRIC] for row in run.history if "train/loss" in row] == [0, 1, 2, 3, 4, 5]

    for namespace in NAMESPACES:
        assert run.metrics[f"{namespace}/*"]["step_metric"] == STEP_METRIC
    assert run.metrics["val/loss"]["summary"] == ["min", "last"]
    assert "max" in run.metrics["perf/tokens_per_sec"]["summary"]
    assert "last" in run.metrics["amp/loss_scale"]["summary"]
    assert run.summary["val/loss"]["min"] <= run.summary["val/loss"]["last"]
    assert run.summary["perf/tokens_per_sec"]["max"] == 1006  # global_step is 6 after the last step

    assert run.config["learning_rate"] == 1e-3 and run.config["config"]["n_layer"] == tiny_config.n_layer
    assert run.config["trainer"]["max_steps"] == 6 and run.config["trainer"]["world_size"] == 1
    assert run.config["api_key"] == REDACTED and run.config["note"] == f"uses {REDACTED}"
    assert run.config["pad_token"] == "<pad>"  # tokenizer settings are not secrets
    assert set(run.tags) == {"unit", "pretrain"}

    assert run.alerts == [{"title": "Loss scale collapsed", "text": "amp/loss_scale fell to 1e-4 (step 3)",
                           "level": "ERROR"}]

    for path in tmp_path.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert FAKE_API_KEY.encode() not in content and FAKE_TOKEN.encode() not in content, path


def test_redact_secrets_names_credentials_not_tokenizer_settings(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    config = {"model": {"hf_token": "x", "tokenizer": "byte", "max_tokens": 5, "eos_token": "</s>"},
              "logger": {"api_key": "y", "password": "z", "Secret": "s", "token": "t"},
              "argv": ["--key", FAKE_API_KEY]}
    assert redact_secrets(config) == {
        "model": {"hf_token": REDACTED, "tokenizer": "byte", "max_tokens": 5, "eos_token": "</s>"},
        "logger": {"api_key": REDACTED, "password": REDACTED, "Secret": REDACTED, "token": REDACTED},
        "argv": ["--key", REDACTED],
    }


def _small_wandb_config(tmp_path: Path, **wandb_args) -> Path:
    """configs/pretrain-tiny-wandb.yaml, shrunk to seconds, with the W&B logger's init_args changed."""
    config = yaml.safe_load((REPO / "configs" / "pretrain-tiny-wandb.yaml").read_text())
    root = str(tmp_path / "run")
    trainer = config["trainer"]
    trainer.update(default_root_dir=root, max_steps=6, val_check_interval=3, limit_val_batches=2,
                   log_every_n_steps=1)
    trainer["logger"][0]["init_args"]["save_dir"] = root
    trainer["logger"][1]["init_args"].update(save_dir=root, **wandb_args)
    config["model"]["init_args"]["config"].update(n_layer=1, n_embd=32, n_head=2, block_size=32)
    config["model"]["init_args"]["warmup_steps"] = 2
    config["data"]["init_args"].update(seq_len=32, batch_size=4)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_misconfigured_wandb_warns_and_training_goes_on(tmp_path):
    """Online mode without an API key and with an unknown entity and an unreachable server: the run
    warns, falls back to an offline W&B run, and trains to the end."""
    config = _small_wandb_config(tmp_path, offline=False, entity="no-such-entity", init_timeout=5)
    env = cli_env(WANDB_MODE="online", HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
                  WANDB_BASE_URL="http://127.0.0.1:9", NETRC=str(tmp_path / "no-netrc"))
    env.pop("WANDB_API_KEY", None)
    result = run_cli("fit", "--config", str(config), cwd=tmp_path, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "W&B could not start in its default mode" in result.stderr
    metrics = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    assert metrics.count("\n") > 6  # header + one row per step + validation rows
    (run_file,) = find_run_files(tmp_path / "run" / "wandb")
    assert max(row[STEP_METRIC] for row in read_run(run_file, timeout=30).history) == 5


@pytest.mark.slow
@pytest.mark.parametrize("log_all_ranks", [False, True])
def test_two_process_job_writes_one_grouped_run_or_one_per_rank(tmp_path, log_all_ranks):
    config = _small_wandb_config(tmp_path, log_all_ranks=log_all_ranks)
    result = run_cli("fit", "--config", str(config), "--trainer.devices=2", "--trainer.accelerator=cpu",
                     cwd=tmp_path, env=cli_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [read_run(path, timeout=30) for path in find_run_files(tmp_path / "run" / "wandb")]
    assert len(runs) == (2 if log_all_ranks else 1)
    assert runs[0].group and {run.group for run in runs} == {runs[0].group}
    assert all(run.config["trainer"]["world_size"] == 2 for run in runs)
    assert all(max(row[STEP_METRIC] for row in run.history) == 5 for run in runs)
    assert os.path.isfile(tmp_path / "run" / "version_0" / "metrics.csv")
