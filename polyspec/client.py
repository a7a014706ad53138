"""Python SDK for a `polyspec serve` server: `Client` (blocking) and `AsyncClient` (asyncio).

    from polyspec.client import Client
    with Client("127.0.0.1:50051") as client:
        print(client.generate("def f(x):", max_new_tokens=32)["text"])
        print(client.generate(messages=[{"role": "user", "content": "Write a haiku"}])["text"])
        for delta in client.stream("import os", max_new_tokens=32):
            print(delta.text, end="", flush=True)
        three = client.generate("def f(x):", n=3, temperature=0.8, seed=1)  # a list: one result per choice
        scored = client.generate("def f(x):", logprobs=True, top_logprobs=2)["logprobs"]
        job = client.submit_job([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
        client.wait(job.job_id, progress=lambda j: print(j.completed, "/", j.total))
        results = list(client.results(job.job_id))

Results have the CLI's shape: {id?, text, token_ids, finish_reason, stats}, and `logprobs`
when asked for (a list of {token_id, token, logprob, top_logprobs}); a failed job item is
{id, error}. Server errors are raised as `ClientError` subclasses carrying the gRPC
status (`.code`) and the server's one-line message (`.details`).

This module loads grpcio and protobuf only (no torch, ray or transformers), so a client
machine installs little.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Iterable, Iterator, TypedDict

import grpc

from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
RETRY_PAUSE_S = 0.5
REQUEST_FIELDS = ("id", "prompt", "prompt_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "approximate",
                  "json_schema", "regex", "grammar")
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = 1  # grpc.health.v1.HealthCheckResponse.SERVING
MAX_MESSAGE_BYTES = 64 << 20
JOB_STATES = {
    pb.JOB_STATE_QUEUED: "queued",
    pb.JOB_STATE_RUNNING: "running",
    pb.JOB_STATE_SUCCEEDED: "succeeded",
    pb.JOB_STATE_FAILED: "failed",
    pb.JOB_STATE_CANCELLED: "cancelled",
}
FINISHED_STATES = ("succeeded", "failed", "cancelled")


# ------------------------------------------------------------------------ errors


class ClientError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(ClientError):
    pass


class NotFound(ClientError):
    pass


class Unauthenticated(ClientError):
    pass


class ResourceExhausted(ClientError):
    pass


class FailedPrecondition(ClientError):
    """E.g. an idempotency key already used for a job with other requests."""


class Unavailable(ClientError):
    pass


class DeadlineExceeded(ClientError):
    pass


class Cancelled(ClientError):
    pass


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def _client_error(exc: grpc.RpcError) -> ClientError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details and "larger than max" in details:
        details += " (the server's --max-message-bytes, 4 MiB by default: split a large job into several)"
    return _ERRORS.get(code, ClientError)(code, details or code.name.lower())


# ------------------------------------------------------------------------- types


@dataclasses.dataclass(frozen=True)
class Delta:
    """One verification round's newly committed tokens; the last also has finish_reason and stats."""

    token_ids: list[int]
    text: str
    finish_reason: str = ""
    stats: dict | None = None
    id: str = ""
    index: int = 0  # the choice it belongs to (a request with n > 1)
    logprobs: list[dict] | None = None  # the choice's last message, when logprobs were asked for: one per token


@dataclasses.dataclass(frozen=True)
class Job:
    job_id: str
    state: str  # queued | running | succeeded | failed | cancelled
    total: int
    completed: int
    failed: int
    created_at: float = 0.0
    finished_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.state in FINISHED_STATES


def request_message(raw: dict) -> pb.GenerateRequest:
    """A request dict (the JSONL format of `polyspec batch`) as a GenerateRequest."""
    if not isinstance(raw, dict):
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"a request must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(REQUEST_FIELDS))
    if unknown:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"unknown request field {unknown[0]!r} (known: {', '.join(REQUEST_FIELDS)})")
    max_new = raw.get("max_new_tokens")
    if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new <= 0:  # 0 on the wire means "default"
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens must be > 0, got {max_new}")
    fields = {key: value for key, value in raw.items() if value is not None}
    if "id" in fields:
        fields["id"] = str(fields["id"])
    if "approximate" in fields:  # an approximate decoding mode travels as JSON (the server validates it)
        fields["approximate_json"] = json.dumps(fields.pop("approximate"))
    if "json_schema" in fields and not isinstance(fields["json_schema"], str):  # a schema object travels as JSON text
        fields["json_schema"] = json.dumps(fields["json_schema"])
    try:
        return pb.GenerateRequest(**fields)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"bad request field: {exc}") from None


