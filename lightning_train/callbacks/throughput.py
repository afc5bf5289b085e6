"""ThroughputMonitor: tokens per second, step time and model FLOPs utilisation (MFU).

Averages over each logging interval: the wall clock is read (after synchronising the device)
only on logging steps, and tokens are counted from the batch's shape, so non-logging steps cost
a few integer additions and never wait for the device. Lightning's own ``ThroughputMonitor``
synchronises the device on every batch, hence this small one.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_train.callbacks._common import data_parallel_size, is_logging_step, log_metrics
from lightning_train.errors import UserInputError

# Dense (no sparsity) peak FLOP/s per GPU from the vendors' datasheets, by compute dtype ("tf32": fp32
# matmuls on tensor cores), for what Lightning's ``get_available_flops`` lacks or misreads: it finds no
# "NVIDIA H200" / "H200 NVL" (it expects "sxm1"/"nvl1" in the name), gives the H100 NVL the with-sparsity
# figures of a GPU pair, reads "L40S" as an L4 and knows no A10. Matched against
# torch.cuda.get_device_name(), first match wins; every other GPU is Lightning's.
ADDED_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    (r"h200 nvl|h100 nvl", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"h200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    (r"l40s", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\ba10\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
]
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


class ThroughputMonitor(Callback):
    """Logs ``perf/tokens_per_sec`` (also in the progress bar), ``perf/step_time`` (seconds per
    optimizer step) and ``perf/mfu``, each the average over the steps since the previous log.

    Counted: everything between two logging steps (data loading, forward, backward, optimizer,
    logging, checkpointing) except validation, whose time is subtracted. Tokens are the number of
    positions in the batch (``batch[token_key].numel()``, padding included, as the model computes
    on them) times the data-parallel size (the world size, less the ranks of a tensor-parallel group,
    which share one batch), i.e. every data-parallel rank is assumed to get batches of the same shape.

    MFU is model FLOPs (``flops_per_token(seq_len)`` of the LightningModule or its ``.model``, e.g.
    ``GPT``: 6 per weight plus attention) per second over the peak of all devices (tensor-parallel
    ranks included, which share each token's FLOPs): ``peak_flops``
    per device if given, else the GPU's datasheet value in the Trainer's precision (Lightning's
    ``get_available_flops``, plus ``ADDED_PEAK_FLOPS`` for the GPUs it lacks). It is not
    logged when either is unknown (e.g. on CPU without ``peak_flops``). Nothing is checkpointed: after
    a resume the first interval starts at the resumed step.

    Args:
        log_every_n_steps: optimizer steps between logs; None: the Trainer's ``log_every_n_steps``.
        peak_flops: peak FLOP/s of one device in the training precision.
        token_key: key of the token ids in dict batches; tensor batches and the first element of
            tuple/list batches count as they are.

    Example (with ``peak_flops`` given, MFU is logged on the CPU too):

        >>> import csv
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import ThroughputMonitor
        >>> logger = L.pytorch.loggers.CSVLogger(tempfile.mkdtemp())
        >>> trainer = L.Trainer(
        ...     max_steps=4, accelerator="cpu", log_every_n_steps=2, limit_val_batches=0, logger=logger,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ...     callbacks=[ThroughputMonitor(peak_flops=1e12)],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
        >>> rows = [row for row in rows if row["perf/tokens_per_sec"]]
        >>> len(rows), all(float(r["perf/tokens_per_sec"]) > 0 and 0 < float(r["perf/mfu"]) < 1 for r in rows)
        (2, True)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        token_key: str = "input_ids",
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise UserInputError(f"ThroughputMonitor log_every_n_steps={log_every_n_steps}: use an int >= 1")
        if peak_flops is not None and not peak_flops > 0:
            raise UserInputError(f"ThroughputMonitor peak_flops={peak_flops}: give one device's peak FLOP/s")
        self.log_every_n_steps, self.peak_flops, self.token_key = log_every_n_steps, peak_flops, token_key
        self._flops_per_token: Callable[[int], float] | None = None
        self._total_peak: float | None = None  # peak FLOP/s of all devices together
        self._start = 0.0  # perf_counter at the start of the interval
        self._start_step = 0
        self._excluded = 0.0  # validation seconds inside the interval
        self._validation_start: float | None = None
        self._tokens = 0
        self._flops = 0.0
        self._data_parallel = 1  # ranks that read different batches (set at train start)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = getattr(pl_module, "model", None)
        flops_fn = getattr(pl_module, "flops_per_token", None) or getattr(model, "flops_per_token", None)
        # Cached per sequence length: a model's count walks its parameters, which is no per-step work.
        self._flops_per_token = functools.cache(flops_fn) if callable(flops_fn) else None
        peak = self.peak_flops or _device_peak_flops(trainer.strategy.root_device, str(trainer.precision))
        self._total_peak = peak * trainer.world_size if peak else None
        self._data_parallel = data_parallel_size(trainer)
        self._restart_interval(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens = self._token_ids(batch)
        count = tokens.numel() * self._data_parallel  # shapes live on the host: no device read
        self._tokens += count
        if self._flops_per_token is not None:
            self._flops += count * self._flops_per_token(tokens.shape[-1])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = trainer.global_step - self._start_step
        if steps == 0 or not is_logging_step(trainer, self.log_every_n_steps):
            return
        _synchronize(trainer.strategy.root_device)
        seconds = time.perf_counter() - self._start - self._excluded
        metrics = {"perf/tokens_per_sec": self._tokens / seconds, "perf/step_time": seconds / steps}
        if self._flops_per_token is not None and self._total_peak is not None:
            metrics["perf/mfu"] = self._flops / seconds / self._total_peak
        log_metrics(trainer, metrics)
        # A CPU tensor: the progress bar reads it every batch, which must not touch the device.
        tokens_per_sec = torch.tensor(metrics["perf/tokens_per_sec"])
        pl_module.log("perf/tokens_per_sec", tokens_per_sec, prog_bar=True, logger=False)
        self._restart_interval(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:  # only validation inside fit
            return
        _synchronize(trainer.strategy.root_device)  # the queued training work belongs to training time
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validation_start is None:
            return
        _synchronize(trainer.strategy.root_device)
        self._excluded += time.perf_counter() - self._validation_start
        self._validation_start = None

    def _restart_interval(self, trainer: L.Trainer) -> None:
        _synchronize(trainer.strategy.root_device)
        self._start, self._start_step = time.perf_counter(), trainer.global_step
        self._excluded, self._tokens, self._flops = 0.0, 0, 0.0

    def _token_ids(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            if self.token_key not in batch:
                raise UserInputError(f"ThroughputMonitor token_key={self.token_key!r} is not in the batch "
                                     f"(keys: {sorted(batch)}); set token_key to the key of the token ids")
            return batch[self.token_key]
        return batch[0] if isinstance(batch, (list, tuple)) else batch


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one ``device`` in the Trainer's ``precision`` ("bf16-mixed", "16-mixed", "32-true",
    ...): ``ADDED_PEAK_FLOPS``, else Lightning's ``get_available_flops``; None when unknown (CPUs)."""
    dtype = _compute_dtype(precision)
    if device.type != "cuda" or dtype is None:
        return None
    name = torch.cuda.get_device_name(device)
    added = next((flops for pattern, flops in ADDED_PEAK_FLOPS if re.search(pattern, name.lower())), None)
    if added is not None:
        tf32 = dtype == "fp32" and torch.get_float32_matmul_precision() != "highest"  # Hopper/Ada/Ampere
        return added["tf32" if tf32 else dtype]
    peak = get_available_flops(device, _TORCH_DTYPES[dtype])  # handles TF32 itself
    return float(peak) if peak is not None else None


def _compute_dtype(precision: str) -> str | None:
    for prefix, dtype in (("bf16", "bf16"), ("16", "fp16"), ("32", "fp32"), ("64", "fp64")):
        if precision.startswith(prefix):
            return dtype
    return None


def _device_peak_flops(device: torch.device, precision: str) -> float | None:
    peak = device_peak_flops(device, precision)
    if peak is None and device.type == "cuda":
        rank_zero_warn(f"ThroughputMonitor knows no peak FLOP/s of {torch.cuda.get_device_name(device)!r} in "
                       f"precision {precision!r}, so perf/mfu is not logged; pass peak_flops=<FLOP/s of one "
                       "device> to get it.")
    return peak


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
