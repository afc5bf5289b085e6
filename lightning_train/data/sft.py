"""``SFTDataModule``: supervised fine-tuning on prompt/response or chat examples, loss on responses only.

Each line of a JSONL file (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), each row of a Parquet, Arrow or CSV
file or of a ``datasets`` folder is one example, either ``{"prompt": str, "response": str}`` or
``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` (the field names are
options: ``prompt_field``, ``response_field``, ``messages_field``). An example becomes
``prompt tokens + response tokens + eos``; the labels are the next tokens, with -100 wherever the next
token belongs to a prompt, so only response tokens (and the eos that ends them) carry loss.

Chats use the model's own chat template when its tokenizer has one, else the plain-text template
(``data/chat.py``); the assistant turns are the response (trained), everything else prompt.

By default batches are padded on the right to the longest example with the tokenizer's pad id (labels
-100); right padding needs no attention mask, since a causal model never attends to later positions.
With ``packing=True`` examples are packed back to back into rows of ``seq_len`` tokens
(``data/packing.py``), with ``position_ids`` that restart at each example, so that our GPT keeps each
example's attention to itself: every example's loss is the one it has alone. The loaders are
``TextDataModule``'s (``data/loading.py``): a resumed run continues with the next unseen example (packed:
row), at any device count, and
``train_loader.sampler.skip_batches(n)`` jumps over examples without loading them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from lightning_train.data.chat import ROLES, Chat, Segments, chat_segments, has_chat_template, template_tokens
from lightning_train.data.loading import ResumableDataModule, check_at_least, check_seed
from lightning_train.data.packing import PackedExamples
from lightning_train.data.readers import dataset_files, iter_lines, iter_rows, record_format
from lightning_train.data.tasks import default_task_dir
from lightning_train.data.tokenizers import Tokenizer, load_tokenizer
from lightning_train.errors import UserInputError


def read_examples(
    path: str | Path, prompt_field: str = "prompt", response_field: str = "response",
    messages_field: str = "messages",
) -> list[Segments | Chat]:
    """The examples of a JSONL (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), Parquet, Arrow or CSV file or a
    ``datasets`` folder as segments, read a line or a batch of rows at a time (``data/readers.py``); a
    malformed example is an error naming file and line (or row). The fields name the prompt and response
    columns, or the column of a chat's messages."""
    path = Path(path).expanduser()
    files = dataset_files(path) if path.is_dir() else [path] if path.is_file() else None
    if not files:
        what = "is a folder (not a datasets save_to_disk folder)" if path.is_dir() else "does not exist"
        raise UserInputError(f"SFT data file {str(path)!r} {what}; pass a JSONL file (.jsonl, .jsonl.gz, "
                             ".jsonl.zst), a Parquet, Arrow or CSV file, or a datasets folder")
    fields = (prompt_field, response_field, messages_field)
    examples = []
    for file in files:
        if record_format(file) == "table":
            examples += [_example(row, f"{file} row {n}", fields) for n, row, _ in iter_rows(file, fields)]
        else:  # JSONL, compressed or not; a file of another suffix is read as JSONL too
            lines = iter_lines(file)
            examples += [_parse(line, f"{file}:{n}", fields) for n, line, _ in lines if line.strip()]
    if not examples:
        raise UserInputError(f"SFT data file {str(path)!r} holds no examples")
    return examples


def _parse(line: bytes, where: str, fields: tuple[str, str, str]) -> Segments | Chat:
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserInputError(
            f"{where}: byte 0x{line[err.start]:02x} is not UTF-8 text; save the file as UTF-8"
        ) from err
    except ValueError as err:
        raise UserInputError(f"{where}: not valid JSON ({err}); write one JSON object a line") from err
    return _example(row, where, fields)


