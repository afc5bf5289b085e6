"""FP8 training (torchao's Float8Linear): the model is converted as documented, and every unsupported
setup (no torchao, CPU, nothing to convert) is refused with a clear message before training starts."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_train.errors import UserInputError
from lightning_train.models.float8 import check_float8_device, convert_to_float8
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules.pretrain import PretrainModule
from tests.conftest import REPO, run_cli


def test_without_torchao_conversion_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_config: GPTConfig):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` fail as if not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserInputError, match=r"needs torchao.*pip install torchao.*model.float8=false"):
        convert_to_float8(GPT(tiny_config))


def test_cpu_is_refused() -> None:
    with pytest.raises(UserInputError, match=r"CUDA GPU with compute capability >= 8.9.*'cpu'.*float8=false"):
        check_float8_device("cpu")


def test_linear_layers_are_converted_and_the_tied_head_is_kept() -> None:
    pytest.importorskip("torchao.float8")
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32))
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    assert convert_to_float8(model) is model
    for name in linears:  # qkv, proj, up, down of every block
        assert type(model.get_submodule(name)).__name__ == "Float8Linear", name  # torchao's class is private
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.embed.weight


def test_model_without_convertible_layers_is_refused() -> None:
    pytest.importorskip("torchao.float8")
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=24))  # 24 % 16 != 0
    with pytest.raises(UserInputError, match="no Linear layer with both dimensions a multiple of 16"):
        convert_to_float8(model)
    with pytest.raises(UserInputError, match="recipe 'blockwise' is not one of tensorwise"):
        convert_to_float8(GPT(GPTConfig(vocab_size=256, n_embd=32, n_head=2)), recipe="blockwise")


def test_pretrain_module_refuses_float8_on_cpu_before_training(tiny_config: GPTConfig) -> None:
    module = PretrainModule(tiny_config, float8=True)
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(UserInputError, match="this run is on 'cpu'"):
        trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    assert trainer.global_step == 0


def test_cli_float8_on_cpu_is_a_one_line_error(tmp_path: Path) -> None:
    done = run_cli(
        "fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--model.init_args.float8=true",
        "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: float8 training needs a CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
