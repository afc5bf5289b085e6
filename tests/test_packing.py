"""SFT packing (``SFTDataModule(packing=True)``): examples packed into full rows keep their own attention,
positions and loss. Each example's loss in a packed batch is its loss in the padded (unpacked) batches on
the same weights, for our GPT's block variants and every Hugging Face family it loads; an example never
sees another; only response tokens carry loss; a fit with FinetuneModule runs through the CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_train import GPT, GPTConfig, PretrainModule, SFTDataModule
from lightning_train.checkpoint import open_pretrained, save_safetensors
from lightning_train.data.sft import PadCollate
from lightning_train.errors import UserInputError
from tests.conftest import REPO, run_cli


def write_examples(path: Path, count: int = 48) -> Path:
    """Prompt/response pairs of varied lengths: rows hold several examples, with padding at their ends."""
    rows = [{"prompt": f"{'x' * (n % 7)}{n} + {n % 5} = ", "response": f"{n + n % 5}{'!' * (n % 4)}"}
            for n in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def example_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each example of a packed row: a new one starts at each position 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    return list(zip(starts, [*starts[1:], len(position_ids)], strict=True))


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")


def unpacked_losses(model: GPT, data: SFTDataModule) -> dict[tuple[int, ...], torch.Tensor]:
    """Each training example's mean loss (keyed by its input ids) from padded batches of 8."""
    rows = data.train_set.rows
    collate, losses = PadCollate(data.tokenizer.pad_id), {}
    for first in range(0, len(rows), 8):
        chunk = [{"input_ids": ids, "labels": labels} for ids, labels in rows[first : first + 8]]
        batch = collate(chunk)
        with torch.no_grad():
            token_losses = per_token_losses(model(batch["input_ids"]), batch["labels"]).view(len(chunk), -1)
        for example, row_losses in zip(chunk, token_losses, strict=True):
            scored = torch.tensor(example["labels"]) != -100
            losses[tuple(example["input_ids"])] = row_losses[: len(scored)][scored].mean()
    return losses


def packed_losses(model: GPT, data: SFTDataModule) -> dict[tuple[int, ...], torch.Tensor]:
    """Each training example's mean loss from one batch of all the packed rows."""
    losses = {}
    batch = torch.utils.data.default_collate([data.train_set[i] for i in range(len(data.train_set))])
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"])
    token_losses = per_token_losses(logits, batch["labels"]).view(batch["labels"].shape)
    for row in range(len(batch["input_ids"])):
        for start, end in example_spans(batch["position_ids"][row]):
            scored = batch["labels"][row, start:end] != -100
            if scored.any():  # the row's padding is an "example" of its own, without targets
                key = tuple(batch["input_ids"][row, start:end].tolist())
                losses[key] = token_losses[row, start:end][scored].mean()
    return losses


def sft_data(tmp_path: Path, packing: bool, seq_len: int = 64) -> SFTDataModule:
    data = SFTDataModule(str(write_examples(tmp_path / "train.jsonl")), tokenizer="byte", seq_len=seq_len,
                         batch_size=4, packing=packing)
    data.setup("fit")
    return data


def assert_same_example_losses(model: GPT, tmp_path: Path) -> None:
    unpacked = unpacked_losses(model, sft_data(tmp_path, packing=False))
    packed = packed_losses(model, sft_data(tmp_path, packing=True))
    assert packed.keys() == unpacked.keys() and len(packed) > 40
    for key, loss in unpacked.items():
        torch.testing.assert_close(packed[key], loss, rtol=1e-5, atol=1e-6)


GPT_VARIANTS = {
    "llama-gqa": {"n_kv_head": 1},
    "gpt2-learned-positions": {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True},
    "sliding-window-softcap": {"sliding_window": 5, "sliding_window_layers": [0], "attn_softcap": 5.0},
}


@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
def test_packed_example_losses_equal_the_padded_ones(tmp_path, variant):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, block_size=64, n_layer=2, n_head=2, n_embd=32, init_std=0.2,
                          **GPT_VARIANTS[variant])).eval()
    assert_same_example_losses(model, tmp_path)


def test_packed_example_losses_equal_the_padded_ones_for_every_hf_family(tmp_path):
    """Every family of tests/test_hf_families.py (Llama, Qwen2 with its window, Gemma 2's soft-capping,
    GPT-NeoX's partial rotary, ...) as our GPT loads it."""
    from tests.test_hf_families import FAMILIES, hf_folder

    for name in FAMILIES:
        hf_folder(name, tmp_path / name)
        model = open_pretrained(tmp_path / name).build().float().eval()
        torch.manual_seed(0)
        tokens = torch.randint(2, 300, (3, 20))
        packed = torch.cat([tokens[0, :7], tokens[1], tokens[2, :9], torch.zeros(4, dtype=torch.long)])
        positions = torch.cat([torch.arange(7), torch.arange(20), torch.arange(9), torch.arange(4)])
        with torch.no_grad():
            alone = [model(tokens[i : i + 1, :n])[0] for i, n in enumerate((7, 20, 9))]
            logits = model(packed[None], position_ids=positions[None])[0]
        for (start, end), expected in zip(example_spans(positions)[:3], alone, strict=True):
            torch.testing.assert_close(logits[start:end], expected, rtol=1e-5, atol=1e-5, msg=name)


