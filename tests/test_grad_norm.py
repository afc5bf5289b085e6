"""GradNormMonitor: logged norms against norms computed independently from the same tensors, in one
process, with DDP (2 gloo ranks through the CLI) and with FSDP2 (DTensor gradients, via torchrun)."""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_train._compat import end_distributed_process
from lightning_train.callbacks import GradNormMonitor
from lightning_train.data import TextDataModule
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules import PretrainModule
from tests.conftest import REPO, run_cli, run_torchrun
from tests.helpers.tiny_runs import TINY, FixedBatches, MemoryLogger


class RecordTensors(L.Callback):
    """Copies each step's gradients and weights (before and after the optimizer step), by name."""

    def __init__(self) -> None:
        self.grads, self.before, self.after = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        named = list(pl_module.named_parameters())
        self.grads.append({n: p.grad.detach().clone() for n, p in named})
        self.before.append({n: p.detach().clone() for n, p in named})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def group_of(name: str) -> str:
    """The default groups of GPT written out by hand (lm_head is tied to embed, so it is absent)."""
    parts = name.split(".")  # model.<top>.<...>
    if parts[1] == "blocks":
        return f"block.{parts[2]}"
    return "embeddings" if parts[1] == "embed" else "head"


def norms_by_group(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    squares: dict[str, float] = {}
    for name, t in tensors.items():
        squares[group_of(name)] = squares.get(group_of(name), 0.0) + t.double().pow(2).sum().item()
    result = {group: math.sqrt(s) for group, s in squares.items()}
    result["total"] = math.sqrt(sum(squares.values()))
    return result


@pytest.fixture(scope="module")
def clipped_run(tmp_path_factory):
    """6 optimizer steps, logging every 2, clipping at a value between the steps' norms."""
    L.seed_everything(0)
    logger, recorder, monitor = MemoryLogger(), RecordTensors(), GradNormMonitor(log_every_n_steps=2)
    trainer = L.Trainer(
        max_steps=6, accelerator="cpu", logger=logger, callbacks=[recorder, monitor], gradient_clip_val=1.02,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path_factory.mktemp("run"),
    )
    trainer.fit(PretrainModule(GPTConfig(**TINY), learning_rate=1e-2, warmup_steps=1), FixedBatches())
    return logger, recorder, monitor


def test_logged_grad_norms_equal_independent_norms_of_the_same_gradients(clipped_run):
    logger, recorder, monitor = clipped_run
    expected = [norms_by_group(recorder.grads[step]) for step in (1, 3, 5)]  # logging steps 2, 4, 6
    assert [step for step, _ in logger.rows] == [1, 3, 5]  # the rows of train/loss at those steps
    for group in ("embeddings", "block.0", "block.1", "head"):
        logged = logger.series(f"health/grad_norm/{group}")
        assert logged == pytest.approx([e[group] for e in expected], rel=1e-5)
    assert logger.series("health/grad_norm") == pytest.approx([e["total"] for e in expected], rel=1e-5)
    # The latest pre-clip total norm stays on the device for other callbacks.
    assert isinstance(monitor.last_total_norm, torch.Tensor)
    assert monitor.last_total_norm.item() == pytest.approx(expected[-1]["total"], rel=1e-5)


def test_clip_fraction_counts_the_steps_above_gradient_clip_val(clipped_run):
    logger, recorder, _ = clipped_run
    totals = [norms_by_group(grads)["total"] for grads in recorder.grads]
    clipped = [total > 1.02 for total in totals]
    assert 0 < sum(clipped) < len(clipped), f"the run should clip some steps only: {totals}"
    expected = [sum(clipped[i:i + 2]) / 2 for i in (0, 2, 4)]
    assert logger.series("health/clip_fraction") == pytest.approx(expected)


def test_update_ratio_and_param_norm_match_a_by_hand_computation(clipped_run):
    logger, recorder, _ = clipped_run
    for row, step in enumerate((1, 3, 5)):
        before, after = recorder.before[step], recorder.after[step]
        weights = norms_by_group(before)
        updates = norms_by_group({n: after[n] - before[n] for n in before})
        assert logger.series("health/param_norm")[row] == pytest.approx(weights["total"], rel=1e-5)
        for group in ("embeddings", "block.0", "block.1", "head"):
            ratio = logger.series(f"health/update_ratio/{group}")[row]
            assert ratio == pytest.approx(updates[group] / weights[group], rel=1e-4)
            assert ratio > 0


def test_groups_by_depth_or_regex_and_tied_weights_count_once():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    tokens = torch.randint(0, 258, (2, 16))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])  # shared tensors once

    by_depth = GradNormMonitor(groups=1).measure(model)
    assert list(by_depth) == ["embed", "blocks", "norm", "total"]
    blocks = torch.cat([p.grad.flatten() for p in model.blocks.parameters()]).norm()
    assert by_depth["blocks"].item() == pytest.approx(blocks.item(), rel=1e-5)

    by_regex = GradNormMonitor(groups={"attention": r"\.attn\.", "mlp": r"\.mlp\."}).measure(model)
    assert list(by_regex) == ["other", "attention", "mlp", "total"]
    mlp = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if ".mlp." in n]).norm()
    assert by_regex["mlp"].item() == pytest.approx(mlp.item(), rel=1e-5)
    for norms in (by_depth, by_regex, GradNormMonitor().measure(model)):
        assert norms["total"].item() == pytest.approx(total.item(), rel=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"groups": {"attn": "(unclosed"}}, "is not a regular expression"),
    ({"groups": 0}, "a depth must be >= 1"),
    ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
    ({"norm_type": -1.0}, "norm_type=-1.0"),
])
def test_bad_settings_are_refused_with_the_value_named(kwargs, message):
    with pytest.raises(UserInputError, match=message):
        GradNormMonitor(**kwargs)


