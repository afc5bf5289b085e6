"""The W&B dashboard of a lightning_train run: one section per metric namespace, the optimizer step
(``trainer/global_step``) as x-axis everywhere, and the summaries worth sorting runs by.

The layout below is the single source of truth: ``WandbLogger`` defines its metrics from it, and
``python -m lightning_train dashboard`` saves it as a W&B workspace view (through the optional
``wandb-workspaces`` package) and always writes it as a JSON spec:

    python -m lightning_train dashboard --entity my-team --project llm --run_dir runs/pretrain-tiny-wandb
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_train.errors import UserInputError, write_failed
from lightning_train.loggers.launches import metrics_files, open_metrics

STEP_METRIC = "trainer/global_step"
NAMESPACES = ("train", "val", "health", "amp", "recovery", "perf")
SPEC_FILE = "wandb_dashboard.json"


@dataclass(frozen=True)
class Panel:
    """A line plot over optimizer steps. ``group_prefix`` panels plot every ``<prefix><group>`` metric
    the run logged (parameter groups are only known once a run exists)."""

    title: str
    metrics: tuple[str, ...]
    y_label: str
    log_y: bool = False
    group_prefix: str | None = None


SECTIONS: dict[str, tuple[Panel, ...]] = {
    "train": (
        Panel("Training loss", ("train/loss",), "cross-entropy (nats/token)", log_y=True),
        Panel("Learning rate", ("train/lr",), "learning rate"),
    ),
    "val": (
        Panel("Validation loss", ("val/loss",), "cross-entropy (nats/token)", log_y=True),
        Panel("Validation perplexity", ("val/ppl",), "perplexity", log_y=True),
    ),
    "health": (
        Panel("Gradient norm (total)", ("health/grad_norm",), "L2 norm", log_y=True),
        Panel("Gradient norm by group", (), "L2 norm", log_y=True, group_prefix="health/grad_norm/"),
        Panel("Update / parameter ratio by group", (), "ratio", log_y=True,
              group_prefix="health/update_ratio/"),
        Panel("Parameter norm", ("health/param_norm",), "L2 norm"),
        Panel("Clipped steps", ("health/clip_fraction",), "fraction of steps clipped"),
    ),
    "amp": (
        Panel("Loss scale", ("amp/loss_scale",), "loss scale", log_y=True),
        Panel("Overflow steps", ("amp/overflow_steps",), "steps (cumulative)"),
    ),
    "recovery": (
        Panel("Recovery events", ("recovery/skipped_steps", "recovery/rollbacks", "recovery/spikes"),
              "events (cumulative)"),
    ),
    "perf": (
        Panel("Throughput", ("perf/tokens_per_sec",), "tokens / s"),
        Panel("Model FLOPs utilization", ("perf/mfu",), "MFU (fraction of peak)"),
        Panel("Step time", ("perf/step_time",), "seconds / step"),
    ),
}

# W&B summary aggregations: what the runs table shows (and sorts by) for each metric.
SUMMARIES: dict[str, str] = {
    "train/loss": "min,last",
    "val/loss": "min,last",
    "val/ppl": "min,last",
    "health/grad_norm": "max,last",
    "amp/loss_scale": "last,min",
    "amp/overflow_steps": "last",
    "recovery/skipped_steps": "last",
    "recovery/rollbacks": "last",
    "recovery/spikes": "last",
    "perf/tokens_per_sec": "max,mean,last",
    "perf/mfu": "max,mean",
    "perf/step_time": "min,mean",
}


def dashboard_spec(name: str = "lightning_train", entity: str | None = None, project: str | None = None,
                   logged_metrics: list[str] | None = None) -> dict[str, Any]:
    """The workspace view as plain data. ``logged_metrics`` (e.g. a run's CSV columns) fills in the
    per-group panels; without it they are left out (there is nothing to list yet).

    Example:

        >>> from lightning_train.loggers.dashboard import dashboard_spec
        >>> spec = dashboard_spec(project="llm", logged_metrics=["health/grad_norm/block.0", "train/loss"])
        >>> spec["x_axis"], [section["prefix"] for section in spec["sections"]][:2]
        ('trainer/global_step', ['train/', 'val/'])
        >>> health = next(section for section in spec["sections"] if section["name"] == "health")
        >>> any("health/grad_norm/block.0" in panel["metrics"] for panel in health["panels"])
        True
    """
    logged = logged_metrics or []
    sections = []
    for namespace, panels in SECTIONS.items():
        section_panels = []
        for panel in panels:
            metrics = list(panel.metrics)
            if panel.group_prefix:
                metrics = sorted(m for m in logged if m.startswith(panel.group_prefix))
            if metrics:
                section_panels.append({**asdict(panel), "metrics": metrics})
        sections.append({"name": namespace, "prefix": f"{namespace}/", "panels": section_panels})
    return {
        "name": name, "entity": entity, "project": project, "x_axis": STEP_METRIC,
        "sections": sections,
        "summaries": {key: summary.split(",") for key, summary in SUMMARIES.items()},
    }


def dashboard(entity: str | None = None, project: str | None = None, run_dir: str | None = None,
              name: str = "lightning_train") -> dict[str, Any]:
    """Save the dashboard: as a W&B workspace view when online with ``wandb-workspaces`` installed,
    and always as ``wandb_dashboard.json`` in ``run_dir`` (or the current folder).

    Args:
        entity: W&B entity (user or team) that owns the view.
        project: W&B project of the view (default: ``$WANDB_PROJECT`` or ``lightning_logs``).
        run_dir: a run folder (``trainer.default_root_dir``, holding ``version_*/metrics.csv``); its
            logged metric names fill in the per-group panels, and the JSON spec is written there.
        name: the view's name.

    Returns:
        The spec as written to ``wandb_dashboard.json``; its ``url`` is None when no view was saved.
    """
    project = project or os.environ.get("WANDB_PROJECT", "lightning_logs")
    folder = Path(run_dir or ".")
    if run_dir is not None and not folder.is_dir():
        raise UserInputError(f"--run_dir {run_dir!r} is not a folder; pass a run folder such as "
                             "runs/pretrain-tiny")
    logged = _logged_metrics(folder, f"--run_dir {run_dir!r}") if run_dir is not None else None
    path = folder / SPEC_FILE
    if path.is_dir():  # before the view is saved on W&B: a refusal leaves nothing done
        raise UserInputError(f"{path} is a folder; the dashboard spec is written there as a file: move "
                             "that folder away")
    spec = dashboard_spec(name, entity, project, logged_metrics=logged)
    spec["url"] = _save_workspace(spec)
    try:
        path.write_text(json.dumps(spec, indent=2) + "\n")
    except OSError as error:
        raise write_failed(path, error, "pass a writable --run_dir") from error
    return spec


def _logged_metrics(run_dir: Path, named: str) -> list[str]:
    """The metric names (CSV columns) the run's launches logged; a folder that holds no run is refused."""
    names: set[str] = set()
    for metrics_csv in metrics_files(run_dir, named):
        with open_metrics(metrics_csv) as f:
            names.update(next(csv.reader(f), []))
    return sorted(names)


def _save_workspace(spec: dict[str, Any]) -> str | None:
    """Create the view on W&B; None (with a warning saying why) when that is not possible."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return None
    if spec["entity"] is None:
        warnings.warn("no --entity given: wrote the dashboard spec only", stacklevel=2)
        return None
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        warnings.warn("wandb-workspaces is not installed (pip install wandb-workspaces): wrote the "
                      "dashboard spec only", stacklevel=2)
        return None
    sections = [
        ws.Section(name=section["name"], is_open=True, panels=[
            wr.LinePlot(title=p["title"], x=spec["x_axis"], y=p["metrics"], log_y=p["log_y"] or None,
                        title_x="optimizer step", title_y=p["y_label"])
            for p in section["panels"]
        ])
        for section in spec["sections"]
    ]
    workspace = ws.Workspace(entity=spec["entity"], project=spec["project"], name=spec["name"],
                             sections=sections, settings=ws.WorkspaceSettings(x_axis=spec["x_axis"]))
    try:
        return workspace.save().url
    except Exception as error:  # no API key, no network, unknown entity: keep the local spec
        warnings.warn(f"could not save the W&B workspace ({error}); wrote the dashboard spec only",
                      stacklevel=2)
        return None
