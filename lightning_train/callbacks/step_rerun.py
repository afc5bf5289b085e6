"""Bad machine or bad batch: rerun a suspect optimizer step from the same state and compare.

``NaNRecovery(rerun=True)`` keeps, for every step, what a rerun needs that the step changes: references to
the step's batches and the RNG states at its first batch (weights, optimizer and loss scale are unchanged
when the step is skipped, and the gradients are put aside while the rerun fills its own). When a step goes
non-finite or spikes, every rank runs the step again (``strategy.training_step`` and backward, through the
same DDP/FSDP2 wrapper, autocast and loss scale), and the per-rank loss and gradient norm of the rerun are
compared with the original's (Megatron-LM's rerun state machine, in small):

* ``transient``: some rank's rerun differs: silent data corruption on that machine. Checkpoint, then exit
  with ``FAULTY_NODE_EXIT_CODE`` on the suspect ranks' nodes (75 on the others): a scheduler requeues the
  job without that node.
* ``data``: the rerun reproduces it, and with every rank's batches moved to the next data-parallel rank
  each rank's result follows its batch: the batch (or the model), not a machine. The ladder goes on (skip,
  roll back, abort).
* ``persistent``: the rerun reproduces it, and no other data-parallel rank can tell (one rank), or with
  the batches moved the result stays with a rank (a deterministic fault of that rank, named in the
  detail). The ladder goes on.

With ``rerun_every=N`` every N-th healthy step is also checked: the batches moved to the next rank (the
same rank with one rank) must give the same losses and gradient norm; a difference is ``transient``.
Reruns need every rank to be a data-parallel rank of its own (ddp, fsdp, hsdp or one device): under
tensor or pipeline parallelism backward runs inside the strategy's contexts and schedules.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer

from lightning_train._compat import logging_as_hook
from lightning_train.callbacks._common import data_parallel_size
from lightning_train.callbacks.preemption import PREEMPTED_EXIT_CODE
from lightning_train.errors import FaultyNode
from lightning_train.loggers.alerts import send_alert
from lightning_train.plugins.step import step_control

FAULTY_NODE_EXIT_CODE = 77  # next to 75 (preempted) and 76 (hang): "requeue me, but not on this node"


@dataclass
class Verdict:
    """What a rerun said about optimizer step ``step``: ``kind`` (transient | persistent | data), the suspect
    ranks, a sentence, the numbers it compared (per rank), and for a transient verdict the suspects' node
    ranks and host names (the nodes to exclude)."""

    kind: str
    suspects: list[int]
    detail: str
    numbers: dict[str, list[float]] = field(default_factory=dict)
    step: int = -1
    nodes: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepRerun:
    """Keeps what a rerun of the current step needs, reruns it and gives the verdict (see the module)."""

    def __init__(self, tolerance: float, every: int = 0) -> None:
        self.tolerance, self.every = tolerance, every
        self.runs = 0  # steps rerun (the owner keeps it in its state_dict)
        self._batches: list[tuple[Any, int]] = []  # the step's batches: references, no copies
        self._rng: dict[str, torch.Tensor] = {}

    def record(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        """Call at every training batch's start."""
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first micro-batch of a step
            self._batches, self._rng = [], _rng_state()
        self._batches.append((batch, batch_idx))

    def verdict(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer, bad: bool,
        loss: torch.Tensor, norm: torch.Tensor,
    ) -> Verdict | None:
        """The verdict on a ``bad`` step, or on a healthy one the periodic check is due on; else None. Every
        rank calls it and takes the same branch (``bad`` comes from all-reduced values)."""
        if bad:
            said: Verdict | None = self.judge_bad_step(trainer, pl_module, optimizer, loss, norm)
        elif self.every and (trainer.global_step + 1) % self.every == 0:
            said = self.check_healthy_step(trainer, pl_module, optimizer, loss, norm)
        else:
            return None
        self.runs += 1
        if said is not None:
            said.step = trainer.global_step
            if said.kind == "transient":
                said.nodes, said.hosts = _places_of(trainer, said.suspects)
        return said

    def judge_bad_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer,
        loss: torch.Tensor, norm: torch.Tensor,
    ) -> Verdict:
        """Rerun a step judged bad (``loss``, ``norm``: this rank's values). Every rank calls it."""
        original = self._gather(trainer, loss, norm)
        rerun = self._gather(trainer, *self._rerun(trainer, pl_module, optimizer, self._batches, self._rng))
        numbers = {"loss": original[:, 0].tolist(), "grad_norm": original[:, 1].tolist(),
                   "rerun_loss": rerun[:, 0].tolist(), "rerun_grad_norm": rerun[:, 1].tolist()}
        suspects = self._differing(original, rerun, shift=0)
        if suspects:
            return Verdict("transient", suspects, f"the rerun on the same rank differs on rank(s) "
                           f"{suspects}: a fault of the machine, not of the data", numbers)
        if not self._can_move_batches(trainer):
            return Verdict("persistent", [], "the rerun on the same rank gives the same result (no other "
                           "data-parallel rank to tell the data from this machine)", numbers)
        moved = self._gather(trainer, *self._rerun_moved(trainer, pl_module, optimizer))
        numbers |= {"moved_loss": moved[:, 0].tolist(), "moved_grad_norm": moved[:, 1].tolist()}
        moved_away = self._differing(original, moved, shift=1)  # results that did not follow their batch
        if not moved_away:
            return Verdict("data", [], "the rerun gives the same result, and each rank's result follows its "
                           "batches to the next data-parallel rank: the data (or the model), not a machine",
                           numbers)
        # a non-finite result that stayed on its rank names that rank; else every rank involved
        tied = [r for r in moved_away if not math.isfinite(moved[r, 0])] or moved_away
        return Verdict("persistent", [], f"the rerun gives the same result, but not with the batches on the "
                       f"next data-parallel rank: a deterministic fault tied to rank(s) {tied}", numbers)

    def check_healthy_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer,
        loss: torch.Tensor, norm: torch.Tensor,
    ) -> Verdict | None:
        """The periodic check of a healthy step: rerun it (its batches on the next data-parallel rank,
        else on this one) and compare; a ``transient`` verdict when the results differ, else None."""
        original = self._gather(trainer, loss, norm)
        moved = self._can_move_batches(trainer)
        result = (self._rerun_moved(trainer, pl_module, optimizer) if moved
                  else self._rerun(trainer, pl_module, optimizer, self._batches, self._rng))
        rerun = self._gather(trainer, *result)
        suspects = self._differing(original, rerun, shift=int(moved))
        if not suspects:
            return None
        if moved:  # the rank that ran the batches or the one that reran them erred: ask the first again
            again = self._rerun(trainer, pl_module, optimizer, self._batches, self._rng)
            suspects = self._differing(original, self._gather(trainer, *again), shift=0) or suspects
        numbers = {"loss": original[:, 0].tolist(), "grad_norm": original[:, 1].tolist(),
                   "rerun_loss": rerun[:, 0].tolist(), "rerun_grad_norm": rerun[:, 1].tolist()}
        where = "on the next data-parallel rank" if moved else "on the same rank"
        return Verdict("transient", suspects, f"periodic check: the step rerun {where} differs (rank(s) "
                       f"{suspects} computed it): silent data corruption", numbers)

    # ---- reruns ---------------------------------------------------------------------------------
    def _rerun(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer,
        batches: list[tuple[Any, int]], rng: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of ``batches`` from ``rng``, as the loop ran them: this rank's summed loss
        (divided by the loss scale, as NaNRecovery sees it) and the pre-clip gradient norm. The step's own
        gradients and the RNG states are put back afterwards."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        after = _rng_state()
        _set_rng_state(rng)
        total = torch.zeros((), device=trainer.strategy.root_device)
        control = step_control(trainer)
        try:
            for p in params:
                p.grad = None
            with logging_as_hook(pl_module, "training_step"):
                for batch, batch_idx in batches:
                    output = trainer.strategy.training_step(batch, batch_idx)
                    loss = output["loss"] if isinstance(output, dict) else output
                    loss = loss / trainer.accumulate_grad_batches
                    control.scale_loss(loss).backward()
                    total = total + loss.detach().float()
            control.unscale_grads_([p.grad for p in params if p.grad is not None])
            norm = control.measure_grad_norms()["total"]
        finally:
            _set_rng_state(after)
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
        return total, norm.float().to(total.device)

    def _rerun_moved(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rerun with every rank's batches and RNG states on the next rank: rank r runs rank r-1's."""
        mine = (move_data_to_device(self._batches, torch.device("cpu")), self._rng)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # token ids and RNG states: small, and only on a check
        batches, rng = everyone[(dist.get_rank() - 1) % dist.get_world_size()]
        batches = [(trainer.strategy.batch_to_device(batch), batch_idx) for batch, batch_idx in batches]
        return self._rerun(trainer, pl_module, optimizer, batches, rng)

    # ---- comparing ------------------------------------------------------------------------------
    def _gather(self, trainer: L.Trainer, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """``[world_size, 2]`` on the host: every rank's (loss, gradient norm)."""
        pair = torch.stack([loss.detach().float().reshape(()), norm.detach().float().reshape(())])
        return trainer.strategy.all_gather(pair).reshape(-1, 2).cpu()

    def _differing(self, original: torch.Tensor, rerun: torch.Tensor, shift: int) -> list[int]:
        """Ranks whose rerun differs. Rank r's rerun ran the batches of rank r - ``shift``: its loss is
        compared with theirs (both ranks are suspects), its gradient norm (of the whole reduced gradient)
        with its own. A loss that differs names the rank; only when none does, a gradient norm."""
        world = len(original)
        owners = [(r - shift) % world for r in range(world)]
        by_loss = [r for r in range(world) if not self._close(original[owners[r], 0], rerun[r, 0])]
        if by_loss:
            return sorted({rank for r in by_loss for rank in (owners[r], r)})
        return [r for r in range(world) if not self._close(original[r, 1], rerun[r, 1])]

    def _close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        x, y = float(a), float(b)
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        if math.isinf(x) or math.isinf(y):
            return x == y
        return abs(x - y) <= self.tolerance * max(abs(x), abs(y))

    def _can_move_batches(self, trainer: L.Trainer) -> bool:
        # every rank a data-parallel rank of its own (no tensor or pipeline parallelism sharing a batch)
        return trainer.world_size > 1 and data_parallel_size(trainer) == trainer.world_size


def exit_faulty_node(
    trainer: L.Trainer, verdict: Verdict, save: Callable[[L.Trainer, str, str], tuple[Path, Path]]
) -> NoReturn:
    """After a ``transient`` verdict, on every rank: ``save(trainer, name, reason)`` the state (the step was
    skipped: the state before it) with the forensic report, alert, and raise ``FaultyNode``: exit code
    ``FAULTY_NODE_EXIT_CODE`` on the nodes of the suspect ranks, 75 (requeue) on the others."""
    code = FAULTY_NODE_EXIT_CODE if trainer.node_rank in verdict.nodes else PREEMPTED_EXIT_CODE
    hosts = ", ".join(verdict.hosts)
    reason = f"transient fault in step {verdict.step} on rank(s) {verdict.suspects} (host(s) {hosts})"
    checkpoint, forensics = save(trainer, f"faulty-node-step={trainer.global_step}.ckpt", reason)
    detail = (f"{reason}: {verdict.detail}; the state before the step is saved to {checkpoint}; requeue "
              f"without host(s) {hosts} and rerun with --resume auto (forensics in {forensics})")
    send_alert(trainer, "NaNRecovery found a faulty machine", detail, "ERROR")
    rank_zero_info(f"NaNRecovery: {detail}")
    raise FaultyNode(code, checkpoint, forensics, verdict.as_dict())


def _places_of(trainer: L.Trainer, ranks: list[int]) -> tuple[list[int], list[str]]:
    """The node ranks and host names of ``ranks`` (one all-gather: only after a transient verdict)."""
    places: list[Any] = [(trainer.node_rank, socket.gethostname())]
    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        places = [None] * dist.get_world_size()
        dist.all_gather_object(places, (trainer.node_rank, socket.gethostname()))
    return sorted({places[r][0] for r in ranks}), sorted({places[r][1] for r in ranks})


def _rng_state() -> dict[str, torch.Tensor]:
    """The torch RNG states a step draws from (dropout): the CPU one, and the current CUDA device's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
