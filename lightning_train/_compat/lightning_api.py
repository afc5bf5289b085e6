"""Private names of Lightning (see the package docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

# torch and Lightning are imported inside the functions that use them, never here: the CLI's help and
# its tools (prepare, report, ...) import this module and must not pay those imports (Lightning's alone
# takes seconds; tests/test_startup.py).

# A file path as Lightning's signatures take it (Lightning's private
# ``lightning.fabric.utilities.types._PATH``).
PathLike: TypeAlias = str | Path

# The file a Lightning sharded checkpoint folder keeps its non-tensor state in: Lightning's private
# ``lightning.fabric.utilities.load._METADATA_FILENAME``, which its loaders look for (Lightning 2.5-2.6;
# written out so that reading a folder does not import Lightning; tests/test_compat_*.py compares them).
METADATA_FILENAME: str = "meta.pt"


# ---- Lightning: Trainer and loops -------------------------------------------------------------------------
def batches_that_stepped(trainer: L.Trainer) -> int:
    """The step Lightning logs metrics at (``fit_loop.epoch_loop._batches_that_stepped``, Lightning 2.5-2.6;
    ``trainer.global_step`` is the public count, but it counts each optimizer of a step)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: L.Trainer, step: int) -> None:
    """Set the step Lightning logs metrics at (the same private counter as ``batches_that_stepped``);
    Lightning has no public setter."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def data_fetcher(trainer: L.Trainer) -> Any:
    """The fit loop's iterator over the training batches, None outside an epoch (``trainer.fit_loop.
    _data_fetcher``, Lightning 2.5-2.6; no public one)."""
    return trainer.fit_loop._data_fetcher


def fetcher_hands_out_iterator(fetcher: Any) -> bool:
    """Whether ``training_step`` draws the batches itself (``dataloader_iter``: Lightning's private
    ``lightning.pytorch.loops.fetchers._DataLoaderIterDataFetcher``, Lightning 2.5-2.6)."""
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

    return isinstance(fetcher, _DataLoaderIterDataFetcher)


def restate_epoch_batches(trainer: L.Trainer, batches_done: int) -> None:
    """Set the fit loop's count of this epoch's batches to ``batches_done`` (writes Lightning's loop
    progress ``fit_loop.epoch_loop.batch_progress.current``, Lightning 2.5-2.6; no public setter)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = batches_done - progress.ready
    for counter in ("ready", "started", "processed", "completed"):
        setattr(progress, counter, getattr(progress, counter) + shift)


def attached_trainer(module: Any) -> L.Trainer | None:
    """The Trainer a LightningModule is attached to, None when it has none or ``module`` is no
    LightningModule (``LightningModule._trainer``, Lightning 2.5-2.6; the public ``module.trainer`` raises
    when there is none)."""
    return getattr(module, "_trainer", None)


@contextlib.contextmanager
def logging_as_hook(module: L.LightningModule, hook_name: str) -> Iterator[None]:
    """While inside, ``self.log`` of ``module`` logs as if called from ``hook_name`` (Lightning keys logged
    values by ``LightningModule._current_fx_name``, Lightning 2.5-2.6): a step rerun from a callback hook
    then updates the step's own ``training_step`` values instead of adding entries of the same name."""
    previous = module._current_fx_name
    module._current_fx_name = hook_name
    try:
        yield
    finally:
        module._current_fx_name = previous


def after_closure(plugin: Any, model: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
    """Run ``on_before_optimizer_step`` hooks, then gradient clipping, as Lightning does after the closure
    (``Precision._after_closure``, Lightning 2.5-2.6; no public one)."""
    plugin._after_closure(model, optimizer)


def has_train_progress_bar(bar: Any) -> bool:
    """Whether a ``TQDMProgressBar`` has made its training bar yet (``TQDMProgressBar._train_progress_bar``,
    Lightning 2.5-2.6; the public ``train_progress_bar`` raises before)."""
    return bar._train_progress_bar is not None


# ---- Lightning: strategies -----------------------------------------------------------------------------
def setup_distributed(strategy: Any) -> None:
    """Start the default process group of ``strategy``'s ranks, from its cluster environment (address,
    port, rank, world size), ``process_group_backend`` and ``timeout``, as Lightning's strategies do
    (``lightning.fabric.utilities.distributed._init_dist_connection``, Lightning 2.5-2.6; no public one)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    device = strategy.root_device
    _init_dist_connection(
        strategy.cluster_environment, strategy.process_group_backend, timeout=strategy.timeout,
        device_id=None if device.type == "cpu" else device,
    )


def subprocess_launcher(strategy: Any) -> Any:
    """The launcher that starts ``strategy``'s other local ranks by running this script again, as
    Lightning's DDP and model-parallel strategies attach it (``lightning.pytorch.strategies.launchers.
    subprocess_script._SubprocessScriptLauncher``, Lightning 2.5-2.6; no public one)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return _SubprocessScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)


