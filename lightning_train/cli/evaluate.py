"""``python -m lightning_train evaluate``: score a checkpoint on lm-evaluation-harness tasks with lm_eval's
own evaluator, print lm_eval's table and, with ``--output``, write the results as JSON. With
``--tensor_parallel``/``--pipeline_parallel`` under torchrun, the model runs laid out over the ranks as it
trains; every rank scores every document, rank 0 prints and writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_train.cli._layout import check_layout_sizes
from lightning_train.cli._parsers import parse_tool_args
from lightning_train.errors import UserInputError
from lightning_train.output_folder import check_apart, check_replaceable, publish, staged

RESULTS_FILE = "results.json"
WRITTEN_BY = "lightning_train evaluate"  # in every results.json written here: what --overwrite replaces


def evaluate(
    checkpoint: str,
    tasks: str | list[str],
    include_path: str | None = None,
    output: str | None = None,
    overwrite: bool = False,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 16,
    max_gen_toks: int = 256,
    bootstrap_iters: int = 100000,
    tokenizer: str | None = None,
    device: str | None = None,
    seed: int = 1234,
    allow_pickle: bool = True,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> dict[str, Any]:
    """Score a checkpoint on lm_eval tasks (lm_eval's evaluator, our model class); returns lm_eval's results.

    Args:
        checkpoint: a .ckpt of this package, a sharded checkpoint folder (read whole by every process),
            a .safetensors file or export folder, or a Hugging Face model folder.
        tasks: lm_eval task names, e.g. --tasks hellaswag,arc_easy or --tasks '[hellaswag, arc_easy]', or
            paths of task YAML files.
        include_path: a folder of task YAML files of your own (lm_eval's --include_path); when it holds
            every task named, lm_eval's own tasks are not indexed (seconds saved).
        output: a folder to write results.json in: created, or empty, or one this tool wrote (with
            --overwrite true); never the checkpoint's or the tasks' folder, or one around them.
        overwrite: replace the results.json of an earlier evaluate in --output.
        num_fewshot: examples in each prompt; default: each task's own.
        limit: score only the first N documents of each task (a fraction when below 1), for a quick look.
        batch_size: requests scored together.
        max_gen_toks: the longest generation of a task that sets none (lm_eval's default, 256).
        bootstrap_iters: lm_eval's resamples for standard errors that need them (0: none; faster).
        tokenizer: "byte" or a tokenizer.json path; None: the checkpoint's.
        device: e.g. cpu or cuda:0; default: the GPU if there is one (a sharded run: each rank's own).
        seed: lm_eval's seeds (few-shot sampling, sampled generation).
        allow_pickle: read pickle-format checkpoints (with torch.load(weights_only=True)).
        tensor_parallel: split each layer over this many ranks, as ParallelStrategy does (under torchrun).
        pipeline_parallel: split the blocks into this many stages, one a rank (under torchrun); the ranks
            are exactly tensor_parallel x pipeline_parallel.

    Returns:
        lm_eval's results (the dict simple_evaluate returns); {} on the other ranks of a sharded run.
    """
    given = [tasks] if isinstance(tasks, str) else tasks
    names = [part.strip() for task in given for part in task.split(",") if part.strip()]
    target = Path(output) if output is not None else None
    earlier = False
    if target is not None:
        inputs = [("the checkpoint being evaluated", checkpoint)] + (
            [("the tasks' folder", include_path)] if include_path else []
        )
        check_apart(target, "--output", inputs, "choose another folder")
        earlier = check_replaceable(target, "--output", overwrite, "a folder evaluate wrote", _written_here)
    if batch_size < 1 or max_gen_toks < 1:
        raise UserInputError(f"--batch_size {batch_size} --max_gen_toks {max_gen_toks}: use ints >= 1")
    if limit is not None and limit <= 0:
        raise UserInputError(f"--limit {limit} must be > 0: a number of documents, or a fraction below 1")
    check_layout_sizes(tensor_parallel, pipeline_parallel)
    # here, not at the top: `evaluate --help` answers without importing torch or lm_eval
    from lightning_train.evaluation.harness import require_lm_eval, run_tasks, task_manager

    require_lm_eval()
    task_manager(names, include_path)  # unknown tasks are refused before the weights are read
    from lightning_train.evaluation.lm_eval_model import LightningTrainLM

    lm = LightningTrainLM.from_checkpoint(
        checkpoint, tokenizer, batch_size, max_gen_toks, device=device, allow_pickle=allow_pickle,
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
    )
    results = run_tasks(lm, names, include_path, num_fewshot, limit, bootstrap_iters, seed) or {}
    if target is not None and _first_rank():
        _write(results, target, earlier)
    return results


def _written_here(folder: Path) -> bool:
    try:
        return json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8")).get("written_by") == WRITTEN_BY
    except (OSError, ValueError, AttributeError):
        return False


def _write(results: dict[str, Any], target: Path, replace: bool) -> None:
    from lm_eval.utils import handle_non_serializable

    text = json.dumps({"written_by": WRITTEN_BY, **results}, indent=2, default=handle_non_serializable)
    with staged(target, "choose an --output this user can create, on a disk with room for it") as tmp:
        (tmp / RESULTS_FILE).write_text(text + "\n", encoding="utf-8")
        publish(tmp, target, replace=replace)


def _first_rank() -> bool:
    """Whether this process prints and writes: the only one, or torchrun's rank 0."""
    return int(os.environ.get("RANK", 0)) == 0


def main(args: list[str]) -> None:
    options = parse_tool_args(evaluate, args, "evaluate")
    results = evaluate(**options)
    if not _first_rank():  # lm_eval returns the results on (local) rank 0
        return
    from lm_eval.utils import make_table

    print(make_table(results), end="")
    if "groups" in results:
        print(make_table(results, "groups"), end="")
    if options["output"] is not None:
        print(f"wrote {Path(options['output']) / RESULTS_FILE}")
