"""``python -m lightning_train report``: one run per report, PNGs, report.json and one HTML page."""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.figure import Figure

from lightning_train.errors import UserInputError
from lightning_train.loggers.report import load_run, report
from lightning_train.loggers.report_plots import _plot_grad_norm
from tests.conftest import REPO, run_cli, run_cli_in_process
from tests.helpers.browser import NO_BROWSER, find_browser, render

# configs/pretrain-tiny.yaml shrunk to seconds: 1 layer, 32 wide, validation every 4 steps
TINY = [
    "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.default_root_dir=runs/mixed",
    "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=2",
    "--trainer.enable_progress_bar=false", "--model.init_args.config.n_layer=1",
    "--model.init_args.config.n_embd=32", "--model.init_args.config.n_head=2",
    "--model.init_args.config.block_size=32", "--model.init_args.warmup_steps=2",
    "--data.init_args.seq_len=32", "--data.init_args.batch_size=4",
]
LAST = "--ckpt_path=runs/mixed/checkpoints/last.ckpt"


def _cli(*args: str, cwd: Path) -> None:
    """A launch that makes what a report reads (in this process: its files are the point)."""
    result = run_cli_in_process(*args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]


def _rows(run_dir: Path, version: int, metric: str) -> dict[int, float]:
    with (run_dir / f"version_{version}" / "metrics.csv").open() as f:
        return {int(row["step"]): float(row[metric]) for row in csv.DictReader(f) if row.get(metric)}


def _first_step(run_dir: Path, version: int) -> int:
    with (run_dir / f"version_{version}" / "metrics.csv").open() as f:
        return min(int(row["step"]) for row in csv.DictReader(f))


def _best_val(run_dir: Path, versions: list[int]) -> str:
    points = {step: loss for v in versions for step, loss in _rows(run_dir, v, "val/loss").items()}
    step = min(points, key=points.get)
    return f"<th>best val/loss</th><td>{points[step]:.4f} (step {step})</td>"


