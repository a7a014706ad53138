"""OpenAI-compatible HTTP API on `polyspec serve --http-port` (a Starlette app, run by asgi.py).

    POST /v1/completions        {model, prompt (string | token ids | list of those), max_tokens (16),
                                 temperature, top_p, top_k, seed, stream, stream_options, n (1)}
    POST /v1/chat/completions   {model, messages: [{role, content}], max_tokens | max_completion_tokens
                                 (default: the config's), temperature, top_p, top_k, seed, stream, n (1)}
    GET  /v1/models
    GET  /health                200 once the models are loaded, 503 while loading or draining (no token needed)

Backed by the same RoundScheduler as gRPC, so both kinds of traffic share the fair queue.
`stream: true` answers with server-sent events (`data: {...}` chunks, then `data: [DONE]`).
Chat messages become the prompt through the target tokenizer's chat template
(polyspec.orchestrator.tokenization.encode_chat).

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`), one line:
400 for a malformed body (not UTF-8, not JSON, nested too deep, a lone surrogate) or a bad
or unsupported option (n > 1, logprobs, echo, stop, best_of > 1, suffix, tools: never
silently ignored), 401 without the token (`Authorization: Bearer <token>`), 404 for an
unknown route, 408 for a body not sent within the request timeout, 413 past a size limit
(body, prompts per list, prompt bytes), 429 when the queue has no room for every prompt of
the request (then none is queued), 503 while loading or draining. A client that
disconnects, streaming or not, cancels its requests.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from polyspec.orchestrator.serving.jobs import LimitExceeded
from polyspec.orchestrator.serving.request_loop import Draining, QueueFull, Work, is_unavailable, public_reason
from polyspec.orchestrator.serving.security import Tenants
from polyspec.orchestrator.tokenization import encode_chat
from polyspec.workers.core.errors import RequestError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_JSON_DEPTH = 32
MAX_MESSAGES = 1024
FINISH_REASONS = {"eos": "stop", "length": "length", "cancelled": "stop"}
UNSUPPORTED = {"logprobs": None, "echo": False, "stop": None, "suffix": None}
SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stream", "n", "user", "frequency_penalty",
                 "presence_penalty", "logit_bias", "stream_options", "top_k", "logprobs", "stop"}
KNOWN_FIELDS = {*SHARED_FIELDS, "prompt", "best_of", *UNSUPPORTED}
CHAT_FIELDS = {*SHARED_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
               "response_format", "parallel_tool_calls"}
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", close: bool = False) -> None:
        super().__init__(message)
        self.status, self.kind, self.close = status, kind, close


def model_name(service) -> str:
    target = service.engine.config.tiers[0]
    return Path(target.model).name if Path(target.model).exists() else target.model


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"Connection": "close"} if error.close else None
    body = {"error": {"message": str(error), "type": error.kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=error.status, headers=headers)


# ------------------------------------------------------------------- the body


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body has {length} bytes (at most {limit})", close=True)
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes", close=True)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body was not sent within {timeout_s:g}s", close=True) from None
    return b"".join(chunks)


def parse_json_body(raw: bytes) -> dict:
    """Bytes -> a JSON object, or ApiError(400) with one line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text) if text.strip() else {}
    except RecursionError:
        raise ApiError(400, f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_values(body, 0)
    return body


def _check_values(value, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "a string in the request holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_values(key, depth + 1)
            _check_values(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_values(item, depth + 1)


# ---------------------------------------------------------------- the options


def _prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those")


def _check_options(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0][:64]!r}")
    for field, neutral in UNSUPPORTED.items():
        if field in known and body.get(field) not in (neutral, None, 0 if field == "logprobs" else neutral, "", [], False):
            raise ApiError(400, f"{field!r} is not supported by polyspec")
    for field in ("n", "best_of"):
        if body.get(field, 1) not in (1, None) or isinstance(body.get(field), bool):
            raise ApiError(400, f"{field!r} must be 1 (polyspec returns one completion per prompt)")
    for field in ("frequency_penalty", "presence_penalty"):
        if body.get(field) not in (None, 0, 0.0) or isinstance(body.get(field), bool):
            raise ApiError(400, f"{field!r} is not supported by polyspec (it would change the target distribution)")
    for field in ("logit_bias", "tools", "tool_choice", "top_logprobs"):
        if body.get(field):
            raise ApiError(400, f"{field!r} is not supported by polyspec")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "'response_format' other than text is not supported by polyspec")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}")
    for field in ("model", "user"):
        if body.get(field) is not None and not isinstance(body[field], str):
            raise ApiError(400, f"{field!r} must be a string")


