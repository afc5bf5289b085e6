"""The chat template of ``SFTDataModule`` and ``generate --chat`` (plain text, so it works with the byte
tokenizer and any other)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<eos>...

Each assistant turn's content and its eos are the response (trained), everything else the prompt.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")
Segments = list[tuple[str, bool]]  # (text, is_response)


def chat_segments(messages: list[dict[str, str]]) -> Segments:
    """The documented chat template as (text, is_response) pieces; eos follows each response."""
    segments: Segments = []
    for message in messages:
        segments.append((f"<|{message['role']}|>\n", False))
        segments.append((message["content"], message["role"] == "assistant"))
        if message["role"] != "assistant":
            segments.append(("\n", False))
    return segments


def chat_prompt(user_message: str) -> str:
    """The text a model continues to answer ``user_message`` as the assistant."""
    return "".join(text for text, _ in chat_segments([{"role": "user", "content": user_message}])) + (
        "<|assistant|>\n"
    )
