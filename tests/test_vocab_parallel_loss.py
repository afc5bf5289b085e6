"""``vocab_parallel_loss``: torch's ``loss_parallel`` made safe to nest and to leave on an exception, on a
real one-process gloo group (the multi-rank parity runs in test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_train.strategies.tensor_parallel import vocab_parallel_loss


def _cross_entropy_of_sharded_logits() -> torch.Tensor:
    """Logits sharded by vocabulary against plain targets: only the vocab-parallel handlers take them."""
    logits = distribute_tensor(torch.randn(6, 10), init_device_mesh("cpu", (1,)), [Shard(1)])
    return F.cross_entropy(logits, torch.randint(0, 10, (6,)))


def test_vocab_parallel_loss_nests_and_ends_on_an_exception(process_group):
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        _cross_entropy_of_sharded_logits()  # the check can fail: outside the context it is refused
    with vocab_parallel_loss():
        with vocab_parallel_loss():  # a manual backward inside the training step's context
            _cross_entropy_of_sharded_logits()
        _cross_entropy_of_sharded_logits()  # still on after the inner one closed
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        _cross_entropy_of_sharded_logits()  # off after the outer one
    with pytest.raises(ValueError, match="a failed step"), vocab_parallel_loss():
        raise ValueError("a failed step")
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        _cross_entropy_of_sharded_logits()  # off after an exception too
