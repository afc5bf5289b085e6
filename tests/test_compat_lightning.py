"""Tests of ``lightning_train._compat.lightning_api``, one a function, against the installed Lightning:
an upgrade that renames or changes one of its private names fails the test named after it."""

from __future__ import annotations

import copy
import copyreg
import socket
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import WandbLogger
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from lightning_train import _compat
from lightning_train.plugins import AmpPrecision
from lightning_train.strategies import DataParallelStrategy

QUIET = dict(
    accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False
)



def test_save_model_checkpoint_now(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(tmp_path, monitor="step", mode="max", save_top_k=1, save_last=True)

    class SaveAtStep2(L.Callback):
        saved: list[str] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                _compat.save_model_checkpoint_now(checkpoint, trainer)
                self.saved = sorted(p.name for p in tmp_path.iterdir())

    saver = SaveAtStep2()
    trainer = L.Trainer(**{**QUIET, "enable_checkpointing": True}, max_steps=3, callbacks=[saver, checkpoint])
    trainer.fit(BoringModel())
    assert saver.saved == ["epoch=0-step=2.ckpt", "last.ckpt"]  # top-k and last, at that step



def test_logging_as_hook():
    """``self.log`` inside the context is keyed as the named hook's, and the current hook comes back after."""
    keys: list[str] = []

    class Logs(BoringModel):
        def on_train_batch_end(self, *args: Any) -> None:
            with _compat.logging_as_hook(self, "training_step"):
                self.log("from_batch_end", 1.0)
            assert self._current_fx_name == "on_train_batch_end"
            keys.extend(self.trainer._results)  # noqa: SLF001 - Lightning's logged values, keyed by hook

    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(Logs())
    assert "training_step.from_batch_end" in keys, keys


# ---- Lightning: Trainer and loops (one real fit, observed from a callback) --------------------------------
class _Observer(L.Callback):
    def __init__(self, bar: TQDMProgressBar) -> None:
        self.bar, self.seen = bar, {"hooks": 0, "stepped": [], "fetchers": [], "bars": [], "grad_norms": []}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen["trainer"] = _compat.attached_trainer(pl_module)
        self.seen["bars"].append(_compat.has_train_progress_bar(self.bar))
        trainer.optimizers[0].register_step_pre_hook(self._record_grad_norm)  # after clipping

    def _record_grad_norm(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        grads = [p.grad.flatten() for group in optimizer.param_groups for p in group["params"]]
        self.seen["grad_norms"].append(torch.linalg.vector_norm(torch.cat(grads)).item())

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen["stepped"].append(_compat.batches_that_stepped(trainer))
        self.seen["fetchers"].append(_compat.data_fetcher(trainer))
        self.seen.setdefault("fetcher_done", []).append(_compat.data_fetcher(trainer).done)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.seen["hooks"] += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.seen["bars"].append(_compat.has_train_progress_bar(self.bar))


@pytest.fixture(scope="module")
def fit_seen() -> dict[str, Any]:
    """What a 3-step fit under AmpPrecision (16-mixed, clipping to 1e-3) showed its callback."""
    bar = TQDMProgressBar()
    observer = _Observer(bar)
    model = BoringModel()
    plugin = AmpPrecision("16-mixed", "cpu", init_scale=2.0)  # a small scale: no overflow, every step taken
    trainer = L.Trainer(**QUIET, max_steps=3, plugins=[plugin], gradient_clip_val=1e-3,
                        callbacks=[bar, observer], limit_val_batches=0)
    trainer.fit(model)
    return {**observer.seen, "fit_trainer": trainer, "model": model}


def test_batches_that_stepped(fit_seen):
    assert fit_seen["stepped"] == [0, 1, 2]  # the step Lightning logs each batch's metrics at


def test_set_batches_that_stepped():
    class Shift(L.Callback):  # moves Lightning's logging counter ahead, as a restart can
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                _compat.set_batches_that_stepped(trainer, 5)
            seen.append(_compat.batches_that_stepped(trainer))

    seen: list[int] = []
    trainer = L.Trainer(**QUIET, max_steps=3, callbacks=[Shift()], limit_val_batches=0)
    trainer.fit(BoringModel())
    assert seen == [0, 5, 6]  # the counter was set, and Lightning counts on from it


class _DropSecondBatch(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            next(_compat.data_fetcher(trainer))  # as NaNRecovery's rollback passes over a batch


def test_data_fetcher(fit_seen):
    fetchers = fit_seen["fetchers"]
    assert all(f is fetchers[0] for f in fetchers) and fit_seen["fetcher_done"] == [False] * 3
    trainer = L.Trainer(**QUIET, max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                        enable_progress_bar=False, callbacks=[_DropSecondBatch()])
    trainer.fit(BoringModel())
    assert trainer.global_step == 3  # of the epoch's 4 batches, the one drawn by the callback was not trained


class _DrawsItsOwnBatches(BoringModel):
    def training_step(self, dataloader_iter: Any) -> Any:
        self.kinds = getattr(self, "kinds", []) + [
            _compat.fetcher_hands_out_iterator(_compat.data_fetcher(self.trainer))
        ]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


def test_fetcher_hands_out_iterator(fit_seen):
    assert not _compat.fetcher_hands_out_iterator(fit_seen["fetchers"][0])
    model = _DrawsItsOwnBatches()
    L.Trainer(**QUIET, max_steps=2, limit_val_batches=0, enable_progress_bar=False).fit(model)
    assert model.kinds == [True, True]


class _RestateAfterFirstBatch(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            _compat.restate_epoch_batches(trainer, 3)


def test_restate_epoch_batches():
    trainer = L.Trainer(**QUIET, max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                        enable_progress_bar=False, callbacks=[_RestateAfterFirstBatch()])
    trainer.fit(BoringModel())
    assert trainer.global_step == 2  # batch 1, then the count says 3 done: one more ends the epoch of 4


def test_attached_trainer(fit_seen):
    assert fit_seen["trainer"] is fit_seen["fit_trainer"]
    assert _compat.attached_trainer(BoringModel()) is None
    assert _compat.attached_trainer(object()) is None


def test_after_closure(fit_seen):
    # AmpPrecision runs the hooks and the clipping through after_closure: both happened on every step
    assert fit_seen["hooks"] == 3
    assert len(fit_seen["grad_norms"]) == 3 and max(fit_seen["grad_norms"]) <= 1e-3 * 1.01


def test_has_train_progress_bar(fit_seen):
    assert fit_seen["bars"] == [False, True, True, True]


# ---- Lightning: strategies -----------------------------------------------------------------------------
@pytest.fixture
def strategy(monkeypatch):
    """DataParallelStrategy as a one-device CPU Trainer sets it up; its process group ends with the test."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    trainer = L.Trainer(**QUIET, strategy=DataParallelStrategy("ddp"))
    yield trainer.strategy
    if dist.is_initialized():
        dist.destroy_process_group()


def test_setup_distributed(strategy):
    assert not dist.is_initialized()
    _compat.setup_distributed(strategy)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"


def test_subprocess_launcher(strategy):
    launcher = _compat.subprocess_launcher(strategy)
    assert (launcher.num_processes, launcher.num_nodes) == (1, 1) and not launcher.is_interactive_compatible


def test_reduce_tensor(strategy):
    _compat.setup_distributed(strategy)
    assert _compat.reduce_tensor(torch.tensor([2.0, 5.0]), reduce_op="mean").tolist() == [2.0, 5.0]
    assert _compat.reduce_tensor(torch.tensor(3), reduce_op="sum").item() == 3  # one rank: itself


def test_set_device_mesh(strategy):
    _compat.setup_distributed(strategy)
    module = BoringModel()
    strategy.connect(module)
    mesh = init_device_mesh("cpu", (1,))
    _compat.set_device_mesh(strategy, mesh)
    assert strategy.device_mesh is mesh and module.device_mesh is mesh


def test_optimizers_to_device():
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.ones(2)
    optimizer.step()
    _compat.optimizers_to_device([optimizer], torch.device("meta"))
    assert optimizer.state[weight]["exp_avg"].device.type == "meta"


def test_sync_module_states(process_group):
    module = nn.Linear(2, 2)
    before = copy.deepcopy(module.state_dict())
    _compat.sync_module_states(module)  # one rank: rank 0's values stay
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


class _LogsValLoss(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.log("val_loss", loss)
        return loss


def test_ddp_sharding_validates(monkeypatch):
    """Regression: validate/test with sharding='ddp' synchronise the unwrapped module through Lightning's
    ``_sync_module_states`` (it failed with an ImportError: the function is not in lightning.fabric)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(free.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    trainer = L.Trainer(**QUIET, strategy="lt_ddp", enable_progress_bar=False)
    try:
        data = DataLoader(RandomDataset(32, 8), batch_size=4)
        metrics = trainer.validate(_LogsValLoss(), data, verbose=False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert list(metrics[0]) == ["val_loss"] and metrics[0]["val_loss"] > 0


# ---- Lightning: checkpoints and loggers ------------------------------------------------------------------
def test_path_like():
    assert _compat.PathLike == str | Path


def test_metadata_filename():
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert _compat.METADATA_FILENAME == "meta.pt"  # the name in every sharded checkpoint already on disk
    assert _compat.METADATA_FILENAME == _METADATA_FILENAME  # and the one Lightning's loaders look for


def test_torch_layout_global():
    reducer, args = copyreg.dispatch_table[torch.layout](torch.sparse_coo)
    assert (reducer.__module__, reducer.__name__) == _compat.TORCH_LAYOUT_GLOBAL
    assert reducer(*args) is torch.sparse_coo


def test_add_prefix():
    assert _compat.add_prefix({"loss": 1.0}, "train", "-") == {"train-loss": 1.0}
    assert _compat.add_prefix({"loss": 1.0}, "", "-") == {"loss": 1.0}


@pytest.fixture
def wandb_logger(tmp_path) -> WandbLogger:
    return WandbLogger(
        project="proj", name="run", save_dir=str(tmp_path), offline=True, prefix="pre", group="g"
    )


def test_logger_prefix(wandb_logger):
    assert _compat.logger_prefix(wandb_logger) == "pre"


def test_wandb_init_kwargs(wandb_logger, tmp_path):
    init = _compat.wandb_init_kwargs(wandb_logger)
    assert (init["project"], init["name"], init["group"], init["dir"]) == ("proj", "run", "g", str(tmp_path))


def test_wandb_offline(wandb_logger, tmp_path):
    assert _compat.wandb_offline(wandb_logger)
    assert not _compat.wandb_offline(WandbLogger(project="proj", save_dir=str(tmp_path)))


def test_wandb_name_or_project(wandb_logger, tmp_path):
    assert _compat.wandb_name_or_project(wandb_logger) == "run"
    assert _compat.wandb_name_or_project(WandbLogger(project="proj", save_dir=str(tmp_path))) == "proj"


def test_cached_experiment(wandb_logger):
    assert _compat.cached_experiment(wandb_logger) is None  # no W&B run started by asking


def test_cache_experiment(wandb_logger):
    run = object()
    _compat.cache_experiment(wandb_logger, run)
    assert wandb_logger.experiment is run and _compat.cached_experiment(wandb_logger) is run


# ---- Lightning: LightningCLI ----------------------------------------------------------------------------
CLI_ARGS = ["--trainer.max_steps=1", "--trainer.accelerator=cpu", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0"]


def test_cli_config_value():
    cli = LightningCLI(BoringModel, run=False, args=CLI_ARGS, save_config_callback=None)
    assert _compat.cli_config_value(cli, cli.config, "trainer")["max_steps"] == 1
    assert _compat.cli_config_value(cli, cli.config, "absent", default={}) == {}


class _SubcommandsThroughCompat(LightningCLI):
    """Builds its subcommands the way LightningTrainCLI does."""

    def _add_subcommands(self, parser: Any, **kwargs: Any) -> None:
        subcommands = parser.add_subcommands()
        for name in self.subcommands():
            subcommands.add_subcommand(name, _compat.subcommand_parser(self, name, **kwargs.get(name, {})))


def test_subcommand_parser():
    # Lightning looks the fit parser up again after parsing (to add configure_optimizers to the model)
    cli = _SubcommandsThroughCompat(BoringModel, args=["fit", *CLI_ARGS], save_config_callback=None)
    assert cli.trainer.global_step == 1  # fit's parser took the trainer's arguments, and it ran