def _example(row: object, where: str, fields: tuple[str, str, str]) -> Segments | Chat:
    prompt_field, response_field, messages_field = fields
    if isinstance(row, dict) and isinstance(row.get(prompt_field), str) and isinstance(
        row.get(response_field), str
    ):
        return [(row[prompt_field], False), (row[response_field], True)]
    messages = row.get(messages_field) if isinstance(row, dict) else None
    if isinstance(messages, list) and messages:
        well_formed = all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages
        )
        if not well_formed:
            raise UserInputError(
                f'{where}: every message needs a "role" in {list(ROLES)} and a string "content"'
            )
        if messages[-1]["role"] != "assistant":
            raise UserInputError(f"{where}: the last message must be the assistant's (it is what is trained)")
        return Chat(messages)  # rendered by tokenize(), which knows the tokenizer's template
    raise UserInputError(
        f'{where}: expected {{"{prompt_field}": str, "{response_field}": str}} or {{"{messages_field}": '
        f"[...]}}, got keys {sorted(row) if isinstance(row, dict) else type(row).__name__}; set "
        "prompt_field and response_field, or messages_field, to the data's fields"
    )


def tokenize(
    segments: Segments | Chat, tokenizer: Tokenizer
) -> tuple[list[int], list[bool], list[int], list[int]]:
    """Tokens of an example, which of them are trained (responses and their eos), and the prompt and
    response (without eos) of its last response, for exact-match evaluation."""
    if isinstance(segments, Chat):
        if has_chat_template(tokenizer):
            return template_tokens(segments.messages, tokenizer)
        segments = chat_segments(segments.messages)
    tokens: list[int] = []
    trained: list[bool] = []
    prompt: list[int] = []
    response: list[int] = []
    for text, is_response in segments:
        ids = tokenizer.encode(text)
        if is_response:
            prompt, response = list(tokens), ids
            ids = ids + [tokenizer.eos_id]
        tokens += ids
        trained += [is_response] * len(ids)
    return tokens, trained, prompt, response


class SFTExamples(Dataset):
    """Tokenized examples, each ``{"input_ids": [...], "labels": [...]}`` (unpadded), truncated to
    ``seq_len``; ``prompts`` holds the (prompt, response) pairs that fit for generation."""

    def __init__(self, examples: list[Segments | Chat], tokenizer: Tokenizer, seq_len: int) -> None:
        self.rows: list[tuple[list[int], list[int]]] = []
        self.prompts: list[tuple[list[int], list[int]]] = []
        truncated = 0
        for segments in examples:
            tokens, trained, prompt, response = tokenize(segments, tokenizer)
            if len(tokens) > seq_len + 1:
                truncated += 1
                tokens, trained = tokens[: seq_len + 1], trained[: seq_len + 1]
            elif prompt:
                self.prompts.append((prompt, response))
            labels = [t if keep else -100 for t, keep in zip(tokens[1:], trained[1:], strict=True)]
            if any(label != -100 for label in labels):
                self.rows.append((tokens[:-1], labels))
        if truncated:
            rank_zero_warn(
                f"{truncated} of {len(examples)} SFT examples are longer than seq_len={seq_len} and were "
                "truncated (those left without response tokens are skipped); raise seq_len to keep them whole"
            )
        self.max_token_id = max(max(ids) for ids, _ in self.rows) if self.rows else 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        input_ids, labels = self.rows[i]
        return {"input_ids": input_ids, "labels": labels}