def _request(prompt, prompt_ids, messages, max_new_tokens, temperature, top_p, top_k, seed, id, stop=None, n=None,
             logprobs=None, top_logprobs=None, json_schema=None, regex=None, grammar=None) -> pb.GenerateRequest:
    raw = {"id": id, "prompt": prompt, "prompt_ids": prompt_ids, "messages": messages, "max_new_tokens": max_new_tokens,
           "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "json_schema": json_schema, "regex": regex,
           "grammar": grammar}
    message = request_message(raw)
    # Generate only (a job's requests run to their end, one result each); the server checks the values
    extra = {"n": n, "logprobs": logprobs, "top_logprobs": top_logprobs}
    try:
        if stop is not None:
            message.stop.extend([stop] if isinstance(stop, str) else stop)
        for field, value in extra.items():
            if value is not None:
                setattr(message, field, value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"bad request field: {exc}") from None
    return message


def _submit_message(requests: Iterable[dict], idempotency_key: str | None) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(requests=[request_message(raw) for raw in requests],
                               idempotency_key=idempotency_key or uuid.uuid4().hex)


def _delta(message: pb.GenerateResponse, logprobs: bool = False) -> Delta:
    """`logprobs`: the request asked for them (a choice's last message then carries its list, empty or not)."""
    stats = json.loads(message.stats_json) if message.stats_json else None
    scored = [_logprob(entry) for entry in message.logprobs] if logprobs and message.finish_reason else None
    return Delta(list(message.token_ids), message.text, message.finish_reason, stats, message.id, message.index, scored)


def _logprob(entry: pb.TokenLogprob) -> dict:
    return {"token_id": entry.token_id, "token": entry.token, "logprob": entry.logprob,
            "top_logprobs": [{"token_id": t.token_id, "token": t.token, "logprob": t.logprob} for t in entry.top_logprobs]}


def _job(message: pb.Job) -> Job:
    return Job(message.job_id, JOB_STATES.get(message.state, "unknown"), message.total, message.completed,
               message.failed, message.created_at, message.finished_at)


def _job_result(message: pb.JobResult) -> dict:
    if message.error:
        return {"id": message.id, "error": message.error}
    return {
        "id": message.id,
        "text": message.text,
        "token_ids": list(message.token_ids),
        "finish_reason": message.finish_reason,
        "stats": json.loads(message.stats_json) if message.stats_json else {},
    }


def message_dict(message) -> dict:
    """Every field of a message as plain Python values (numbers stay numbers, unlike MessageToDict's int64);
    an `optional` number the server left unset is absent."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.message_type is None and not repeated and field.has_presence and not message.HasField(field.name):
            continue
        if field.message_type is not None:
            out[field.name] = [message_dict(v) for v in value] if repeated else message_dict(value)
        else:
            out[field.name] = list(value) if repeated else value
    return out


class _PlanTotals(TypedDict):
    rounds: int
    tokens: int
    seconds: float
    measured_tokens_per_s: float


class ChainPlan(_PlanTotals, total=False):
    """`stats()["plans"]` entry: one chain the planner chose (`speculation.lengths: auto`), summed over every
    plan run on it since the server started: `chain` ("target<-mid<-ngram", /metrics' label), `tiers` (the same as
    names), `rounds`, the `tokens` they committed, their wall `seconds` summed over requests,
    `measured_tokens_per_s` (tokens / seconds) and `predicted_tokens_per_s` (the planner's prediction over the
    seconds that had one; absent where none did)."""

    chain: str
    tiers: list[str]
    predicted_tokens_per_s: float


class PlanRecord(_PlanTotals, total=False):
    """`stats()["recent_plans"]` entry: one plan a request ran under, as its result's `stats["plans"]` lists it:
    `tiers` (target first), `lengths` (one per verifying tier; 0: the target alone), `new_tokens` before it,
    `rounds`, `tokens`, `seconds`, `measured_tokens_per_s` and `predicted_tokens_per_s` (absent: the planner gave none)."""

    tiers: list[str]
    lengths: list[int]
    new_tokens: int
    predicted_tokens_per_s: float


class _Collector:
    """Deltas -> the whole result, in the CLI's shape."""

    def __init__(self, request_id: str | None) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.text.append(delta.text)
        self.last = delta

    def result(self) -> dict:
        last = self.last or Delta([], "")
        result = {"text": "".join(self.text), "token_ids": self.token_ids, "finish_reason": last.finish_reason, "stats": last.stats or {}}
        if last.logprobs is not None:
            result["logprobs"] = last.logprobs
        return {"id": self.request_id, **result} if self.request_id is not None else result


