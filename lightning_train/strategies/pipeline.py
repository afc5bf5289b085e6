"""Pipeline parallelism for the GPT, with ``torch.distributed.pipelining``, applied from outside.

``split_blocks`` cuts the sequence of blocks into stages (balanced by parameters, or at given split
points); ``stage_model`` keeps of the GPT what one stage computes: its blocks (in a ``ModuleList`` keyed
by their indices in the whole model, so parameter names and checkpoints do not change), the embedding
on the first stage, the final norm and head on the last. ``gpt.py`` stays plain: a stage without the
embedding takes hidden states, one without the head returns them.

With tied embeddings the last stage keeps the embedding too (its weight is the head's); the two copies
start equal (every rank builds the same model from the same seed) and stay equal because their
gradients are summed after each backward (``Pipeline.sum_tied_grads``, Megatron's embedding group). The
V-shaped schedules run the first and the last stage on one rank: one embedding, nothing to sum.

``Pipeline`` runs a schedule (``SCHEDULES``) over the microbatches of one batch inside Lightning's
training step: each microbatch's loss is weighted by its share of the batch's scored tokens, so the
gradients, and the loss returned, are those of one process on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_train._compat import forward_only_v_schedule
from lightning_train.errors import UserInputError
from lightning_train.strategies.tensor_parallel import match_grad_placement

# torch.distributed.pipelining is imported by Pipeline only: every one-process fit imports this module (the
# memory estimate's stage split), and the import costs it ~30 ms
SCHEDULES = {
    "1F1B": "Schedule1F1B",
    "GPipe": "ScheduleGPipe",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
# several stages per rank (virtual_stages >= 2); the V-shaped ones exactly two: stages r and 2 x pp - 1 - r
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# backward split into input and weight gradients (the weights' fill the bubble); torch refuses compile there
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
LossFn = Callable[[Tensor, Tensor], Tensor]


def check_pipeline(
    pipeline_parallel: int,
    schedule: str,
    microbatches: int | None,
    virtual_stages: int,
    split_points: Sequence[int] | None,
) -> None:
    """Refuse pipeline options that cannot work whatever the model (``check_stages`` checks the model)."""
    if pipeline_parallel < 1:
        raise UserInputError(f"pipeline_parallel={pipeline_parallel}: use an int >= 1")
    if schedule not in SCHEDULES:
        raise UserInputError(f"pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if microbatches is not None and microbatches < 1:
        raise UserInputError(f"microbatches={microbatches}: use an int >= 1 (or null: 2 x stages)")
    if virtual_stages < 1:
        raise UserInputError(f"virtual_stages={virtual_stages}: use an int >= 1")
    if schedule in V_SHAPED and virtual_stages != 2:
        raise UserInputError(
            f"pipeline_schedule={schedule!r} with virtual_stages={virtual_stages}: the V-shaped schedules "
            "run exactly 2 stages per rank; set virtual_stages=2"
        )
    if (virtual_stages > 1) != (schedule in MULTI_STAGE):
        raise UserInputError(
            f"pipeline_schedule={schedule!r} with virtual_stages={virtual_stages}: "
            f"{', '.join(MULTI_STAGE)} run virtual_stages >= 2 stages per rank, the other schedules one; set "
            "both together"
        )
    if schedule == "DualPipeV" and microbatches is not None and microbatches < 2 * pipeline_parallel:
        raise UserInputError(
            f"pipeline_schedule='DualPipeV' with microbatches={microbatches}: it needs one per stage at "
            f"least; use microbatches >= {2 * pipeline_parallel} (2 x pipeline_parallel)"
        )
    rounds = max(1, (microbatches or 1) // pipeline_parallel)  # torch's interleaved loops go in rounds
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches and microbatches % rounds:
        raise UserInputError(
            f"pipeline_schedule={schedule!r} with microbatches={microbatches}: it runs them in {rounds} "
            f"rounds, which must divide them; use a multiple of pipeline_parallel ({pipeline_parallel})"
        )
    if split_points is not None and pipeline_parallel == 1:
        raise UserInputError("pipeline_split_points needs pipeline_parallel >= 2; remove it")


def check_zero_bubble(
    schedule: str, data_parallel: int, tensor_parallel: int, tied: bool, checkpointing: bool, compiled: bool
) -> None:
    """Refuse what torch 2.13's zero-bubble schedules do not train correctly (each found by running it):
    their backward, split into input and weight gradients, recomputes a checkpointed block twice (which
    fails), is refused by torch under compile, and under FSDP gives other gradients than one process;
    the V-shaped ones hold a tied embedding in two stages of one rank, which tensor parallelism shards
    twice."""
    if schedule not in ZERO_BUBBLE:
        return
    fix = "or use pipeline_schedule=Interleaved1F1B or 1F1B"
    if checkpointing:
        raise UserInputError(
            f"pipeline_schedule={schedule!r} does not work with activation_checkpointing (the split backward "
            f"recomputes a block twice); set activation_checkpointing=false, {fix}"
        )
    if compiled:
        raise UserInputError(
            f"pipeline_schedule={schedule!r} does not work with compile (torch does not split a compiled "
            f"backward); set compile=false, {fix}"
        )
    if data_parallel > 1:
        raise UserInputError(
            f"pipeline_schedule={schedule!r} with {data_parallel} data-parallel (FSDP) ranks trains with "
            "other gradients than one process under torch 2.13; use tensor_parallel x pipeline_parallel = "
            f"the world size, {fix}"
        )
    if schedule in V_SHAPED and tensor_parallel > 1 and tied:
        raise UserInputError(
            f"pipeline_schedule={schedule!r} with tensor_parallel={tensor_parallel} and tied embeddings: "
            "rank 0 holds the embedding in its first and last stage; set model.config.tie_embeddings=false, "
            "or use InterleavedZeroBubble"
        )


def check_stages(num_stages: int, n_layer: int, split_points: Sequence[int] | None) -> None:
    """Refuse a split the model's ``n_layer`` blocks cannot take (each stage needs one block at least)."""
    if n_layer < num_stages:
        raise UserInputError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks; the model has "
            f"n_layer={n_layer}: lower pipeline_parallel (or virtual_stages) or use a deeper model"
        )
    if split_points is None:
        return
    points = list(split_points)
    increasing = points == sorted(set(points)) and points[0] > 0 and points[-1] < n_layer
    if len(points) != num_stages - 1 or not increasing:
        raise UserInputError(
            f"pipeline_split_points={points} must be {num_stages - 1} increasing block indices in "
            f"1..{n_layer - 1} (where stages 2..{num_stages} start), e.g. "
            f"{[n_layer * (i + 1) // num_stages for i in range(num_stages - 1)]}"
        )


