"""Pretrained weights read a slice at a time (``checkpoint/slices.py``): any box of any tensor, read from an
HF folder through ``get_slice`` (renamed, fused, per-head and transposed tensors), our sharded folder
through DCP, or a memory-mapped file, equals that box of the whole state dict, a LoRA fine-tune's adapters
folded in box by box; on real gloo ranks a tiny Llama folder loaded under fsdp and tp=2, and a LoRA
fine-tune's .ckpt under fsdp, give one process's weights and logits, and on ~50 M parameters
no rank's peak host memory rises by more than 0.6x the model's bytes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_train.checkpoint import open_pretrained, save_safetensors
from lightning_train.checkpoint.sharded import save_sharded_checkpoint
from lightning_train.checkpoint.slices import load_slices
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.lora import LoRAConfig, apply_lora
from tests.conftest import REPO, cli_env
from tests.helpers.lora_names import to_adapted_names

transformers = pytest.importorskip("transformers")
from tests.test_hf_families import SMALL, hf_folder  # noqa: E402 (needs transformers)

RUN = REPO / "tests" / "helpers" / "meta_init_run.py"


def _boxes(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Uneven boxes covering ``shape``: the rows in three runs (crossing q/k/v and per-head boundaries),
    the columns of a matrix in two."""
    def runs(n: int, parts: int) -> list[tuple[int, int]]:
        edges = sorted({0, n, *(min(n, n * i // parts + 1) for i in range(1, parts))})
        return [(start, end - start) for start, end in zip(edges, edges[1:], strict=False)]

    rows = runs(shape[0], 3)
    if len(shape) == 1:
        return [((r,), (n,)) for r, n in rows]
    return [((r, c), (n, m)) for r, n in rows for c, m in runs(shape[1], 2)]


def _check_every_box(source: str | Path, exact: bool = True) -> None:
    """Every box of ``_boxes`` read in slices equals that box of the whole state dict: bit for bit, or for a
    LoRA fine-tune's merged weights within float32 rounding (B @ A of a box sums in its own order)."""
    pretrained = open_pretrained(source)
    whole = pretrained.read_state_dict()
    slices = pretrained.slices()
    assert slices.shapes == {name: tuple(tensor.shape) for name, tensor in whole.items()}
    requests, expected = [], []
    for name, tensor in whole.items():
        for offsets, sizes in _boxes(tuple(tensor.shape)):
            requests.append((name, offsets, torch.empty(sizes, dtype=tensor.dtype)))
            expected.append(tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))])
    slices.fill(requests)
    for (name, offsets, got), want in zip(requests, expected, strict=True):
        if exact:
            assert torch.equal(got, want), (name, offsets)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{name} at {offsets}")


@pytest.mark.parametrize("name", ["llama3", "qwen3", "phi3", "gpt-neox", "gemma"])
def test_every_box_of_an_hf_folder_is_the_whole_tensors_box(tmp_path, name):
    """GQA q/k/v fused from three tensors, qk norms, Phi-3's fused qkv and gate_up, GPT-NeoX's rows per
    head, a tied embedding; bf16 as saved."""
    hf_folder(name, tmp_path / name, torch.bfloat16)
    _check_every_box(tmp_path / name)


def test_every_box_of_a_sharded_gpt2_folder_is_the_whole_tensors_box(tmp_path):
    """GPT-2's transposed Conv1D weights, from a folder of several safetensors files and its index."""
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2", max_shard_size="100KB")
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").is_file()
    _check_every_box(tmp_path / "gpt2")


def test_every_box_of_our_folder_and_files_is_the_whole_tensors_box(tmp_path):
    """Our sharded folder (DCP reads the boxes), our export (safetensors), a .ckpt (memory-mapped)."""
    config = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    weights = GPT(config).state_dict()
    state = {f"model.{name}": tensor for name, tensor in weights.items()}
    hparams = {"config": dataclasses.asdict(config), "tokenizer": None}
    folder = tmp_path / "step=1"
    save_sharded_checkpoint({"state_dict": dict(state), "hyper_parameters": hparams}, folder, is_writer=True,
                            barrier=lambda: None)
    torch.save({"state_dict": state, "hyper_parameters": hparams}, tmp_path / "last.ckpt")
    exported = save_safetensors(GPT(config), tmp_path / "export")
    for source in (folder, tmp_path / "last.ckpt", exported):
        _check_every_box(source)


def _lora_checkpoint(config: GPTConfig, lora: LoRAConfig) -> tuple[dict, dict]:
    """The state dict and hyper-parameters a LoRA fine-tune of ``config`` saves, its adapters as if trained
    (B is zero when they start)."""
    torch.manual_seed(0)
    model = apply_lora(GPT(config), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    hparams = {"config": dataclasses.asdict(config), "tokenizer": "byte", "lora": dataclasses.asdict(lora)}
    return state, hparams


@pytest.mark.parametrize("targets", [["q", "k", "v", "proj", "up"], ["qkv", "down", "lm_head"]])
def test_every_box_of_a_lora_finetunes_checkpoint_is_the_merged_tensors_box(tmp_path, targets):
    """A LoRA fine-tune's .ckpt (memory-mapped) and sharded folder (DCP): each box of a merged weight is the
    box of ``merge_lora``'s whole weight (adapters on q, k and v split from the fused qkv, or on the fused
    qkv; on an untied head), so an ``init_from`` of it is read in slices too."""
    config = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       tie_embeddings=False)
    lora = LoRAConfig(rank=3, alpha=6.0, target_modules=targets)
    state, hparams = _lora_checkpoint(config, lora)
    folder = tmp_path / "step=1"
    save_sharded_checkpoint({"state_dict": dict(state), "hyper_parameters": hparams}, folder, is_writer=True,
                            barrier=lambda: None)
    torch.save({"state_dict": state, "hyper_parameters": hparams}, tmp_path / "last.ckpt")
    for source in (folder, tmp_path / "last.ckpt"):
        assert open_pretrained(source).lora == lora
        _check_every_box(source, exact=False)


def test_load_slices_fills_a_lora_models_split_qkv_from_its_rows(tmp_path):
    """q, k and v of a LoRA model (split from the fused qkv) take their rows of it; the adapters stay."""
    hf_folder("llama3", tmp_path / "llama")
    pretrained = open_pretrained(tmp_path / "llama")
    model = apply_lora(GPT(pretrained.config), LoRAConfig(rank=2, target_modules=["q", "k", "v", "proj"]))
    adapters = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    load_slices(model, pretrained.slices(), pretrained.config, pretrained.source)
    own = model.state_dict()
    for name, tensor in to_adapted_names(pretrained.read_state_dict(), model).items():
        assert torch.equal(own[name], tensor), name
    assert all(torch.equal(own[n], p) for n, p in adapters.items())


# ---- real gloo ranks -----------------------------------------------------------------------------------
def _run(out: Path, *args: str) -> list[tuple[dict, dict[str, torch.Tensor], torch.Tensor | None]]:
    """``meta_init_run.py`` under ``args``; per rank its report, the whole weights its stages hold and
    the logits of fixed tokens, before the first step."""
    result = subprocess.run([sys.executable, str(RUN), str(out), *args], cwd=out.parent, env=cli_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = []
    for report in sorted(out.glob("rank*.json")):
        weights, logits = report.with_suffix(".safetensors"), report.with_suffix(".logits.safetensors")
        ranks.append((json.loads(report.read_text()), load_file(weights) if weights.exists() else {},
                      load_file(logits)["logits"] if logits.exists() else None))
    return ranks


@pytest.mark.slow  # real process groups: ~1 minute a launch on 2 shared cores
@pytest.mark.parametrize("layout", [["--devices=2"], ["--devices=2", "--tp=2"], ["--devices=2", "--pp=2"]],
                         ids=["fsdp", "tp", "pp"])
def test_an_hf_folder_loaded_in_slices_gives_one_process_weights_and_logits(tmp_path, layout):
    """A tiny Llama folder in safetensors shards: each rank reads its slices (a pipeline stage: its own
    layers); gathered, the weights are exactly one process's loading it whole, and the logits the same."""
    config = transformers.LlamaConfig(**SMALL | {"vocab_size": 64, "max_position_embeddings": 16})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama", max_shard_size="100KB")
    source = f"--init_from={tmp_path / 'llama'}"
    [(one, whole, one_logits)] = _run(tmp_path / "one", "--devices=1", source)
    assert one["built_on"] == ["cpu"]
    ranks = _run(tmp_path / "sharded", *layout, source)
    assert len(ranks) == 2
    held = set()
    for report, weights, logits in ranks:
        assert report["built_on"] == ["meta"]
        assert report["local_param_bytes"] <= 0.8 * report["model_param_bytes"]
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, whole[name], rtol=0, atol=0, msg=name)
        if logits is not None:  # not under pipeline parallelism: a stage's output is not the logits
            torch.testing.assert_close(logits, one_logits, rtol=1e-5, atol=1e-5)
        held |= weights.keys()
    assert held == whole.keys()


@pytest.mark.slow
def test_a_lora_finetunes_checkpoint_loaded_in_slices_gives_one_process_weights(tmp_path):
    """A LoRA fine-tune's .ckpt as ``init_from`` on 2 fsdp ranks: each rank folds the adapters into its own
    boxes; gathered, the weights are one process's, which merges them whole (to float32 rounding)."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32)
    state, hparams = _lora_checkpoint(config, LoRAConfig(rank=2, alpha=4.0))
    torch.save({"state_dict": state, "hyper_parameters": hparams}, tmp_path / "lora.ckpt")
    source = f"--init_from={tmp_path / 'lora.ckpt'}"
    [(_, whole, one_logits)] = _run(tmp_path / "one", "--devices=1", source)
    ranks = _run(tmp_path / "sharded", "--devices=2", source)
    assert len(ranks) == 2
    for report, weights, logits in ranks:
        assert report["built_on"] == ["meta"]
        assert weights.keys() == whole.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, whole[name], rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(logits, one_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_no_rank_holds_the_whole_model_loading_an_hf_folder(tmp_path):
    """~111 M parameters (445 MB in fp32) from an HF folder on 2 fsdp ranks: each rank's peak resident
    memory rises by at most 0.6x the model's bytes from before the model is built to the first step (half
    the model, plus ~20-25 MB the process allocates beside it: at 60 M parameters that reached 0.601x once
    in CI); one process, the control, by more than the model's bytes (model and state dict read whole)."""
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=16, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    source = f"--init_from={tmp_path / 'llama'}"
    [(one, _, _)] = _run(tmp_path / "one", "--devices=1", source, "--no_weights")
    assert one["model_param_bytes"] > 200e6
    assert one["rss_rise"] >= 1.0 * one["model_param_bytes"], one
    ranks = _run(tmp_path / "fsdp", "--devices=2", source, "--no_weights")
    assert len(ranks) == 2
    for report, _, _ in ranks:
        assert report["built_on"] == ["meta"]
        assert report["rss_rise"] <= 0.6 * report["model_param_bytes"], report
