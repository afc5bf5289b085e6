"""Every use of a private name of torch, Lightning, torchmetrics, tqdm or argparse, in one place.

Private names change without notice, so each one is reached only through a small function here, with a
test of its own in ``tests/test_compat.py``: a dependency upgrade that breaks one fails a named test
instead of a training run. Each docstring names the private API, the versions it was checked on, and the
public alternative where one exists. Checked on torch 2.13, Lightning 2.6, tqdm 4.70 and Python 3.11
unless a docstring says otherwise.

Overrides of private methods that stay in their classes (a subclass can only override them there):

* ``LightningTrainCLI._add_subcommands`` and ``._parse_ckpt_path`` (``lightning.pytorch.cli.LightningCLI``),
  in ``cli/trainer.py``: a whole line of help per subcommand; checking ``--ckpt_path`` before Lightning
  unpickles its hyper-parameters.
* ``ParallelStrategy._configure_launcher`` (``lightning.pytorch.strategies.Strategy``), in
  ``strategies/parallel.py``: checking the layout before any process starts, and attaching the launcher.
* ``HelpFormatter._fill_text``, ``._get_help_string`` and ``._format_action`` (``argparse.HelpFormatter``
  through jsonargparse's ``DefaultHelpFormatter``), in ``cli/_parsers.py``: argparse's only way to
  format help text.

``tests/test_compat.py`` checks that each of these methods is still defined and called by its base.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

if TYPE_CHECKING:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from tqdm import tqdm

# torch and Lightning are imported inside the functions that use them, never here: the CLI's help and
# its tools (prepare, report, ...) import this module and must not pay those imports (Lightning's alone
# takes seconds; tests/test_startup.py).

# A file path as Lightning's signatures take it (Lightning's private
# ``lightning.fabric.utilities.types._PATH``).
PathLike: TypeAlias = str | Path

# The file a Lightning sharded checkpoint folder keeps its non-tensor state in: Lightning's private
# ``lightning.fabric.utilities.load._METADATA_FILENAME``, which its loaders look for (Lightning 2.5-2.6;
# written out so that reading a folder does not import Lightning; tests/test_compat.py compares them).
METADATA_FILENAME: str = "meta.pt"

# What a pickled ``torch.layout`` calls to rebuild itself (torch registers ``torch.serialization._get_layout``
# with copyreg; torch 2.5-2.13), for the restricted unpickler of sharded checkpoints.
TORCH_LAYOUT_GLOBAL = ("torch.serialization", "_get_layout")


# ---- torch: GradScaler and optimizers ---------------------------------------------------------------------
def loss_scale_async(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scale as a device tensor without a host sync (``GradScaler._get_scale_async``, torch 2.5-2.13;
    the public ``get_scale()`` returns a float, a sync); None before the first ``scale()``."""
    return scaler._get_scale_async()


