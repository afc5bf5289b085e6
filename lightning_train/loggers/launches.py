"""The launches recorded in a run folder, and which of them form one run.

Every launch of ``python -m lightning_train`` with a CSV logger writes one ``version_N/`` folder:
``metrics.csv``, ``hparams.yaml`` and (from the CLI) the resolved ``config.yaml``. A folder can hold
launches of several runs: a resume of a run, but also a fresh fit with other settings, a fit on another
corpus, a ``validate`` of a checkpoint. A *run* is a chain of fit launches that resumed one another.

How a launch is classified, from what it recorded:

* ``validate``/``test``: its config has the evaluation subcommands' ``verbose`` key (without a config:
  it logged only ``val/``/``test/`` metrics). Evaluations are not part of a run's curves.
* a fit is *resumed* when its config names a ``ckpt_path`` or when its first logged step lies beyond
  its first logging interval (a fresh fit logs within its first ``log_every_n_steps`` steps).
* the launch it resumed from (its *parent*): the earlier fit launch that wrote the checkpoint it loaded,
  found by the checkpoint file's time when the file has not been rewritten since; otherwise the newest
  earlier fit launch that reached the resume step, preferring one with the same hyperparameters. A
  resumed launch with no such parent (a checkpoint from another folder) starts a run of its own.

``select_run`` picks one run: by default the one of the newest fit launch.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from lightning_train.errors import UserInputError
from lightning_train.loggers.alerts import read_alerts

LIGHTNING_LOG_EVERY_N_STEPS = 50  # Lightning's default, for a launch without a saved config
CLOCK_SLACK_S = 2.0  # file times vs the launch's own files (1 s resolution on some file systems)


@dataclass(eq=False)  # one launch is one folder: compared by identity
class Launch:
    """One ``version_N/`` folder: what it logged and how it relates to the other launches."""

    name: str  # "version_3"
    folder: Path
    kind: str  # "fit", "validate", "test", or "empty" (logged nothing: a failed start, a predict)
    points: dict[str, dict[int, float]]  # metric -> step -> value
    config: dict[str, Any]  # the saved LightningCLI config; {} without one
    hparams: dict[str, Any] | None
    started: float | None  # when its config was saved (setup); None without a config
    ended: float  # its files' last write
    resumed: bool = False
    parent: str | None = None  # the launch whose checkpoint it resumed from
    children: list[str] = field(default_factory=list)

    @property
    def first_step(self) -> int:
        return min(min(by_step) for by_step in self.points.values())

    @property
    def last_step(self) -> int:
        return max(max(by_step) for by_step in self.points.values())

    def describe(self) -> dict[str, Any]:
        """The launch as report.json lists it."""
        facts: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.points:
            facts["steps"] = [self.first_step, self.last_step]
        if self.kind == "fit":
            facts["resumed_from"] = self.parent if self.parent else ("elsewhere" if self.resumed else None)
        if self.config.get("ckpt_path"):
            facts["ckpt_path"] = str(self.config["ckpt_path"])
        if self.kind in ("validate", "test"):
            facts["metrics"] = {name: by_step[max(by_step)] for name, by_step in sorted(self.points.items())}
        return facts


def read_launches(run_dir: str | Path) -> list[Launch]:
    """Every ``version_*/`` launch under ``run_dir``, oldest first, with each fit's parent linked."""
    run_dir = Path(run_dir)
    launches = [_read_launch(path.parent) for path in metrics_files(run_dir, repr(str(run_dir)))]
    by_name = {launch.name: launch for launch in launches}
    for index, launch in enumerate(launches):
        if launch.kind != "fit":
            continue
        launch.resumed = bool(launch.config.get("ckpt_path")) or launch.first_step >= _log_interval(launch)
        earlier = [p for p in launches[:index] if p.kind == "fit"]
        parent = _find_parent(launch, earlier, run_dir) if launch.resumed else None
        if parent is not None:
            launch.parent = parent.name
            by_name[parent.name].children.append(launch.name)
    return launches


