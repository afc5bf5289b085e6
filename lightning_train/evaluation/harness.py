"""Running lm_eval tasks: ``run_tasks`` (lm_eval's own ``simple_evaluate`` over a model of ours, tasks found
by name or in a folder of YAML files) and ``task_metrics`` (its results as ``<task>/<metric>`` numbers). The
``evaluate`` tool and the ``DownstreamEval`` callback both run tasks through here."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning_train.errors import UserInputError

INSTALL_HINT = "pip install 'lightning_train[eval]'"


def require_lm_eval() -> None:
    """Refuse, in one line, a run that needs lm-evaluation-harness where it is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise UserInputError(f"evaluating tasks needs lm-evaluation-harness: {INSTALL_HINT}") from error


def task_manager(tasks: list[str], include_path: str | list[str] | None = None) -> Any:
    """An lm_eval ``TaskManager`` that knows ``tasks``: the YAML tasks under ``include_path`` alone when
    they name them all (indexing lm_eval's own thousands of tasks takes seconds), else lm_eval's tasks too.
    A name found nowhere (and not a task YAML file) is one ``UserInputError``."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise UserInputError("no task given; pass task names, e.g. --tasks '[hellaswag]'")
    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    for path in paths:
        if not Path(path).exists():
            raise UserInputError(
                f"include_path {path!r} does not exist; pass a folder of lm_eval task YAML files"
            )
    named = [task for task in tasks if not Path(task).is_file()]  # a YAML file is a task of its own
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if set(named) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=paths or None)
    unknown = [task for task in named if task not in manager.all_tasks]
    if unknown:
        where = f" nor under include_path {paths}" if paths else ""
        raise UserInputError(
            f"tasks {unknown} are not lm_eval tasks{where}; `lm_eval ls tasks` lists lm_eval's, and a task "
            "of your own is a YAML file (pass its path, or its folder as include_path)"
        )
    return manager


def run_tasks(
    lm: Any,
    tasks: list[str],
    include_path: str | list[str] | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    bootstrap_iters: int = 0,
    seed: int = 1234,
    progress: bool = True,
) -> dict[str, Any] | None:
    """lm_eval's ``simple_evaluate`` of ``lm`` (a ``LightningTrainLM``) on ``tasks``: its results dict on
    rank 0, None on the other ranks. ``limit``: the first N documents of each task (a fraction below 1);
    ``bootstrap_iters``: lm_eval's resamples for the standard errors of metrics that need them (0: none);
    ``progress`` False: none of lm_eval's progress bars or log below errors (an evaluation during training,
    under the run's own progress bar)."""
    import lm_eval

    from lightning_train._compat import lm_eval_console

    manager = task_manager(tasks, include_path)
    with lm_eval_console(progress):
        return lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=num_fewshot, limit=limit,
            bootstrap_iters=bootstrap_iters, log_samples=False, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed,
        )


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` from lm_eval's results (groups included): the metric of lm_eval's
    ``"acc,none"`` is ``acc``, of ``"exact_match,flexible-extract"`` ``exact_match_flexible-extract``;
    standard errors and values that are not numbers are left out."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                name = metric if filter_name == "none" else f"{metric}_{filter_name}"
                metrics[f"{task}/{name}"] = float(value)
    return metrics