def test_a_named_block_list_that_does_not_exist_is_refused():
    with pytest.raises(UserInputError, match="blocks='layers' is not an nn.ModuleList"):
        GradNormMonitor(blocks="layers").measure(GPT(GPTConfig(**TINY)))


def test_one_measurement_a_step_serves_clipping_the_monitor_and_nan_recovery(tmp_path, monkeypatch):
    """GradNormMonitor, NaNRecovery and gradient clipping read one fused measurement a step: the pre-clip
    total norm, which clipping scales the gradients by."""
    from lightning_train.callbacks import NaNRecovery
    from lightning_train.plugins.grad_norm import GradNorms

    passes: list[int] = []
    measure = GradNorms.of_grads
    monkeypatch.setattr(GradNorms, "of_grads", lambda self: passes.append(1) or measure(self))
    clipped: list[dict[str, torch.Tensor]] = []

    class RecordClipped(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # the gradients the step used
            clipped.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    recorder, monitor, recovery = RecordTensors(), GradNormMonitor(), NaNRecovery()
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", logger=False, gradient_clip_val=1e-3, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[recovery, recorder, RecordClipped(), monitor],
    )
    trainer.fit(PretrainModule(GPTConfig(**TINY)), FixedBatches())
    assert len(passes) == 4  # one measurement a step, however many read it
    expected = [norms_by_group(grads)["total"] for grads in recorder.grads]  # before clipping
    judged = [norm for _, _, norm in recovery.state_dict()["recent"]]
    assert judged == pytest.approx(expected, rel=1e-5)
    assert monitor.last_total_norm.item() == pytest.approx(expected[-1], rel=1e-5)
    assert [norms_by_group(grads)["total"] for grads in clipped] == pytest.approx([1e-3] * 4, rel=1e-4)


