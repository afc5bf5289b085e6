"""Run reports without W&B: PNG plots and one self-contained HTML page from a run folder.

    python -m lightning_train report runs/pretrain-tiny     # -> runs/pretrain-tiny/report/

Reads every ``version_*/metrics.csv`` of the run in order (a resumed run has one per launch; where
launches overlap, e.g. after resuming from an older checkpoint, the later launch wins) and the
alerts of ``lightning_train.alerts`` (``alerts.jsonl``). Plots: loss, learning rate, gradient norms
(total, and a steps x groups heatmap), loss scale with overflow marks, recovery events with alerts,
and throughput. A namespace the run did not log is skipped with a note on the page.
``report.json`` lists every plot with the number of points of each series it drew.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from lightning_train.alerts import read_alerts
from lightning_train.errors import UserInputError

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values), sorted by step
STEP_LABEL = "optimizer step"
LEVEL_COLORS = {"INFO": "tab:blue", "WARN": "tab:orange", "ERROR": "tab:red"}


def load_run(run_dir: str | Path) -> tuple[Series, list[int], list[dict[str, Any]]]:
    """The run's metric series, the steps where a later launch resumed, and its alerts."""
    versions = sorted(Path(run_dir).glob("version_*/metrics.csv"), key=lambda p: _version_number(p.parent))
    if not versions:
        raise UserInputError(f"no version_*/metrics.csv under {str(run_dir)!r}; pass the run folder "
                             "(trainer.default_root_dir) of a run that logged with the CSV logger")
    points: dict[str, dict[int, float]] = {}
    resumed_at, alerts = [], read_alerts(run_dir)
    for index, path in enumerate(versions):
        with path.open(newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("step")]
        if index and rows:
            resumed_at.append(min(int(float(row["step"])) for row in rows))
        for row in rows:
            step = int(float(row.pop("step")))
            for name, value in row.items():
                if value not in ("", None) and name != "epoch":
                    points.setdefault(name, {})[step] = float(value)  # a later launch overrides
        alerts += read_alerts(path.parent)
    series = {name: _arrays(by_step) for name, by_step in points.items()}
    return series, resumed_at, sorted(alerts, key=lambda a: (a["step"], a.get("time", 0)))


def report(run_dir: str, output_dir: str | None = None) -> dict[str, Any]:
    """Render a run's metrics to PNGs plus ``report.html`` and ``report.json``.

    Args:
        run_dir: the run folder (``trainer.default_root_dir``, holding ``version_*/metrics.csv``).
        output_dir: where to write (default ``<run_dir>/report``).

    Returns:
        What ``report.json`` holds: the output folder, the files, the points per plotted series, and
        the notes.
    """
    series, resumed_at, alerts = load_run(run_dir)
    out = Path(output_dir) if output_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"run_dir": str(run_dir), "output_dir": str(out), "plots": {}, "notes": [],
                              "alerts": len(alerts), "resumed_at": resumed_at}
    for name, title, plot in PLOTS:
        figure = Figure(figsize=(9, 4.8), layout="constrained")
        drawn = plot(figure, series, resumed_at, alerts)
        if isinstance(drawn, str):  # nothing to draw: the note says why
            result["notes"].append(drawn)
            continue
        figure.suptitle(title, fontsize=13, fontweight="bold")
        figure.savefig(out / f"{name}.png", dpi=110)
        result["plots"][name] = {"file": f"{name}.png", "title": title, "series": drawn}
    (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "report.html").write_text(_html(result, series, alerts, out))
    return result


