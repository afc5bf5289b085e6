"""``python -m lightning_train generate``: print completions of prompts from trained weights."""

from __future__ import annotations

import os

from lightning_train.cli._layout import check_layout_sizes
from lightning_train.cli._parsers import parse_tool_args
from lightning_train.errors import UserInputError


def generate(
    checkpoint: str,
    prompt: str | list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    chat: bool = False,
    tokenizer: str | None = None,
    use_cache: bool = True,
    seed: int = 1234,
    allow_pickle: bool = True,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> list[str]:
    """Print each prompt followed by the model's completion (up to its end-of-text token).

    Args:
        checkpoint: a .ckpt of this package, a .safetensors file or folder, or a Hugging Face model folder.
        prompt: one or more prompts, e.g. --prompt "read_file in CamelCase: " or --prompt '[a, b]'.
        max_new_tokens: longest completion.
        temperature: 0 is greedy; higher samples more freely.
        top_k: sample only among the k likeliest tokens.
        chat: wrap each prompt as a user message of the SFT chat template: the model's own (a model folder's
            chat template), else the plain-text one.
        tokenizer: "byte", a tokenizer.json path or a model folder; None: the checkpoint's.
        use_cache: decode with the KV cache (faster; same tokens).
        seed: seeds the sampling.
        allow_pickle: read pickle-format checkpoints (with torch.load(weights_only=True)).
        tensor_parallel: split each layer over this many ranks, as ParallelStrategy does (under torchrun).
        pipeline_parallel: split the blocks into this many stages, one a rank (under torchrun); with
            tensor_parallel, their product must divide the ranks (the rest are replicas).

    Returns:
        Each prompt followed by its completion, in the order of the prompts.
    """
    if max_new_tokens < 1:
        raise UserInputError(f"--max_new_tokens {max_new_tokens} must be at least 1, e.g. 64")
    if temperature < 0:
        raise UserInputError(f"--temperature {temperature} must be >= 0 (0 is greedy), e.g. 0.8")
    check_layout_sizes(tensor_parallel, pipeline_parallel)
    if top_k is not None and top_k < 1:
        raise UserInputError(f"--top_k {top_k} must be at least 1, or left out to sample from every token")
    prompts = prompt if isinstance(prompt, list) else [prompt]
    _check_prompts(prompts)
    # here, not at the top: `generate --help` answers without importing torch
    import torch

    from lightning_train.checkpoint.pretrained import open_pretrained
    from lightning_train.data.chat import chat_prompt
    from lightning_train.data.tokenizers import load_tokenizer
    from lightning_train.models.generate import generate_batched

    try:
        torch.manual_seed(seed)
    except (ValueError, RuntimeError) as error:  # torch's seeds are 64-bit
        raise UserInputError(f"--seed {seed} is not a 64-bit seed ({error}); use e.g. 1234") from error
    pretrained = open_pretrained(checkpoint, allow_pickle=allow_pickle)
    spec = tokenizer or pretrained.tokenizer
    if spec is None:
        raise UserInputError(
            f"{checkpoint!r} names no tokenizer; pass --tokenizer byte, a tokenizer.json or a model folder"
        )
    tok = load_tokenizer(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tensor_parallel * pipeline_parallel > 1:
        from lightning_train.strategies.generation import shard_under_torchrun

        model = shard_under_torchrun(pretrained.build(), tensor_parallel, pipeline_parallel, "generate")
    else:
        model = pretrained.build().to(device)
    if chat:  # the template's special tokens are tokens, not text
        prompts, prompt_ids = map(list, zip(*(chat_prompt(p, tok) for p in prompts), strict=True))
    else:
        prompt_ids = [tok.encode(p) for p in prompts]
    completions = generate_batched(
        model, prompt_ids, max_new_tokens, tok.eos_id, temperature, top_k,
        device=device, use_cache=use_cache, tokenizer_vocab_size=tok.vocab_size,
    )
    return [p + tok.decode(c) for p, c in zip(prompts, completions, strict=True)]


def _check_prompts(prompts: list[str]) -> None:
    """Refuse no prompt at all, and one with bytes that are not UTF-8 (a command line in another
    encoding reaches Python as lone surrogates, which no tokenizer can encode)."""
    if not prompts:
        raise UserInputError("--prompt [] holds no prompt; pass at least one, e.g. --prompt 'def '")
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            byte = ord(text[error.start]) - 0xDC00  # how Python keeps an undecodable byte of argv
            shown = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else repr(text[error.start])
            raise UserInputError(
                f"prompt {i} holds {shown}, which is not UTF-8 text; pass the prompt in UTF-8 (set the "
                "terminal's encoding to UTF-8)"
            ) from error


def main(args: list[str]) -> None:
    texts = generate(**parse_tool_args(generate, args, "generate"))
    if int(os.environ.get("RANK", 0)) == 0:  # every rank of a sharded run has them; one prints
        print("\n\n".join(texts))
