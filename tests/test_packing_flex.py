"""Packed rows through FlexAttention (``GPTConfig.packed_attention``, ``models/flex.py``) give the SDPA-mask
path's logits and gradients: several examples a row, with GQA, sliding windows and Gemma 2's soft-capping.

torch 2.13 refuses FlexAttention's backward on CPU at its front door (``_validate_device``: "does not
support backward on CPU"); below it, the unfused implementation (the reference CUDA's compiled kernels are
checked against) differentiates. ``cpu_flex_backward`` lifts that refusal so that CPU checks the gradients
our mask and score modifications give; the refusal itself is checked as users meet it."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

import lightning_train.models.layers as layers
from lightning_train import GPT, FinetuneModule, GPTConfig, SFTDataModule
from lightning_train.checkpoint import save_safetensors
from lightning_train.errors import UserInputError
from lightning_train.models import flex
from lightning_train.models.hf import hf_config
from tests.conftest import REPO, run_torchrun
from tests.test_packing import write_examples

VARIANTS = {
    "mha": {},
    "gqa": {"n_kv_head": 1},
    "sliding-window": {"sliding_window": 4, "sliding_window_layers": [0]},
    "gemma2-softcap-window-gqa": {"n_kv_head": 2, "sliding_window": 4, "sliding_window_layers": [0],
                                  "attn_softcap": 2.0, "query_scale_dim": 12.0},
}
EXAMPLES_PER_ROW = [[7, 9, 5, 3], [24], [2, 10, 12]]  # lengths; each row is 24 tokens


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, position_ids and next-token targets of rows holding several examples each."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in EXAMPLES_PER_ROW])
    tokens = torch.randint(0, 64, (len(EXAMPLES_PER_ROW), 24), generator=generator)
    targets = torch.randint(0, 64, tokens.shape, generator=generator)
    return tokens, positions, targets


def twin_models(variant: str) -> tuple[GPT, GPT]:
    """The same weights with packed rows through SDPA's mask and through FlexAttention."""
    torch.manual_seed(0)
    shape = {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, "init_std": 0.2}
    sdpa = GPT(GPTConfig(**shape, **VARIANTS[variant], packed_attention="sdpa"))
    flexed = GPT(GPTConfig(**shape, **VARIANTS[variant], packed_attention="flex"))
    flexed.load_state_dict(sdpa.state_dict())
    return sdpa, flexed


@pytest.fixture
def flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per attention layer that ran FlexAttention (so equal outputs cannot come from SDPA twice)."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex.flex_packed_attention(*args, **kwargs)

    monkeypatch.setattr(layers, "flex_packed_attention", counted)
    return calls


@pytest.fixture
def cpu_flex_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_flex, "_validate_device", allow_cpu_backward)