def check_microbatches(batch_size: int | None, microbatches: int) -> None:
    """Refuse a per-device batch that does not split into ``microbatches`` equal microbatches."""
    if batch_size is not None and batch_size % microbatches:
        raise UserInputError(
            f"a batch of {batch_size} sequences does not split into microbatches={microbatches}; use a "
            f"per-device batch_size divisible by {microbatches}, or set the strategy's microbatches to a "
            "divisor of it"
        )


def split_blocks(model: nn.Module, num_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """The blocks of each stage: contiguous ranges cut at ``split_points`` (the first block of stages 2, 3,
    ...), or else the split whose largest stage holds the fewest parameters (the first stage counts the
    embeddings, the last the final norm and head; a tied head counts again: the last stage computes it).

        >>> import torch
        >>> from lightning_train.models.gpt import GPT, GPTConfig
        >>> from lightning_train.strategies.pipeline import split_blocks, stage_model
        >>> model = GPT(GPTConfig(vocab_size=320, n_layer=4, n_head=2, n_embd=32))
        >>> split_blocks(model, 2), split_blocks(model, 2, split_points=[1])
        ([range(0, 2), range(2, 4)], [range(0, 1), range(1, 4)])
        >>> last = stage_model(model, range(2, 4), first=False, last=True)
        >>> [name for name, _ in last.named_parameters()][1]  # the whole model's names
        'blocks.2.attn_norm.weight'
        >>> last(torch.randn(1, 8, 32)).shape  # hidden states of the stage before -> logits
        torch.Size([1, 8, 320])
    """
    cost = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    cost[0] += sum(p.numel() for p in model.embed.parameters())
    if model.pos_embed is not None:
        cost[0] += model.pos_embed.weight.numel()
    cost[-1] += model.lm_head.weight.numel() + sum(p.numel() for p in model.norm.parameters())
    return split_by_cost(cost, num_stages, split_points)


def split_by_cost(
    cost: Sequence[int], num_stages: int, split_points: Sequence[int] | None = None
) -> list[range]:
    """Layers ``0..len(cost)-1`` in ``num_stages`` contiguous ranges: cut at ``split_points``, or else where
    the largest stage's summed ``cost`` is least."""
    n_layer = len(cost)
    check_stages(num_stages, n_layer, split_points)
    if split_points is not None:
        bounds = [0, *split_points, n_layer]
        return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    # best[s][j]: the least largest-stage cost of blocks [0, j) in s stages, and where its last stage starts
    inf = float("inf")
    best = [[(inf, 0)] * (n_layer + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for stages in range(1, num_stages + 1):
        for end in range(stages, n_layer + 1):
            best[stages][end] = min(
                (max(best[stages - 1][start][0], sum(cost[start:end])), start)
                for start in range(stages - 1, end)
            )
    bounds, end = [n_layer], n_layer
    for stages in range(num_stages, 0, -1):
        end = best[stages][end][1]
        bounds.append(end)
    bounds.reverse()
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def stage_model(model: nn.Module, blocks: Sequence[int], first: bool, last: bool) -> nn.Module:
    """A shallow copy of ``model`` (a ``GPT``) holding what one stage, or one rank's stages, compute:
    ``blocks`` (by index in the whole model), the embeddings if ``first``, the final norm and head if
    ``last`` (and the embedding a tied head shares). Its modules are the model's own, not copies."""
    stage = type(model).__new__(type(model))
    nn.Module.__init__(stage)  # hooks and children of its own (FSDP and TP register hooks on a stage)
    stage.config, stage.training = model.config, model.training
    stage.init_seed = model.init_seed  # a stage materialised from the meta device draws the model's values
    children = ("embed", "pos_embed", "rope", "local_rope", "dropout", "blocks", "norm", "lm_head")  # GPT's
    for name in children:
        setattr(stage, name, getattr(model, name))
    kept = nn.ModuleList()
    for index in blocks:
        kept.add_module(str(index), model.blocks[index])  # keyed by the global index: names do not change
    stage.blocks = kept
    tied = model.config.tie_embeddings
    if not first:
        stage.pos_embed = None
        if not (last and tied):
            stage.embed = None
    if not last:
        stage.norm, stage.lm_head = None, None
    return stage


def pipeline_stage_ids(pp_rank: int, pp_size: int, virtual_stages: int, schedule: str = "1F1B") -> list[int]:
    """The stages rank ``pp_rank`` runs, as torch's ``schedule`` places them: one, or every ``pp_size``-th
    of ``pp_size * virtual_stages`` (the interleaved loop: rank 0 runs stages 0 and pp_size, ...), or for
    the V-shaped schedules stages ``pp_rank`` and ``2 * pp_size - 1 - pp_rank`` (rank 0 runs the first and
    the last: the embedding and the head on one rank)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + pp_size * v for v in range(virtual_stages)]


def last_stage_rank(pp_size: int, schedule: str) -> int:
    """The pipeline rank that runs the last stage (the head and the loss): the V turns back to rank 0."""
    return 0 if schedule in V_SHAPED else pp_size - 1


class Pipeline:
    """The schedule of one rank's stage(s): runs forward and backward of every microbatch of a batch.

    Args:
        stage_modules: this rank's stage models (``stage_model``), in schedule order.
        stage_ids: their indices among ``num_stages``.
        num_stages: stages in the whole pipeline.
        schedule: a key of ``SCHEDULES``.
        microbatches: microbatches per batch (the local batch size must divide by it).
        group: the pipeline process group (this rank's ``pp`` mesh dimension).
        tied_group: the group of the first and last stage's ranks that share a tied embedding, or None.
        device: where the stages run.
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        tied_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.stage_modules, self.microbatches = list(stage_modules), microbatches
        self.group, self.tied_group = group, tied_group
        self.is_last = num_stages - 1 in stage_ids
        # this rank's copy of a tied embedding (the first stage's or the last's); the last's is left out of
        # gradient norms
        holder = next((m for m in stage_modules if m.embed is not None), None) if tied_group else None
        self._tied = holder.embed.weight if holder is not None else None
        self._tied_copy = self._tied if 0 not in stage_ids else None
        last_rank = last_stage_rank(dist.get_world_size(group), schedule)
        self.last_stage_rank = dist.get_global_rank(group, last_rank)
        from torch.distributed.pipelining import PipelineStage, schedules

        self._stages = [
            PipelineStage(module, index, num_stages, device, group=group)
            for module, index in zip(stage_modules, stage_ids, strict=True)
        ]
        self._schedule_class, self._v_shaped = getattr(schedules, SCHEDULES[schedule]), schedule in V_SHAPED
        self._single = issubclass(self._schedule_class, schedules.PipelineScheduleSingle)
        self._train_schedule = self._make_schedule(self._weighted_loss)
        self._eval_schedules: dict[int, Any] = {}  # by microbatch count: the last batch may be smaller
        self._loss_fn: LossFn | None = None
        self._scale: Callable[[Tensor], Tensor] = lambda loss: loss
        self._weights: tuple[Tensor, float] | None = None  # (scored tokens of the batch, accumulation)
        self._losses: list[Tensor] = []

    def _make_schedule(self, loss_fn: LossFn | None, microbatches: int | None = None) -> Any:
        n = microbatches or self.microbatches
        # scale_grads=False: _weighted_loss already weights each microbatch by its share of the batch
        if self._single:
            return self._schedule_class(self._stages[0], n, loss_fn=loss_fn, scale_grads=False)
        return self._schedule_class(self._stages, n, loss_fn=loss_fn, scale_grads=False)

    def _make_eval_schedule(self, microbatches: int) -> Any:
        """A schedule for ``eval``: the training one's, but for the V-shaped schedules ZBV's without its
        input-gradient action (torch 2.13's own V-shaped ``eval`` fails at the V's turn)."""
        if self._v_shaped:
            return forward_only_v_schedule(self._stages, microbatches)
        return self._make_schedule(None, microbatches)

    def _weighted_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        tokens, accumulation = self._weights
        loss = self._loss_fn(logits, labels) * ((labels != -100).sum() / tokens)
        self._losses.append(loss.detach())
        return self._scale(loss / accumulation)

    def train_step(
        self,
        input_ids: Tensor,
        labels: Tensor,
        loss_fn: LossFn,
        accumulation: int = 1,
        scale: Callable[[Tensor], Tensor] | None = None,
        starts_step: bool = True,
        ends_step: bool = True,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Forward and backward of every microbatch; gradients accumulate in the stage parameters as one
        process's would for ``loss_fn`` on the whole batch divided by ``accumulation``. ``starts_step``
        (the first batch of an optimizer step) sets the gradients to None first; ``ends_step`` (its last)
        then sums a tied embedding's two copies' gradients, once for all the step's batches. ``scale`` is
        applied to each microbatch's loss before its backward (a GradScaler's). ``position_ids`` of packed
        rows go to every stage (each rank holds the batch). Returns the batch's loss, detached, on every
        stage."""
        check_microbatches(input_ids.shape[0], self.microbatches)
        if starts_step:
            for module in self.stage_modules:
                module.zero_grad(set_to_none=True)
        self._loss_fn, self._scale = loss_fn, scale or (lambda loss: loss)
        self._weights = ((labels != -100).sum().clamp(min=1), accumulation)
        self._losses = []
        # return_outputs=False: the last stage does not keep every microbatch's logits until the step ends
        self._train_schedule.step(input_ids, target=labels, return_outputs=False, **_packed(position_ids))
        # the last n: the first step's shape inference calls the loss once more, before the microbatches
        loss = torch.stack(self._losses[-self.microbatches:]).sum() if self.is_last else None
        if ends_step:
            self._sum_tied_grads()
        return self._broadcast_from_last(loss, labels)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor | None:
        """The logits of ``input_ids`` (and packed rows' ``position_ids``; no backward): on the rank of the
        last stage; None on the others."""
        size = input_ids.shape[0]  # the most microbatches, up to the training's, that split the batch
        n = next(m for m in range(min(self.microbatches, size), 0, -1) if size % m == 0)
        if n not in self._eval_schedules:
            self._eval_schedules[n] = self._make_eval_schedule(n)
        return self._eval_schedules[n].eval(input_ids, **_packed(position_ids))

    def _broadcast_from_last(self, value: Tensor | None, like: Tensor) -> Tensor:
        if value is None:
            value = torch.zeros((), device=like.device)
        value = value.float().contiguous()
        dist.broadcast(value, src=self.last_stage_rank, group=self.group)
        return value

    def is_tied_copy(self, param: Tensor) -> bool:
        """Whether ``param`` is the last stage's copy of a tied embedding (left out of gradient norms)."""
        return param is self._tied_copy

    def _sum_tied_grads(self) -> None:
        """Sum the gradients of the embedding the first and last stages share (their copies stay equal)."""
        if self.tied_group is None or self._tied.grad is None:  # None on both copies when it is frozen
            return
        match_grad_placement(self._tied)  # both copies' gradients in one layout (TP may leave a Partial)
        grad = self._tied.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.tied_group)


def _packed(position_ids: Tensor | None) -> dict[str, Tensor]:
    """The keyword arguments of every stage's forward: torch's schedules split them into microbatches and
    hand each stage its own (the positional input reaches the first stage only)."""
    return {} if position_ids is None else {"position_ids": position_ids}