def test_scaled_gradients_are_reported(tmp_path):
    """Lightning's AMP plugin does not unscale for a fused optimizer (PretrainModule's AdamW on CPU)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", plugins=[plugin], callbacks=[GradNormMonitor()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="still multiplied by the loss scale"):
        trainer.fit(PretrainModule(GPTConfig(**TINY)), FixedBatches())


GROUPINGS = {  # GradNormMonitor's groups option -> the group of each parameter name, written out by hand
    "default": (None, group_of),
    "depth": (1, lambda name: name.split(".")[1]),
    "regex": ({"attention": r"\.attn\.", "mlp": r"\.mlp\."},
              lambda name: "attention" if ".attn." in name else "mlp" if ".mlp." in name else "other"),
}


def p_norms(tensors: dict[str, torch.Tensor], group: Callable[[str], str], p: float) -> dict[str, float]:
    """Norms per group and in total, with torch.linalg.vector_norm over the concatenated tensors."""
    members: dict[str, list[torch.Tensor]] = {}
    for name, t in tensors.items():
        members.setdefault(group(name), []).append(t.double().flatten())
    norms = {g: torch.linalg.vector_norm(torch.cat(ts), ord=p).item() for g, ts in members.items()}
    norms["total"] = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors.values()]),
                                              ord=p).item()
    return norms


@pytest.mark.parametrize("update_ratio", [True, False])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_every_norm_type_with_every_option_logs_the_independent_norms(tmp_path, norm_type, grouping,
                                                                     update_ratio):
    groups, group = GROUPINGS[grouping]
    torch.manual_seed(0)
    logger, recorder = MemoryLogger(), RecordTensors()
    monitor = GradNormMonitor(
        log_every_n_steps=1, groups=groups, norm_type=norm_type, update_ratio=update_ratio
    )
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=logger, callbacks=[recorder, monitor], gradient_clip_val=1.0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(PretrainModule(GPTConfig(**TINY), learning_rate=1e-2, warmup_steps=1), FixedBatches())
    for step in (0, 1):
        expected = p_norms(recorder.grads[step], group, norm_type)
        logged = logger.rows[step][1]
        assert logged["health/grad_norm"] == pytest.approx(expected["total"], rel=1e-5)
        for name in set(expected) - {"total"}:
            assert logged[f"health/grad_norm/{name}"] == pytest.approx(expected[name], rel=1e-5)
        assert ("health/clip_fraction" in logged) == (norm_type == 2.0)  # clipping is by the 2-norm
        assert ("health/param_norm" in logged) == update_ratio
        if update_ratio:
            before, after = recorder.before[step], recorder.after[step]
            weights = p_norms(before, group, norm_type)
            updates = p_norms({n: after[n] - before[n] for n in before}, group, norm_type)
            assert logged["health/param_norm"] == pytest.approx(weights["total"], rel=1e-5)
            for name in set(weights) - {"total"}:
                ratio = logged[f"health/update_ratio/{name}"]
                assert ratio == pytest.approx(updates[name] / weights[name], rel=1e-4)


def test_no_norm_records_an_autograd_graph(tmp_path):
    """The weights require grad: their norms (update ratio) must not be recorded for backward."""
    recorded_by_monitor = []
    monitor_file = sys.modules[GradNormMonitor.__module__].__file__

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != monitor_file:
            frame = frame.f_back
        if frame is not None:
            recorded_by_monitor.append(frame.f_lineno)
        return tensor

    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=MemoryLogger(), enable_checkpointing=False,
        callbacks=[GradNormMonitor(log_every_n_steps=1)], enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.fit(PretrainModule(GPTConfig(**TINY), warmup_steps=1), FixedBatches())
    assert recorded_by_monitor == []


def test_clip_fraction_of_an_interval_cut_by_a_resume_is_the_uninterrupted_one(tmp_path):
    """Steps 4-6 form one logging interval (norms 1.535, 1.539, 1.510: 4 and 5 clipped); a resume after step
    4 must still count step 4's clip. TextDataModule resumes exactly and ``decay_steps`` is fixed, so the
    4-step and the 6-step runs take the same steps."""
    def fit(max_steps: int, ckpt_path=None) -> tuple[L.Trainer, MemoryLogger]:
        torch.manual_seed(0)
        logger = MemoryLogger()
        trainer = L.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=logger, log_every_n_steps=3,
            callbacks=[GradNormMonitor(log_every_n_steps=3)], gradient_clip_val=1.52,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        module = PretrainModule(GPTConfig(**TINY), learning_rate=1e-2, warmup_steps=1, decay_steps=100)
        trainer.fit(module, TextDataModule(seq_len=16, batch_size=4), ckpt_path=ckpt_path, weights_only=False)
        return trainer, logger

    _, uninterrupted = fit(6)
    fraction = uninterrupted.series("health/clip_fraction")[-1]
    assert 0 < fraction < 1, "the interval should clip some of its steps only"
    stopped, _ = fit(4)
    stopped.save_checkpoint(tmp_path / "four.ckpt")
    _, resumed = fit(6, ckpt_path=tmp_path / "four.ckpt")
    assert resumed.series("health/clip_fraction") == pytest.approx([fraction])


# ---- data parallel: the same global batch gives the same norm -----------------------------------
def _cli_run(tmp_path: Path, devices: int, batch_size: int, strategy: str = "auto") -> list[float]:
    """``health/grad_norm`` of 3 steps of the CLI, logging every step."""
    root = tmp_path / f"run-{strategy}-{devices}"
    config = {
        "trainer": {
            "accelerator": "cpu", "devices": devices, "strategy": strategy, "default_root_dir": str(root),
            "max_steps": 3, "log_every_n_steps": 1, "enable_progress_bar": False,
            "callbacks": [{"class_path": "lightning_train.callbacks.GradNormMonitor"}],
        },
        "model": {"class_path": "lightning_train.PretrainModule",
                  "init_args": {"config": TINY, "learning_rate": 1e-2, "warmup_steps": 1}},
        "data": {"class_path": "tests.helpers.tiny_runs.FixedBatches",
                 "init_args": {"batch_size": batch_size}},
    }
    path = tmp_path / f"config-{strategy}-{devices}.json"
    path.write_text(json.dumps(config))
    result = run_cli("fit", "--config", str(path), cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(root / "version_0" / "metrics.csv") as f:
        return [float(row["health/grad_norm"]) for row in csv.DictReader(f) if row.get("health/grad_norm")]


@pytest.fixture(scope="module")
def single_process_norms(tmp_path_factory) -> list[float]:
    return _cli_run(tmp_path_factory.mktemp("single"), devices=1, batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "lt_fsdp"])
def test_two_ranks_log_the_norm_of_a_single_process_run(tmp_path, strategy, single_process_norms):
    """The same global batch (8 rows) in 1 process or split over 2 gloo ranks: DDP (replicated,
    averaged gradients) or this package's FSDP2 strategy (DTensor gradient shards)."""
    single = single_process_norms
    parallel = _cli_run(tmp_path, devices=2, batch_size=4, strategy=strategy)
    assert len(single) == len(parallel) == 3
    assert parallel == pytest.approx(single, rel=1e-5)


