"""``python -m lightning_train report``: PNGs, report.json and one self-contained HTML page."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_train.errors import UserInputError
from lightning_train.loggers.report import load_run, report
from tests.conftest import run_cli
from tests.test_wandb import _cli_env, _small_wandb_config


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted({key for row in rows for key in row})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


def _csv_count(run_dir: Path, metric: str) -> int:
    steps = set()
    for path in run_dir.glob("version_*/metrics.csv"):
        with path.open() as f:
            steps |= {row["step"] for row in csv.DictReader(f) if row.get(metric)}
    return len(steps)


@pytest.mark.slow
def test_report_of_a_real_resumed_run(tmp_path):
    """Two launches of configs/pretrain-tiny-wandb.yaml (the second resumes), then the report."""
    config = _small_wandb_config(tmp_path)
    root = tmp_path / "run"
    first = run_cli("fit", "--config", str(config), cwd=tmp_path, env=_cli_env())
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("fit", "--config", str(config), "--trainer.max_steps=10",
                     f"--ckpt_path={root / 'checkpoints' / 'last.ckpt'}", cwd=tmp_path, env=_cli_env())
    assert second.returncode == 0, second.stderr[-3000:]

    result = run_cli("report", str(root), cwd=tmp_path, env=_cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((root / "report" / "report.json").read_text())
    plots = summary["plots"]
    assert set(plots) == {"loss", "lr", "grad_norm", "grad_norm_groups", "throughput"}
    for name, plot in plots.items():
        assert (root / "report" / plot["file"]).stat().st_size > 10_000, name
        assert all(points > 0 for points in plot["series"].values()), name
    # every logged step is drawn once, across both launches
    assert plots["loss"]["series"]["train/loss"] == _csv_count(root, "train/loss") == 10
    groups = plots["grad_norm_groups"]["series"].keys()
    assert {"health/grad_norm/embeddings", "health/grad_norm/head"} <= groups
    with (root / "version_1" / "metrics.csv").open() as f:
        assert summary["resumed_at"] == [min(int(row["step"]) for row in csv.DictReader(f))]
    assert any("Loss scale" in note for note in summary["notes"])
    page = (root / "report" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(plots)
    assert "Loss scale: no amp/ metrics logged" in page


def test_report_plots_amp_recovery_alerts_and_skips_the_rest(tmp_path):
    run_dir = tmp_path / "run"
    scale = [65536.0, 65536.0, 32768.0, 32768.0, 16384.0, 16384.0]
    _write_csv(run_dir / "version_0" / "metrics.csv", [
        {"step": s, "epoch": 0, "train/loss": 5.0 - s * 0.1, "amp/loss_scale": scale[s],
         "amp/overflow_steps": [0, 0, 1, 1, 2, 2][s], "recovery/skipped_steps": [0, 0, 1, 1, 2, 2][s]}
        for s in range(6)
    ])
    # the relaunch resumed from step 4: its rows replace the first launch's steps 4 and 5
    _write_csv(run_dir / "version_1" / "metrics.csv", [
        {"step": s, "epoch": 0, "train/loss": 1.0, "amp/loss_scale": 16384.0, "amp/overflow_steps": 2,
         "recovery/skipped_steps": 2, "recovery/rollbacks": 1} for s in range(4, 9)
    ])
    alert = {"time": 0.0, "step": 5, "level": "ERROR", "title": "Rollback", "text": "restored step 4"}
    (run_dir / "version_0" / "alerts.jsonl").write_text(json.dumps(alert) + "\n")

    series, resumed_at, alerts = load_run(run_dir)
    assert list(series["train/loss"][0]) == list(range(9)) and series["train/loss"][1][4] == 1.0
    assert resumed_at == [4] and alerts == [alert]

    result = report(str(run_dir))
    assert result["plots"]["loss_scale"]["series"] == {"amp/loss_scale": 9, "overflows": 2}
    assert result["plots"]["recovery"]["series"] == {"recovery/rollbacks": 5, "recovery/skipped_steps": 9,
                                                      "alerts": 1}
    assert {"lr", "grad_norm", "grad_norm_groups", "throughput"}.isdisjoint(result["plots"])
    assert len(result["notes"]) == 4 and any("perf/" in note for note in result["notes"])
    page = (run_dir / "report" / "report.html").read_text()
    assert "Rollback" in page and "restored step 4" in page


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(UserInputError, match="no version_\\*/metrics.csv"):
        report(str(tmp_path))
    result = run_cli("report", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: no version_*/metrics.csv")