def test_an_example_never_sees_another(tmp_path):
    """Changing the first example of a row leaves the second's logits exactly as they were."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    row = sft_data(tmp_path, packing=True).train_set[0]
    (start, end), (second, second_end) = example_spans(row["position_ids"])[:2]
    changed = row["input_ids"].clone()
    changed[start:end] = (changed[start:end] + 7) % 256
    with torch.no_grad():
        before = model(row["input_ids"][None], position_ids=row["position_ids"][None])[0]
        after = model(changed[None], position_ids=row["position_ids"][None])[0]
    assert not torch.allclose(before[start:end], after[start:end])
    assert torch.equal(before[second:second_end], after[second:second_end])


def test_rows_are_full_positions_restart_and_only_responses_carry_loss(tmp_path):
    packed, padded = sft_data(tmp_path, packing=True), sft_data(tmp_path, packing=False)
    tokenizer, rows = packed.tokenizer, [packed.train_set[i] for i in range(len(packed.train_set))]
    assert all(len(row["input_ids"]) == 64 for row in rows) and len(rows) < len(padded.train_set) / 3
    examples = []
    for row in rows:
        spans = example_spans(row["position_ids"])
        for start, end in spans:
            assert row["position_ids"][start:end].tolist() == list(range(end - start))  # restarts at 0
        for start, end in spans:
            labels = row["labels"][start:end]
            if (labels == -100).all():  # the row's padding
                assert (row["input_ids"][start:end] == tokenizer.pad_id).all()
                continue
            text = tokenizer.decode(row["input_ids"][start:end].tolist())
            prompt, response = text.split(" = ")
            assert tokenizer.decode(labels[labels != -100].tolist()) == response + "<|endoftext|>"
            examples.append((prompt, response))
    # every example exactly once, as the padded batches hold them
    expected = [tokenizer.decode(ids).split(" = ") for ids, _ in padded.train_set.rows]
    assert sorted(examples) == sorted(map(tuple, expected))
    assert packed.train_set.padding_fraction < 0.2
    assert packed.describe_train_set() == f"{len(rows)} packed rows ({len(expected)} examples)"


class EmbeddingOnly(PretrainModule):
    """A module whose model is not our GPT: nothing in it keeps packed examples apart."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Embedding(self.config.vocab_size, self.config.vocab_size)


def test_rows_are_packed_best_fit():
    """Each example goes into the row with the least room that holds it: next-fit would leave 3 rows here."""
    from lightning_train.data.packing import pack

    assert pack([5, 5, 3, 3], seq_len=8) == [[0, 2], [1, 3]]
    assert pack([6, 3, 2, 1, 4], seq_len=8) == [[0, 2], [1, 3, 4]]  # 2 into the row of room 2, not 5
    lengths = torch.randint(1, 30, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = pack(lengths, seq_len=32)
    assert sorted(i for row in rows for i in row) == list(range(500))  # each example once, in order in a row
    assert all(sum(lengths[i] for i in row) <= 32 and row == sorted(row) for row in rows)
    assert sum(lengths) / (32 * len(rows)) > 0.93  # next-fit: 0.75


def test_packed_batches_need_our_gpt():
    module = EmbeddingOnly(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    module.configure_model()
    tokens = torch.zeros(1, 8, dtype=torch.long)
    assert module(tokens).shape == (1, 8, 64)  # unpacked batches: any model
    message = r"data.packing=true needs our GPT \(model: Embedding\); set data.packing=false"
    with pytest.raises(UserInputError, match=message):
        module(tokens, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))


@pytest.mark.slow  # two CLI runs
def test_a_packed_fit_runs_from_the_cli_and_resumes_its_data_position(tmp_path):
    torch.manual_seed(0)
    start = save_safetensors(GPT(GPTConfig(vocab_size=320, block_size=64, n_layer=1, n_head=2, n_embd=32)),
                             tmp_path / "start")
    args = ["fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"), "--model.init_from", str(start),
            "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--data.eval_prompts=2",
            "--data.batch_size=4", "--data.packing=true"]
    done = run_cli(*args, "--trainer.max_steps=2", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = tmp_path / "runs/finetune-tiny/checkpoints/last.ckpt"
    loops = torch.load(checkpoint, weights_only=False)["loops"]
    state = loops["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["consumed"] == 8 and "packed rows" in state["data"]
    resumed = run_cli(*args, "--trainer.max_steps=4", "--resume", "auto", cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(tmp_path / "runs/finetune-tiny/version_1/metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("val/loss")]
    assert logged and float(logged[-1]["val/loss"]) > 0
