"""The step of ``ParallelStrategy`` under tensor and pipeline parallelism: the vocab-parallel loss's context
around each step and backward (``tensor_parallel.vocab_parallel_loss``), the backward a pipeline schedule
already ran in the step, clipping by the step's one gradient norm (over every shard and stage), and the
partial gradients of sequence parallelism reduced after backward. Without model parallelism: Lightning's."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import Tensor

from lightning_train.plugins.step import step_control
from lightning_train.strategies.tensor_parallel import reduce_partial_grads, vocab_parallel_loss


class ModelParallelStep:
    """``ParallelStrategy``'s step hooks (module doc); a base of it, before Lightning's ``ParallelStrategy``.
    They read the strategy's ``tensor_parallel``, ``loss_parallel`` and ``pipeline`` (None without one)."""

    def _loss_context(self) -> AbstractContextManager:
        """Around every step and backward: the vocab-parallel cross-entropy where the logits are sharded."""
        return vocab_parallel_loss() if self.tensor_parallel > 1 and self.loss_parallel else nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():  # a pipeline schedule runs backward in here too
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return super().test_step(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of all parameters to a total ``norm_type`` norm of ``max_norm`` and return
        the norm before clipping, the same on every rank: the norm over every shard and pipeline stage,
        the step's one measurement (``lightning_train.plugins.step``), which ``gradient_clip_val`` uses."""
        return step_control(self.lightning_module.trainer).clip_grad_norm_(max_norm, norm_type)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            with self._loss_context():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the pipeline schedule ran every microbatch's backward in training_step; the hooks still run once
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        # before on_before_optimizer_step: every callback sees whole gradients
        if self.tensor_parallel > 1:
            reduce_partial_grads(self.lightning_module)
