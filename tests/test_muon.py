"""PretrainModule(optimizer="muon"): torch.optim.Muon on the blocks' matrices and AdamW on the rest, the same
update as one process under FSDP2 and tensor parallelism (2 real gloo ranks, torchrun)."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch

from lightning_train.checkpoint.sharded import read_whole_sharded_checkpoint
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.modules import PretrainModule
from lightning_train.modules.muon import GatheringMuon, MuonAdamW
from tests.conftest import REPO, run_cli, run_torchrun
from tests.helpers.tiny_runs import TINY, WithValidation


def muon_module(**kwargs) -> PretrainModule:
    config = GPTConfig(**{**TINY, "vocab_size": 64})
    module = PretrainModule(config, optimizer="muon", decay_steps=10, **kwargs)
    module.model = GPT(module.config)
    return module


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    module = muon_module()
    names = {id(p): n for n, p in module.model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in module.configure_param_groups()}
    assert groups["muon"] == sorted(n for n, p in module.model.named_parameters()
                                    if n.startswith("blocks.") and p.ndim == 2)
    assert {n.split(".")[-2] for n in groups["muon"]} == {"qkv", "proj", "gate", "up", "down"}
    assert "decay" not in groups  # the head is tied to the embedding, which decays not: no empty group
    assert "embed.weight" in groups["no_decay"] and "norm.weight" in groups["no_decay"]
    assert isinstance(module.configure_optimizers()["optimizer"], MuonAdamW)


def test_on_plain_tensors_the_steps_are_torch_optim_muons():
    torch.manual_seed(0)
    start = torch.randn(24, 8)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    options = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    optimizers = [GatheringMuon([ours], **options), torch.optim.Muon([theirs], **options)]
    for step in range(3):
        grad = torch.randn(24, 8, generator=torch.Generator().manual_seed(step))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(ours, theirs) and (ours - start).abs().max() > 0.01


def test_a_reloaded_optimizer_takes_the_same_next_step():
    def steps(module: PretrainModule, optimizer: torch.optim.Optimizer, n: int) -> None:
        for step in range(n):
            tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
            module.model(tokens[:, :-1]).logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    first = muon_module()
    optimizer = first.configure_optimizers()["optimizer"]
    steps(first, optimizer, 2)
    saved_weights = copy.deepcopy(first.model.state_dict())
    saved_state = copy.deepcopy(optimizer.state_dict())
    steps(first, optimizer, 1)

    second = muon_module()
    second.model.load_state_dict(saved_weights)
    reloaded = second.configure_optimizers()["optimizer"]
    reloaded.load_state_dict(saved_state)
    steps(second, reloaded, 1)
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_lightning_fit_with_muon_learns(tmp_path):
    L.seed_everything(0)
    module = PretrainModule(GPTConfig(**TINY), learning_rate=1e-2, warmup_steps=1, optimizer="muon")
    trainer = L.Trainer(max_steps=8, accelerator="cpu", logger=False, gradient_clip_val=1.0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    data = WithValidation()
    before = trainer.validate(module, data, verbose=False)[0]["val/loss"]
    trainer.fit(module, data)
    after = trainer.validate(module, data, verbose=False)[0]["val/loss"]
    assert trainer.global_step == 8 and after < before - 0.5


def test_an_unknown_optimizer_is_one_clear_error():
    with pytest.raises(UserInputError, match="optimizer='sgd' must be 'adamw' or 'muon'"):
        PretrainModule(optimizer="sgd")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_sharded_muon_takes_the_same_steps_as_one_process(tmp_path, layout):
    result = run_torchrun(2, "-m", "tests.helpers.muon_parity", layout, str(tmp_path), cwd=REPO, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    sharded_on = {"fsdp": ["(Shard(dim=0),)"], "tp": ["(Shard(dim=0),)", "(Shard(dim=1),)"]}[layout]
    for rank in ranks:
        assert rank["placements"] == sharded_on and rank["muon_matrices"] == 10  # the matrices really sharded
        assert max(rank["differences"]) < 1e-8  # 3 steps: every weight as the unsharded copy's
        assert rank["moved"] > 0.05  # and the steps moved the weights
    # orthogonalising a shard alone would be wrong by far more than the tolerance
    assert max(rank["shard_alone_difference"] for rank in ranks) > 0.01


@pytest.mark.slow
def test_an_fsdp_muon_run_resumed_ends_where_an_uninterrupted_one_does(tmp_path):
    """Through the CLI on 2 gloo ranks: the sharded checkpoint holds Muon's and AdamW's states, and 4 steps
    + a resume + 4 steps give the weights of 8 steps in one go."""
    def fit(run: str, steps: int) -> None:
        result = run_cli(
            "fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.devices", "2",
            "--trainer.strategy", "lt_fsdp", "--trainer.max_steps", str(steps), "--trainer.callbacks", "[]",
            "--trainer.limit_val_batches", "0", "--model.init_args.optimizer", "muon",
            "--model.config", json.dumps({**TINY, "block_size": 32}), "--data.seq_len", "32",
            "--data.batch_size", "2", "--run_name", run, "--resume", "auto", cwd=tmp_path, timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    fit("whole", 8)
    fit("resumed", 4)
    fit("resumed", 8)
    whole, resumed = (read_whole_sharded_checkpoint(tmp_path / "runs" / run / "checkpoints" / "last.ckpt")
                      for run in ("whole", "resumed"))
    assert whole["global_step"] == resumed["global_step"] == 8
    for name, tensor in whole["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), name
