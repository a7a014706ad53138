"""OpenAI-compatible HTTP API on `polyspec serve --http-port`: POST /v1/completions, GET /v1/models.

Backed by the same RoundScheduler as gRPC, so both kinds of traffic share the fair queue.
`stream: true` answers with server-sent events (`data: {...}` chunks, then `data: [DONE]`).

    request  {model, prompt (string | token ids | list of strings), max_tokens (16),
              temperature, top_p, seed, stream, n (1)}
    response {id, object: "text_completion", created, model,
              choices: [{index, text, logprobs: null, finish_reason: "stop" | "length"}],
              usage: {prompt_tokens, completion_tokens, total_tokens}}

Unsupported options (n > 1, logprobs, echo, stop, best_of > 1, suffix) are a 400 with one
line, never silently ignored. The token, when the server has one, is the API key
(`Authorization: Bearer <token>`). A client that disconnects cancels its request.
"""

from __future__ import annotations

import hmac
import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from polyspec.orchestrator.serving.request_loop import Draining, QueueFull, Work
from polyspec.workers.core.errors import RequestError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 8 << 20
FINISH_REASONS = {"eos": "stop", "length": "length", "cancelled": "stop"}
UNSUPPORTED = {"logprobs": None, "echo": False, "stop": None, "suffix": None}
KNOWN_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "n", "best_of", "user",
                "frequency_penalty", "presence_penalty", "logit_bias", "stream_options", "top_k", *UNSUPPORTED}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def model_name(service) -> str:
    target = service.engine.config.tiers[0]
    return Path(target.model).name if Path(target.model).exists() else target.model


def _prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those")


def _check_options(body: dict) -> None:
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}")
    for field, neutral in UNSUPPORTED.items():
        if body.get(field) not in (neutral, None, 0 if field == "logprobs" else neutral, "", []):
            raise ApiError(400, f"{field!r} is not supported by polyspec")
    for field in ("n", "best_of"):
        if body.get(field, 1) not in (1, None):
            raise ApiError(400, f"{field!r} must be 1 (polyspec returns one completion per prompt)")
    for field in ("frequency_penalty", "presence_penalty"):
        if body.get(field) not in (None, 0, 0.0):
            raise ApiError(400, f"{field!r} is not supported by polyspec (it would change the target distribution)")
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by polyspec")


def _raw_request(body: dict, prompt) -> dict:
    raw = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": prompt}
    raw["max_new_tokens"] = body.get("max_tokens") if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    for field in ("temperature", "top_p", "top_k", "seed"):
        if body.get(field) is not None:
            raw[field] = body[field]
    return raw


class _Handler(BaseHTTPRequestHandler):
    service = None  # set by start_openai_http
    token: str | None = None
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the gRPC side logs nothing per request either
        pass

    # ----------------------------------------------------------------- plumbing

    def _send_json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.status, {"error": {"message": str(error), "type": error.kind, "param": None, "code": None}})

    def _authorize(self) -> None:
        if self.token is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            self.service.metrics.request_finished("unauthenticated")
            raise ApiError(401, "missing authorization token" if not given else "wrong authorization token", "authentication_error")

    def _ready(self) -> None:
        if self.service.draining:
            raise ApiError(503, "the server is shutting down", "server_error")
        if self.service.scheduler is None:
            raise ApiError(503, "the models are still loading", "server_error")

    def do_GET(self) -> None:
        try:
            self._authorize()
            self._ready()
            if self.path.rstrip("/") != "/v1/models":
                raise ApiError(404, f"no route GET {self.path}", "not_found_error")
            created = int(self.service.started)
            self._send_json(200, {"object": "list", "data": [
                {"id": model_name(self.service), "object": "model", "created": created, "owned_by": "polyspec"}]})
        except ApiError as error:
            self._send_error(error)

    def do_POST(self) -> None:
        try:
            self._authorize()
            if self.path.rstrip("/") != "/v1/completions":
                raise ApiError(404, f"no route POST {self.path}", "not_found_error")
            self._ready()
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"malformed JSON: {exc.msg}") from None
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            self._completions(body)
        except ApiError as error:
            self._send_error(error)
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -------------------------------------------------------------- completions

    def _parse(self, raw: dict):
        try:
            return self.service._parse(raw)
        except RequestError as exc:
            self.service.metrics.request_finished("invalid_argument")
            raise ApiError(400, str(exc)) from None

    def _submit(self, parsed) -> tuple[Work, queue.Queue]:
        events: queue.Queue = queue.Queue()
        work = Work(parsed, on_event=lambda kind, payload: events.put((kind, payload)))
        try:
            self.service.scheduler.submit(work)
        except QueueFull as exc:
            self.service.metrics.request_finished("resource_exhausted")
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except Draining as exc:
            raise ApiError(503, str(exc), "server_error") from None
        return work, events

    def _completions(self, body: dict) -> None:
        _check_options(body)
        prompts = _prompts(body)
        requests = [self._parse(_raw_request(body, prompt)) for prompt in prompts]
        header = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                  "model": body.get("model") or model_name(self.service)}
        if body.get("stream"):
            if len(requests) > 1:
                raise ApiError(400, "stream: true takes one prompt")
            self._stream(header, requests[0], bool((body.get("stream_options") or {}).get("include_usage")))
            return
        submitted = [self._submit(request) for request in requests]
        choices, completion_tokens = [], 0
        for index, (work, events) in enumerate(submitted):
            result, text = self._collect(work, events)
            completion_tokens += len(result["token_ids"])
            choices.append({"index": index, "text": text, "logprobs": None,
                            "finish_reason": FINISH_REASONS.get(result["finish_reason"], "stop")})
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        self._send_json(200, {**header, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})

    def _collect(self, work: Work, events: queue.Queue) -> tuple[dict, str]:
        pieces = []
        while True:
            kind, payload = events.get()
            if kind == "delta":
                pieces.append(payload[1])
            elif kind == "done":
                result, tail, _ = payload
                return result, "".join(pieces) + tail
            else:
                raise _api_error(payload)

    def _stream(self, header: dict, request, include_usage: bool) -> None:
        work, events = self._submit(request)
        first = events.get()  # an error before any token is still a plain JSON error
        if first[0] == "error":
            raise _api_error(first[1])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        completion_tokens, event = 0, first
        try:
            while True:
                kind, payload = event
                if kind == "delta":
                    completion_tokens += len(payload[0])
                    self._event({**header, "choices": [{"index": 0, "text": payload[1], "logprobs": None, "finish_reason": None}]})
                elif kind == "done":
                    result, tail, _ = payload
                    reason = FINISH_REASONS.get(result["finish_reason"], "stop")
                    self._event({**header, "choices": [{"index": 0, "text": tail, "logprobs": None, "finish_reason": reason}]})
                    if include_usage:
                        self._event({**header, "choices": [], "usage": _usage(len(request.prompt_ids), completion_tokens)})
                    break
                else:
                    self._event({"error": {"message": str(payload), "type": "server_error", "param": None, "code": None}})
                    break
                event = events.get()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.service.scheduler.cancel(work)  # the client went away

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _api_error(exc: Exception) -> ApiError:
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal error: {exc}", "server_error")


def start_openai_http(service, host: str, port: int, token: str | None) -> ThreadingHTTPServer:
    """Serve in a daemon thread; raises OSError when the port cannot be bound."""
    handler = type("OpenAIHandler", (_Handler,), {"service": service, "token": token})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="polyspec-openai-http", daemon=True).start()
    return httpd