def _raw_request(body: dict, prompt, max_tokens_default: int | None) -> dict:
    raw = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": prompt}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    for field in ("temperature", "top_p", "top_k", "seed"):
        if body.get(field) is not None:
            raw[field] = body[field]
    return raw


def _messages(body: dict, max_bytes: int) -> list[dict]:
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _failure(exc: Exception) -> ApiError:
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc))
    return ApiError(503 if is_unavailable(exc) else 500, public_reason(exc), "server_error")


# -------------------------------------------------------------------- the app


class OpenAIApi:
    def __init__(self, service) -> None:
        self.service = service
        self.limits = service.limits

    # ---------------------------------------------------------------- plumbing

    def _authorize(self, request: Request) -> None:
        tenants = self.service.tenants
        if tenants.enabled:
            given = request.headers.get("authorization", "")
            if tenants.tenant_of(given) is None:
                self.service.metrics.request_finished("unauthenticated")
                raise ApiError(401, Tenants.denial(given), "authentication_error")

    def _ready(self) -> None:
        if self.service.draining:
            raise ApiError(503, "the server is shutting down", "server_error")
        if self.service.scheduler is None:
            raise ApiError(503, "the models are still loading", "server_error")

    def endpoint(self, handler, needs_body: bool):
        async def run(request: Request) -> Response:
            try:
                self._authorize(request)
                self._ready()
                if not needs_body:
                    return await handler(request, None)
                body = parse_json_body(await _read_body(request, self.limits.max_body_bytes, self.limits.request_timeout_s))
                return await handler(request, body)
            except ApiError as error:
                return _error_response(error)
            except ClientDisconnect:
                return Response(status_code=499)  # nobody is listening
            except Exception as exc:  # noqa: BLE001 - one line in the log, never a traceback or a dropped connection
                print(f"polyspec serve: HTTP {request.url.path} failed: {exc!r}"[:500], file=sys.stderr, flush=True)
                return _error_response(ApiError(500, "internal error", "server_error"))

        return run

    async def _parse_all(self, raws: list[dict]) -> list:
        service = self.service
        try:
            for raw in raws:
                service.check_sizes(raw)
            return await asyncio.to_thread(lambda: [service.parse_now(raw) for raw in raws])
        except LimitExceeded as exc:
            service.metrics.request_finished("resource_exhausted")
            raise ApiError(413, str(exc)) from None
        except RequestError as exc:
            service.metrics.request_finished("invalid_argument")
            raise ApiError(400, str(exc)) from None

    def _submit(self, requests: list) -> list[tuple[Work, asyncio.Queue]]:
        """Queue every request, or none of them."""
        pairs = []
        for parsed in requests:
            events, on_event = self.service.events()
            pairs.append((Work(parsed, on_event=on_event), events))
        try:
            self.service.scheduler.submit_all([work for work, _ in pairs])
        except QueueFull as exc:
            self.service.metrics.request_finished("resource_exhausted")
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except Draining as exc:
            raise ApiError(503, str(exc), "server_error") from None
        return pairs

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        if self.service.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.service.scheduler is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request, body: None) -> Response:
        created = int(self.service.started)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name(self.service), "object": "model", "created": created, "owned_by": "polyspec"}]})

    async def completions(self, request: Request, body: dict) -> Response:
        _check_options(body, KNOWN_FIELDS)
        prompts = _prompts(body)
        if len(prompts) > self.limits.max_prompts:
            raise ApiError(413, f"{len(prompts)} prompts in one request (at most {self.limits.max_prompts})")
        stream = bool(body.get("stream"))
        if stream and len(prompts) > 1:
            raise ApiError(400, "stream: true takes one prompt")
        requests = await self._parse_all([_raw_request(body, prompt, DEFAULT_MAX_TOKENS) for prompt in prompts])
        return await self._answer(request, body, requests, chat=False)

    async def chat(self, request: Request, body: dict) -> Response:
        _check_options(body, CHAT_FIELDS)
        messages = _messages(body, self.limits.max_prompt_bytes)
        service = self.service

        def encode() -> list[int]:
            with service.prompt_tokenizer() as tokenizer:
                return encode_chat(tokenizer, messages)

        try:
            ids = await asyncio.to_thread(encode)
        except RequestError as exc:
            service.metrics.request_finished("invalid_argument")
            raise ApiError(400, str(exc)) from None
        requests = await self._parse_all([_raw_request(body, ids, None)])
        return await self._answer(request, body, requests, chat=True)

    # ---------------------------------------------------------------- answers

    async def _answer(self, request: Request, body: dict, requests: list, chat: bool) -> Response:
        kind = "chat.completion" if chat else "text_completion"
        header = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": kind,
                  "created": int(time.time()), "model": body.get("model") or model_name(self.service)}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(header, requests[0], include_usage, chat)
        pairs = self._submit(requests)
        collecting = asyncio.ensure_future(asyncio.gather(*(self._collect(events) for _, events in pairs)))
        watching = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client went away: its requests stop
                return Response(status_code=499)
            outcomes = collecting.result()
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
            for work, _ in pairs:
                self.service.scheduler.cancel(work)  # no-op for finished work
        choices, completion_tokens = [], 0
        for index, (result, text) in enumerate(outcomes):
            completion_tokens += len(result["token_ids"])
            reason = FINISH_REASONS.get(result["finish_reason"], "stop")
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        return JSONResponse({**header, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})

    @staticmethod
    async def _collect(events: asyncio.Queue) -> tuple[dict, str]:
        pieces = []
        while True:
            kind, payload = await events.get()
            if kind == "delta":
                pieces.append(payload[1])
            elif kind == "done":
                result, tail, _ = payload
                return result, "".join(pieces) + tail
            else:
                raise _failure(payload)

    async def _stream(self, header: dict, parsed, include_usage: bool, chat: bool) -> Response:
        ((work, events),) = self._submit([parsed])
        try:
            first = await events.get()  # an error before any token is still a plain JSON error
        except asyncio.CancelledError:
            self.service.scheduler.cancel(work)
            raise
        if first[0] == "error":
            raise _failure(first[1])
        header = {**header, "object": "chat.completion.chunk" if chat else "text_completion"}
        scheduler = self.service.scheduler

        def chunk(text: str | None, reason: str | None, role: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return b"data: " + json.dumps({**header, "choices": [choice]}).encode() + b"\n\n"

        async def sse():
            finished, completion_tokens, event = False, 0, first
            try:
                if chat:
                    yield chunk("", None, role=True)
                while True:
                    kind, payload = event
                    if kind == "delta":
                        completion_tokens += len(payload[0])
                        yield chunk(payload[1], None)
                    elif kind == "done":
                        finished = True
                        result, tail, _ = payload
                        yield chunk(tail, FINISH_REASONS.get(result["finish_reason"], "stop"))
                        if include_usage:
                            usage = _usage(len(parsed.prompt_ids), completion_tokens)
                            yield b"data: " + json.dumps({**header, "choices": [], "usage": usage}).encode() + b"\n\n"
                        break
                    else:
                        finished = True
                        error = _failure(payload)
                        yield b"data: " + json.dumps({"error": {"message": str(error), "type": error.kind, "param": None,
                                                                "code": None}}).encode() + b"\n\n"
                        break
                    event = await events.get()
                yield b"data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away
                    scheduler.cancel(work)

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(service) -> Starlette:
    api = OpenAIApi(service)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            return _error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path[:100]}"))
        return _error_response(ApiError(404, f"no route {request.method} {request.url.path[:100]}", "not_found_error"))

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.endpoint(api.models, needs_body=False), methods=["GET"]),
        Route("/v1/completions", api.endpoint(api.completions, needs_body=True), methods=["POST"]),
        Route("/v1/chat/completions", api.endpoint(api.chat, needs_body=True), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})