def allow_cpu_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Stands in for torch's ``_validate_device``: the one refusal CPU inputs meet there is of backward."""


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flex_gives_the_sdpa_masks_logits(variant, flex_calls):
    """As shipped (no patch): CPU runs FlexAttention's forward, e.g. in evaluation."""
    sdpa, flexed = twin_models(variant)
    tokens, positions, _ = packed_batch()
    with torch.no_grad():
        expected = sdpa(tokens, position_ids=positions)
        logits = flexed(tokens, position_ids=positions)
    assert len(flex_calls) == 2  # both layers
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flex_gives_the_sdpa_masks_gradients(variant, flex_calls, cpu_flex_backward):
    sdpa, flexed = twin_models(variant)
    tokens, positions, targets = packed_batch()
    for model in (sdpa, flexed):
        F.cross_entropy(model(tokens, position_ids=positions).flatten(0, 1), targets.flatten()).backward()
    assert len(flex_calls) == 2
    flex_grads = dict(flexed.named_parameters())
    for name, parameter in sdpa.named_parameters():
        assert parameter.grad.abs().sum() > 0, name
        torch.testing.assert_close(flex_grads[name].grad, parameter.grad, rtol=1e-5, atol=1e-6, msg=name)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def packed_fine_tune(tmp_path: Path, packed_attention: str, steps: int = 2) -> list[float]:
    """The losses of a short packed fine-tune on CPU (FinetuneModule, SFTDataModule(packing=True))."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       sliding_window=8, sliding_window_layers=[0], packed_attention=packed_attention)
    module = FinetuneModule(config=config, tokenizer="byte", learning_rate=1e-2, warmup_steps=1)
    data = SFTDataModule(str(write_examples(tmp_path / "train.jsonl")), tokenizer="byte", seq_len=64,
                         batch_size=4, packing=True)
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[recorder], default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    return recorder.losses


def test_flex_cannot_train_on_cpu_in_this_torch(tmp_path):
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        packed_fine_tune(tmp_path, "flex")


def test_a_packed_fine_tune_through_flex_takes_the_sdpa_steps(tmp_path, flex_calls, cpu_flex_backward):
    flexed = packed_fine_tune(tmp_path, "flex")
    assert len(flex_calls) == 2 * 2  # layers x steps
    sdpa = packed_fine_tune(tmp_path, "sdpa")
    assert len(flexed) == 2 and flexed[1] != flexed[0]  # the optimizer step changed the model
    assert flexed == pytest.approx(sdpa, rel=1e-5)


def test_auto_is_flex_on_cuda_without_dropout_only():
    auto = GPTConfig(vocab_size=64, packed_attention="auto")
    with_dropout = GPTConfig(vocab_size=64, dropout=0.1, packed_attention="auto")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not flex.uses_flex(GPTConfig(vocab_size=64), cuda)  # sdpa until flex has run on a GPU here
    assert flex.uses_flex(auto, cuda) and not flex.uses_flex(auto, cpu)
    assert not flex.uses_flex(with_dropout, cuda)  # flex_attention has no dropout
    assert flex.uses_flex(GPTConfig(vocab_size=64, packed_attention="flex"), cpu)
    assert not flex.uses_flex(GPTConfig(vocab_size=64, packed_attention="sdpa"), cuda)
    with pytest.raises(UserInputError, match="packed_attention='flex' with dropout=0.1"):
        GPTConfig(vocab_size=64, dropout=0.1, packed_attention="flex")
    with pytest.raises(UserInputError, match="packed_attention='varlen' is not one of auto, sdpa, flex"):
        GPTConfig(vocab_size=64, packed_attention="varlen")


def test_a_fine_tune_sets_the_kernel_over_its_init_froms_config(tmp_path):
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    save_safetensors(GPT(config), tmp_path / "base")
    assert FinetuneModule(str(tmp_path / "base")).config.packed_attention == "sdpa"
    module = FinetuneModule(str(tmp_path / "base"), packed_attention="auto")
    assert module.config == dataclasses.replace(config, packed_attention="auto")


def test_the_kernel_choice_does_not_stop_a_hugging_face_export():
    config = GPTConfig(vocab_size=64, n_head=4, n_kv_head=2, family="llama", packed_attention="flex")
    assert hf_config(config)["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow  # inductor compiles the mask's creation and the attention as C++: ~20 s each on 2 cores
@pytest.mark.parametrize("compiled", ["kernels", "whole-model"])
def test_compiled_flex_gives_the_sdpa_masks_logits(monkeypatch, flex_calls, compiled):
    """CUDA compiles create_block_mask and flex_attention (kernels), or they are compiled with the model
    (``compile=True``). Compiled on CPU here: the mask and score modifications trace whole (fullgraph)
    and give the same logits."""
    monkeypatch.setattr(flex, "COMPILED_ON", ("cpu",))
    flex._compiled.cache_clear()
    sdpa, flexed = twin_models("gemma2-softcap-window-gqa")
    tokens, positions, _ = packed_batch()
    with torch.no_grad():
        expected = sdpa(tokens, position_ids=positions)
        logits = (flexed if compiled == "kernels" else torch.compile(flexed))(tokens, position_ids=positions)
    assert len(flex_calls) == 2
    # by themselves, else in the model's graph
    assert flex._compiled.cache_info().currsize == (2 if compiled == "kernels" else 0)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _tensor_parallel_worker(out_dir: str) -> None:
    """Run by torchrun on 2 gloo ranks: a tp=2 GPT through FlexAttention (each rank its own heads, plain
    local tensors) and a one-process GPT through SDPA's mask take a forward and backward of the same packed
    rows; logits and whole gradients saved."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_train._compat import end_distributed_process
    from lightning_train.strategies.tensor_parallel import apply_tensor_parallel, reduce_partial_grads

    torch_flex._validate_device = allow_cpu_backward  # as cpu_flex_backward
    torch.distributed.init_process_group("gloo")
    sdpa, flexed = twin_models("gemma2-softcap-window-gqa")
    apply_tensor_parallel(flexed, init_device_mesh("cpu", (2,)), loss_parallel=False)
    tokens, positions, targets = packed_batch()
    logits = {}
    for name, model in (("sdpa", sdpa), ("flex", flexed)):
        logits[name] = model(tokens, position_ids=positions)
        F.cross_entropy(logits[name].flatten(0, 1), targets.flatten()).backward()
    reduce_partial_grads(flexed)
    grads = {name: (parameter.grad.full_tensor(), sdpa.get_parameter(name).grad)
             for name, parameter in flexed.named_parameters()}
    rank = torch.distributed.get_rank()
    torch.save({"logits": {k: v.detach() for k, v in logits.items()}, "grads": grads,
                "local_heads": flexed.blocks[0].attn.n_head}, Path(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()  # no rank tears gloo down while the other is still in a collective
    end_distributed_process(0)


@pytest.mark.slow  # torchrun, 2 ranks
def test_flex_under_tensor_parallelism_gives_one_process_sdpa_logits_and_gradients(tmp_path):
    result = run_torchrun(2, "-m", "tests.test_packing_flex", str(tmp_path), cwd=REPO, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert report["local_heads"] == 2  # of 4
        torch.testing.assert_close(report["logits"]["flex"], report["logits"]["sdpa"], rtol=1e-5, atol=1e-5)
        for name, (flex_grad, sdpa_grad) in report["grads"].items():
            torch.testing.assert_close(flex_grad, sdpa_grad, rtol=1e-5, atol=1e-6, msg=name)


if __name__ == "__main__":  # the tensor-parallel worker, started by torchrun
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _tensor_parallel_worker(sys.argv[1])
