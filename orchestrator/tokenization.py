"""Turning chat messages into the target's prompt token ids.

`encode_chat` applies the tokenizer's chat template with the generation prompt added, so
the model continues as the assistant. A model without a chat template, or messages the
template rejects, are the client's mistake: RequestError with one line.
"""

from __future__ import annotations

from collections.abc import Mapping

from polyspec.workers.core.errors import RequestError


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """`messages` ([{role, content}, ...]) -> prompt token ids, ending with the assistant's turn."""
    if tokenizer is None:
        raise RequestError("the target model has no tokenizer, so it cannot take chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("the target model's tokenizer has no chat template; use /v1/completions with a prompt")
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - a template raises anything (jinja errors, its own raise_exception)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RequestError(f"the chat template rejected the messages: {message[:300]}") from None
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    ids = list(encoded)
    if ids and isinstance(ids[0], list):  # a batch of one conversation
        ids = list(ids[0])
    return [int(token) for token in ids]
