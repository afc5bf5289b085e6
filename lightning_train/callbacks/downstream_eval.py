"""DownstreamEval: lm-evaluation-harness tasks every N optimizer steps, logged as ``eval/<task>/<metric>``."""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from lightning_train.callbacks._common import log_metrics
from lightning_train.errors import UserInputError


class DownstreamEval(Callback):
    """Scores the model being trained on lm_eval tasks every ``every_n_steps`` optimizer steps, with lm_eval's
    own evaluator (``lightning_train.evaluation``), and logs each score as ``eval/<task>/<metric>`` at that
    step, beside ``train/loss`` (``eval/tiny_choice/acc``; a filter other than lm_eval's ``none`` is added
    to the metric's name: ``eval/gsm8k/exact_match_strict-match``). Needs the ``eval`` extra.

    Every rank takes part, in the layout it trains in. Where each rank holds the whole model (DDP), lm_eval
    gives each rank its share of the documents and gathers the scores on rank 0, which logs them. Where the
    model is split over the ranks (FSDP, HSDP, tensor and pipeline parallelism, composed), every rank runs
    every request together, through the strategy's generator under tensor or pipeline parallelism
    (``ParallelStrategy.generator``), so no rank ever gathers the whole model. The random number generators
    (torch, numpy, Python) are as they were after each evaluation, so training draws the same numbers with
    or without it. lm_eval's progress bars and warnings stay off the console, under the run's own bar.

    Args:
        tasks: lm_eval task names or task YAML paths.
        every_n_steps: evaluate after every this many optimizer steps.
        include_path: a folder of your own task YAML files (lm_eval's ``include_path``).
        limit: the first N documents of each task (a fraction when below 1); None: all.
        num_fewshot: examples in each prompt; None: each task's own.
        batch_size: requests scored together on a rank.
        max_gen_toks: the longest generation of a task that sets none.
        tokenizer: "byte" or a tokenizer.json; None: the data module's ``tokenizer``.

    Example (a two-question task of its own, written beside its documents, scored every 2 steps):

        >>> import json, tempfile
        >>> from pathlib import Path
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import DownstreamEval
        >>> folder = Path(tempfile.mkdtemp())
        >>> docs = [{"q": "import os\\nimport ", "choices": ["sys", ")"], "a": 0},
        ...         {"q": "def f(", "choices": ["x):", "]]"], "a": 0}]
        >>> _ = (folder / "python.jsonl").write_text("".join(json.dumps(d) + "\\n" for d in docs))
        >>> _ = (folder / "python.yaml").write_text(
        ...     "task: python_choice\\ndataset_path: json\\n"
        ...     f"dataset_kwargs: {{data_files: {{test: {folder / 'python.jsonl'}}}}}\\ntest_split: test\\n"
        ...     "output_type: multiple_choice\\ndoc_to_text: '{{q}}'\\ndoc_to_choice: '{{choices}}'\\n"
        ...     "doc_to_target: '{{a}}'\\ntarget_delimiter: ''\\nmetric_list: [{metric: acc}]\\n")
        >>> scores = DownstreamEval(["python_choice"], every_n_steps=2, include_path=str(folder))
        >>> trainer = L.Trainer(
        ...     max_steps=4, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_checkpointing=False, enable_model_summary=False, callbacks=[scores],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32))
        >>> trainer.fit(module, TextDataModule(seq_len=32, batch_size=4))
        >>> scores.last_step, sorted(scores.last_metrics)
        (4, ['eval/python_choice/acc'])
    """

    def __init__(
        self,
        tasks: list[str],
        every_n_steps: int,
        include_path: str | None = None,
        limit: float | None = None,
        num_fewshot: int | None = None,
        batch_size: int = 16,
        max_gen_toks: int = 256,
        tokenizer: str | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise UserInputError(f"DownstreamEval every_n_steps={every_n_steps} must be >= 1, e.g. 1000")
        if not tasks:
            raise UserInputError("DownstreamEval tasks=[] names no task; pass lm_eval task names")
        self.tasks, self.every_n_steps, self.include_path = list(tasks), every_n_steps, include_path
        self.limit, self.num_fewshot, self.tokenizer = limit, num_fewshot, tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.last_step = 0  # the optimizer step of the latest evaluation (saved in checkpoints)
        self.last_metrics: dict[str, float] = {}  # its scores, on rank 0
        self._tokenizer: Any = None  # the spec or Tokenizer the evaluations use, found when the fit starts

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_train.evaluation.harness import task_manager

        if stage == "fit":  # lm_eval installed and the tasks known before training, not at step N
            task_manager(self.tasks, self.include_path)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = getattr(pl_module, "model", None)
        config = getattr(model, "config", None)
        if not isinstance(model, torch.nn.Module) or not hasattr(config, "block_size"):
            raise UserInputError(
                f"DownstreamEval needs the module's network as `model` with a `config.block_size` (a GPT); "
                f"{type(pl_module).__name__} has none"
            )
        self._tokenizer = self.tokenizer or getattr(trainer.datamodule, "tokenizer", None)
        if self._tokenizer is None:
            raise UserInputError(
                "DownstreamEval found no tokenizer: the data module has no `tokenizer`; pass "
                "DownstreamEval(tokenizer=...), e.g. 'byte' or the path of a tokenizer.json"
            )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self.last_step or step % self.every_n_steps:  # once a step, accumulated batches included
            return
        self.last_step = step
        metrics = self._evaluate(trainer, pl_module)
        if trainer.is_global_zero:
            self.last_metrics = {f"eval/{name}": value for name, value in metrics.items()}
            log_metrics(trainer, self.last_metrics)

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """The tasks' scores (on rank 0; {} elsewhere), every random generator left as it was."""
        from lightning_train.evaluation.harness import run_tasks, task_metrics
        from lightning_train.evaluation.lm_eval_model import LightningTrainLM

        strategy = trainer.strategy
        sharded = strategy.generator() if hasattr(strategy, "generator") else None  # tp/pp layouts
        lm = LightningTrainLM(sharded or pl_module.model, self._tokenizer, self.batch_size, self.max_gen_toks)
        python_state, numpy_state = random.getstate(), np.random.get_state()
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                results = run_tasks(lm, self.tasks, self.include_path, self.num_fewshot, self.limit,
                                    progress=False)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        return task_metrics(results) if results is not None else {}

    # ---- checkpointing: a resumed run does not score the step it resumed at again ------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "last_metrics": self.last_metrics}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step, self.last_metrics = state_dict["last_step"], state_dict["last_metrics"]