def test_report_shows_one_run_of_a_folder_of_mixed_launches(tmp_path):
    """The issue's case, as real CLI launches: a run, a fresh fit with other settings, a validate, a fit
    on another corpus, all in one folder; then a resume of the first run. The CLI now gives each run its
    own folder, so the mixed folder is assembled as older versions left it: each other launch runs in a
    folder of its own and its launch folder is moved in beside the first run's."""
    run_dir = tmp_path / "runs" / "mixed"

    def moved_in(name: str, version: int) -> None:
        shutil.move(tmp_path / "runs" / name / "version_0", run_dir / f"version_{version}")

    _cli("fit", *TINY, "--trainer.max_steps=8", cwd=tmp_path)  # version_0
    _cli("fit", *TINY, "--trainer.max_steps=12", "--model.init_args.learning_rate=1e-3", "--run_name=lr",
         cwd=tmp_path)
    moved_in("lr", 1)
    _cli("validate", *TINY, LAST, cwd=tmp_path)
    shutil.move(run_dir / "validate" / "version_0", run_dir / "version_2")
    shutil.copytree(REPO / "lightning_train" / "loggers", tmp_path / "corpus")
    _cli("prepare", "--inputs", "[corpus/]", "--output_dir", "data/other", "--val_fraction", "0.3",
         "--num_workers", "0", cwd=tmp_path)
    _cli("fit", *TINY, "--trainer.max_steps=6", "--data.init_args.data_dir=data/other", "--run_name=other",
         cwd=tmp_path)
    moved_in("other", 3)

    # the newest run alone: the fit on the other corpus; the others are listed, not drawn
    result = report(str(run_dir), output_dir=str(tmp_path / "newest"))
    assert result["run"] == ["version_3"] and result["resumed_at"] == []
    roles = {launch["name"]: launch["role"] for launch in result["launches"]}
    assert roles == {"version_0": "another run", "version_1": "another run",
                     "version_2": "evaluation, not a training curve", "version_3": "this run"}
    assert result["plots"]["loss"]["series"] == {"train/loss": len(_rows(run_dir, 3, "train/loss")),
                                                 "val/loss": len(_rows(run_dir, 3, "val/loss"))}
    page = Path(result["html"]).read_text()
    (validated,) = _rows(run_dir, 2, "val/loss").items()
    assert validated[0] == 0  # the validate logged its val/loss at step 0: a result, not a curve point
    assert f"evaluation, not a training curve: val/loss {validated[1]:.4f}" in page
    assert _best_val(run_dir, [3]) in page and "report it with --launch version_0" in page

    # an older run on request: its own points only
    result = report(str(run_dir), output_dir=str(tmp_path / "first"), launch="version_0")
    assert result["run"] == ["version_0"] and result["resumed_at"] == []
    assert result["plots"]["loss"]["series"]["val/loss"] == len(_rows(run_dir, 0, "val/loss"))
    assert _best_val(run_dir, [0]) in Path(result["html"]).read_text()

    # resuming version_0 after version_1 (other settings) covered those steps continues version_0's run
    _cli("fit", *TINY, "--trainer.max_steps=12", LAST, cwd=tmp_path)  # version_4
    shown = run_cli("report", str(run_dir), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    result = json.loads((run_dir / "report" / "report.json").read_text())
    assert result["run"] == ["version_0", "version_4"]
    assert result["resumed_at"] == [_first_step(run_dir, 4)]
    train_loss = {s: v for s, v in _rows(run_dir, 0, "train/loss").items() if s < _first_step(run_dir, 4)}
    train_loss.update(_rows(run_dir, 4, "train/loss"))
    steps, values = load_run(run_dir).series["train/loss"]
    assert dict(zip(steps.tolist(), values.tolist(), strict=True)) == train_loss
    assert _best_val(run_dir, [0, 4]) in (run_dir / "report" / "report.html").read_text()

    refused = run_cli("report", str(run_dir), "--launch", "version_2", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.startswith("error: launch 'version_2' is not a training launch of this folder; "
                                     "pass one of version_0, version_1, version_3, version_4")


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> dict[str, Path]:
    """A pretraining run of 8 steps and a fine-tuning run of 8 steps from its checkpoint, by the CLI."""
    work = tmp_path_factory.mktemp("tiny-runs")
    _cli("fit", *TINY, "--trainer.max_steps=8", cwd=work)
    _cli("fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"),
         "--trainer.default_root_dir=runs/ft", f"--model.init_args.init_from={work / LAST.split('=')[1]}",
         "--trainer.max_steps=8", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
         "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
         "--data.init_args.seq_len=32", "--data.init_args.batch_size=8", "--data.init_args.eval_prompts=4",
         "--model.init_args.eval_max_new_tokens=4", cwd=work)
    return {"pretrain": work / "runs" / "mixed", "finetune": work / "runs" / "ft"}


def test_finetune_report_plots_accuracy_beside_loss_and_lr(tiny_runs, tmp_path):
    result = report(str(tiny_runs["finetune"]), output_dir=str(tmp_path))
    assert {"loss", "lr", "accuracy"} <= set(result["plots"])
    accuracy = result["plots"]["accuracy"]["series"]
    assert accuracy["val/exact_match"] == len(_rows(tiny_runs["finetune"], 0, "val/exact_match")) == 2
    assert accuracy.get("val/token_accuracy", accuracy.get("val/token_acc")) == 2
    page = Path(result["html"]).read_text()
    assert "best val/exact_match" in page and 'alt="Accuracy (fine-tuning)"' in page


def test_report_of_a_run_without_recovery_events_says_so(tiny_runs, tmp_path):
    result = report(str(tiny_runs["pretrain"]), output_dir=str(tmp_path))
    assert _rows(tiny_runs["pretrain"], 0, "recovery/skipped_steps")  # NaNRecovery logged its counters
    assert result["plots"]["recovery"]["note"] == ("no recovery events (recovery/rollbacks, "
                                                   "recovery/skipped_batches, recovery/skipped_steps, "
                                                   "recovery/spikes stayed 0)")
    assert "Recovery events and alerts: no recovery events" in Path(result["html"]).read_text()


@pytest.mark.parametrize(("run", "plots"), [("pretrain", 7), ("finetune", 4)])  # goodput.png in each
def test_report_page_renders_in_a_browser(tiny_runs, tmp_path, run, plots):
    browser = find_browser()
    if browser is None:
        pytest.skip(NO_BROWSER)
    result = report(str(tiny_runs[run]), output_dir=str(tmp_path / "report"))
    screenshot = tmp_path / "screenshot.png"
    seen = render(Path(result["html"]), screenshot, browser)
    assert len(seen["images"]) == len(result["plots"]) == plots
    assert all(image["width"] == 990 and image["height"] == 528 for image in seen["images"]), seen["images"]
    sections = {section["id"]: section for section in seen["sections"]}
    assert list(sections) == ["summary", "launches", "plots", "not-shown", "alerts"]
    for section in sections.values():  # each laid out, with more in it than its heading
        assert section["height"] > 20 and section["text"] > len(section["heading"]), section
    assert screenshot.stat().st_size > 50_000


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted({key for row in rows for key in row})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


def test_report_plots_amp_recovery_alerts_and_skips_the_rest(tmp_path, capsys):
    """Launches of a Trainer without the CLI (no config.yaml): a relaunch that resumed from step 4."""
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
    alert = {"time": 0.0, "step": 3, "level": "ERROR", "title": "Rollback", "text": "restored step 2"}
    abandoned = {"time": 1.0, "step": 5, "level": "WARN", "title": "Spike", "text": "on the abandoned branch"}
    lines = [json.dumps(record) for record in (alert, abandoned)]
    (run_dir / "version_0" / "alerts.jsonl").write_text("\n".join(lines) + "\n")

    run = load_run(run_dir)
    assert [launch.name for launch in run.chain] == ["version_0", "version_1"]
    assert list(run.series["train/loss"][0]) == list(range(9)) and run.series["train/loss"][1][4] == 1.0
    assert run.resumed_at == [4] and run.alerts == [alert]

    result = report(str(run_dir))
    assert capsys.readouterr().out == ""  # the library writes files and returns; the CLI prints
    assert result["html"] == str(run_dir / "report" / "report.html")
    assert result["plots"]["loss_scale"]["series"] == {"amp/loss_scale": 9, "overflows": 2}
    assert result["plots"]["recovery"]["series"] == {"recovery/rollbacks": 5, "recovery/skipped_steps": 9,
                                                      "alerts": 1}
    assert "note" not in result["plots"]["recovery"]
    assert {"lr", "accuracy", "grad_norm", "grad_norm_groups", "throughput"}.isdisjoint(result["plots"])
    assert len(result["notes"]) == 6 and any("perf/" in note for note in result["notes"])
    assert any("no goodput.json" in note for note in result["notes"])  # a run without Goodput
    page = (run_dir / "report" / "report.html").read_text()
    assert "Rollback" in page and "restored step 2" in page and "on the abandoned branch" not in page


def test_a_resume_belongs_to_the_launch_that_wrote_its_checkpoint(tmp_path):
    """The checkpoint file's time names the launch that wrote it, even when the resume changed the
    settings and a later fresh fit reached the same steps; once the file was rewritten, the settings
    decide."""
    run_dir, start = tmp_path / "run", time.time() - 1000

    def launch(version: int, steps: range, lr: float, started: float, ckpt_path: str | None = None) -> None:
        folder = run_dir / f"version_{version}"
        _write_csv(folder / "metrics.csv", [{"step": s, "epoch": 0, "train/loss": 5.0} for s in steps])
        (folder / "hparams.yaml").write_text(f"learning_rate: {lr}\n")
        config = {"trainer": {"default_root_dir": "runs/x", "log_every_n_steps": 2}, "ckpt_path": ckpt_path}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        os.utime(folder / "config.yaml", (started, started))
        for name in ("metrics.csv", "hparams.yaml"):
            os.utime(folder / name, (started + 50, started + 50))

    launch(0, range(1, 20, 2), 2e-3, start)  # wrote checkpoints/step=10.ckpt 20 s in
    launch(1, range(1, 30, 2), 1e-3, start + 100)  # a fresh fit with other settings, further
    launch(2, range(11, 16, 2), 5e-4, start + 200, "runs/x/checkpoints/step=10.ckpt")  # resumed, new lr
    checkpoint = run_dir / "checkpoints" / "step=10.ckpt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    os.utime(checkpoint, (start + 20, start + 20))
    assert [item.name for item in load_run(run_dir).chain] == ["version_0", "version_2"]

    os.utime(checkpoint, (start + 250, start + 250))  # rewritten after version_2 started
    (run_dir / "version_2" / "hparams.yaml").write_text("learning_rate: 0.002\n")  # version_0's settings
    assert [item.name for item in load_run(run_dir).chain] == ["version_0", "version_2"]
    (run_dir / "version_2" / "hparams.yaml").write_text("learning_rate: 0.001\n")  # version_1's
    assert [item.name for item in load_run(run_dir).chain] == ["version_1", "version_2"]


@pytest.mark.parametrize(("low", "high"), [(2.8, 4.5), (0.3, 6.3), (0.002, 40.0)])
def test_grad_norm_axis_has_one_set_of_plain_tick_labels(low, high):
    steps = np.arange(9, 500, 10)
    norms = low + (high - low) * np.exp(-steps / 60)
    figure = Figure(figsize=(9, 4.8), layout="constrained")
    _plot_grad_norm(figure, {"health/grad_norm": (steps, norms)}, [], [])
    figure.canvas.draw()
    (ax,) = figure.axes
    bottom, top = ax.get_ylim()
    shown = [t for t in ax.get_yticklabels() if t.get_text() and bottom <= t.get_position()[1] <= top]
    assert [t for t in ax.get_yticklabels(minor=True) if t.get_text()] == []
    assert len(shown) >= 3, [t.get_text() for t in shown]
    assert all("\\times" not in t.get_text() and "^" not in t.get_text() for t in shown)  # plain numbers
    boxes = [t.get_window_extent() for t in shown]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(UserInputError, match="no version_\\*/metrics.csv"):
        report(str(tmp_path))
    result = run_cli("report", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: no version_*/metrics.csv")


def test_report_of_a_folder_with_only_a_validate_is_a_clear_error(tmp_path):
    _write_csv(tmp_path / "version_0" / "metrics.csv", [{"step": 0, "epoch": 0, "val/loss": 4.4}])
    with pytest.raises(UserInputError, match="no training launch to report: the folder holds only "
                                             "version_0: validate"):
        report(str(tmp_path))


@pytest.mark.parametrize(("content", "says"), [
    ("step,train/loss\n0,5.5\n1,5.0,4.0\n", "metrics.csv line 3 has more values than its header"),
    ("step,train/loss\nnan,5.5\n", "metrics.csv line 2: step='nan' is not a number"),
    ("step,train/loss\n0,5.5\n1,\x00\n", "metrics.csv line 3: train/loss='\\x00' is not a number"),
])
def test_report_of_a_damaged_metrics_file_names_its_line(tmp_path, content, says):
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_0" / "metrics.csv").write_text(content)
    with pytest.raises(UserInputError, match="move .*version_0 out of the run folder") as refused:
        report(str(tmp_path))
    assert says in str(refused.value)


def test_a_config_that_is_not_utf8_is_read_as_absent(tmp_path):
    """Like one that is not YAML: the launch is then told apart by what it logged."""
    _write_csv(tmp_path / "version_0" / "metrics.csv", [{"step": s, "train/loss": 5.0 - s} for s in range(3)])
    (tmp_path / "version_0" / "config.yaml").write_bytes(b"trainer:\n  max_steps: caf\xe9\n")
    assert report(str(tmp_path))["run"] == ["version_0"]
