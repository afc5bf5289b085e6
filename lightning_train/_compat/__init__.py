"""Every use of a private name of torch, Lightning, torchmetrics, lm_eval, tqdm or argparse, in one place.

This package: ``torch_api.py`` (torch and torch.distributed), ``lightning_api.py`` (Lightning) and
``other_api.py`` (torchmetrics, lm_eval, tqdm, argparse); callers import the names from here.

Private names change without notice, so each one is reached only through a small function here, with a
test of its own in ``tests/test_compat_*.py``: a dependency upgrade that breaks one fails a named test
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

``tests/test_compat_*.py`` checks that each of these methods is still defined and called by its base.
"""

from __future__ import annotations

from lightning_train._compat.lightning_api import (
    METADATA_FILENAME,
    PathLike,
    add_prefix,
    after_closure,
    attached_trainer,
    batches_that_stepped,
    cache_experiment,
    cached_experiment,
    cli_config_value,
    data_fetcher,
    fetcher_hands_out_iterator,
    has_train_progress_bar,
    logger_prefix,
    logging_as_hook,
    optimizers_to_device,
    reduce_tensor,
    restate_epoch_batches,
    save_model_checkpoint_now,
    set_batches_that_stepped,
    set_device_mesh,
    setup_distributed,
    subcommand_parser,
    subprocess_launcher,
    sync_module_states,
    wandb_init_kwargs,
    wandb_name_or_project,
    wandb_offline,
)
from lightning_train._compat.other_api import (
    FULL_TORCHMETRICS_ENV,
    lm_eval_console,
    object_storage_check_without_imports,
    open_tqdm_bars,
    subcommand_actions,
    torchmetrics_without_heavy_extras,
)
from lightning_train._compat.torch_api import (
    TORCH_LAYOUT_GLOBAL,
    checkpoint_activations,
    ddp_comm_hook_name,
    end_distributed_process,
    fake_process_group,
    foreach_copy,
    foreach_norm,
    foreach_sub_,
    forward_only_v_schedule,
    found_inf_per_device,
    handles_amp_scaling,
    is_compiled,
    local_box,
    loss_scale_async,
    muon_adjusted_lr,
    muon_orthogonalise,
    process_group_store,
)

__all__ = [
    "FULL_TORCHMETRICS_ENV",
    "METADATA_FILENAME",
    "PathLike",
    "TORCH_LAYOUT_GLOBAL",
    "add_prefix",
    "after_closure",
    "attached_trainer",
    "batches_that_stepped",
    "cache_experiment",
    "cached_experiment",
    "checkpoint_activations",
    "cli_config_value",
    "data_fetcher",
    "ddp_comm_hook_name",
    "end_distributed_process",
    "fake_process_group",
    "fetcher_hands_out_iterator",
    "foreach_copy",
    "foreach_norm",
    "foreach_sub_",
    "forward_only_v_schedule",
    "found_inf_per_device",
    "handles_amp_scaling",
    "has_train_progress_bar",
    "is_compiled",
    "logger_prefix",
    "logging_as_hook",
    "lm_eval_console",
    "local_box",
    "loss_scale_async",
    "muon_adjusted_lr",
    "muon_orthogonalise",
    "object_storage_check_without_imports",
    "open_tqdm_bars",
    "optimizers_to_device",
    "process_group_store",
    "reduce_tensor",
    "restate_epoch_batches",
    "save_model_checkpoint_now",
    "set_batches_that_stepped",
    "set_device_mesh",
    "setup_distributed",
    "subcommand_actions",
    "subcommand_parser",
    "subprocess_launcher",
    "sync_module_states",
    "torchmetrics_without_heavy_extras",
    "wandb_init_kwargs",
    "wandb_name_or_project",
    "wandb_offline",]
