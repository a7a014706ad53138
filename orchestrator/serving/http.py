"""OpenAI-compatible HTTP API on `polyspec serve --http-port` (a Starlette app, run by asgi.py):
POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], GET /health (no token needed).

docs/serving.md ("OpenAI-compatible") is the reference for its fields, polyspec's extensions
(`approximate`: docs/approximate.md; `usage.polyspec_plans`; structured output) and its status codes;
errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`), one line, each counted in
polyspec_requests_total. Backed by the same RoundScheduler as gRPC, so both kinds of traffic share the
fair queue. A body is measured before it is parsed (bounded_json); one over 64 KiB is parsed in a worker
thread, one at a time, so no body holds the event loop. A client that disconnects, streaming or not,
cancels its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from polyspec.orchestrator.serving.bounded_json import LARGE_REQUEST_BYTES, JsonRefused, loads_bounded, return_memory_soon
from polyspec.orchestrator.serving.jobs import LimitExceeded
from polyspec.orchestrator.serving.request_loop import Choice, Draining, QueueFull, is_unavailable, public_reason
from polyspec.orchestrator.serving.security import Tenants
from polyspec.orchestrator.serving import openai_request
from polyspec.orchestrator.serving.openai_request import CHAT_FIELDS, KNOWN_FIELDS, MAX_STOPS, ApiError
from polyspec.orchestrator.tokenization import check_stops, encode_chat
from polyspec.workers.core.errors import RequestError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
BUFFERED_BODIES = 16  # bodies of the largest size the server holds at once, read and not yet parsed (BodyBudget)
INLINE_PARSE_BYTES = 64 << 10  # a body up to this size is parsed on the event loop; a larger one in a worker thread
HTTP_STATUS_LABELS = {400: "invalid_argument", 401: "unauthenticated", 404: "invalid_argument", 405: "invalid_argument",
                      408: "resource_exhausted", 413: "resource_exhausted", 429: "resource_exhausted", 500: "internal",
                      503: "unavailable"}  # an HTTP refusal -> polyspec_requests_total's status
# the engine's finish_reason -> OpenAI's ("stop" stays; "grammar": the request's grammar allowed no token of the vocabulary)
FINISH_REASONS = {"eos": "stop", "length": "length", "cancelled": "stop", "grammar": "grammar"}
SHOWN_NAME_CHARS = 64  # of a model name an error quotes back


def served_names(service) -> list[str]:
    """The names the API answers to: `serve --served-model-name`, or the target's folder name or id."""
    target = service.engine.config.tiers[0].model
    return list(service.served_model_names or [Path(target).name if Path(target).exists() else target])


def _shown(name: str) -> str:
    return repr(name if len(name) <= SHOWN_NAME_CHARS else name[:SHOWN_NAME_CHARS] + "...")


def _model_not_found(service, name: str) -> ApiError:
    return ApiError(404, f"the model {_shown(name)} does not exist (this server serves {', '.join(map(repr, served_names(service)))})",
                    param="model", code="model_not_found")


def _error_body(error: ApiError) -> dict:
    return {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}}


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"Connection": "close"} if error.close else None
    return JSONResponse(_error_body(error), status_code=error.status, headers=headers)


# ------------------------------------------------------------------- the body


