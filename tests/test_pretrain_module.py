import json
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_train.errors import UserInputError
from lightning_train.modules.pretrain import PretrainModule, warmup_cosine


def _batch(config, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=g)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


class _OneBatch(L.LightningDataModule):
    """The same batch over and over (and for validation); ``max_token_id``/``seq_len`` as a real
    data module reports them."""

    def __init__(self, batch, max_token_id=None, seq_len=None):
        super().__init__()
        self.batch, self.max_token_id, self.seq_len = batch, max_token_id, seq_len

    def train_dataloader(self):
        return DataLoader([self.batch] * 100, batch_size=None)

    def val_dataloader(self):
        return DataLoader([self.batch] * 2, batch_size=None)


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer; validation only where a test asks for it (``limit_val_batches``)."""
    defaults = dict(
        accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_a_few_steps_on_one_batch_lower_the_loss(tiny_config, tmp_path):
    torch.manual_seed(0)
    module = PretrainModule(tiny_config, learning_rate=3e-3, warmup_steps=2)
    batch = _batch(tiny_config)
    module.configure_model()
    with torch.no_grad():
        before = module.compute_loss(module(batch["input_ids"]), batch["labels"]).item()
    trainer = _trainer(tmp_path, max_steps=20)
    trainer.fit(module, datamodule=_OneBatch(batch))
    with torch.no_grad():
        after = module.compute_loss(module(batch["input_ids"]), batch["labels"]).item()
    assert after < 0.8 * before
    assert trainer.callback_metrics["train/loss"] < before


def test_lr_schedule_warms_up_then_decays_to_min():
    def lr(step):
        return 1e-3 * warmup_cosine(step, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)

    assert lr(0) == pytest.approx(1e-4)
    assert lr(9) == pytest.approx(1e-3)
    assert lr(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way through the cosine
    assert lr(110) == pytest.approx(1e-4)
    assert lr(500) == pytest.approx(1e-4)


def test_scheduler_follows_optimizer_steps(tiny_config, tmp_path):
    module = PretrainModule(tiny_config, learning_rate=1e-3, min_lr=1e-4, warmup_steps=4)
    trainer = _trainer(tmp_path, max_steps=12)
    trainer.fit(module, datamodule=_OneBatch(_batch(tiny_config)))
    # after 12 optimizer steps the schedule (decay_steps = max_steps = 12) has reached min_lr
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 12


def test_no_weight_decay_on_norms_biases_and_embeddings(tiny_config):
    module = PretrainModule(tiny_config)
    module.configure_model()
    groups = {g["name"]: g for g in module.configure_param_groups()}
    names = {id(p): n for n, p in module.model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert "embed.weight" in no_decay and "norm.weight" in no_decay
    assert all(
        names[id(p)].endswith(("qkv.weight", "proj.weight", "gate.weight", "up.weight", "down.weight"))
        for p in groups["decay"]["params"]
    )
    assert groups["no_decay"]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    ("max_token_id", "seq_len", "message"),
    [(300, 32, "token id 300.*vocab_size is 258"), (10, 64, "seq_len=64.*block_size=32")],
)
def test_data_that_does_not_fit_the_model_is_refused(tiny_config, tmp_path, max_token_id, seq_len, message):
    module = PretrainModule(tiny_config)
    with pytest.raises(UserInputError, match=message):
        _trainer(tmp_path, max_steps=1).fit(
            module, datamodule=_OneBatch(_batch(tiny_config), max_token_id, seq_len)
        )


def test_val_ppl_is_exp_of_val_loss(tiny_config, tmp_path):
    data = _OneBatch(_batch(tiny_config))
    module = PretrainModule(tiny_config)
    _trainer(tmp_path, max_steps=2).fit(module, datamodule=data)
    metrics = _trainer(tmp_path, limit_val_batches=1.0).validate(module, datamodule=data, verbose=False)[0]
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-5)


def test_validate_then_fit_in_one_process(tiny_config, tmp_path):
    data = _OneBatch(_batch(tiny_config))
    module = PretrainModule(tiny_config)
    _trainer(tmp_path, limit_val_batches=1.0).validate(module, datamodule=data, verbose=False)
    trainer = _trainer(tmp_path, max_steps=2, val_check_interval=1, limit_val_batches=1.0)
    trainer.fit(module, datamodule=data)
    assert torch.isfinite(trainer.callback_metrics["val/loss"])


def test_readme_snippet_trains_on_the_default_corpus(tmp_path, monkeypatch):
    """README "The callbacks in your own Trainer", its module and data as written: GPTConfig says no
    vocab_size, so the model takes the corpus's 258 (bytes, end of text, pad), padded to 320. The default
    was 256: token 256 failed fit."""
    from lightning_train import GPTConfig, TextDataModule
    from tests.conftest import cli_env

    monkeypatch.setenv("LIGHTNING_TRAIN_CACHE", cli_env()["LIGHTNING_TRAIN_CACHE"])
    module = PretrainModule(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128), learning_rate=2e-3)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", gradient_clip_val=1.0, default_root_dir=tmp_path,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, TextDataModule(seq_len=128, batch_size=16))
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.model.embed.num_embeddings == 320
    (checkpoint,) = (tmp_path / "lightning_logs").rglob("*.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["hyper_parameters"]["config"]
    assert saved.vocab_size == 320  # a complete source for FinetuneModule and generate


def test_vocab_size_left_unset_without_data_that_knows_it_is_one_clear_error(tmp_path):
    from lightning_train import GPTConfig

    module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32))
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
    with pytest.raises(UserInputError, match="vocab_size is not set and no data module gave one"):
        _trainer(tmp_path, max_steps=1).fit(module, DataLoader([batch], batch_size=None))


def _logged_train_loss(run_dir) -> dict[int, float]:
    import csv

    (metrics,) = run_dir.rglob("metrics.csv")
    rows = csv.DictReader(metrics.open())
    return {int(row["step"]): float(row["train/loss"]) for row in rows if row["train/loss"]}


def test_two_rank_train_loss_is_the_mean_over_the_global_batch(tmp_path):
    """Real 2-rank gloo DDP (2 micro-batches of 2 per rank) against one process with the same global batch
    of 8: the logged train/loss agrees at each logging step (it used to be rank 0's own value), and the
    validation metrics, synced by torchmetrics, bring no "use sync_dist=True" warning."""
    from tests.conftest import REPO, run_cli

    model = {"vocab_size": 258, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
    common = [
        "fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"), "--trainer.callbacks=[]",
        "--trainer.max_steps=4", "--trainer.log_every_n_steps=2", "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu",
        "--model.init_args.warmup_steps=1", "--data.init_args.seq_len=32",
        f"--model.init_args.config={json.dumps(model)}",
    ]
    runs = {
        "one": ["--trainer.devices=1", "--data.init_args.batch_size=8"],
        "ddp": ["--trainer.devices=2", "--trainer.strategy=lt_ddp", "--data.init_args.batch_size=2",
                "--trainer.accumulate_grad_batches=2"],
    }
    logged = {}
    for name, args in runs.items():
        result = run_cli(*common, *args, f"--trainer.default_root_dir={tmp_path / name}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        logged[name] = _logged_train_loss(tmp_path / name)
        assert "sync_dist" not in result.stderr + result.stdout
    assert sorted(logged["one"]) == sorted(logged["ddp"]) == [1, 3]
    for step, loss in logged["one"].items():
        assert logged["ddp"][step] == pytest.approx(loss, rel=1e-5, abs=0), step