def select_run(launches: list[Launch], launch: str | None = None) -> list[Launch]:
    """The run's launches in order, root first: the chain from the root to the newest launch that
    descends from ``launch`` (a ``version_N`` name; default: the newest fit launch)."""
    by_name = {item.name: item for item in launches}
    fits = [item.name for item in launches if item.kind == "fit"]
    if launch is None:
        if not fits:
            kinds = ", ".join(f"{item.name}: {item.kind}" for item in launches)
            raise UserInputError(f"no training launch to report: the folder holds only {kinds}")
        launch = fits[-1]
    if launch not in by_name or by_name[launch].kind != "fit":
        raise UserInputError(f"launch {launch!r} is not a training launch of this folder; pass one of "
                             f"{', '.join(fits) or '(none)'}")
    descendants, queue = [launch], [launch]
    while queue:
        children = by_name[queue.pop()].children
        descendants += children
        queue += children
    chain = [by_name[max(descendants, key=_version_number)]]  # the newest branch: a later resume wins
    while chain[0].parent is not None:
        chain.insert(0, by_name[chain[0].parent])
    return chain


def merge_chain(chain: list[Launch]) -> tuple[dict[str, dict[int, float]], list[int], list[dict[str, Any]]]:
    """The run's points, the steps where a launch resumed, and its alerts. A resumed launch replaces
    everything its ancestors logged from its first step on (that part of their branch was abandoned)."""
    points: dict[str, dict[int, float]] = {}
    alerts: list[dict[str, Any]] = []
    resumed_at: list[int] = []
    for index, launch in enumerate(chain):
        if index:
            start = launch.first_step
            resumed_at.append(start)
            points = {name: {step: value for step, value in by_step.items() if step < start}
                      for name, by_step in points.items()}
            alerts = [alert for alert in alerts if alert["step"] < start]
        for name, by_step in launch.points.items():
            points.setdefault(name, {}).update(by_step)
        alerts += read_alerts(launch.folder)
    points = {name: by_step for name, by_step in points.items() if by_step}
    return points, resumed_at, sorted(alerts, key=lambda a: (a["step"], a.get("time", 0)))


# ---- reading one launch ---------------------------------------------------------------------------
def role_in_run(launch: Launch, chain: list[Launch], launches: list[Launch]) -> str:
    """What ``launch`` is to the run ``chain`` of the folder's ``launches``: part of it, an abandoned
    branch of it, another run, an evaluation, or a launch that logged nothing."""
    if launch.name in {item.name for item in chain}:
        return "this run"
    if launch.kind == "fit":
        by_name = {item.name: item for item in launches}
        root = launch
        while root.parent is not None:
            root = by_name[root.parent]
        return "abandoned branch of this run" if root.name == chain[0].name else "another run"
    return "logged nothing" if launch.kind == "empty" else "evaluation, not a training curve"


def metrics_files(run_dir: Path, named: str) -> list[Path]:
    """Each launch's ``version_*/metrics.csv`` under ``run_dir``, oldest launch first; a folder without
    any is refused, calling it ``named``."""
    files = sorted(run_dir.glob("version_*/metrics.csv"), key=lambda path: _version_number(path.parent))
    if not files:
        raise UserInputError(f"no version_*/metrics.csv under {named}; pass the run folder "
                             "(trainer.default_root_dir) of a run that logged with the CSV logger")
    return files


@contextmanager
def open_metrics(path: Path) -> Iterator[TextIO]:
    """A launch's ``metrics.csv``, open for ``csv``; a file that cannot be read as one (a folder, bytes
    that are not UTF-8, a NUL byte) is one error line naming it."""
    try:
        with path.open(encoding="utf-8", newline="") as f:
            yield f
    except IsADirectoryError as error:
        raise UserInputError(f"{path} is a folder, not the CSV logger's file; {_fix(path)}") from error
    except UnicodeDecodeError as error:  # its start counts from the chunk read, not from the file's start
        byte = error.object[error.start]
        raise UserInputError(f"{path} holds byte 0x{byte:02x}, which is not UTF-8; {_fix(path)}") from error
    except (OSError, csv.Error) as error:
        why = (error.strerror or str(error)) if isinstance(error, OSError) else f"not CSV: {error}"
        raise UserInputError(f"cannot read {path} ({why}); {_fix(path)}") from error


def _fix(metrics_csv: Path) -> str:
    return (f"restore the file the CSV logger wrote, or move {metrics_csv.parent} out of the run folder to "
            "leave that launch out")