def found_inf_per_device(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """The 0/1 found-inf tensors ``unscale_`` left for ``optimizer``, one per device, [] before it
    (``GradScaler._per_optimizer_states[id(opt)]["found_inf_per_device"]``, torch 2.5-2.13; no public one)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    return list(state["found_inf_per_device"].values()) if state else []


def scaler_unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``unscale_`` has run for ``optimizer`` this step (``GradScaler._per_optimizer_states[...]
    ["stage"]``, torch 2.5-2.13; no public flag)."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"] is OptState.UNSCALED


def handles_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's ``step`` unscales by itself, as fused AdamW does (``Optimizer.
    _step_supports_amp_scaling``, torch 2.5-2.13; no public one)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float) -> tuple[torch.Tensor, ...]:
    """The ``ord``-norm of each tensor in one fused kernel (``torch._foreach_norm``, torch 2.5-2.13;
    public alternative, one kernel per tensor: ``torch.linalg.vector_norm``)."""
    import torch

    return torch._foreach_norm(tensors, ord)


def foreach_copy(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """New copies of ``tensors`` in one fused kernel (``torch._foreach_mul(tensors, 1.0)``, torch 2.5-2.13;
    public alternative, one kernel per tensor: ``tensor.clone()``)."""
    import torch

    return torch._foreach_mul(tensors, 1.0)


def foreach_sub_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> None:
    """``tensors[i] -= others[i]`` in place, fused (``torch._foreach_sub_``, torch 2.5-2.13; public
    alternative, one kernel per tensor: ``tensor.sub_(other)``)."""
    import torch

    torch._foreach_sub_(tensors, others)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called (``nn.Module._compiled_call_impl``, torch 2.2-2.13; no
    public accessor)."""
    return getattr(module, "_compiled_call_impl", None) is not None


# ---- torch.distributed -------------------------------------------------------------------------------------
def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward, keeping its parameter names (torch's composable
    ``torch.distributed._composable.checkpoint``, torch 2.5-2.13; ``torch.utils.checkpoint`` needs a
    wrapper module, which renames the parameters)."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def ddp_comm_hook_name(model: nn.parallel.DistributedDataParallel) -> str | None:
    """The communication hook's name as torch records it (``DistributedDataParallel.
    _get_ddp_logging_data()["comm_hook"]``, torch 2.5-2.13; no public one)."""
    return model._get_ddp_logging_data().get("comm_hook")


def end_distributed_process(code: int) -> NoReturn:
    """Leave a process that ran a process group: destroy the group, run Python's exit handlers (W&B,
    multiprocessing, atexit), flush, then ``os._exit(code)``, skipping interpreter finalisation. At
    finalisation Gloo's C++ threads (kept alive by FSDP2's references to the group) can still be torn
    down and abort a finished process with SIGABRT ("terminate called without an active exception";
    pytorch/pytorch#179291, #190489), which a scheduler or torchrun reads as a failed rank. Uses
    ``atexit._run_exitfuncs`` (CPython 3.10-3.13); the public alternative is a plain ``sys.exit``."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_group_store() -> Any | None:
    """The key-value store every rank of the default process group reaches (``_get_default_store``,
    torch 2.x), or None outside a process group: torch has no public accessor for it."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.distributed_c10d._get_default_store()


def forward_only_v_schedule(stages: Sequence[Any], microbatches: int) -> Any:
    """A schedule whose ``eval`` runs ``stages`` placed in a V (rank r: stages r and 2 x pp - 1 - r):
    ``ScheduleZBVZeroBubble`` with its input-gradient action skipped. torch's own V-shaped ``eval`` fails
    on the rank holding two adjacent stages: that action hands a gradient between them without backward.
    The skip drops the action's (empty) backward receive, ``bwd_recv_ops`` of ``_PipelineScheduleRuntime``
    (torch 2.6-2.13), as the action would have."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, ScheduleZBVZeroBubble

    def skip_input_gradient(action: Any, context: Any) -> None:
        context.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)

    schedule = ScheduleZBVZeroBubble(list(stages), microbatches, loss_fn=None, scale_grads=False)
    schedule.register_custom_function(BACKWARD_INPUT, skip_input_gradient)
    return schedule


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


# ---- torchmetrics ----------------------------------------------------------------------------------------
# Its flags for the optional packages whose metrics import them with torchmetrics itself (BERTScore, InfoLM,
# CLIPScore, CLIP-IQA: transformers; Metric.plot: matplotlib); ``RequirementCache``s of
# ``torchmetrics.utilities.imports`` (torchmetrics 1.4-1.9), which skip their check once ``available`` is set.
_HEAVY_OPTIONAL_FLAGS = ("_TRANSFORMERS_AVAILABLE", "_TRANSFORMERS_GREATER_EQUAL_4_4",
                         "_TRANSFORMERS_GREATER_EQUAL_4_10", "_MATPLOTLIB_AVAILABLE")
FULL_TORCHMETRICS_ENV = "LIGHTNING_TRAIN_FULL_TORCHMETRICS"


def torchmetrics_without_heavy_extras() -> None:
    """Make the coming first import of torchmetrics (Lightning's import does it) see transformers and
    matplotlib as absent: importing them takes about 1.7 of the 5.5 CPU seconds of ``import lightning``,
    in every process of every run, for metrics training does not use. A no-op when torchmetrics is already
    imported or ``LIGHTNING_TRAIN_FULL_TORCHMETRICS=1`` asks for those metrics. No public switch exists."""
    if "torchmetrics" in sys.modules or os.environ.get(FULL_TORCHMETRICS_ENV) == "1":
        return
    import importlib.abc
    import importlib.machinery

    class FlagsOff(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "torchmetrics.utilities.imports":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run_module = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run_module(module)
                for flag in _HEAVY_OPTIONAL_FLAGS:
                    getattr(module, flag).available = False

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, FlagsOff())


_OBJECT_STORAGE_PACKAGES = frozenset({"s3fs", "gcsfs", "adlfs"})


def object_storage_check_without_imports() -> None:
    """Lightning asks of every path it writes whether its filesystem is object storage, importing s3fs,
    gcsfs and adlfs to check (``lightning.fabric.utilities.cloud_io._is_object_storage``, Lightning
    2.5-2.6): ~0.3 CPU s in every process where the ``s3`` extra is installed, for local paths too. An
    instance of one of their filesystems exists only once its package is imported, so with none imported
    the answer is no, without importing them. Once per process (a second call finds it in place)."""
    import lightning.fabric.utilities.cloud_io as cloud_io

    check = cloud_io._is_object_storage
    if check.__module__ == __name__:
        return

    def is_object_storage(fs: Any) -> bool:
        return bool(_OBJECT_STORAGE_PACKAGES & sys.modules.keys()) and check(fs)

    cloud_io._is_object_storage = is_object_storage


# ---- tqdm and argparse ------------------------------------------------------------------------------------
def open_tqdm_bars() -> list[tqdm]:
    """Every tqdm bar not yet closed (``tqdm._instances``, tqdm 4.66-4.70; no public one)."""
    from tqdm import tqdm

    return list(getattr(tqdm, "_instances", ()))


def subcommand_actions(action: argparse.Action) -> list[argparse.Action] | None:
    """The per-subcommand actions of a subparsers action, None for any other action (``argparse.
    _SubParsersAction._get_subactions``, Python 3.10-3.13; no public one)."""
    if isinstance(action, argparse._SubParsersAction):
        return action._get_subactions()
    return None