class BodyBudget:
    """The bytes of request bodies the server holds at once (read, not yet parsed), all
    connections together: many clients sending the largest body at once get 429 past it,
    instead of the server growing by connections x --max-body-bytes."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    @contextlib.contextmanager
    def ticket(self):
        """`take(size)` for each chunk (ApiError 429 past the budget); all of it given back at the end."""
        taken = 0

        def take(size: int) -> None:
            nonlocal taken
            if self.used + size > self.total:
                raise ApiError(429, "the server is reading too many large request bodies at once; retry later",
                               "rate_limit_error", close=True)
            self.used += size
            taken += size

        try:
            yield take
        finally:
            self.used -= taken


async def _read_body(request: Request, limit: int, timeout_s: float, take) -> bytes:
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
            take(len(chunk))
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body was not sent within {timeout_s:g}s", close=True) from None
    return b"".join(chunks)


def parse_json_body(raw: bytes, max_bytes: int) -> dict:
    """Bytes -> a JSON object, or ApiError(400 / 413) with one line. Measured before it is parsed
    (bounded_json), so a body of millions of nested arrays costs milliseconds, not seconds."""
    try:
        body = loads_bounded(raw, "the request body", max_bytes) if raw.strip() else {}
    except JsonRefused as exc:
        raise ApiError(exc.status, str(exc)) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _failure(exc: Exception) -> ApiError:
    """A request the request loop failed (and counted already)."""
    if isinstance(exc, RequestError):
        error = ApiError(400, str(exc))
    else:
        error = ApiError(503 if is_unavailable(exc) else 500, public_reason(exc), "server_error")
    error.counted = True
    return error


# -------------------------------------------------------------------- the app


class OpenAIApi:
    def __init__(self, service) -> None:
        self.service = service
        self.limits = service.limits
        self._parsing = asyncio.Semaphore(1)  # large bodies parsed one at a time
        self._bodies = BodyBudget(BUFFERED_BODIES * self.limits.max_body_bytes)

    # ---------------------------------------------------------------- plumbing

    def _authorize(self, request: Request) -> str:
        """The caller's tenant ("" without tokens); ApiError(401) for a missing or wrong token."""
        tenants = self.service.tenants
        given = request.headers.get("authorization", "")
        tenant = tenants.tenant_of(given)
        if tenant is None:
            raise ApiError(401, Tenants.denial(given), "authentication_error")
        return tenant

    def _ready(self) -> None:
        if self.service.draining:
            raise ApiError(503, "the server is shutting down", "server_error")
        if self.service.scheduler is None:
            raise ApiError(503, "the models are still loading", "server_error")

    def endpoint(self, handler, needs_body: bool):
        async def run(request: Request) -> Response:
            try:
                tenant = self._authorize(request)
                self._ready()
                if not needs_body:
                    return await handler(request, tenant, None)
                with self._bodies.ticket() as take:  # the body's bytes count until it is parsed
                    raw = await _read_body(request, self.limits.max_body_bytes, self.limits.request_timeout_s, take)
                    if len(raw) > LARGE_REQUEST_BYTES:
                        return_memory_soon()  # its pages go back to the system once it is freed
                    if len(raw) <= INLINE_PARSE_BYTES:  # milliseconds at most: not worth a thread
                        body = parse_json_body(raw, self.limits.max_body_bytes)
                    else:  # one at a time: each holds the interpreter lock up to a few tenths of a second
                        async with self._parsing:
                            body = await asyncio.to_thread(parse_json_body, raw, self.limits.max_body_bytes)
                    del raw
                return await handler(request, tenant, body)
            except ApiError as error:
                if not error.counted:
                    self.service.metrics.request_finished(HTTP_STATUS_LABELS.get(error.status, "invalid_argument"))
                return _error_response(error)
            except ClientDisconnect:
                return Response(status_code=499)  # nobody is listening
            except Exception as exc:  # noqa: BLE001 - one line in the log, never a traceback or a dropped connection
                print(f"polyspec serve: HTTP {request.url.path} failed: {exc!r}"[:500], file=sys.stderr, flush=True)
                return _error_response(ApiError(500, "internal error", "server_error"))

        return run

    async def _parse_all(self, raws: list[dict], body: dict) -> list:
        """Each prompt's request validated and tokenized once, then one request per choice (`n`), a prompt's together."""
        service = self.service
        try:
            for raw in raws:
                service.check_sizes(raw)
            parsed = await asyncio.to_thread(lambda: [service.parse_now(raw) for raw in raws])
        except LimitExceeded as exc:
            raise ApiError(413, str(exc)) from None
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        return [request.choice(j) for request in parsed for j in range(openai_request.choices(body))]

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        if self.service.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.service.scheduler is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(self.service.started), "owned_by": "polyspec"}

    async def models(self, request: Request, tenant: str, body: None) -> Response:
        return JSONResponse({"object": "list", "data": [self._model(name) for name in served_names(self.service)]})

    async def model(self, request: Request, tenant: str, body: None) -> Response:
        name = request.path_params["model_id"]
        if name not in served_names(self.service):
            raise _model_not_found(self.service, name)
        return JSONResponse(self._model(name))

    def _check_model(self, body: dict, chat: bool) -> str:
        """The body's fields and logprobs checked (completions' or chat's), then the served name it asked for
        (the first one when it named none)."""
        openai_request.check_options(body, CHAT_FIELDS if chat else KNOWN_FIELDS)
        openai_request.top_logprobs(body, chat)
        names = served_names(self.service)
        name = body.get("model")
        if name is None:
            return names[0]
        if name not in names:
            raise _model_not_found(self.service, name)
        return name

    async def completions(self, request: Request, tenant: str, body: dict) -> Response:
        model = self._check_model(body, chat=False)
        prompts = openai_request.prompts(body)
        if len(prompts) * openai_request.choices(body) > self.limits.max_prompts:
            raise ApiError(413, f"{len(prompts)} prompts x n = {openai_request.choices(body)} choices in one request (at most {self.limits.max_prompts})")
        stream = bool(body.get("stream"))
        if stream and len(prompts) > 1:
            raise ApiError(400, "stream: true takes one prompt")
        requests = await self._parse_all([openai_request.raw_request(body, prompt, DEFAULT_MAX_TOKENS) for prompt in prompts], body)
        return await self._answer(request, tenant, body, model, requests, chat=False)

    async def chat(self, request: Request, tenant: str, body: dict) -> Response:
        model = self._check_model(body, chat=True)
        if openai_request.choices(body) > self.limits.max_prompts:
            raise ApiError(413, f"n = {openai_request.choices(body)} choices in one request (at most {self.limits.max_prompts})")
        messages = openai_request.messages(body, self.limits.max_prompt_bytes)
        service = self.service

        def encode() -> list[int]:
            with service.prompt_tokenizer() as tokenizer:
                return encode_chat(tokenizer, messages)

        try:
            ids = await asyncio.to_thread(encode)
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        requests = await self._parse_all([openai_request.raw_request(body, ids, None)], body)
        return await self._answer(request, tenant, body, model, requests, chat=True)

    # ---------------------------------------------------------------- answers

    def _choices_of(self, requests: list, body: dict, tenant: str) -> tuple[list["_Answer"], asyncio.Queue]:
        """Every request queued (or none: each counts against `tenant`'s share of the queue), and the queue of their events."""
        stops = check_stops(body.get("stop"), "'stop'", limit=MAX_STOPS)
        try:
            return self.service.submit(requests, tenant, stops, _Answer)
        except QueueFull as exc:
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except Draining as exc:
            raise ApiError(503, str(exc), "server_error") from None

    @staticmethod
    def _usage(requests: list, choices: list["_Answer"], body: dict) -> dict:
        # a prompt counts once however many choices it has (as OpenAI counts it)
        prompt_tokens = sum(len(r.prompt_ids) for r in requests[:: openai_request.choices(body)])
        completion_tokens = sum(len(choice.token_ids) for choice in choices)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
        if any(choice.plans for choice in choices):  # polyspec's extension (lengths: auto): per choice, the planner's plans
            usage["polyspec_plans"] = [choice.plans for choice in choices]
        return usage

    async def _answer(self, request: Request, tenant: str, body: dict, model: str, requests: list, chat: bool) -> Response:
        kind = "chat.completion" if chat else "text_completion"
        header = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": kind,
                  "created": int(time.time()), "model": model}
        mode = requests[0].approximate  # one body, one mode
        if not mode.lossless:  # polyspec's extension: this text is not the target's own (every chunk says so too)
            header["approximate"] = mode.describe()
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(header, body, requests, include_usage, chat, tenant)
        choices, events = self._choices_of(requests, body, tenant)
        collecting = asyncio.ensure_future(_collect(choices, events))
        watching = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():  # the client went away: its requests stop
                return Response(status_code=499)
            texts = collecting.result()
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
            for choice in choices:
                choice.cancel()  # no-op for finished work
        top = openai_request.top_logprobs(body, chat)
        logprobs = [None] * len(choices) if top is None else await asyncio.gather(
            *(self._logprobs(choice, top, chat) for choice in choices))
        answers = []
        for choice, text, scored in zip(choices, texts, logprobs):
            if chat:
                answers.append({"index": choice.index, "message": {"role": "assistant", "content": text}, "logprobs": scored,
                                "finish_reason": choice.reason})
            else:
                answers.append({"index": choice.index, "text": text, "logprobs": scored, "finish_reason": choice.reason})
        return JSONResponse({**header, "choices": answers, "usage": self._usage(requests, choices, body)})

    async def _logprobs(self, choice: "_Answer", top: int, chat: bool) -> dict:
        """The choice's tokens (those its text holds, when a stop string cut it) with the target's log-probabilities."""
        scored, names = await asyncio.to_thread(self.service.score_choice, choice, top)
        if chat:
            def entry(token: int, logprob: float) -> dict:
                return {"token": names[token], "logprob": logprob, "bytes": list(names[token].encode("utf-8"))}

            return {"content": [{**entry(s.token_id, s.logprob), "top_logprobs": [entry(i, v) for i, v in s.top]} for s in scored],
                    "refusal": None}
        offsets, offset = [], 0
        for s in scored:
            offsets.append(offset)
            offset += len(names[s.token_id])
        return {"tokens": [names[s.token_id] for s in scored], "token_logprobs": [s.logprob for s in scored],
                "top_logprobs": [{names[i]: v for i, v in s.top} for s in scored] if top else None, "text_offset": offsets}

    async def _stream(self, header: dict, body: dict, requests: list, include_usage: bool, chat: bool,
                      tenant: str) -> Response:
        choices, events = self._choices_of(requests, body, tenant)  # (choice index, kind, payload) of every choice, as they come

        def stop_all() -> None:
            for choice in choices:
                choice.cancel()

        try:
            first = await events.get()  # an error before any token is still a plain JSON error
        except asyncio.CancelledError:
            stop_all()
            raise
        if first[1] == "error":
            stop_all()
            raise _failure(first[2])
        header = {**header, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(index: int, text: str | None, reason: str | None, role: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
            return b"data: " + json.dumps({**header, "choices": [choice]}).encode() + b"\n\n"

        async def sse():
            try:
                if chat:
                    for choice in choices:
                        yield chunk(choice.index, "", None, role=True)
                pending, item = len(choices), first
                while True:
                    choice = choices[item[0]]
                    try:
                        text, done = choice.handle(item[1:])
                    except ApiError as error:
                        yield b"data: " + json.dumps(_error_body(error)).encode() + b"\n\n"
                        break
                    if done:
                        pending -= 1
                        yield chunk(choice.index, text, choice.reason)
                    elif text:
                        yield chunk(choice.index, text, None)
                    if not pending:
                        if include_usage:
                            usage = self._usage(requests, choices, body)
                            yield b"data: " + json.dumps({**header, "choices": [], "usage": usage}).encode() + b"\n\n"
                        break
                    item = await events.get()
                yield b"data: [DONE]\n\n"
            finally:
                stop_all()  # the client went away, or an error ended the stream: every choice stops

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Answer(Choice):
    """One choice of an answer (request_loop.Choice: cut at the first stop string) as OpenAI shows it: its request's
    events in, text and OpenAI's finish_reason out."""

    @property
    def reason(self) -> str:
        """OpenAI's finish_reason, once done."""
        return FINISH_REASONS.get(self.finish_reason, "stop")

    def handle(self, event) -> tuple[str, bool]:
        """(text to show, whether the choice is done); ApiError for a failed request."""
        kind, payload = event
        if kind == "delta":
            return self.delta(*payload), False
        if kind == "done":
            self.done(payload[0])
            return "", True
        self.failed()
        raise _failure(payload)


async def _collect(choices: list[_Answer], events: asyncio.Queue) -> list[str]:
    """Every choice's events until each is done (ApiError for one that failed); their texts."""
    while not all(choice.finished for choice in choices):
        index, *event = await events.get()
        choices[index].handle(event)
    return [choice.text for choice in choices]


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
        Route("/v1/models/{model_id:path}", api.endpoint(api.model, needs_body=False), methods=["GET"]),
        Route("/v1/completions", api.endpoint(api.completions, needs_body=True), methods=["POST"]),
        Route("/v1/chat/completions", api.endpoint(api.chat, needs_body=True), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})