def _read_launch(folder: Path) -> Launch:
    points: dict[str, dict[int, float]] = {}
    path = folder / "metrics.csv"
    with open_metrics(path) as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None in row:  # DictReader's key for the values past the header's names
                raise UserInputError(f"{path} line {reader.line_num} has more values than its header; "
                                     f"{_fix(path)}")
            if not row.get("step"):
                continue
            step = int(_number(row, "step", path, reader.line_num, whole=True))
            for name, value in row.items():
                if value and name not in ("step", "epoch"):
                    points.setdefault(name, {})[step] = _number(row, name, path, reader.line_num)
    config_file = folder / "config.yaml"
    config = _read_yaml(config_file) or {}
    return Launch(
        name=folder.name, folder=folder, kind=_kind(config, points), points=points, config=config,
        hparams=_read_yaml(folder / "hparams.yaml"),
        started=config_file.stat().st_mtime if config else None,
        ended=max(path.stat().st_mtime for path in folder.iterdir() if path.is_file()),
    )


def _number(row: dict[str, str], name: str, path: Path, line: int, whole: bool = False) -> float:
    """The value of ``name`` in ``row`` (line ``line`` of ``path``); ``whole``: as an int."""
    try:
        return int(float(row[name])) if whole else float(row[name])
    except (ValueError, OverflowError) as error:  # int() of nan or inf among them
        raise UserInputError(
            f"{path} line {line}: {name}={row[name]!r} is not a number; {_fix(path)}"
        ) from error


def _kind(config: dict[str, Any], points: dict[str, dict[int, float]]) -> str:
    if not points:
        return "empty"
    # with a config: only LightningCLI's validate and test take --verbose; without: by what it logged
    only_eval_metrics = all(name.startswith(("val/", "test/")) for name in points)
    if not ("verbose" in config if config else only_eval_metrics):
        return "fit"
    return "test" if any(name.startswith("test/") for name in points) else "validate"


def _read_yaml(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, OSError):  # e.g. Python-specific tags: read as if absent
        return None
    return loaded if isinstance(loaded, dict) else None


def _log_interval(launch: Launch) -> int:
    configured = (launch.config.get("trainer") or {}).get("log_every_n_steps")
    if configured:
        return int(configured)
    steps = sorted(launch.points.get("train/loss", {}))
    return steps[1] - steps[0] if len(steps) > 1 else LIGHTNING_LOG_EVERY_N_STEPS


# ---- which launch a resumed one continues ---------------------------------------------------------
def _find_parent(launch: Launch, earlier: list[Launch], run_dir: Path) -> Launch | None:
    writer = _checkpoint_writer(launch, earlier, run_dir)
    if writer is not None:
        return writer
    start, slack = launch.first_step, 2 * _log_interval(launch) + 1
    reached = [p for p in earlier if p.first_step <= start + 1 and p.last_step >= start - slack]
    same_settings = [p for p in reached if launch.hparams is not None and p.hparams == launch.hparams]
    return (same_settings or reached or [None])[-1]


def _checkpoint_writer(launch: Launch, earlier: list[Launch], run_dir: Path) -> Launch | None:
    """The launch that wrote the checkpoint ``launch`` loaded, when that file still holds what it loaded
    (written before ``launch`` started) and its time falls within an earlier launch."""
    path = _local_checkpoint(launch.config, run_dir)
    if path is None or launch.started is None:
        return None
    stamp = path if path.is_file() else path / "manifest.json"
    if not stamp.exists():
        return None
    written = stamp.stat().st_mtime
    if written > launch.started:  # rewritten since: it no longer tells who wrote what was loaded
        return None
    within = [p for p in earlier if p.started is not None
              and p.started - CLOCK_SLACK_S <= written <= p.ended + CLOCK_SLACK_S]
    return within[-1] if within else None


def _local_checkpoint(config: dict[str, Any], run_dir: Path) -> Path | None:
    """The launch's ``ckpt_path`` as a path under this run folder (the config holds it as typed)."""
    ckpt_path = config.get("ckpt_path")
    if not ckpt_path:
        return None
    path = Path(str(ckpt_path))
    root = (config.get("trainer") or {}).get("default_root_dir")
    if not path.is_absolute():
        try:  # typed relative to where the command ran, like default_root_dir
            return run_dir / path.relative_to(Path(root)) if root else None
        except ValueError:
            return None
    inside = path.resolve().is_relative_to(run_dir.resolve())
    return path if inside and path.exists() else None


def _version_number(folder: Path | str) -> int:
    match = re.fullmatch(r"version_(\d+)", Path(folder).name)
    return int(match.group(1)) if match else -1
