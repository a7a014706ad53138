"""What an OpenAI-shaped request asks for, checked: its fields, prompts or messages, `n`,
`stop`, `logprobs`, `max_tokens`, `response_format`, and the engine requests it becomes (one per choice).
Every mistake is an ApiError with one line naming the field as the client sent it."""

from __future__ import annotations

from polyspec.orchestrator.serving.logprobs import MAX_TOP_LOGPROBS
from polyspec.orchestrator.tokenization import check_stops
from polyspec.workers.core.errors import RequestError
from polyspec.workers.core.grammar import JSON_OBJECT_SCHEMA, KINDS

MAX_MESSAGES = 1024
MAX_CHOICES = 16  # n
MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' `logprobs` (top alternatives), as OpenAI bounds it
UNSUPPORTED = {"echo": False, "suffix": None}
SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stream", "n", "user", "frequency_penalty",
                 "presence_penalty", "logit_bias", "stream_options", "top_k", "logprobs", "stop",
                 "approximate",  # polyspec's extension: an approximate decoding mode ({"mode": "bild", ...}), never implied
                 *KINDS}  # polyspec's structured output: json_schema / regex / grammar (chat also takes OpenAI's response_format)
KNOWN_FIELDS = {*SHARED_FIELDS, "prompt", "best_of", *UNSUPPORTED}
CHAT_FIELDS = {*SHARED_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
               "response_format", "parallel_tool_calls"}
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", close: bool = False,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.close, self.param, self.code = status, kind, close, param, code
        self.counted = False  # already in polyspec_requests_total (a request the request loop failed)


def prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those")


def check_options(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0][:64]!r}")
    for field, neutral in UNSUPPORTED.items():
        if field in known and body.get(field) not in (neutral, None, "", [], False):
            raise ApiError(400, f"{field!r} is not supported by polyspec")
    if body.get("best_of", 1) not in (1, None) or isinstance(body.get("best_of"), bool):
        raise ApiError(400, "'best_of' must be 1 (polyspec returns every choice it samples; ask for several with 'n')")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES):
        raise ApiError(400, f"'n' must be an integer from 1 to {MAX_CHOICES}, got {repr(n)[:40]}", param="n")
    for field in ("frequency_penalty", "presence_penalty"):
        if body.get(field) not in (None, 0, 0.0) or isinstance(body.get(field), bool):
            raise ApiError(400, f"{field!r} is not supported by polyspec (it would change the target distribution)")
    for field in ("logit_bias", "tools", "tool_choice"):
        if body.get(field):
            raise ApiError(400, f"{field!r} is not supported by polyspec")
    constraint_fields(body)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}")
    for field in ("model", "user"):
        if body.get(field) is not None and not isinstance(body[field], str):
            raise ApiError(400, f"{field!r} must be a string")
    try:
        check_stops(body.get("stop"), "'stop'", limit=MAX_STOPS)
    except RequestError as exc:
        raise ApiError(400, str(exc), param="stop") from None


def constraint_fields(body: dict) -> dict:
    """The engine fields (json_schema / regex / grammar) of the request's structured output: polyspec's own
    fields, or OpenAI's `response_format` (`json_object`: any JSON object; `json_schema`: its `schema`, always
    enforced whatever `strict` says). Their contents are checked when the engine compiles them."""
    own = {kind: body[kind] for kind in KINDS if body.get(kind) is not None}
    if len(own) > 1:
        raise ApiError(400, f"give one of {', '.join(KINDS)}, not several", param=sorted(own)[1])
    response_format = body.get("response_format")
    if response_format is None or response_format == {"type": "text"}:
        return own
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ApiError(400, "'response_format' must be an object with a 'type'", param="response_format")
    if own:
        raise ApiError(400, f"give 'response_format' or {next(iter(own))!r}, not both", param="response_format")
    kind = response_format["type"]
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind != "json_schema":
        raise ApiError(400, f"'response_format' type {kind[:32]!r} is not supported (text, json_object, json_schema)",
                       param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(400, "'response_format.json_schema' must be an object like {\"name\": ..., \"schema\": {...}}",
                       param="response_format")
    if not isinstance(spec.get("strict", True), (bool, type(None))):
        raise ApiError(400, "'response_format.json_schema.strict' must be true or false", param="response_format")
    return {"json_schema": spec.get("schema", {})}


def top_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no logprobs asked for.
    Completions send `logprobs: N` (0-5); chat sends `logprobs: true` and `top_logprobs: N` (0-20)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise ApiError(400, f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if top is not None and not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        wanted = (top or 0) if logprobs else None
    else:
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
            raise ApiError(400, f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}", param="logprobs")
        wanted = logprobs
    if wanted is not None and body.get("stream"):
        raise ApiError(400, "'logprobs' with stream: true is not supported by polyspec (ask without streaming)", param="logprobs")
    return wanted


def choices(body: dict) -> int:
    return body.get("n") or 1


def max_tokens(body: dict) -> tuple[str, object]:
    """(the field as the client named it, its value): max_completion_tokens wins over the older max_tokens."""
    for field in ("max_completion_tokens", "max_tokens"):
        if body.get(field) is not None:
            value = body[field]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ApiError(400, f"{field!r} must be an integer, got {repr(value)[:40]}", param=field)
            if value < 1:
                raise ApiError(400, f"{field!r} must be >= 1, got {value}", param=field)
            return field, value
    return "max_tokens", None


def raw_request(body: dict, prompt, max_tokens_default: int | None) -> dict:
    """The engine request of one prompt (its `n` choices are made from it once parsed: GenerationRequest.choice)."""
    raw = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": prompt}
    limit = max_tokens(body)[1]
    if limit is None:
        limit = max_tokens_default
    if limit is not None:
        raw["max_new_tokens"] = limit
    for field in ("temperature", "top_p", "top_k", "seed", "approximate"):
        if body.get(field) is not None:
            raw[field] = body[field]
    raw.update(constraint_fields(body))
    return raw


def messages(body: dict, max_bytes: int) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(413, f"{len(messages)} messages (at most {MAX_MESSAGES})")
    plain, size = [], 0
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"message {number} must be an object with a 'role' and a 'content'")
        if message["role"] not in CHAT_ROLES:
            raise ApiError(400, f"message {number}: unknown role {message['role'][:32]!r} (known: {', '.join(sorted(CHAT_ROLES))})")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
                raise ApiError(400, f"message {number}: only text content parts are supported")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ApiError(400, f"message {number}: content must be a string")
        size += len(content.encode("utf-8"))
        if size > max_bytes:
            raise ApiError(413, f"the messages hold over {max_bytes} bytes")
        plain.append({"role": message["role"], "content": content})
    return plain
