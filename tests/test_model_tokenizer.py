"""A model folder's own tokenizer and chat template: read through transformers (tokenizer.json, or a
SentencePiece tokenizer.model alone), chats rendered with the template and trained on the assistant turns
only, `generate --chat` with the same template, the files carried by `export`, and a folder with no
tokenizer warned about at `fit`. The tokenizers and templates are built here; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_train.checkpoint import export, open_pretrained
from lightning_train.cli.generate import generate
from lightning_train.data import SFTDataModule, TransformersTokenizer, load_tokenizer
from lightning_train.errors import UserInputError
from lightning_train.modules.finetune import FinetuneModule
from tests.conftest import run_cli, run_cli_in_process
from tests.test_hf_families import hf_folder

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["What is the capital of France? Paris. And of Germany? Berlin. You are a helpful assistant."] * 20
# Two common template styles, as model folders ship them; `generation` marks what each assistant turn adds,
# for transformers' own assistant mask (only the test's cross-check reads it).
LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
          "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML = ("{% if messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
          "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\n' }}"
          "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
STYLES = {  # style -> (special tokens, bos, eos, template, the end of an assistant turn)
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", LLAMA3, "<|eot_id|>"),
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML, "<|im_end|>\n"),
}
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany?"},
        {"role": "assistant", "content": " Berlin."}]  # ChatML keeps the space, Llama 3 trims it


def tokenizer_folder(folder: Path, style: str, in_config: bool = False) -> Path:
    """A tiny byte-level BPE (under 300 ids) with the style's special tokens and chat template, saved by
    transformers: the template in chat_template.jinja, or in tokenizer_config.json with ``in_config``."""
    specials, bos, eos, template, _ = STYLES[style]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(
        vocab_size=290, special_tokens=specials, initial_alphabet=alphabet, show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos,
                                                chat_template=template)
    fast.save_pretrained(folder)
    if in_config:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "chat_template.jinja").unlink()
    return folder


def model_folder(folder: Path, style: str, family: str = "qwen2") -> Path:
    """A tiny random model of ``family`` (vocabulary 300) with the style's tokenizer beside it."""
    hf_folder(family, folder)
    return tokenizer_folder(folder, style, in_config=style == "chatml")


