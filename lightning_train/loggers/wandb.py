"""``WandbLogger``: Lightning's W&B logger with this package's dashboard, config, alerts and a promise:
W&B never stops a training run.

    trainer:
      logger:
        - class_path: lightning_train.loggers.WandbLogger
          init_args: {project: llm, save_dir: runs/pretrain-tiny-wandb, offline: true}

What it adds to ``lightning.pytorch.loggers.WandbLogger``:

* the dashboard: every namespace (``train/``, ``val/``, ``health/``, ``amp/``, ``recovery/``,
  ``perf/``) plotted against ``trainer/global_step``, with summaries such as min ``val/loss`` and
  max ``perf/tokens_per_sec`` (the layout lives in ``lightning_train.loggers.dashboard``);
* the resolved LightningCLI config (or the Trainer's main settings), with secrets redacted: any key
  that names a credential (api_key, token, password, secret, ...) and any value of such an
  environment variable (``WANDB_API_KEY``, ``HF_TOKEN``, ...) becomes ``"<redacted>"``;
* tags (``pretrain`` / ``fine-tune`` from the module) and a run group for multi-process jobs: one run
  per job, written by rank zero, or one run per rank (``log_all_ranks=True``) in the same group;
* ``log_alert``: the package's alerts (``lightning_train.loggers.alerts.send_alert``) become ``wandb.alert``
  (offline they are kept in the run file and sent by ``wandb sync``);
* robustness: if W&B cannot start (no API key, bad entity, no network) it warns once and falls back
  to offline mode, then to a no-op run; if a W&B call fails later it warns once and stops logging.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.logger import DummyExperiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_train._compat import (
    add_prefix,
    attached_trainer,
    cache_experiment,
    cached_experiment,
    logger_prefix,
    wandb_init_kwargs,
    wandb_name_or_project,
    wandb_offline,
)
from lightning_train.loggers.dashboard import NAMESPACES, STEP_METRIC, SUMMARIES

REDACTED = "<redacted>"
# Credential-like names; tokenizer settings such as pad_token or max_tokens are not secrets.
_SECRET_KEY = re.compile(
    r"api[_-]?key|secret|passw(or)?d|credential|^(auth|token)$"
    r"|(^|[_-])(hf|hub|github|access|auth|api|refresh|bearer)[_-]?token$", re.I,
)
_TAGS_BY_MODULE = {"PretrainModule": "pretrain", "FinetuneModule": "fine-tune"}


def redact_secrets(value: Any) -> Any:
    """A copy of ``value`` (nested dicts/lists of plain data) safe to log: credential-named keys and
    the values of credential-named environment variables are replaced by ``"<redacted>"``."""
    secrets = [v for k, v in os.environ.items() if _SECRET_KEY.search(k) and len(v) >= 8]
    return _redact(value, secrets)


def _redact(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, Mapping):
        return {k: REDACTED if isinstance(k, str) and _SECRET_KEY.search(k) else _redact(v, secrets)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(v, secrets) for v in value)
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value


class WandbLogger(LightningWandbLogger):
    """Lightning's ``WandbLogger`` with the lightning_train dashboard (see the module docstring).

    Args:
        project: W&B project (default ``$WANDB_PROJECT`` or ``lightning_logs``).
        name: display name of the run (W&B picks one when None).
        save_dir: folder that receives ``wandb/`` (use the run folder, ``trainer.default_root_dir``).
        offline: write the run locally only (``wandb sync`` uploads it later); no API key needed.
        entity: W&B user or team.
        group: run group; default for multi-process jobs: ``<name or project>-<job id>``.
        tags: extra tags; ``pretrain`` / ``fine-tune`` are added from the LightningModule.
        log_all_ranks: one W&B run per rank (same group) instead of one run written by rank zero.
        init_timeout: seconds to wait for W&B to start before falling back to offline mode.
        **kwargs: the rest of Lightning's ``WandbLogger`` and ``wandb.init`` arguments.

    Example (offline: no account, no network; ``wandb sync`` uploads the run later):

        >>> import os
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.loggers import WandbLogger
        >>> folder = tempfile.mkdtemp()
        >>> logger = WandbLogger(project="doctest", save_dir=folder, offline=True)
        >>> trainer = L.Trainer(
        ...     max_steps=2, accelerator="cpu", log_every_n_steps=1, limit_val_batches=0, logger=logger,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> logger.experiment.tags, logger.experiment.config["config"]["n_embd"]
        (('pretrain',), 32)
        >>> logger.experiment.finish()  # a script's run finishes at exit
        >>> any(name.startswith("offline-run-") for name in os.listdir(f"{folder}/wandb"))
        True
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str = ".",
        offline: bool = False,
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        log_all_ranks: bool = False,
        init_timeout: float = 90.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name, save_dir=save_dir, project=project, offline=offline, entity=entity,
                         group=group, tags=list(tags or []), **kwargs)
        self._log_all_ranks = log_all_ranks
        self._init_timeout = init_timeout
        self._failed = False  # a W&B call failed: warned once, logging stopped
        self._described = False  # config, tags and dashboard written

    # ---- the run ----------------------------------------------------------------------------------
    @property
    def experiment(self) -> Any:
        """The W&B run (a no-op stand-in on ranks that do not write, or when W&B cannot start)."""
        if cached_experiment(self) is None:
            if not self._writes_here():
                return DummyExperiment()
            cache_experiment(self, self._start_run())
        return cached_experiment(self)

    def _writes_here(self) -> bool:
        return self._log_all_ranks or rank_zero_only.rank == 0

    def _start_run(self) -> Any:
        import wandb

        if wandb.run is not None:
            rank_zero_warn("A wandb run is already in progress: WandbLogger logs to it.")
            self._define_dashboard(wandb.run)
            return wandb.run
        # unset options (YAML nulls included) keep W&B's defaults
        init = {key: value for key, value in wandb_init_kwargs(self).items() if value is not None}
        os.makedirs(init.setdefault("dir", "."), exist_ok=True)
        init["dir"] = os.path.abspath(init["dir"])
        if init.get("config") is not None:
            init["config"] = redact_secrets(init["config"])
        init["group"] = init.get("group") or self._default_group()
        if self._log_all_ranks and _world_size() > 1:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else rank_zero_only.rank
            init["name"] = f"{init.get('name') or init['group']}-rank{rank}"
        init["settings"] = {"init_timeout": self._init_timeout, **(init.get("settings") or {})}
        requested = "offline" if wandb_offline(self) else init.pop("mode", None)  # None: W&B's (WANDB_MODE)
        init.pop("mode", None)
        modes = list(dict.fromkeys([requested, "offline", "disabled"]))  # in order, without repeats
        for mode, fallback in zip(modes, modes[1:] + [None], strict=True):
            try:
                run = wandb.init(**init, mode=mode) if mode else wandb.init(**init)
                self._define_dashboard(run)
                return run
            except Exception as error:  # W&B misconfigured or unreachable: never stop training
                self._warn(f"W&B could not start in {mode or 'its default'} mode ({error}); "
                           f"{f'trying {fallback} mode' if fallback else 'training goes on without W&B'}.")
                if wandb.run is not None:
                    wandb.run.finish()
        return DummyExperiment()

    def _default_group(self) -> str | None:
        if _world_size() == 1:
            return None
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if job == "none":  # plain Lightning launcher: the rendezvous address is shared by all ranks
            address = os.environ.get("MASTER_ADDR", socket.gethostname())
            job = f"{address}-{os.environ.get('MASTER_PORT', '0')}"
        return f"{wandb_name_or_project(self)}-{job}"

    @staticmethod
    def _define_dashboard(run: Any) -> None:
        run.define_metric(STEP_METRIC, hidden=True)
        for namespace in NAMESPACES:
            run.define_metric(f"{namespace}/*", step_metric=STEP_METRIC, step_sync=True)
        for key, summary in SUMMARIES.items():
            run.define_metric(key, step_metric=STEP_METRIC, step_sync=True, summary=summary)
        run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)  # anything else a user logs

    # ---- logging (never raises) -------------------------------------------------------------------
    def log_hyperparams(self, params: Any) -> None:
        self._guard(lambda run: run.config.update(redact_secrets(_plain(params)), allow_val_change=True))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        metrics = add_prefix(metrics, logger_prefix(self), self.LOGGER_JOIN_CHAR)
        row = dict(metrics) if step is None else {**metrics, STEP_METRIC: step}
        self._guard(lambda run: run.log(row))

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Lightning calls this once per fit/validate/test, right after ``log_hyperparams``, with the
        LightningModule: the first moment the Trainer (and the CLI's config) is in reach."""
        if not self._described:
            self._described = True
            self._guard(self._describe_run, model)

    def log_alert(self, title: str, text: str, level: str = "WARN", step: int | None = None) -> None:
        """The package's alert protocol (``lightning_train.loggers.alerts``) as a W&B alert."""

        def alert(run: Any) -> None:
            import wandb

            message = redact_secrets(text if step is None else f"{text} (step {step})")
            run.alert(title=title, text=message, level=wandb.AlertLevel[level.upper()], wait_duration=0)

        self._guard(alert)

    def _describe_run(self, run: Any, model: Any) -> None:
        trainer = attached_trainer(model)
        tags = {_TAGS_BY_MODULE[c.__name__] for c in type(model).__mro__ if c.__name__ in _TAGS_BY_MODULE}
        if tags - set(run.tags or ()):
            run.tags = tuple(run.tags or ()) + tuple(sorted(tags - set(run.tags or ())))
        if trainer is not None:
            described = {"cli": _cli_config(trainer), "trainer": _trainer_facts(trainer)}
            run.config.update(redact_secrets(described), allow_val_change=True)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(run, *args)`` on ranks that write, unless W&B is off; a failure warns once and stops
        further W&B calls."""
        if self._failed or not self._writes_here() or isinstance(self.experiment, DummyExperiment):
            return
        try:
            fn(self.experiment, *args)
        except Exception as error:  # W&B failing must never fail the training run
            self._failed = True
            self._warn(f"W&B logging failed ({type(error).__name__}: {error}); training continues "
                       "without W&B. Metrics are still in the run's other loggers.")

    def _warn(self, message: str) -> None:
        if self._log_all_ranks:
            warnings.warn(message, stacklevel=3)
        else:
            rank_zero_warn(message)


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _plain(params: Any) -> dict[str, Any]:
    """Hyperparameters as JSON-able data; dataclasses (``GPTConfig``) become dicts, not strings."""
    from lightning.fabric.utilities.logger import (
        _convert_json_serializable,
        _convert_params,
        _sanitize_callable_params,
    )

    def expand(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        if isinstance(value, Mapping):
            return {k: expand(v) for k, v in value.items()}
        return value

    return _convert_json_serializable(expand(_sanitize_callable_params(_convert_params(params))))


def _cli_config(trainer: Any) -> dict[str, Any] | None:
    """The resolved LightningCLI config, as the CLI saved it (None outside the CLI)."""
    import yaml

    for callback in trainer.callbacks:
        if hasattr(callback, "parser") and hasattr(callback, "config"):  # LightningCLI's SaveConfigCallback
            return yaml.safe_load(callback.parser.dump(callback.config, skip_none=False))
    return None


def _trainer_facts(trainer: Any) -> dict[str, Any]:
    return {
        "world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "precision": str(trainer.precision),
        "max_steps": trainer.max_steps, "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "strategy": type(trainer.strategy).__name__, "default_root_dir": trainer.default_root_dir,
    }
