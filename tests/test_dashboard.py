"""``python -m lightning_train dashboard``: the saved W&B view, written as a JSON spec offline."""

from __future__ import annotations

import json

from lightning_train.loggers.dashboard import NAMESPACES, SPEC_FILE, STEP_METRIC, SUMMARIES
from tests.conftest import run_cli


def test_offline_dashboard_writes_a_spec_with_every_namespace(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "version_0").mkdir(parents=True)
    (run_dir / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,health/grad_norm,health/grad_norm/block.0,health/grad_norm/head\n0,0,5.5,1,0.5,0.2\n"
    )
    result = run_cli("dashboard", "--entity", "my-team", "--project", "llm", "--run_dir", str(run_dir),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    spec = json.loads((run_dir / SPEC_FILE).read_text())
    assert (spec["entity"], spec["project"], spec["x_axis"]) == ("my-team", "llm", STEP_METRIC)
    assert spec["url"] is None  # offline: the spec only
    assert [section["name"] for section in spec["sections"]] == list(NAMESPACES)
    for section in spec["sections"]:
        assert section["panels"], section["name"]
        assert all(metric.startswith(section["prefix"]) for p in section["panels"] for metric in p["metrics"])
    panels = {p["title"]: p for section in spec["sections"] for p in section["panels"]}
    # per-group panels list the groups the run logged
    groups = panels["Gradient norm by group"]["metrics"]
    assert groups == ["health/grad_norm/block.0", "health/grad_norm/head"]
    assert panels["Training loss"]["log_y"] is True and panels["Throughput"]["y_label"] == "tokens / s"
    assert spec["summaries"]["val/loss"] == ["min", "last"]
    assert set(spec["summaries"]) == set(SUMMARIES)


def test_dashboard_with_a_missing_run_dir_is_a_clear_error(tmp_path):
    result = run_cli("dashboard", "--run_dir", str(tmp_path / "nope"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --run_dir") and "is not a folder" in result.stderr