def theirs(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_a_model_folder_tokenizer_is_read_through_transformers(tmp_path):
    folder = model_folder(tmp_path / "model", "llama3")
    spec = open_pretrained(folder).tokenizer
    tokenizer, reference = load_tokenizer(spec), theirs(folder)
    assert spec == str(folder.resolve()) and isinstance(tokenizer, TransformersTokenizer)
    text = "What is the capital of France?"
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_id == reference.convert_tokens_to_ids("<|eot_id|>")
    assert tokenizer.pad_id == reference.pad_token_id  # transformers' Qwen2 tokenizer adds <|endoftext|>
    assert tokenizer.bos_id == reference.convert_tokens_to_ids("<|begin_of_text|>")
    # a special token's text in a document stays text, as with the other tokenizers
    assert tokenizer.eos_id not in tokenizer.encode("Paris<|eot_id|>")
    assert tokenizer.vocab_size == len(reference) <= 300


def test_a_sentencepiece_tokenizer_model_alone_is_read(tmp_path):
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed: no tokenizer.model "
                              "can be trained here (pip install sentencepiece)")
    folder = tmp_path / "model"
    hf_folder("llama3", folder)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 5), model_prefix=str(folder / "tokenizer"), vocab_size=60,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    assert sorted(p.name for p in folder.iterdir() if "token" in p.name) == ["tokenizer.model"]
    tokenizer = load_tokenizer(open_pretrained(folder).tokenizer)
    text = "What is the capital of Germany?"
    assert tokenizer.encode(text) == theirs(folder).encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text)) == text and tokenizer.eos_id == 2
    rows = [{"prompt": f"capital {n}? ", "response": "Paris."} for n in range(8)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = SFTDataModule(str(train), val_file=str(train), tokenizer=str(folder), seq_len=64, batch_size=2)
    data.setup("fit")
    labels = [t for t in data.train_set[0]["labels"] if t != -100]
    assert labels == tokenizer.encode("Paris.") + [tokenizer.eos_id]


@pytest.mark.parametrize("style", list(STYLES))
def test_chats_use_the_model_template_with_loss_on_assistant_turns(tmp_path, style):
    folder = tokenizer_folder(tmp_path / "tokenizer", style, in_config=style == "chatml")
    reference, end = theirs(folder), STYLES[style][4]
    train = tmp_path / "chats.jsonl"
    train.write_text(json.dumps({"messages": CHAT}) + "\n")
    data = SFTDataModule(str(train), val_file=str(train), tokenizer=str(folder), seq_len=128, batch_size=1)
    data.setup("fit")
    row = data.train_set[0]
    rendered = reference.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    assert row["input_ids"] == rendered["input_ids"][:-1]  # the whole chat, as the model's template writes it
    trained = [label for label in row["labels"] if label != -100]
    last = " Berlin." if style == "chatml" else "Berlin."  # Llama 3's template trims the content
    assert data.tokenizer.decode(trained) == f"Paris.{end}{last}{end}"
    # the same tokens transformers marks as the assistant's where the template says which they are
    assert [label != -100 for label in row["labels"]] == [bool(m) for m in rendered["assistant_masks"][1:]]
    (prompt, response), = data.val_set.prompts
    assert data.tokenizer.decode(prompt) == reference.apply_chat_template(CHAT[:-1], tokenize=False,
                                                                          add_generation_prompt=True)
    assert data.tokenizer.decode(response) == last


def test_plain_template_stays_for_a_tokenizer_without_one(tmp_path):
    train = tmp_path / "chats.jsonl"
    train.write_text(json.dumps({"messages": CHAT[1:3]}) + "\n")
    data = SFTDataModule(str(train), val_file=str(train), tokenizer="byte", seq_len=128, batch_size=1)
    data.setup("fit")
    text = data.tokenizer.decode(data.train_set[0]["input_ids"])
    assert text == "<|user|>\nWhat is the capital of France?\n<|assistant|>\nParis."


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tmp_path):
    folder = tokenizer_folder(tmp_path / "tokenizer", "chatml")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # Qwen3-like: only the last assistant turn is written whole
    template = (folder / "chat_template.jinja").read_text().replace(
        "m['content']", "(m['content'] if loop.last else '')", 1)
    (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    train = tmp_path / "chats.jsonl"
    train.write_text(json.dumps({"messages": CHAT}) + "\n")
    data = SFTDataModule(str(train), val_file=str(train), tokenizer=str(folder), seq_len=128)
    with pytest.raises(UserInputError, match="writes assistant turn 2 of a chat otherwise"):
        data.setup("fit")


def test_generate_chat_uses_the_model_template(tmp_path):
    folder = model_folder(tmp_path / "model", "chatml")
    reference = theirs(folder)
    [text] = generate(str(folder), "What is the capital of France?", max_new_tokens=6, chat=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = reference.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = reference.convert_tokens_to_ids("<|im_end|>")
    new = new[: new.index(eos)] if eos in new else new
    assert text == prompt + reference.decode(new)


@pytest.mark.parametrize("form", ["hf", "safetensors"])
def test_export_carries_the_model_tokenizer_and_template(tmp_path, form):
    folder = model_folder(tmp_path / "model", "llama3")
    written = export(str(folder), str(tmp_path / "out"), format=form)
    names = {path.name for path in written}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()
    rendered = theirs(tmp_path / "out").apply_chat_template(CHAT, tokenize=False)
    assert rendered == theirs(folder).apply_chat_template(CHAT, tokenize=False)
    assert open_pretrained(tmp_path / "out").tokenizer == str((tmp_path / "out").resolve())
    if form == "hf":
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["bos_token_id"] == theirs(folder).convert_tokens_to_ids("<|begin_of_text|>")
    module = FinetuneModule(str(folder))
    module.configure_model()
    assert "chat_template.jinja" in {p.name for p in module.export(tmp_path / "module").iterdir()}


def test_a_folder_without_tokenizer_warns_at_fit_and_then_generates(tmp_path):
    hf_folder("qwen2", tmp_path / "model")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{n} + 1 = ", "response": str(n + 1)}) + "\n"
                             for n in range(16)))
    fit = run_cli(  # a process of its own: its console is what a user sees
        "fit", "--config", str(REPO / "configs" / "finetune-tiny.yaml"), "--run_name", "nt",
        "--model.init_args.init_from", str(tmp_path / "model"), "--data.init_args.train_file", str(train),
        "--data.init_args.batch_size", "4", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
        cwd=tmp_path,
    )
    assert fit.returncode == 0, fit.stdout + fit.stderr
    warned = [line for line in (fit.stdout + fit.stderr).splitlines() if "holds no tokenizer" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and "byte tokenizer is used" in warned[0]
    run = run_cli_in_process("generate", "--checkpoint", "runs/nt/checkpoints/last.ckpt",
                             "--prompt", "1 + 1 = ", "--max_new_tokens", "3", cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("1 + 1 = "), run.stdout + run.stderr