# ---- FSDP2: DTensor gradients, all-reduced sums of squares --------------------------------------
def _fsdp_worker(out_dir: str) -> None:
    """Run by torchrun on 2 gloo ranks: the monitor's norms of FSDP2-sharded gradients against the norms
    of an unsharded copy trained on the whole batch."""
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    sharded = copy.deepcopy(model)
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    tokens = torch.randint(0, 258, (4, 17))

    def loss(net: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
        logits = net(rows[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())

    loss(model, tokens).backward()
    loss(sharded, tokens[rank::2]).backward()  # FSDP2 averages the two halves' gradients
    monitor = GradNormMonitor()
    measured = {name: norm.item() for name, norm in monitor.measure(sharded).items()}
    reference = {name: norm.item() for name, norm in GradNormMonitor().measure(model).items()}
    placements = {str(p.grad.placements) for p in sharded.parameters()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"measured": measured, "reference": reference, "placements": sorted(placements)}
    ))
    torch.distributed.barrier()  # no rank tears gloo down while the other is still in a collective
    end_distributed_process(0)  # not interpreter finalisation, which can abort a finished gloo rank


@pytest.mark.slow
def test_fsdp2_sharded_gradients_give_the_full_norm_on_every_rank(tmp_path):
    result = run_torchrun(2, "-m", "tests.test_grad_norm", str(tmp_path), cwd=REPO, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["placements"] == ["(Shard(dim=0),)"]  # the gradients really were sharded
    assert ranks[0]["measured"] == ranks[1]["measured"]  # identical on every rank
    assert set(ranks[0]["measured"]) == {"embeddings", "block.0", "block.1", "head", "total"}
    for name, value in ranks[0]["reference"].items():
        assert ranks[0]["measured"][name] == pytest.approx(value, rel=1e-5), name


if __name__ == "__main__":  # the FSDP2 worker, started by torchrun
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _fsdp_worker(sys.argv[1])
