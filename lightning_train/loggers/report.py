"""Run reports without W&B: PNG plots and one self-contained HTML page of one run.

    python -m lightning_train report runs/pretrain-tiny     # -> runs/pretrain-tiny/report/

A run folder can hold several launches (``version_N/``); the report shows one run, the chain of fit
launches that resumed one another (see ``lightning_train.loggers.launches``): by default the run of the
newest fit launch, or the run of ``launch``. Other runs and ``validate``/``test`` launches are listed on
the page, never drawn as training curves, and never enter the summary. Where a launch resumed from an
earlier step, its points replace its ancestors' from that step on.

Plots: loss, learning rate, fine-tuning accuracy (exact match, token accuracy), gradient norms (total,
and a steps x groups heatmap), loss scale with overflow marks, recovery events with alerts, throughput,
and goodput (where each launch's wall time went, from ``goodput.json``). A namespace the run did not
log is skipped with a note on the page. ``report.json`` lists every launch, the run's launches, and
every plot with the number of points of each series it drew.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from lightning_train.loggers.goodput import read_goodput
from lightning_train.loggers.launches import Launch, merge_chain, read_launches, role_in_run, select_run
from lightning_train.loggers.report_html import render_html
from lightning_train.loggers.report_plots import PLOTS, Series, plot_goodput, series_arrays
from lightning_train.output_folder import check_apart, check_replaceable, publish, staged


@dataclass
class RunHistory:
    """One run of a folder: its metric series, where it resumed, its alerts, and its launches."""

    series: Series
    resumed_at: list[int]  # the first step of each launch after the first
    alerts: list[dict[str, Any]]
    chain: list[Launch]  # the run's launches, oldest first
    launches: list[Launch]  # every launch in the folder
    goodput: dict[str, Any] | None  # the newest launch's goodput.json: the run's and each launch's time




def load_run(run_dir: str | Path, launch: str | None = None) -> RunHistory:
    """The run of ``launch`` (a ``version_N`` name; default: the newest fit launch) in ``run_dir``."""
    launches = read_launches(run_dir)
    chain = select_run(launches, launch)
    points, resumed_at, alerts = merge_chain(chain)
    series = {name: series_arrays(by_step) for name, by_step in points.items()}
    return RunHistory(series, resumed_at, alerts, chain, launches, read_goodput(chain[-1].folder))


def report(run_dir: str, output_dir: str | None = None, launch: str | None = None) -> dict[str, Any]:
    """Render one run's metrics to PNGs plus ``report.html`` and ``report.json``.

    Args:
        run_dir: the run folder (``trainer.default_root_dir``, holding ``version_*/metrics.csv``).
        output_dir: where to write (default ``<run_dir>/report``): a new or empty folder, or an earlier
            report, which is replaced whole; never the run folder or one around it. Written in a
            hidden sibling folder first, so a failed write (a full disk among the causes) leaves
            nothing of it and an earlier report as it was.
        launch: report the run that this launch (``version_N``) belongs to; default: the newest fit.

    Returns:
        What ``report.json`` holds: the page, the run's launches and every launch of the folder, the
        points per plotted series, and the notes on what was not plotted.

    Example (a run that logs only the loss and the LR; the health callbacks add their plots):

        >>> import os
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.loggers.report import report
        >>> run_dir = tempfile.mkdtemp()
        >>> trainer = L.Trainer(
        ...     max_steps=4, accelerator="cpu", log_every_n_steps=1, val_check_interval=2,
        ...     limit_val_batches=2, default_root_dir=run_dir,
        ...     logger=L.pytorch.loggers.CSVLogger(run_dir, name=""),  # run_dir/version_0/metrics.csv
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> result = report(run_dir)
        >>> sorted(os.listdir(f"{run_dir}/report"))
        ['loss.png', 'lr.png', 'report.html', 'report.json']
        >>> any("ThroughputMonitor" in note for note in result["notes"])  # what it could not plot, and why
        True
    """
    out = Path(output_dir) if output_dir else Path(run_dir) / "report"
    check_apart(out, "output_dir", [("the run folder", run_dir)],
                "choose another output_dir (the default is <run_dir>/report)", inside_allowed=True)
    replace = check_replaceable(out, "output_dir", None, "an earlier report", _is_report)
    run = load_run(run_dir, launch)
    with staged(out, "choose an output_dir this user can create, on a disk with room for the report") as tmp:
        result = _write_report(run, run_dir, out, tmp)
        publish(tmp, out, replace)
    return result


def _write_report(run: RunHistory, run_dir: str, out: Path, folder: Path) -> dict[str, Any]:
    """Draw the plots of ``run`` and write the report that will be ``out`` into ``folder``."""
    roles = [{**item.describe(), "role": role_in_run(item, run.chain, run.launches)} for item in run.launches]
    result: dict[str, Any] = {
        "run_dir": str(run_dir), "html": str(out / "report.html"), "run": [item.name for item in run.chain],
        "resumed_at": run.resumed_at, "launches": roles,
        "plots": {}, "notes": [], "alerts": len(run.alerts),
    }
    plots = [(name, title, partial(plot, s=run.series, resumed_at=run.resumed_at, alerts=run.alerts))
             for name, title, plot in PLOTS]
    plots.append(("goodput", "Goodput: where the wall time went", partial(plot_goodput, record=run.goodput)))
    for name, title, plot in plots:
        figure = Figure(figsize=(9, 4.8), layout="constrained")
        drawn = plot(figure)
        if isinstance(drawn, str):  # nothing to draw: the note says why
            result["notes"].append(drawn)
            continue
        figure.suptitle(title, fontsize=13, fontweight="bold")
        figure.savefig(folder / f"{name}.png", dpi=110)
        entry = {"file": f"{name}.png", "title": title, "series": drawn.series}
        result["plots"][name] = {**entry, "note": drawn.note} if drawn.note else entry
    (folder / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    (folder / "report.html").write_text(render_html(result, _summary_facts(run), run.alerts, folder))
    return result


def _is_report(folder: Path) -> bool:
    """Whether ``folder`` holds a report this function wrote (its report.json)."""
    try:
        written = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and {"run_dir", "plots"} <= written.keys()


def _summary_facts(run: RunHistory) -> dict[str, str]:
    s = run.series
    facts = {"launches": " → ".join(launch.name for launch in run.chain),
             "last step": str(max(int(steps[-1]) for steps, _ in s.values()))}
    if "train/loss" in s:
        facts["last train/loss"] = f"{s['train/loss'][1][-1]:.4f}"
    if "val/loss" in s:
        best = int(np.nanargmin(s["val/loss"][1]))
        facts["best val/loss"] = f"{s['val/loss'][1][best]:.4f} (step {s['val/loss'][0][best]})"
    if "val/exact_match" in s:
        steps, values = s["val/exact_match"]
        best = int(np.nanargmax(values))
        facts["best val/exact_match"] = f"{values[best]:.1%} (step {steps[best]})"
    if "perf/tokens_per_sec" in s:
        facts["peak throughput"] = f"{np.nanmax(s['perf/tokens_per_sec'][1]):,.0f} tokens/s"
    if run.goodput is not None:
        facts["goodput"] = f"{run.goodput['productive_fraction']:.1%} of the wall time in productive steps"
    facts["alerts"] = str(len(run.alerts))
    return facts