def _results(deltas: list[Delta], request_id: str | None, n: int | None) -> dict | list[dict]:
    """Deltas of every choice -> one result (no `n` asked for), or a list of them in choice order."""
    collectors: dict[int, _Collector] = {}
    for delta in deltas:
        collectors.setdefault(delta.index, _Collector(request_id)).add(delta)
    results = [collectors[index].result() for index in sorted(collectors)]
    if n is None:
        return results[0] if results else _Collector(request_id).result()
    return results


def _credentials(tls) -> grpc.ChannelCredentials | None:
    """tls: None / False = plain TCP; True = system roots; a path or PEM bytes = that CA certificate."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    pem = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


# ------------------------------------------------------------------------ Client


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, tls=None) -> None:
        credentials = _credentials(tls)
        self._channel = (grpc.secure_channel(address, credentials, _CHANNEL_OPTIONS) if credentials
                         else grpc.insecure_channel(address, _CHANNEL_OPTIONS))
        self._stub = pb_grpc.PolyspecStub(self._channel)
        self._health = self._channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        self._metadata = _metadata(token)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    # ------------------------------------------------------------- generation

    def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None, messages: list[dict] | None = None,
               max_new_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               seed: int | None = None, id: str | None = None, timeout: float | None = None,
               stop: str | list[str] | None = None, n: int | None = None, logprobs: bool | None = None,
               top_logprobs: int | None = None, json_schema: dict | str | None = None, regex: str | None = None,
               grammar: str | None = None) -> Iterator[Delta]:
        """Deltas as they are committed; leaving the loop early cancels the request on the server.
        `stop`: the text ends before the first of these strings (finish_reason "stop").
        `json_schema` (a schema, or its JSON text), `regex` or `grammar` (EBNF): structured output, lossless;
        an invalid one raises InvalidArgument before any model work.
        `n`: that many choices, sampled independently (each delta's `index` says whose); with a
        seed, choice j samples from a seed derived from (seed, j).
        `logprobs` (and `top_logprobs`, 0-20 alternatives): each choice's last delta carries the
        target's log-probabilities of its tokens, under the request's warp (docs/serving.md)."""
        request = _request(prompt, prompt_ids, messages, max_new_tokens, temperature, top_p, top_k, seed, id, stop, n,
                           logprobs, top_logprobs, json_schema, regex, grammar)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for message in call:
                yield _delta(message, bool(logprobs))
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt: str | None = None, **kwargs) -> dict | list[dict]:
        """The whole result: {id?, text, token_ids, finish_reason, stats} (as `polyspec generate --json`),
        with `logprobs` when asked for; with `n`, a list of n results in choice order."""
        return _results(list(self.stream(prompt, **kwargs)), kwargs.get("id"), kwargs.get("n"))

    # ------------------------------------------------------------------- jobs

    def submit_job(self, requests: Iterable[dict], timeout: float | None = None, idempotency_key: str | None = None,
                   retry_s: float = 0.0) -> Job:
        """Submit a job. Every submission carries an idempotency key (a fresh one unless given):
        for `retry_s` seconds a call that fails UNAVAILABLE (server down or restarting, reply
        lost) is sent again with the same key, so it makes one job however often it is sent."""
        message = _submit_message(requests, idempotency_key)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return _job(self._call(self._stub.SubmitJob, message, timeout))
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_PAUSE_S)

    def job(self, job_id: str) -> Job:
        return _job(self._call(self._stub.GetJob, pb.GetJobRequest(job_id=job_id)))

    def jobs(self, limit: int = 0) -> list[Job]:
        return [_job(j) for j in self._call(self._stub.ListJobs, pb.ListJobsRequest(limit=limit)).jobs]

    def cancel(self, job_id: str) -> Job:
        return _job(self._call(self._stub.CancelJob, pb.CancelJobRequest(job_id=job_id)))

    def wait(self, job_id: str, progress: Callable[[Job], None] | None = None, poll_s: float = 0.5,
             timeout: float | None = None) -> Job:
        """Poll until the job is over; `progress(job)` after every poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if progress is not None:
                progress(job)
            if job.done:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"job {job_id} not finished after {timeout:g}s")
            time.sleep(poll_s)

    def results(self, job_id: str) -> Iterator[dict]:
        """Every finished result (in finishing order), then the rest as they finish, until the job ends."""
        call = self._stub.StreamJobResults(pb.StreamJobResultsRequest(job_id=job_id), metadata=self._metadata)
        try:
            for message in call:
                yield _job_result(message)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            call.cancel()

    # ------------------------------------------------------------------ server

    def stats(self) -> dict:
        """GetStats as a dict: stages, speculation_lengths, active_tiers, tiers, queue, requests, generated_tokens,
        uptime_s, ready, draining, and the planner's decisions (`speculation.lengths: auto`; empty lists with fixed
        lengths): `plans` (list[ChainPlan], per chain, the sums /metrics' polyspec_plan_* series export) and
        `recent_plans` (list[PlanRecord], the last 32 plans requests ran, oldest first, with their lengths)."""
        return message_dict(self._call(self._stub.GetStats, pb.GetStatsRequest()))

    def ready(self, timeout: float = 1.0) -> bool:
        """True when the server's health says SERVING (models loaded and warm)."""
        try:
            return self._health(b"", timeout=timeout) == bytes([0x08, SERVING])
        except grpc.RpcError:
            return False

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, f"server not ready after {timeout:g}s")
            time.sleep(poll_s)


