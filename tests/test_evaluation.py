"""lm-evaluation-harness (issue 36, parts 3 and 4): our model class scores a checkpoint as lm_eval's own HF
backend scores its export, on local tasks of each request type; the ``evaluate`` tool writes lm_eval's
results; ``DownstreamEval`` logs ``eval/<task>/<metric>`` during a fit, the same scores as the checkpoint's,
with every rank taking part in the layout it trains in (DDP, FSDP, tensor and pipeline parallelism)."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import lightning as L
import lm_eval
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_train import GPTConfig, PretrainModule, TextDataModule, UserInputError
from lightning_train.callbacks import DownstreamEval
from lightning_train.checkpoint import export
from lightning_train.evaluation import LightningTrainLM, run_tasks, task_metrics
from lightning_train.evaluation.harness import task_manager
from tests.conftest import REPO, run_cli, run_cli_in_process
from tests.helpers.ft_runs import sharded_two_rank_checkpoint
from tests.helpers.lm_eval_tasks import TASKS, write_tasks
from tests.test_startup import HEAVY, imported

# vocab_size 258 is the byte tokenizer's own: no padded rows, which lm_eval's HF backend would let greedy
# decoding pick (ours never draws them)
CONFIG = GPTConfig(vocab_size=258, block_size=64, n_layer=2, n_head=2, n_embd=32)


def trainer(**kwargs) -> L.Trainer:
    options = {"accelerator": "cpu", "limit_val_batches": 0, "logger": False, "enable_progress_bar": False,
               "enable_checkpointing": False, "enable_model_summary": False, **kwargs}
    return L.Trainer(**options)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of 30 training steps (it writes Python a little), its Hugging Face export, the tasks."""
    folder = tmp_path_factory.mktemp("evaluation")
    L.seed_everything(0)
    fit = trainer(max_steps=30)
    module = PretrainModule(CONFIG, learning_rate=3e-3, warmup_steps=2)
    fit.fit(module, TextDataModule(seq_len=64, batch_size=8))
    fit.save_checkpoint(folder / "last.ckpt")
    export(str(folder / "last.ckpt"), str(folder / "hf"))
    write_tasks(folder / "tasks")
    return folder


@pytest.fixture(scope="module")
def ours(work: Path) -> dict:
    """lm_eval's evaluator on our class, by its registry name and model_args, as lm_eval's CLI makes it."""
    return lm_eval.simple_evaluate(
        model="lightning_train", model_args=f"checkpoint={work / 'last.ckpt'}", batch_size=4, tasks=TASKS,
        task_manager=task_manager(TASKS, str(work / "tasks")), bootstrap_iters=0, log_samples=True,
    )


def by_document(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def log_likelihoods(sample: dict) -> list[float]:
    """A sample's answers: one per request, each ``(log-likelihood, greedy)`` or a rolling log-likelihood."""
    return [answer[0] if isinstance(answer, tuple) else answer for (answer,) in sample["resps"]]


def greedy(sample: dict) -> list[bool]:
    return [answer[1] for (answer,) in sample["resps"] if isinstance(answer, tuple)]


def test_scores_equal_lm_evals_hf_backend_on_the_export(work, ours):
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={work / 'hf'},dtype=float32", batch_size=1, device="cpu",
        tasks=TASKS, task_manager=task_manager(TASKS, str(work / "tasks")), bootstrap_iters=0,
        log_samples=True,
    )
    assert set(task_metrics(ours)) == {
        "tiny_choice/acc", "tiny_choice/acc_norm", "tiny_rolling/word_perplexity",
        "tiny_rolling/byte_perplexity", "tiny_rolling/bits_per_byte", "tiny_generate/exact_match",
    }
    assert task_metrics(ours) == pytest.approx(task_metrics(theirs), rel=1e-5)
    # each request's answer, not only the averages: log-likelihoods (batched with right padding here, one
    # at a time there), whether greedy decoding gives the continuation, and the generated text
    for task in ("tiny_choice", "tiny_rolling"):
        for mine, hf in zip(by_document(ours, task), by_document(theirs, task), strict=True):
            assert mine["arguments"] == hf["arguments"]
            assert log_likelihoods(mine) == pytest.approx(log_likelihoods(hf), abs=1e-4)
            assert greedy(mine) == greedy(hf)
    generated = [(mine["filtered_resps"], hf["filtered_resps"]) for mine, hf in
                 zip(by_document(ours, "tiny_generate"), by_document(theirs, "tiny_generate"), strict=True)]
    assert [mine for mine, _ in generated] == [hf for _, hf in generated]
    assert all(text[0] for text, _ in generated)  # something before a stop string (30 steps: indentation)