# ---- plots: each draws on a figure and returns {series: points}, or a note when it has no data ----
def _plot_loss(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict[str, int] | str:
    drawn = {k: len(s[k][0]) for k in ("train/loss", "val/loss") if k in s}
    if not drawn:
        return "Loss: no train/loss or val/loss logged."
    ax = fig.add_subplot()
    if "train/loss" in s:
        ax.plot(*s["train/loss"], color="tab:blue", lw=1, alpha=0.8, label="train/loss")
    if "val/loss" in s:
        ax.plot(*s["val/loss"], color="tab:orange", lw=2, marker="o", ms=4, label="val/loss")
    _log_if_wide(ax, [s[k][1] for k in drawn])
    _mark_resumes(ax, resumed_at)
    _labels(ax, "cross-entropy (nats/token)")
    return drawn


def _plot_lr(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict[str, int] | str:
    if "train/lr" not in s:
        return "Learning rate: no train/lr logged."
    ax = fig.add_subplot()
    ax.plot(*s["train/lr"], color="tab:green", lw=1.5, label="train/lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _mark_resumes(ax, resumed_at)
    _labels(ax, "learning rate")
    return {"train/lr": len(s["train/lr"][0])}


def _plot_grad_norm(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict[str, int] | str:
    if "health/grad_norm" not in s:
        return "Gradient norm: no health/ metrics logged (add lightning_train.callbacks.GradNormMonitor)."
    ax = fig.add_subplot()
    ax.plot(*s["health/grad_norm"], color="tab:purple", lw=1, label="health/grad_norm (total)")
    ax.set_yscale("log")
    _mark_resumes(ax, resumed_at)
    _labels(ax, "L2 norm, before clipping (log scale)")
    return {"health/grad_norm": len(s["health/grad_norm"][0])}


def _plot_grad_norm_groups(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict | str:
    groups = sorted(k for k in s if k.startswith("health/grad_norm/"))
    if not groups:
        return "Gradient norm by group: no health/grad_norm/<group> logged."
    steps = np.unique(np.concatenate([s[g][0] for g in groups]))
    grid = np.full((len(groups), len(steps)), np.nan)
    for row, group in enumerate(groups):
        grid[row, np.searchsorted(steps, s[group][0])] = s[group][1]
    positive = grid[np.isfinite(grid) & (grid > 0)]
    spread = positive.size and positive.min() < positive.max()
    norm = LogNorm(positive.min(), positive.max()) if spread else None
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap="viridis",
                      norm=norm, extent=(steps[0] - 0.5, steps[-1] + 0.5, len(groups) - 0.5, -0.5))
    ax.set_yticks(range(len(groups)), [g.removeprefix("health/grad_norm/") for g in groups])
    fig.colorbar(image, ax=ax, label="L2 norm (log color scale)")
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel("parameter group")
    return {g: len(s[g][0]) for g in groups}


def _plot_loss_scale(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict[str, int] | str:
    if "amp/loss_scale" not in s:
        return "Loss scale: no amp/ metrics logged (a mixed-precision run with LossScaleMonitor logs them)."
    steps, scale = s["amp/loss_scale"]
    ax = fig.add_subplot()
    ax.step(steps, scale, where="post", color="tab:blue", lw=1.5, label="amp/loss_scale")
    ax.set_yscale("log", base=2)
    if "amp/overflow_steps" in s:  # a cumulative count: an overflow where it grew
        o_steps, count = s["amp/overflow_steps"]
        overflow = o_steps[np.diff(count, prepend=0) > 0]
    else:  # the scaler halves the scale on every overflow
        overflow = steps[1:][np.diff(scale) < 0]
    if len(overflow):
        marks = np.interp(overflow, steps, scale)
        ax.scatter(overflow, marks, marker="x", s=50, color="tab:red", zorder=3,
                   label="overflow (step skipped)")
    _mark_resumes(ax, resumed_at)
    _labels(ax, "loss scale (log2)")
    drawn = {"amp/loss_scale": len(steps), "overflows": len(overflow)}
    return drawn


def _plot_recovery(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict[str, int] | str:
    counters = sorted(k for k in s if k.startswith("recovery/"))
    if not counters and not alerts:
        return "Recovery: no recovery/ metrics and no alerts (add NaNRecovery to see skips and rollbacks)."
    ax = fig.add_subplot()
    for name in counters:
        ax.step(*s[name], where="post", lw=1.5, label=name)
    for alert in alerts:
        color = LEVEL_COLORS.get(alert["level"], "gray")
        ax.axvline(alert["step"], color=color, ls="--", lw=1)
        ax.annotate(alert["title"], (alert["step"], 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8, color=color)
    for level in sorted({a["level"] for a in alerts}):
        ax.plot([], [], color=LEVEL_COLORS.get(level, "gray"), ls="--", label=f"{level} alert")
    _mark_resumes(ax, resumed_at)
    all_steps = np.concatenate([steps for steps, _ in s.values()])
    ax.set_xlim(all_steps.min(), all_steps.max())  # the whole run, so events sit where they happened
    ax.yaxis.get_major_locator().set_params(integer=True)
    if counters:
        ax.set_ylim(bottom=0)
        _labels(ax, "events (cumulative)")
    else:
        ax.set_yticks([])
        _labels(ax, "alerts (no recovery/ metrics logged)")
    return {**{k: len(s[k][0]) for k in counters}, "alerts": len(alerts)}


def _plot_throughput(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> dict[str, int] | str:
    if "perf/tokens_per_sec" not in s:
        return "Throughput: no perf/ metrics logged (add lightning_train.callbacks.ThroughputMonitor)."
    has_mfu = "perf/mfu" in s
    axes = fig.subplots(2 if has_mfu else 1, 1, sharex=True, squeeze=False)[:, 0]
    steps, rate = s["perf/tokens_per_sec"]
    axes[0].plot(steps, rate / 1e3, color="tab:green", lw=1.5, label="perf/tokens_per_sec")
    axes[0].set_ylim(bottom=0)
    _mark_resumes(axes[0], resumed_at)
    _labels(axes[0], "throughput (k tokens/s)", x_label=not has_mfu)
    drawn = {"perf/tokens_per_sec": len(steps)}
    if has_mfu:
        axes[1].plot(s["perf/mfu"][0], 100 * s["perf/mfu"][1], color="tab:brown", lw=1.5, label="perf/mfu")
        axes[1].set_ylim(bottom=0)
        _mark_resumes(axes[1], resumed_at)
        _labels(axes[1], "MFU (% of peak FLOP/s)")
        drawn["perf/mfu"] = len(s["perf/mfu"][0])
    return drawn


PLOTS: list[tuple[str, str, Callable[..., dict[str, int] | str]]] = [
    ("loss", "Loss", _plot_loss),
    ("lr", "Learning rate", _plot_lr),
    ("grad_norm", "Gradient norm (total)", _plot_grad_norm),
    ("grad_norm_groups", "Gradient norm by parameter group", _plot_grad_norm_groups),
    ("loss_scale", "Mixed-precision loss scale", _plot_loss_scale),
    ("recovery", "Recovery events and alerts", _plot_recovery),
    ("throughput", "Throughput", _plot_throughput),
]


# ---- helpers ---------------------------------------------------------------------------------------
def _version_number(folder: Path) -> int:
    match = re.fullmatch(r"version_(\d+)", folder.name)
    return int(match.group(1)) if match else -1


def _arrays(by_step: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    steps = sorted(by_step)
    return np.array(steps), np.array([by_step[k] for k in steps])


def _labels(ax: Any, y_label: str, x_label: bool = True) -> None:
    if x_label:
        ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(y_label)
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=9)


def _log_if_wide(ax: Any, values: list[np.ndarray]) -> None:
    """Log scale when the values span more than ~one order of magnitude (early loss vs late)."""
    finite = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in values])
    if finite.size and finite.max() / finite.min() > 10:
        ax.set_yscale("log")


def _mark_resumes(ax: Any, resumed_at: list[int]) -> None:
    for index, step in enumerate(resumed_at):
        ax.axvline(step, color="gray", ls=":", lw=1, label="resumed" if index == 0 else None)


def _html(result: dict[str, Any], series: Series, alerts: list[dict[str, Any]], out: Path) -> str:
    esc = html.escape
    facts = _summary_facts(series, alerts)
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts.items())
    figures = ""
    for plot in result["plots"].values():
        image = base64.b64encode((out / plot["file"]).read_bytes()).decode()
        caption = ", ".join(f"{name} ({n} points)" for name, n in plot["series"].items())
        figures += (f'<figure><img alt="{esc(plot["title"])}" src="data:image/png;base64,{image}">'
                    f'<figcaption>{esc(plot["title"])}: {esc(caption)}</figcaption></figure>')
    notes = "".join(f"<li>{esc(note)}</li>" for note in result["notes"])
    alert_rows = "".join(
        f'<tr><td>{a["step"]}</td><td style="color:{_css_color(a["level"])}">'
        f'{esc(a["level"])}</td><td>{esc(a["title"])}</td><td>{esc(a["text"])}</td></tr>'
        for a in alerts
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Run report: {esc(result["run_dir"])}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: left; }}
figure {{ margin: 2em 0; }} img {{ max-width: 100%; }} figcaption {{ color: #555; }}
.notes {{ background: #fff8e1; padding: 0.6em 2em; }}
</style></head><body>
<h1>Run report</h1><p><code>{esc(result["run_dir"])}</code></p>
<table>{rows}</table>
{f'<div class="notes"><p>Not shown:</p><ul>{notes}</ul></div>' if notes else ""}
{figures}
<h2>Alerts</h2>
{f"<table><tr><th>step</th><th>level</th><th>title</th><th>text</th></tr>{alert_rows}</table>"
 if alerts else "<p>No alerts.</p>"}
</body></html>
"""


def _css_color(level: str) -> str:
    return LEVEL_COLORS.get(level, "gray").removeprefix("tab:")


def _summary_facts(s: Series, alerts: list[dict[str, Any]]) -> dict[str, str]:
    facts = {"last step": str(max(int(steps[-1]) for steps, _ in s.values()))}
    if "train/loss" in s:
        facts["last train/loss"] = f"{s['train/loss'][1][-1]:.4f}"
    if "val/loss" in s:
        best = int(np.nanargmin(s["val/loss"][1]))
        facts["best val/loss"] = f"{s['val/loss'][1][best]:.4f} (step {s['val/loss'][0][best]})"
    if "perf/tokens_per_sec" in s:
        facts["peak throughput"] = f"{np.nanmax(s['perf/tokens_per_sec'][1]):,.0f} tokens/s"
    facts["alerts"] = str(len(alerts))
    return facts
