"""``python -m lightning_train generate``: print completions of prompts from trained weights."""

from __future__ import annotations

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
) -> list[str]:
    """Print each prompt followed by the model's completion (up to its end-of-text token).

    Args:
        checkpoint: a .ckpt of this package, a .safetensors file or folder, or a Hugging Face model folder.
        prompt: one or more prompts, e.g. --prompt "read_file in CamelCase: " or --prompt '[a, b]'.
        max_new_tokens: longest completion.
        temperature: 0 is greedy; higher samples more freely.
        top_k: sample only among the k likeliest tokens.
        chat: wrap each prompt as a user message of the SFT chat template.
        tokenizer: "byte" or a tokenizer.json path; None: the checkpoint's.
        use_cache: decode with the KV cache (faster; same tokens).
        seed: seeds the sampling.
        allow_pickle: read pickle-format checkpoints (with torch.load(weights_only=True)).

    Returns:
        Each prompt followed by its completion, in the order of the prompts.
    """
    if max_new_tokens < 1:
        raise UserInputError(f"--max_new_tokens {max_new_tokens} must be at least 1, e.g. 64")
    if temperature < 0:
        raise UserInputError(f"--temperature {temperature} must be >= 0 (0 is greedy), e.g. 0.8")
    if top_k is not None and top_k < 1:
        raise UserInputError(f"--top_k {top_k} must be at least 1, or left out to sample from every token")
    # here, not at the top: `generate --help` answers without importing torch
    import torch

    from lightning_train.checkpoint.pretrained import open_pretrained
    from lightning_train.data.chat import chat_prompt
    from lightning_train.data.tokenizers import load_tokenizer
    from lightning_train.models.generate import generate_batched

    torch.manual_seed(seed)
    pretrained = open_pretrained(checkpoint, allow_pickle=allow_pickle)
    spec = tokenizer or pretrained.tokenizer
    if spec is None:
        raise UserInputError(f"{checkpoint!r} names no tokenizer; pass --tokenizer byte or a tokenizer.json")
    tok = load_tokenizer(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = pretrained.build().to(device)
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if chat:
        prompts = [chat_prompt(p) for p in prompts]
    completions = generate_batched(
        model, [tok.encode(p) for p in prompts], max_new_tokens, tok.eos_id, temperature, top_k,
        device=device, use_cache=use_cache, tokenizer_vocab_size=tok.vocab_size,
    )
    return [p + tok.decode(c) for p, c in zip(prompts, completions, strict=True)]


def main(args: list[str]) -> None:
    print("\n\n".join(generate(**parse_tool_args(generate, args, "generate"))))
