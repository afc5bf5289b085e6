"""Chats for ``SFTDataModule`` and ``generate --chat``: rendered with the model's own chat template when its
tokenizer has one (a model folder's ``tokenizer_config.json`` ``chat_template`` or ``chat_template.jinja``,
through transformers' ``apply_chat_template``), else with this plain-text template, which works with the
byte tokenizer and any other::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<eos>...

Trained (the response): in the plain template each assistant turn's content and its eos; in a model's
template what each assistant turn adds after the generation prompt (its content and the end-of-turn
tokens the template writes, e.g. Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``). Everything else is
prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_train.errors import UserInputError

ROLES = ("system", "user", "assistant")
Segments = list[tuple[str, bool]]  # (text, is_response)
Messages = list[dict[str, str]]


@dataclass
class Chat:
    """An SFT example that is a chat: its messages, rendered once the tokenizer is known."""

    messages: Messages


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders chats itself (``TransformersTokenizer`` of a folder with a template);
    a tokenizer of another kind has no ``chat_template`` attribute."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_segments(messages: Messages) -> Segments:
    """The plain-text chat template as (text, is_response) pieces; eos follows each response."""
    segments: Segments = []
    for message in messages:
        segments.append((f"<|{message['role']}|>\n", False))
        segments.append((message["content"], message["role"] == "assistant"))
        if message["role"] != "assistant":
            segments.append(("\n", False))
    return segments


def template_tokens(
    messages: Messages, tokenizer: Any
) -> tuple[list[int], list[bool], list[int], list[int]]:
    """A chat through the tokenizer's own template: its tokens, which are trained (what each assistant turn
    adds after the generation prompt), and the prompt and response (up to eos) of its last assistant turn.

    An assistant turn's characters are found by rendering the chat up to it twice: with the generation
    prompt and without the turn, then with it; both renders must begin the whole chat's. A token is trained
    when it starts inside a turn, so a token the tokenizer merged across the turn's start stays prompt."""
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise UserInputError(
                f"the chat template of {tokenizer.name!r} writes assistant turn {i} of a chat otherwise once "
                "more turns follow it, so the turn to train cannot be found; give each assistant turn an "
                "example of its own (a chat ending with it)"
            )
        spans.append((len(before), len(through)))
    tokens, offsets = tokenizer.encode_chat(text)
    trained = [any(start <= first < end for start, end in spans) for first, _ in offsets]
    last_start = spans[-1][0]
    first_response = next((n for n, (first, _) in enumerate(offsets) if first >= last_start), len(tokens))
    response = [t for t, keep in zip(tokens[first_response:], trained[first_response:], strict=True) if keep]
    if tokenizer.eos_id in response:  # the response a generation stopping at eos must reproduce
        response = response[: response.index(tokenizer.eos_id)]
    return tokens, trained, tokens[:first_response], response


def chat_prompt(user_message: str, tokenizer: Any) -> tuple[str, list[int]]:
    """The text, and its ids, a model continues to answer ``user_message`` as the assistant: its own
    template's generation prompt, else the plain template's."""
    messages = [{"role": "user", "content": user_message}]
    if has_chat_template(tokenizer):
        text = _render(tokenizer, messages, add_generation_prompt=True)
        return text, tokenizer.encode_chat(text)[0]
    segments = [text for text, _ in chat_segments(messages)]
    text = "".join(segments) + "<|assistant|>\n"
    return text, tokenizer.encode(text)


def _render(tokenizer: Any, messages: Messages, add_generation_prompt: bool = False) -> str:
    from jinja2 import TemplateError  # transformers' dependency: installed wherever a template is

    try:
        return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except TemplateError as err:  # a template may refuse a chat, e.g. roles that do not alternate
        raise UserInputError(
            f"the chat template of {tokenizer.name!r} refuses a chat of the roles "
            f"{[m['role'] for m in messages]} ({err}); fix the example's messages"
        ) from err
