"""Scoring models with EleutherAI's lm-evaluation-harness (the ``eval`` extra: ``pip install
'lightning_train[eval]'``).

- ``lm_eval_model``: ``LightningTrainLM``, our models as an lm_eval model (registered as
  ``"lightning_train"``);
- ``harness``: ``run_tasks`` (lm_eval's ``simple_evaluate`` on tasks by name or from a folder of YAML files)
  and ``task_metrics`` (its results as ``<task>/<metric>`` numbers).

Used by the ``evaluate`` tool and the ``DownstreamEval`` callback; lm_eval is imported on first use.
"""

from lightning_train._lazy import lazy_exports

__all__ = ["LightningTrainLM", "run_tasks", "task_metrics"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "LightningTrainLM": "lightning_train.evaluation.lm_eval_model",
    "run_tasks": "lightning_train.evaluation.harness",
    "task_metrics": "lightning_train.evaluation.harness",
})
