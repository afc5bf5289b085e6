"""SFTDataModule: loss only on responses, padding, chat template, resumable order, bad lines."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_train.data.sft import SFTDataModule
from lightning_train.data.tasks import default_task_dir, snake_to_camel
from lightning_train.data.tokenizers import ByteTokenizer
from lightning_train.errors import UserInputError

EOS, PAD = ByteTokenizer.eos_id, ByteTokenizer.pad_id


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def data_module(tmp_path, rows, **kwargs) -> SFTDataModule:
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    data = SFTDataModule(train, val, tokenizer="byte", **kwargs)
    data.setup()
    return data


def test_prompt_tokens_carry_no_loss_and_padding_is_ignored(tmp_path):
    rows = [{"prompt": "Q: 2+2?\nA: ", "response": "4"}, {"prompt": "Q: hi\nA: ", "response": "hello"}]
    data = data_module(tmp_path, rows, batch_size=2, seq_len=64)
    batch = next(iter(data.val_dataloader()))
    for row, example in enumerate(rows):
        prompt, response = example["prompt"].encode(), example["response"].encode()
        tokens = list(prompt) + list(response) + [EOS]
        n = len(tokens) - 1
        assert batch["input_ids"][row, :n].tolist() == tokens[:-1]
        # labels[t] is the token after position t: only response tokens and the final eos are targets
        expected = [-100] * (len(prompt) - 1) + list(response) + [EOS]
        assert batch["labels"][row, :n].tolist() == expected
        assert (batch["input_ids"][row, n:] == PAD).all() and (batch["labels"][row, n:] == -100).all()
    longest = max(len(r["prompt"] + r["response"]) for r in rows)
    assert batch["input_ids"].shape[1] == longest  # padded to the longest example


def test_batches_pad_to_a_multiple_for_sequence_parallelism(tmp_path):
    """pad_to_multiple_of (by default the Trainer's tensor_parallel size: sequence parallelism splits every
    sequence into that many parts) rounds the padded width up; a seq_len it does not divide is one error."""
    rows = [{"prompt": "Q: 2+2?\nA: ", "response": "4"}, {"prompt": "Q: hi\nA: ", "response": "hello"}]
    longest = max(len(r["prompt"] + r["response"]) for r in rows)  # 14: the batch's width without a multiple
    data = data_module(tmp_path, rows, batch_size=2, seq_len=64, pad_to_multiple_of=8)
    batch = next(iter(data.val_dataloader()))
    assert longest % 8 and batch["input_ids"].shape[1] == batch["labels"].shape[1] == 16
    assert (batch["labels"][:, longest:] == -100).all()
    with pytest.raises(UserInputError, match=r"data.seq_len=63 does not divide by 8, the multiple batches"):
        data_module(tmp_path, rows, batch_size=2, seq_len=63, pad_to_multiple_of=8).val_dataloader()
    with pytest.raises(UserInputError, match="pad_to_multiple_of=0 must be at least 1"):
        SFTDataModule(pad_to_multiple_of=0)


def test_chat_template_trains_assistant_turns_only(tmp_path):
    rows = [{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    ]}]
    data = data_module(tmp_path, rows, batch_size=1, seq_len=128)
    batch = data.val_set[0]
    text = (
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello\x00"
        "<|user|>\nBye\n<|assistant|>\nCiao\x00"
    )
    tokens = [EOS if b == 0 else b for b in text.encode()]
    assert batch["input_ids"] == tokens[:-1]
    trained = [label for label in batch["labels"] if label != -100]
    assert trained == list(b"Hello") + [EOS] + list(b"Ciao") + [EOS]
    prompt, response = data.eval_examples[0]
    rendered = text.replace("\x00", "<|endoftext|>")
    assert ByteTokenizer().decode(prompt) == rendered.removesuffix("Ciao<|endoftext|>")
    assert bytes(response) == b"Ciao"


def test_line_without_fields_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "answer": "b"}\n', encoding="utf-8")
    data = SFTDataModule(str(path), tokenizer="byte")
    with pytest.raises(UserInputError, match=rf"{path}:3: expected .*got keys \['answer', 'prompt'\]"):
        data.setup()
    path.write_text('{"messages": [{"role": "user", "content": "x"}]}\n', encoding="utf-8")
    with pytest.raises(UserInputError, match=rf"{path}:1: the last message must be the assistant's"):
        SFTDataModule(str(path), tokenizer="byte").setup()
    with pytest.raises(UserInputError, match=r"does not exist"):
        SFTDataModule(str(tmp_path / "missing.jsonl"), tokenizer="byte").setup()


def test_train_order_resumes_from_the_loader_state(tmp_path):
    rows = [{"prompt": f"p{i} ", "response": f"r{i}"} for i in range(40)]
    data = data_module(tmp_path, rows, batch_size=4, seq_len=32)
    loader = data.train_dataloader()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    expected = [next(iterator)["input_ids"] for _ in range(2)]
    resumed = data_module(tmp_path, rows, batch_size=4, seq_len=32).train_dataloader()
    resumed.load_state_dict(state)
    got = [batch["input_ids"] for _, batch in zip(range(2), resumed, strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_default_task_is_generated_locally_with_disjoint_splits():
    folder = default_task_dir()
    train = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (folder / "val.jsonl").read_text().splitlines()]
    assert len(train) > 1000 and len(val) > 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert snake_to_camel("read_file_lines") == "ReadFileLines"
    assert val[0]["response"] == snake_to_camel(val[0]["prompt"].split(" ")[0])
