"""Prompts and chats tokenized as the model expects, the tokens that end a generation, and a
request's text as it streams (`TextStream`: incremental detokenization and stop strings).

A plain prompt goes through the tokenizer with its defaults, special tokens included: a
model trained with a BOS token (Llama-2/3, Vicuna, Gemma) produces degenerate text
without it. A chat (`messages`) goes through the tokenizer's chat template with the
assistant turn opened; the template's text already carries its special tokens, so it is
encoded without adding any (as transformers' own `apply_chat_template` does).

A chat model ends its turn with a token of its template (`<|im_end|>`, `<|eot_id|>`,
`<end_of_turn>`) that is not always the tokenizer's EOS; `stop_token_ids` adds it, so
every request stops there whether it came in as `prompt` or `messages`.
"""

from __future__ import annotations

from typing import Any, Callable

from polyspec.workers.core.errors import RequestError, first_line

REPLACEMENT_CHAR = "\ufffd"  # a token that ends inside a multi-byte character decodes to this
ROLES = ("system", "user", "assistant", "tool", "developer", "function")
_SENTINEL = "polyspec-end-of-turn-probe"


def encode_prompt(tokenizer, text: str) -> list[int]:
    """`text` with the tokenizer's defaults (its BOS token where it adds one)."""
    return list(tokenizer(text)["input_ids"])


def _content(index: int, content: Any) -> str:
    """A message's text: a string, or OpenAI's list of {type: text, text} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(part["text"] for part in content)
    raise RequestError(f"messages[{index}].content must be a string (or a list of text parts), got {type(content).__name__}")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """[{role, content}] with string contents; one-line RequestError otherwise."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{index}] must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}")
        if "content" not in message:
            raise RequestError(f"messages[{index}] has no 'content'")
        checked.append({"role": role, "content": _content(index, message["content"])})
    return checked


def encode_chat(tokenizer, messages: Any) -> list[int]:
    """The conversation through the tokenizer's chat template, the assistant's turn opened."""
    if tokenizer is None:
        raise RequestError("the target model has no tokenizer, so it cannot take chat messages")
    checked = check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("the target model's tokenizer has no chat template; send a prompt instead of messages")
    try:
        text = tokenizer.apply_chat_template(checked, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may raise on a conversation it does not accept
        raise RequestError(f"the chat template rejected these messages: {first_line(exc)}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn_ids(tokenizer) -> set[int]:
    """The special token the chat template closes an assistant turn with (empty set without a template)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return set()
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that cannot render a plain exchange has no turn end to find
        return set()
    if _SENTINEL not in text:
        return set()
    after = text.split(_SENTINEL, 1)[1]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    for token in tokenizer(after, add_special_tokens=False)["input_ids"][:4]:
        if token in special:
            return {int(token)}
    return set()


def stop_token_ids(tokenizer, configured: set[int] | tuple[int, ...] = ()) -> tuple[int, ...]:
    """EOS ids the model's configs name, the tokenizer's EOS and the template's end-of-turn token."""
    stops = {int(t) for t in configured}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    stops |= end_of_turn_ids(tokenizer)
    return tuple(sorted(stops))


class TextStream:
    """One request's text as its tokens are committed: incremental detokenization and the stop-string rule.

    `push(tokens)` takes a round's committed tokens and returns only the new text that is safe
    to show: nothing while the last token ends inside a character, and a tail that could still
    grow into a stop string is held back, so what a stream has shown never runs past a stop.
    The token that completes a stop string ends the request: `stopped` is set, `token_ids`
    ends with that token and `text` ends just before the stop string's first character.
    Stops are matched on decoded text (str), so a cut never falls inside a UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] | list[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(stop for stop in stops if stop)
        self.token_ids: list[int] = []  # committed so far (cut after the stop-completing token once stopped)
        self.text = ""  # shown so far
        self.stopped = False
        self._held = ""  # matched, not shown: it may be the start of a stop string
        # A round decodes only its own tokens, after a few already shown (vLLM's prefix / read
        # offsets): decoding a window that starts mid-text can differ at its first token (a
        # SentencePiece leading space), so the window starts one round back and only the text
        # past `ids[prefix:read]` is new. Decoding the whole request each round costs O(n^2).
        self._prefix = 0
        self._read = 0

    def push(self, tokens: list[int], final: bool = False) -> str:
        """A round's tokens -> the new text to show. `final`: no more tokens come (what was held is shown)."""
        if self.stopped:
            return ""
        before = len(self.token_ids)
        self.token_ids += tokens
        ids = self.token_ids
        seen = self.decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        decoded = self.decode(ids[self._prefix :])
        if decoded.endswith(REPLACEMENT_CHAR) and not final:  # a token ended inside a character: wait for the rest
            return ""
        delta = decoded[len(seen) :] if decoded.startswith(seen) else ""
        self._prefix, self._read = self._read, len(ids)
        shown = self._match(delta)
        if self.stopped:  # the tokens up to the one that completed the stop string (a round commits several)
            self.token_ids = ids[: next(n for n in range(before + 1, len(ids) + 1)
                                        if any(stop in self.decode(ids[:n]) for stop in self.stops))]
        self.text += shown
        return shown + self.finish() if final else shown

    def finish(self) -> str:
        """What was held back, now that no more text comes (shown from now on)."""
        rest, self._held = ("" if self.stopped else self._held), ""
        self.text += rest
        return rest

    def _match(self, delta: str) -> str:
        text = self._held + delta
        hits = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = max((size for stop in self.stops for size in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:size])), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]


def check_stops(stop: Any, what: str = "stop", limit: int = 16, max_chars: int = 256) -> tuple[str, ...]:
    """A stop string or a list of them (OpenAI's `stop`), checked; RequestError naming `what` otherwise."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"{what} must be a string or a list of strings")
    if len(stops) > limit:
        raise RequestError(f"{what} holds {len(stops)} strings (at most {limit})")
    if any(not s for s in stops):
        raise RequestError(f"{what} strings must not be empty")
    if any(len(s) > max_chars for s in stops):
        raise RequestError(f"{what} strings must be at most {max_chars} characters")
    return tuple(stops)
