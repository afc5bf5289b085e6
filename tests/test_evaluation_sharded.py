"""lm-evaluation-harness in the training layout (issue 36, part 3): a checkpoint laid out by tensor or
pipeline parallelism on 2 gloo ranks answers every request of the local tasks (tests/helpers/lm_eval_tasks)
as one process does: the same log-likelihoods, greedy flags and generated text, on each rank; the
``evaluate`` tool does so under torchrun, rank 0 alone printing and writing, and refuses bad launches in one
line."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import lm_eval
import pytest
import torch

from lightning_train.checkpoint import save_safetensors
from lightning_train.evaluation import LightningTrainLM, task_metrics
from lightning_train.evaluation.harness import task_manager
from lightning_train.models.gpt import GPT, GPTConfig
from tests.conftest import REPO, run_cli_in_process, run_torchrun
from tests.helpers.lm_eval_tasks import TASKS, write_tasks

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}  # (tensor_parallel, pipeline_parallel) on 2 ranks
# init_std 0.4: logits far enough apart that greedy choices are not near-ties a changed sum order could flip
CONFIG = GPTConfig(vocab_size=258, block_size=64, n_layer=2, n_head=2, n_embd=32, init_std=0.4)
DOCUMENTS = {"tiny_choice": 6, "tiny_rolling": 3, "tiny_generate": 4}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model's safetensors folder and the three tasks."""
    folder = tmp_path_factory.mktemp("evaluation-sharded")
    torch.manual_seed(0)
    save_safetensors(GPT(CONFIG), folder / "model")
    write_tasks(folder / "tasks")
    return folder


def answers(lm: LightningTrainLM, tasks: Path) -> dict:
    """lm_eval's metrics and, per task, each document's answers in document order (JSON: tuples as lists)."""
    results = lm_eval.simple_evaluate(
        model=lm, tasks=TASKS, task_manager=task_manager(TASKS, str(tasks)), bootstrap_iters=0,
        log_samples=True,
    )
    samples = {task: [sample["resps"] for sample in sorted(found, key=lambda sample: sample["doc_id"])]
               for task, found in results["samples"].items()}
    return json.loads(json.dumps({"metrics": task_metrics(results), "samples": samples}))


def _worker(work: str, out_dir: str) -> None:
    """Run by torchrun on 2 gloo ranks: each layout's answers, from this rank."""
    from lightning_train.checkpoint.pretrained import open_pretrained
    from lightning_train.strategies.generation import shard_for_generation

    torch.distributed.init_process_group("gloo")
    os.environ["LOCAL_RANK"] = "0"  # lm_eval returns results on local rank 0 alone: here, every rank's
    model = open_pretrained(str(Path(work, "model"))).build().eval()
    report = {}
    for name, (tp, pp) in LAYOUTS.items():
        lm = LightningTrainLM(shard_for_generation(copy.deepcopy(model), tp, pp), "byte", batch_size=4)
        report[name] = answers(lm, Path(work, "tasks"))
    Path(out_dir, f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_every_rank_of_each_layout_answers_as_one_process(work, tmp_path):
    """Per request: log-likelihoods within 1e-5 (relative: sums over up to 63 tokens whose tensor-parallel
    sums run in another order), the same greedy flags and the same generated text; every rank scored every
    document (lm_eval split none over the model's ranks)."""
    done = run_torchrun(2, "-m", "tests.test_evaluation_sharded", str(work), str(tmp_path), cwd=REPO,
                        timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.manual_seed(0)
    reference = answers(LightningTrainLM.from_checkpoint(str(work / "model"), "byte", 4, device="cpu"),
                        work / "tasks")
    assert {task: len(found) for task, found in reference["samples"].items()} == DOCUMENTS
    generated = [resps[0][0] for resps in reference["samples"]["tiny_generate"]]
    assert any(generated)  # something before the stop string
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in LAYOUTS:
            mine = report[name]
            assert mine["metrics"] == pytest.approx(reference["metrics"], rel=1e-5), (rank, name)
            assert mine["samples"]["tiny_generate"] == reference["samples"]["tiny_generate"], (rank, name)
            for task in ("tiny_choice", "tiny_rolling"):
                for got, want in zip(mine["samples"][task], reference["samples"][task], strict=True):
                    assert _numbers(got) == pytest.approx(_numbers(want), rel=1e-5), (rank, name, task)
                    assert _flags(got) == _flags(want), (rank, name, task)


def _numbers(resps: list) -> list[float]:
    """A document's log-likelihoods: one per request, ``[log-likelihood, greedy]`` or a rolling total."""
    return [answer[0] if isinstance(answer, list) else answer for (answer,) in resps]


def _flags(resps: list) -> list[bool]:
    return [answer[1] for (answer,) in resps if isinstance(answer, list)]


@pytest.mark.slow
def test_evaluate_tool_runs_pipeline_parallel_under_torchrun(work, tmp_path):
    """`evaluate --pipeline_parallel 2` on 2 torchrun ranks writes the one-process results; rank 0 alone
    prints the table and writes results.json."""
    args = ("evaluate", "--checkpoint", str(work / "model"), "--tokenizer", "byte", "--tasks",
            ",".join(TASKS), "--include_path", str(work / "tasks"), "--batch_size", "4",
            "--bootstrap_iters", "0")
    single = run_cli_in_process(*args, "--output", "single", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    sharded = run_torchrun(2, "-m", "lightning_train", *args, "--output", "sharded", "--pipeline_parallel",
                           "2", cwd=tmp_path, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert sharded.stdout.count("|tiny_choice  |") == 1 and sharded.stdout.count("wrote ") == 1
    expected, written = (json.loads((tmp_path / folder / "results.json").read_text())
                         for folder in ("single", "sharded"))
    assert set(task_metrics(written)) == set(task_metrics(expected))
    assert task_metrics(written) == pytest.approx(task_metrics(expected), rel=1e-5)


def test_evaluate_refuses_bad_layouts_in_one_line(work, tmp_path, monkeypatch):
    """Sizes below 1; a layout outside torchrun; torchrun ranks other than the layout's (replicas would
    each score every document); --device with a layout (each rank takes its own)."""
    args = ("evaluate", "--checkpoint", str(work / "model"), "--tokenizer", "byte", "--tasks", "tiny_choice",
            "--include_path", str(work / "tasks"))

    def refusal(*extra: str) -> str:
        done = run_cli_in_process(*args, *extra, cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
        return done.stderr.strip()

    assert refusal("--tensor_parallel", "0") == (
        "error: --tensor_parallel 0 --pipeline_parallel 1: use ints >= 1")
    assert refusal("--tensor_parallel", "2") == (
        "error: --tensor_parallel 2 --pipeline_parallel 1 runs on 2 ranks; start it with torchrun "
        "--nproc_per_node=2 -m lightning_train evaluate ...")
    assert refusal("--pipeline_parallel", "2", "--device", "cpu").startswith(
        "error: --device cpu is one process's device; the ranks of --tensor_parallel 1 --pipeline_parallel 2 "
        "take their own")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert refusal("--tensor_parallel", "2") == (
        "error: --tensor_parallel 2 --pipeline_parallel 1 evaluates on exactly 2 ranks, and torchrun started "
        "4; use --nproc_per_node=2 (documents are not split over replicas)")


if __name__ == "__main__":  # the worker, started by torchrun
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(sys.argv[1], sys.argv[2])