class PadCollate:
    """Right-pads a list of examples to the longest one, rounded up to a multiple of ``multiple``:
    ``pad_id`` inputs, -100 labels."""

    def __init__(self, pad_id: int, multiple: int = 1) -> None:
        self.pad_id, self.multiple = pad_id, multiple

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = -(-max(len(example["input_ids"]) for example in batch) // self.multiple) * self.multiple
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, example in enumerate(batch):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.tensor(example["input_ids"])
            labels[row, :n] = torch.tensor(example["labels"])
        return {"input_ids": input_ids, "labels": labels}


class SFTDataModule(ResumableDataModule):
    """Prompt/response or chat JSONL for fine-tuning (see the module docstring for the format).

    Args:
        train_file: the training examples: a JSONL (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), Parquet,
            Arrow or CSV file or a ``datasets`` ``save_to_disk`` folder; None: the generated default task
            (``data/tasks.py``).
        val_file: the validation examples, in any of those formats; None: hold out ``val_fraction`` of
            ``train_file``.
        tokenizer: ``"byte"``, a ``tokenizer.json`` path or a model folder (its own tokenizer and chat
            template, through transformers); None: the model's (a
            module's ``tokenizer_spec``, as FinetuneModule has), else ``"byte"``.
        seq_len: longest example in tokens; longer ones are truncated (with a warning). Packed: the length
            of every row.
        batch_size: examples (packed: rows) per batch on each device.
        global_batch_size: samples per optimizer step over all devices; the Trainer's
            ``accumulate_grad_batches`` becomes ``global_batch_size / (batch_size x data-parallel ranks)``
            at each launch (set by the ``GlobalBatch`` callback, which the CLI adds), so a run resumed
            on fewer or more devices keeps its batch. None: no change.
        val_fraction: share of ``train_file`` held out when there is no ``val_file``.
        eval_prompts: held-out prompts whose greedy generations are scored by exact match.
        seed: seeds the example order (epoch ``e`` uses the permutation for ``(seed, e)``) and the split.
        num_workers: data-loading processes per device.
        pad_to_multiple_of: batches are padded to a multiple of this many tokens (under pipeline
            parallelism every batch is padded to ``seq_len``: the stages take one shape); None: the Trainer's
            ``tensor_parallel`` size (sequence parallelism splits every sequence into that many parts),
            else 1. ``seq_len`` must divide by it.
        packing: pack examples into full rows of ``seq_len`` tokens, each example attending only to itself
            (the model must be our ``GPT``). False (the default, which any model takes): one example a
            row, padded to the batch's longest.
        prompt_field: the field (column) of an example's prompt text.
        response_field: the field of its response text.
        messages_field: the field of a chat's messages, for examples without prompt and response.

    Example (only the response and its eos carry loss):

        >>> import json
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lightning_train import SFTDataModule
        >>> train_file = Path(tempfile.mkdtemp()) / "train.jsonl"
        >>> rows = [{"prompt": f"{n} + 1 = ", "response": f"{n + 1}"} for n in range(40)]
        >>> _ = train_file.write_text("".join(json.dumps(row) + "\\n" for row in rows))
        >>> data = SFTDataModule(str(train_file), tokenizer="byte", seq_len=32, batch_size=4)
        >>> data.setup("fit")
        >>> batch = next(iter(data.train_dataloader()))
        >>> batch["input_ids"].shape, batch["labels"].shape  # padded to the longest example of the batch
        (torch.Size([4, 11]), torch.Size([4, 11]))
        >>> data.tokenizer.decode(batch["input_ids"][0].tolist())
        '12 + 1 = 13'
        >>> data.tokenizer.decode([label for label in batch["labels"][0].tolist() if label != -100])
        '13<|endoftext|>'

    Packed, several examples share each row of 32 tokens; positions restart at each:

        >>> packed = SFTDataModule(str(train_file), tokenizer="byte", seq_len=32, batch_size=4, packing=True)
        >>> packed.setup("fit")
        >>> row = packed.train_set[0]
        >>> row["input_ids"].shape, row["position_ids"][:12].tolist()
        (torch.Size([32]), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0])
    """

    def __init__(
        self,
        train_file: str | None = None,
        val_file: str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        global_batch_size: int | None = None,
        val_fraction: float = 0.05,
        eval_prompts: int = 64,
        seed: int = 1234,
        num_workers: int = 0,
        pad_to_multiple_of: int | None = None,
        prompt_field: str = "prompt",
        response_field: str = "response",
        messages_field: str = "messages",
        packing: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise UserInputError(f"val_fraction={val_fraction} must be between 0 and 1")
        check_at_least(
            ("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
            ("eval_prompts", eval_prompts, 0), ("num_workers", num_workers, 0),
            ("global_batch_size", 1 if global_batch_size is None else global_batch_size, 1),
            ("pad_to_multiple_of", 1 if pad_to_multiple_of is None else pad_to_multiple_of, 1),
        )  # fmt: skip
        check_seed(seed)
        # No tokenizer given means the model's: recorded by the model alone, since Lightning refuses a
        # `tokenizer` key of model and data that differ (None here, "byte" there).
        self.save_hyperparameters(ignore=["tokenizer"] if tokenizer is None else None)
        self.seq_len, self.batch_size, self.seed, self.num_workers = seq_len, batch_size, seed, num_workers
        self.global_batch_size, self.packing = global_batch_size, packing
        self.tokenizer: Tokenizer | None = None
        self.train_set: SFTExamples | PackedExamples | None = None
        self.val_set: SFTExamples | PackedExamples | None = None

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_token_id(self) -> int:
        return max(self.train_set.max_token_id, self.val_set.max_token_id, self.tokenizer.pad_id)

    @property
    def eval_examples(self) -> list[tuple[list[int], list[int]]]:
        """Held-out (prompt ids, response ids) pairs for exact-match evaluation."""
        return self.val_set.prompts[: self.hparams.eval_prompts]

    def prepare_data(self) -> None:
        if self.hparams.train_file is None:
            default_task_dir()  # builds the default task once per node

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.tokenizer = load_tokenizer(self._tokenizer_spec())
        train_file, val_file = self.hparams.train_file, self.hparams.val_file
        if train_file is None:
            folder = default_task_dir()
            train_file, val_file = folder / "train.jsonl", folder / "val.jsonl"
        fields = (self.hparams.prompt_field, self.hparams.response_field, self.hparams.messages_field)
        train = read_examples(train_file, *fields)
        if val_file is not None:
            val = read_examples(val_file, *fields)
        else:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
            held_out = set(order[: max(1, round(len(train) * self.hparams.val_fraction))])
            val = [e for i, e in enumerate(train) if i in held_out]
            train = [e for i, e in enumerate(train) if i not in held_out]
        self.train_set, self.val_set = (self._dataset(examples) for examples in (train, val))

    def _dataset(self, examples: list[Segments]) -> SFTExamples | PackedExamples:
        tokenized = SFTExamples(examples, self.tokenizer, self.seq_len)
        if not self.packing:
            return tokenized
        return PackedExamples(tokenized, self.seq_len, self.tokenizer.pad_id, self.seed)

    def describe_train_set(self) -> str:
        if isinstance(self.train_set, PackedExamples):
            return f"{len(self.train_set)} packed rows ({self.train_set.num_examples} examples)"
        return super().describe_train_set()

    def _tokenizer_spec(self) -> str:
        module = self.trainer.lightning_module if self.trainer is not None else None
        model_spec = getattr(module, "tokenizer_spec", None)
        given = self.hparams.get("tokenizer")
        if given is None:
            return model_spec or "byte"
        if model_spec is not None and model_spec != given:
            raise UserInputError(
                f"the data's tokenizer {given!r} is not the model's {model_spec!r}; drop the data's "
                "tokenizer (it then uses the model's) or give both the same"
            )
        return given

    def collate(self) -> PadCollate | None:
        multiple = self._pad_multiple()
        return None if self.packing else PadCollate(self.tokenizer.pad_id, multiple)  # packed: stacked rows

    def _pad_multiple(self) -> int:
        multiple = self.hparams.get("pad_to_multiple_of")
        strategy = self.trainer.strategy if self.trainer is not None else None
        if getattr(strategy, "pipeline_parallel", 1) > 1:
            return self.seq_len  # torch's pipeline stages keep the shapes of their first batch: one length
        if multiple is None:
            multiple = getattr(strategy, "tensor_parallel", 1)
        if self.seq_len % multiple:
            raise UserInputError(
                f"data.seq_len={self.seq_len} does not divide by {multiple}, the multiple batches are padded "
                "to (pad_to_multiple_of, else tensor_parallel); use a seq_len divisible by it"
            )
        return multiple