def reduce_tensor(tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """``tensor`` reduced in place over ``group`` (None: every rank) after a barrier, as Lightning's
    strategies reduce (``"mean"``: summed and divided where the backend has no average)
    (``lightning.fabric.utilities.distributed._sync_ddp_if_available``, Lightning 2.5-2.6; no public one)."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Make ``mesh`` the strategy's and its LightningModule's ``device_mesh`` (``LightningModule.
    _device_mesh``, Lightning 2.5-2.6, behind a read-only property; the strategy's is its own)."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the optimizers' states to ``device`` (``lightning.fabric.utilities.optimizer.
    _optimizers_to_device``, Lightning 2.5-2.6; no public one)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def sync_module_states(module: nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers to every rank (``lightning.pytorch.overrides.distributed.
    _sync_module_states``, Lightning 2.5-2.6; DDP does this itself when it wraps a module)."""
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(module)


# ---- Lightning: checkpoints and loggers ------------------------------------------------------------------
def save_model_checkpoint_now(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Let ``callback`` save its top-k and ``last`` checkpoints at this step, as its step rule does
    (``ModelCheckpoint._monitor_candidates``, ``._save_topk_checkpoint``, ``._save_last_checkpoint``,
    Lightning 2.5-2.6). The public alternative, ``train_time_interval``, excludes a step interval and
    broadcasts every step."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str) -> Mapping[str, Any]:
    """``metrics`` with ``prefix + separator`` before each name, as Lightning's loggers do
    (``lightning.fabric.utilities.logger._add_prefix``, Lightning 2.5-2.6)."""
    from lightning.fabric.utilities.logger import _add_prefix

    return _add_prefix(metrics, prefix, separator)


def logger_prefix(logger: Any) -> str:
    """The ``prefix`` a Lightning logger was made with (``WandbLogger._prefix``, Lightning 2.5-2.6)."""
    return logger._prefix


def wandb_init_kwargs(logger: Any) -> dict[str, Any]:
    """The ``wandb.init`` arguments a Lightning ``WandbLogger`` collected (``WandbLogger._wandb_init``,
    Lightning 2.5-2.6)."""
    return logger._wandb_init


def wandb_offline(logger: Any) -> bool:
    """The ``offline`` flag of a Lightning ``WandbLogger`` (``WandbLogger._offline``, Lightning 2.5-2.6)."""
    return logger._offline


def wandb_name_or_project(logger: Any) -> str | None:
    """The run name a Lightning ``WandbLogger`` was given, else its project (``WandbLogger._name``,
    ``._project``, Lightning 2.5-2.6; the public ``name`` is always the project)."""
    return logger._name or logger._project


def cached_experiment(logger: Any) -> Any:
    """The W&B run a Lightning ``WandbLogger`` holds, None before it started one (``WandbLogger._experiment``,
    Lightning 2.5-2.6; the public ``experiment`` starts one)."""
    return logger._experiment


def cache_experiment(logger: Any, run: Any) -> None:
    """Make ``run`` the W&B run a Lightning ``WandbLogger`` holds (``WandbLogger._experiment``,
    Lightning 2.5-2.6)."""
    logger._experiment = run


# ---- Lightning: LightningCLI ----------------------------------------------------------------------------
def cli_config_value(cli: Any, config: Any, key: str, default: Any = None) -> Any:
    """``config``'s value for ``key`` under the running subcommand (``LightningCLI._get``,
    Lightning 2.5-2.6)."""
    return cli._get(config, key, default=default)


def subcommand_parser(cli: Any, name: str, **options: Any) -> Any:
    """A subcommand's parser, made and recorded where LightningCLI reads it after parsing, as its
    ``_add_subcommands`` does (``LightningCLI._prepare_subcommand_parser``, ``._subcommand_parsers``,
    Lightning 2.5-2.6)."""
    parser = cli._prepare_subcommand_parser(cli.trainer_class, name, **options)
    if not hasattr(cli, "_subcommand_parsers"):
        cli._subcommand_parsers = {}
    cli._subcommand_parsers[name] = parser
    return parser


