"""The report's plots: each draws one namespace of a run's metrics on a figure and returns what it
drew (points per series), or a note saying why there was nothing to draw."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from lightning_train.loggers.report_html import LEVEL_COLORS

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values), sorted by step
STEP_LABEL = "optimizer step"
ACCURACY_METRICS = ("val/exact_match", "val/token_accuracy", "val/token_acc", "train/token_accuracy")
GOODPUT_COLORS = {"productive": "tab:green", "startup": "tab:blue", "checkpoint": "tab:orange",
                  "validation": "tab:purple", "recovery": "tab:red", "lost": "black", "other": "tab:gray"}



@dataclass
class Drawn:
    """What a plot drew: points per series, and a note for the caption."""

    series: dict[str, int]
    note: str = ""


# ---- plots: each draws on a figure and returns what it drew, or a note when it has no data ---------
def _plot_loss(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
    drawn = {k: len(s[k][0]) for k in ("train/loss", "val/loss") if k in s}
    if not drawn:
        return "Loss: no train/loss or val/loss logged."
    ax = fig.add_subplot()
    if "train/loss" in s:
        ax.plot(*s["train/loss"], color="tab:blue", lw=1, alpha=0.8, label="train/loss")
    if "val/loss" in s:
        ax.plot(*s["val/loss"], color="tab:orange", lw=2, marker="o", ms=4, label="val/loss")
    scale = _value_axis(ax, [s[k][1] for k in drawn])
    _mark_resumes(ax, resumed_at)
    _labels(ax, f"cross-entropy (nats/token){scale}")
    return Drawn(drawn)


def _plot_lr(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
    if "train/lr" not in s:
        return "Learning rate: no train/lr logged."
    ax = fig.add_subplot()
    ax.plot(*s["train/lr"], color="tab:green", lw=1.5, label="train/lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _mark_resumes(ax, resumed_at)
    _labels(ax, "learning rate")
    return Drawn({"train/lr": len(s["train/lr"][0])})


def _plot_accuracy(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
    names = [name for name in ACCURACY_METRICS if name in s]
    if not names:
        return "Accuracy: no val/exact_match or token accuracy logged (a fine-tuning run logs them)."
    ax = fig.add_subplot()
    for name in names:
        steps, values = s[name]
        style = {"lw": 1, "alpha": 0.8} if name.startswith("train/") else {"lw": 2, "marker": "o", "ms": 4}
        ax.plot(steps, 100 * values, label=name, **style)
    ax.set_ylim(-2, 102)  # lines at 0 % and 100 % stay visible
    _mark_resumes(ax, resumed_at)
    _labels(ax, "accuracy (%)")
    return Drawn({name: len(s[name][0]) for name in names})


def _plot_grad_norm(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
    if "health/grad_norm" not in s:
        return "Gradient norm: no health/ metrics logged (add lightning_train.callbacks.GradNormMonitor)."
    ax = fig.add_subplot()
    ax.plot(*s["health/grad_norm"], color="tab:purple", lw=1, label="health/grad_norm (total)")
    scale = _value_axis(ax, [s["health/grad_norm"][1]])
    _mark_resumes(ax, resumed_at)
    _labels(ax, f"L2 norm, before clipping{scale}")
    return Drawn({"health/grad_norm": len(s["health/grad_norm"][0])})


def _plot_grad_norm_groups(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
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
    return Drawn({g: len(s[g][0]) for g in groups})


def _plot_loss_scale(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
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
    return Drawn({"amp/loss_scale": len(steps), "overflows": len(overflow)})


def _plot_recovery(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
    counters = sorted(k for k in s if k.startswith("recovery/"))
    if not counters and not alerts:
        return "Recovery: no recovery/ metrics and no alerts (add NaNRecovery to see skips and rollbacks)."
    drawn = {**{k: len(s[k][0]) for k in counters}, "alerts": len(alerts)}
    ax = fig.add_subplot()
    all_steps = np.concatenate([steps for steps, _ in s.values()])
    ax.set_xlim(all_steps.min(), max(all_steps.max(), all_steps.min() + 1))  # the whole run
    if not alerts and all(np.nanmax(s[k][1]) == 0 for k in counters):
        ax.text(0.5, 0.5, "no recovery events", transform=ax.transAxes, ha="center", va="center",
                fontsize=18, color="tab:green")
        ax.set_yticks([])
        _mark_resumes(ax, resumed_at)
        _labels(ax, "events")
        return Drawn(drawn, note=f"no recovery events ({', '.join(counters)} stayed 0)")
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
    ax.yaxis.get_major_locator().set_params(integer=True)
    if counters:
        ax.set_ylim(bottom=0)
        _labels(ax, "events (cumulative)")
    else:
        ax.set_yticks([])
        _labels(ax, "alerts (no recovery/ metrics logged)")
    return Drawn(drawn)


def _plot_throughput(fig: Figure, s: Series, resumed_at: list[int], alerts: list) -> Drawn | str:
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
    return Drawn(drawn)


def plot_goodput(fig: Figure, record: dict[str, Any] | None) -> Drawn | str:
    if record is None:
        return ("Goodput: no goodput.json in the run's newest launch (add "
                "lightning_train.callbacks.GoodputMonitor; the CLI adds it to every fit).")
    rows = [*record["launches"], {**record, "name": "run (sum)", "state": ""}]
    scale, unit = _time_unit(record["wall_sec"])
    ax = fig.add_subplot()
    left = np.zeros(len(rows))
    for part, color in GOODPUT_COLORS.items():
        widths = np.array([row["seconds"][part] for row in rows]) / scale
        seconds = record["seconds"][part]
        share = seconds / record["wall_sec"] if record["wall_sec"] > 0 else 0.0
        ax.barh(range(len(rows)), widths, left=left, color=color, height=0.6,
                label=f"{part}: {seconds / scale:,.3g} {unit} ({share:.0%})")
        left += widths
    for index, row in enumerate(rows):
        productive = row["seconds"]["productive"] / row["wall_sec"] if row["wall_sec"] > 0 else 0.0
        ax.annotate(f" {productive:.0%} productive", (left[index], index), va="center", fontsize=9)
    labels = [f"{row['name']} ({row['state']})" if row["state"] else row["name"] for row in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()  # launches top down in order, the run's sum last
    ax.set_xlim(0, left.max() * 1.2 if left.max() > 0 else 1)
    ax.set_xlabel(f"wall time ({unit})")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, fontsize=9, frameon=False,
              title="the run's parts (share of its wall time)", title_fontsize=9)
    fraction, lost = record["productive_fraction"], record["steps"]["lost"]
    note = (f"{fraction:.1%} of {record['wall_sec']:,.1f} s in productive steps over "
            f"{len(record['launches'])} launch(es); {lost} steps recomputed after restarts")
    if record["between_launches_sec"]:  # 0 for a run of one launch
        note += f"; {record['between_launches_sec']:,.1f} s between launches"
    return Drawn({part: len(rows) for part in GOODPUT_COLORS}, note=note)


PLOTS: list[tuple[str, str, Callable[..., Drawn | str]]] = [
    ("loss", "Loss", _plot_loss),
    ("lr", "Learning rate", _plot_lr),
    ("accuracy", "Accuracy (fine-tuning)", _plot_accuracy),
    ("grad_norm", "Gradient norm (total)", _plot_grad_norm),
    ("grad_norm_groups", "Gradient norm by parameter group", _plot_grad_norm_groups),
    ("loss_scale", "Mixed-precision loss scale", _plot_loss_scale),
    ("recovery", "Recovery events and alerts", _plot_recovery),
    ("throughput", "Throughput", _plot_throughput),
]


# ---- helpers ---------------------------------------------------------------------------------------
def _time_unit(seconds: float) -> tuple[float, str]:
    """The divisor and name of the unit that shows ``seconds`` best."""
    return (3600.0, "h") if seconds >= 3 * 3600 else (60.0, "min") if seconds >= 600 else (1.0, "s")


def series_arrays(by_step: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    steps = sorted(by_step)
    return np.array(steps), np.array([by_step[k] for k in steps])


def _labels(ax: Any, y_label: str, x_label: bool = True) -> None:
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    if x_label:
        ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(y_label)
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=9)


def _value_axis(ax: Any, values: list[np.ndarray]) -> str:
    """A log axis when the values span more than a decade (early loss vs late), labelled once at
    1, 2, 5 x 10^k in plain numbers; a linear one otherwise. Returns the y label's suffix."""
    finite = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in values])
    if not (finite.size and finite.max() / finite.min() > 10):
        return ""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())  # minor ticks stay as marks, without labels
    return " (log scale)"


def _mark_resumes(ax: Any, resumed_at: list[int]) -> None:
    for index, step in enumerate(resumed_at):
        ax.axvline(step, color="gray", ls=":", lw=1, label="resumed" if index == 0 else None)