def test_evaluate_tool_writes_lm_evals_results(work, ours, tmp_path):
    args = ("evaluate", "--checkpoint", str(work / "last.ckpt"), "--tasks", ",".join(TASKS),
            "--include_path", str(work / "tasks"), "--batch_size", "4", "--bootstrap_iters", "0")
    done = run_cli_in_process(*args, "--output", "scores", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / "scores" / "results.json").read_text())
    assert written["results"] == ours["results"]
    assert "|tiny_choice  |" in done.stdout and f"wrote {Path('scores') / 'results.json'}" in done.stdout
    again = run_cli_in_process(*args, "--output", "scores", cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.startswith("error: --output scores already exists and is not empty (it is a folder "
                                   "evaluate wrote); pass --overwrite true")
    into_input = run_cli_in_process(*args, "--output", str(work / "tasks"), cwd=tmp_path)
    assert into_input.returncode == 2 and "is the tasks' folder; choose another folder" in into_input.stderr
    assert json.loads((tmp_path / "scores" / "results.json").read_text()) == written


def test_evaluate_refuses_bad_options_in_one_line(work, tmp_path):
    bad = run_cli_in_process("evaluate", "--checkpoint", str(work / "last.ckpt"), "--tasks", "tiny_choice",
                             "--batch_size", "0", cwd=tmp_path)
    assert (bad.returncode, bad.stderr) == (2, "error: --batch_size 0 --max_gen_toks 256: use ints >= 1\n")
    with pytest.raises(UserInputError, match=r"model_args \['bogus', 'checkpoint'\]: unknown \['bogus'\]; "):
        LightningTrainLM.create_from_arg_string(f"checkpoint={work / 'last.ckpt'},bogus=1")
    with pytest.raises(UserInputError, match=r"model_args \['batch_size'\]: no checkpoint; pass "):
        LightningTrainLM.create_from_arg_string("batch_size=2")
    with pytest.raises(UserInputError, match=r"generation_kwargs \['num_beams'\] are not supported"):
        LightningTrainLM.from_checkpoint(str(work / "last.ckpt"))._generation_options({"num_beams": 4})
    with pytest.raises(UserInputError, match="max_gen_toks=64 leaves no room for a context"):
        LightningTrainLM.from_checkpoint(str(work / "last.ckpt"))._generation_options({"max_gen_toks": 64})


def test_evaluate_help_imports_not_even_torch(tmp_path):
    assert imported(["evaluate", "--help"], tmp_path, (*HEAVY, "torch", "lm_eval")) == []


def test_evaluate_runs_without_lightning_or_torchmetrics(work):
    """(lm_eval imports transformers itself, to record its version in the results.)"""
    args = ["evaluate", "--checkpoint", str(work / "last.ckpt"), "--tasks", "tiny_choice", "--include_path",
            str(work / "tasks"), "--bootstrap_iters", "0"]
    assert imported(args, work, ("lightning", "torchmetrics", "lm_eval")) == ["lm_eval"]


def logged(folder: Path) -> dict[int, dict[str, float]]:
    """metrics.csv's ``eval/*`` values by step."""
    with open(folder / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    return {int(row["step"]): {k: float(v) for k, v in row.items() if k.startswith("eval/") and v}
            for row in rows if any(k.startswith("eval/") and v for k, v in row.items())}


def test_callback_logs_the_tasks_scores_during_a_fit(work, tmp_path):
    """Scores at steps 2 and 4, those of step 4 the final model's; training itself is unchanged (with
    dropout, which draws from torch's generator, which lm_eval seeds)."""
    config = dataclasses.replace(CONFIG, dropout=0.1)

    def fit(callbacks: list) -> PretrainModule:
        L.seed_everything(0)
        module = PretrainModule(config, warmup_steps=1)
        trainer(max_steps=4, logger=CSVLogger(tmp_path, name="", version=len(callbacks)), log_every_n_steps=1,
                callbacks=callbacks).fit(module, TextDataModule(seq_len=64, batch_size=4))
        return module

    scores = DownstreamEval(TASKS, every_n_steps=2, include_path=str(work / "tasks"), batch_size=4)
    module = fit([scores])
    values = logged(tmp_path / "version_1")
    assert sorted(values) == [1, 3]  # Lightning's CSV rows count from 0: optimizer steps 2 and 4
    final = task_metrics(run_tasks(LightningTrainLM(module.model, "byte"), TASKS, str(work / "tasks")))
    assert values[3] == pytest.approx({f"eval/{name}": value for name, value in final.items()}, rel=1e-6)
    assert scores.state_dict() == {"last_step": 4, "last_metrics": values[3]}
    alone = fit([])
    for mine, plain in zip(module.state_dict().values(), alone.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, plain, rtol=0, atol=0)


def test_callback_without_a_tokenizer_is_refused_when_the_fit_starts():
    module = PretrainModule(CONFIG)
    module.configure_model()
    with pytest.raises(UserInputError, match=r"found no tokenizer: the data module has no `tokenizer`; pass "
                                             r"DownstreamEval\(tokenizer=...\)"):
        DownstreamEval(["tiny_choice"], every_n_steps=1).on_fit_start(trainer(), module)


PARALLEL = "--trainer.strategy=lightning_train.strategies.ParallelStrategy"
LAYOUTS = {  # strategy flags: each rank's share of the documents (ddp), or every rank every request
    "ddp": ["--trainer.strategy=ddp"],
    "fsdp": ["--trainer.strategy=lt_fsdp"],
    "tp2": [PARALLEL, "--trainer.strategy.tensor_parallel=2"],
    "pp2": [PARALLEL, "--trainer.strategy.pipeline_parallel=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_callback_scores_in_the_layout_it_trains_in(work, tmp_path, layout):
    """Two ranks score the tasks during the fit: under DDP each its half of the documents, under FSDP, tp and
    pp the model split over both, every request on both; rank 0 logs the scores of the run's last
    checkpoint scored in one process."""
    tasks = ",".join(TASKS)
    done = run_cli(
        "fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"),
        f"--trainer.default_root_dir={tmp_path}/run",
        "--model.init_args.config.n_layer=2", "--model.init_args.config.n_embd=32",
        "--model.init_args.config.n_head=2", "--model.init_args.config.block_size=64",
        "--model.init_args.config.vocab_size=258", "--data.init_args.seq_len=64",
        "--data.init_args.batch_size=4",
        "--trainer.max_steps=4", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--model.init_args.warmup_steps=1",
        "--trainer.accelerator=cpu", "--trainer.devices=2", *LAYOUTS[layout],
        "--trainer.callbacks+=lightning_train.callbacks.DownstreamEval",
        f"--trainer.callbacks.tasks=[{tasks}]",
        "--trainer.callbacks.every_n_steps=4", f"--trainer.callbacks.include_path={work / 'tasks'}",
        "--trainer.callbacks.batch_size=4", cwd=tmp_path, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in ("fatal: not a git repository", "Tokenizing inputs", "[Task: ", "Generating test split"):
        assert noise not in done.stderr + done.stdout, noise  # lm_eval's console stays off the run's
    run = tmp_path / "run"
    values = logged(next(run.glob("version_*")))
    final = LightningTrainLM.from_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    expected = {f"eval/{name}": value for name, value in task_metrics(
        run_tasks(final, TASKS, str(work / "tasks"))).items()}
    assert list(values.values()) == [pytest.approx(expected, rel=1e-5)]


@pytest.mark.slow
def test_a_sharded_checkpoint_scores_as_its_export_does_in_hf(work, tmp_path):
    """An FSDP run's sharded folder, read whole into the one process of ``evaluate``, scores what lm_eval's
    HF backend scores on the folder ``export`` writes of it."""
    config = {"vocab_size": 258, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}
    folder = sharded_two_rank_checkpoint(tmp_path, config, max_steps=3)
    export(str(folder), str(tmp_path / "hf"))
    done = run_cli_in_process("evaluate", "--checkpoint", str(folder), "--tasks", ",".join(TASKS),
                              "--include_path", str(work / "tasks"), "--bootstrap_iters", "0",
                              "--output", "scores", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = json.loads((tmp_path / "scores" / "results.json").read_text())
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", batch_size=1, device="cpu",
        tasks=TASKS, task_manager=task_manager(TASKS, str(work / "tasks")), bootstrap_iters=0,
    )
    assert task_metrics(ours) == pytest.approx(task_metrics(theirs), rel=1e-5)