# ------------------------------------------------------------------- AsyncClient


class AsyncClient:
    """The same calls as `Client`, as coroutines (`stream` and `results` are async iterators)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, tls=None) -> None:
        credentials = _credentials(tls)
        self._channel = (grpc.aio.secure_channel(address, credentials, _CHANNEL_OPTIONS) if credentials
                         else grpc.aio.insecure_channel(address, _CHANNEL_OPTIONS))
        self._stub = pb_grpc.PolyspecStub(self._channel)
        self._health = self._channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        self._metadata = _metadata(token)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method, request, timeout=None):
        try:
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    async def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None, messages: list[dict] | None = None,
                     max_new_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     seed: int | None = None, id: str | None = None, timeout: float | None = None,
                     stop: str | list[str] | None = None, n: int | None = None, logprobs: bool | None = None,
                     top_logprobs: int | None = None, json_schema: dict | str | None = None, regex: str | None = None,
                     grammar: str | None = None) -> AsyncIterator[Delta]:
        """As Client.stream."""
        request = _request(prompt, prompt_ids, messages, max_new_tokens, temperature, top_p, top_k, seed, id, stop, n,
                           logprobs, top_logprobs, json_schema, regex, grammar)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield _delta(message, bool(logprobs))
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs) -> dict | list[dict]:
        """As Client.generate."""
        return _results([delta async for delta in self.stream(prompt, **kwargs)], kwargs.get("id"), kwargs.get("n"))

    async def submit_job(self, requests: Iterable[dict], timeout: float | None = None, idempotency_key: str | None = None,
                         retry_s: float = 0.0) -> Job:
        """As Client.submit_job."""
        message = _submit_message(requests, idempotency_key)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return _job(await self._call(self._stub.SubmitJob, message, timeout))
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)

    async def job(self, job_id: str) -> Job:
        return _job(await self._call(self._stub.GetJob, pb.GetJobRequest(job_id=job_id)))

    async def jobs(self, limit: int = 0) -> list[Job]:
        return [_job(j) for j in (await self._call(self._stub.ListJobs, pb.ListJobsRequest(limit=limit))).jobs]

    async def cancel(self, job_id: str) -> Job:
        return _job(await self._call(self._stub.CancelJob, pb.CancelJobRequest(job_id=job_id)))

    async def wait(self, job_id: str, progress: Callable[[Job], Awaitable[None] | None] | None = None,
                   poll_s: float = 0.5, timeout: float | None = None) -> Job:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = await self.job(job_id)
            if progress is not None:
                maybe = progress(job)
                if asyncio.iscoroutine(maybe):
                    await maybe
            if job.done:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"job {job_id} not finished after {timeout:g}s")
            await asyncio.sleep(poll_s)

    async def results(self, job_id: str) -> AsyncIterator[dict]:
        call = self._stub.StreamJobResults(pb.StreamJobResultsRequest(job_id=job_id), metadata=self._metadata)
        try:
            async for message in call:
                yield _job_result(message)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            call.cancel()

    async def stats(self) -> dict:
        """`Client.stats`: GetStats as a dict, with the planner's `plans` and `recent_plans`."""
        return message_dict(await self._call(self._stub.GetStats, pb.GetStatsRequest()))

    async def ready(self, timeout: float = 1.0) -> bool:
        try:
            return await self._health(b"", timeout=timeout) == bytes([0x08, SERVING])
        except grpc.RpcError:
            return False
