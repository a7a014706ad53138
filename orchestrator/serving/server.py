"""`polyspec serve`: the gRPC API (protos/polyspec/v1/polyspec.proto) over one Engine.

    event loop (grpc.aio)  --Work-->  RoundScheduler thread (all model work, rounds.py)
         ^                                    |
         +------ deltas / results ------------+   (loop.call_soon_threadsafe)

The gRPC server starts first and answers health NOT_SERVING while the models load;
SERVING once they are loaded and warm. Streams carry one message per target round.
A client that cancels (or whose deadline passes) cancels its request's work. SIGTERM
(or Ctrl-C) drains: health NOT_SERVING, no new work, running streams get `--grace`
seconds to finish, the current job item is dropped and runs again at the next start.

Errors map to status codes: RequestError -> INVALID_ARGUMENT, unknown job -> NOT_FOUND,
token -> UNAUTHENTICATED, queue full -> RESOURCE_EXHAUSTED, loading / draining / no valid
chain -> UNAVAILABLE. Each with one line of text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import sqlite3
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from polyspec.orchestrator.serving.jobs import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, JobRecord, JobStore
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.request_loop import Draining, QueueFull, RoundScheduler, Work, is_unavailable
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc
from polyspec.workers.core.errors import ConfigError, PolyspecError, RequestError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Polyspec"].full_name  # polyspec.v1.Polyspec
STREAMING_METHODS = ("Generate", "StreamJobResults")
MAX_MESSAGE_BYTES = 64 << 20  # a job's requests arrive in one message
MAX_JOB_ITEMS = 100_000
DEFAULT_GRACE_S = 30.0
DEFAULT_METRICS_PORT = 9464
JOB_STATES = {
    QUEUED: pb.JOB_STATE_QUEUED,
    RUNNING: pb.JOB_STATE_RUNNING,
    SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    FAILED: pb.JOB_STATE_FAILED,
    CANCELLED: pb.JOB_STATE_CANCELLED,
}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


# ------------------------------------------------------------------ message <-> dict


def request_dict(request: pb.GenerateRequest, request_id: str | None = None) -> dict:
    """A GenerateRequest as the dict `Engine.parse_request` validates (unset fields left out)."""
    raw: dict = {}
    if request_id or request.id:
        raw["id"] = request_id or request.id
    if request.prompt:
        raw["prompt"] = request.prompt
    if request.prompt_ids:
        raw["prompt_ids"] = list(request.prompt_ids)
    if request.messages:
        raw["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    if request.max_new_tokens:
        raw["max_new_tokens"] = request.max_new_tokens
    for field in SAMPLING_FIELDS:
        if request.HasField(field):
            raw[field] = getattr(request, field)
    return raw


def stats_message(stats: dict, timings: dict | None = None) -> pb.GenerationStats:
    message = pb.GenerationStats(
        tokens_per_s=stats.get("tokens_per_s", 0.0),
        new_tokens=stats.get("new_tokens", 0),
        time_s=stats.get("time_s", 0.0),
        stages=[stage_message(s) for s in stats.get("stages", [])],
        tiers=[pb.TierBusy(tier=t["tier"], busy_s=t.get("busy_s", 0.0)) for t in stats.get("tiers", [])],
    )
    if timings:
        message.queue_s, message.first_token_s = timings["queue_s"], timings["first_token_s"]
    return message


def stage_message(stage: dict) -> pb.StageStats:
    return pb.StageStats(
        tier=stage["tier"],
        drafter=stage["drafter"],
        blocks=stage.get("blocks", 0),
        proposed=stage.get("proposed", 0),
        accepted=stage.get("accepted", 0),
        mean_accepted_length=stage.get("mean_accepted_length", 0.0),
        lengths=stage.get("lengths", []),
        accepted_counts=stage.get("accepted_counts", []),
        time_s=stage.get("time_s", 0.0),
    )


def job_message(job: JobRecord) -> pb.Job:
    return pb.Job(
        job_id=job.job_id,
        state=JOB_STATES[job.state],
        total=job.total,
        completed=job.completed,
        failed=job.failed,
        created_at=job.created_at,
        finished_at=job.finished_at,
    )


# ------------------------------------------------------------------------- service


class PolyspecService(pb_grpc.PolyspecServicer):
    def __init__(self, store: JobStore, metrics: Metrics, max_queue: int) -> None:
        self.store = store
        self.metrics = metrics
        self.max_queue = max_queue
        self.engine = None
        self.scheduler: RoundScheduler | None = None
        self.draining = False
        self.started = time.time()
        self.tokenizer_lock = threading.Lock()
        self._jobs_changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def attach(self, engine, scheduler: RoundScheduler) -> None:
        self.engine, self.scheduler = engine, scheduler

    def jobs_changed(self) -> None:
        """Wake every StreamJobResults (called from any thread)."""

        def wake() -> None:
            self._jobs_changed.set()
            self._jobs_changed = asyncio.Event()

        try:
            self._loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    async def _ready(self, context) -> None:
        if self.draining:
            self.metrics.request_finished("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the models are still loading; retry when health says SERVING")

    def _parse(self, raw: dict):
        with self.tokenizer_lock:
            return self.engine.parse_request(raw)

    # ---------------------------------------------------------------- Generate

    async def Generate(self, request, context):
        await self._ready(context)
        try:
            parsed = self._parse(request_dict(request))
        except RequestError as exc:
            self.metrics.request_finished("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(kind, payload) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:
                pass

        work = Work(parsed, on_event=on_event)
        try:
            self.scheduler.submit(work)
        except QueueFull as exc:
            self.metrics.request_finished("resource_exhausted")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Draining as exc:
            self.metrics.request_finished("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finished = False
        try:
            while True:
                kind, payload = await events.get()
                if kind == "delta":
                    token_ids, text = payload
                    yield pb.GenerateResponse(token_ids=token_ids, text=text, id=request.id)
                elif kind == "done":
                    finished = True
                    result, tail, timings = payload
                    stats = result.get("stats") or {}
                    yield pb.GenerateResponse(
                        text=tail,
                        finish_reason=result["finish_reason"],
                        stats=stats_message(stats, timings),
                        stats_json=json.dumps(stats),
                        id=request.id,
                    )
                    return
                else:
                    finished = True
                    code = (
                        grpc.StatusCode.INVALID_ARGUMENT if isinstance(payload, RequestError)
                        else grpc.StatusCode.UNAVAILABLE if is_unavailable(payload)
                        else grpc.StatusCode.INTERNAL
                    )
                    await context.abort(code, str(payload) or type(payload).__name__)
        finally:
            if not finished:  # the client went away, or its deadline passed
                self.scheduler.cancel(work)

    # -------------------------------------------------------------------- jobs

    async def SubmitJob(self, request, context):
        await self._ready(context)
        if not request.requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a job needs at least one request")
        if len(request.requests) > MAX_JOB_ITEMS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a job holds at most {MAX_JOB_ITEMS} requests, got {len(request.requests)}")
        items = await asyncio.to_thread(self._job_items, request.requests)  # tokenizing many prompts: off the loop
        if isinstance(items, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, items)
        job = await asyncio.to_thread(self.store.create, items)
        self.scheduler.jobs_added()
        self.jobs_changed()
        return job_message(job)

    def _job_items(self, requests) -> list[tuple[str, dict, str | None]] | str:
        """(id, raw request, validation error) per request, or the message for a job that cannot be taken."""
        items, seen = [], set()
        for number, item in enumerate(requests, start=1):
            item_id = item.id or f"item-{number}"
            if item_id in seen:
                return f"request id {item_id!r} appears twice in the job (ids must be unique)"
            seen.add(item_id)
            raw = request_dict(item, item_id)
            try:
                self._parse(raw)
                error = None
            except RequestError as exc:
                error = f"request {number}: {exc}"
            items.append((item_id, raw, error))
        return items

    async def _job(self, job_id: str, context) -> JobRecord:
        job = self.store.get(job_id) if job_id else None
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}" if job_id else "job_id is empty")
        return job

    async def GetJob(self, request, context):
        return job_message(await self._job(request.job_id, context))

    async def ListJobs(self, request, context):
        return pb.ListJobsResponse(jobs=[job_message(job) for job in self.store.list(max(0, request.limit))])

    async def CancelJob(self, request, context):
        await self._job(request.job_id, context)
        job = await asyncio.to_thread(self.store.cancel, request.job_id)
        if self.scheduler is not None:
            self.scheduler.cancel_job(request.job_id)
        self.jobs_changed()
        return job_message(job)

    async def StreamJobResults(self, request, context):
        job = await self._job(request.job_id, context)
        seq = 0
        while True:
            changed = self._jobs_changed
            over = job.finished
            for seq, item in self.store.results_after(job.job_id, seq):
                result = item.result or {}
                yield pb.JobResult(
                    id=item.id,
                    token_ids=result.get("token_ids", []),
                    text=result.get("text", ""),
                    finish_reason=result.get("finish_reason", ""),
                    error=item.error,
                    stats_json=json.dumps(result["stats"]) if "stats" in result else "",
                )
            if over:
                return
            try:
                await asyncio.wait_for(changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            job = self.store.get(job.job_id)

    # ------------------------------------------------------------------- stats

    async def GetStats(self, request, context):
        snapshot = self.metrics.snapshot()
        waiting, running = self.scheduler.queue_depth() if self.scheduler else (0, 0)
        response = pb.StatsResponse(
            stages=[
                stage_message({"tier": tier, "drafter": drafter, **totals,
                               "mean_accepted_length": totals["accepted"] / totals["blocks"] if totals["blocks"] else 0.0})
                for (tier, drafter), totals in snapshot["stages"].items()
            ],
            queue=pb.QueueStats(waiting=waiting, running=running, max_queue=self.max_queue,
                                job_items_pending=self.store.pending_count()),
            requests=pb.RequestCounts(
                ok=snapshot["requests"].get("ok", 0),
                cancelled=snapshot["requests"].get("cancelled", 0),
                invalid=snapshot["requests"].get("invalid_argument", 0),
                rejected=snapshot["requests"].get("resource_exhausted", 0),
                failed=snapshot["requests"].get("internal", 0) + snapshot["requests"].get("unavailable", 0),
                job_items_done=sum(snapshot["job_items"].values()),
            ),
            generated_tokens=snapshot["generated_tokens"],
            uptime_s=time.time() - self.started,
            ready=self.scheduler is not None,
            draining=self.draining,
        )
        if self.engine is not None:
            chain = self.engine.scheduler
            active = getattr(chain, "active", tuple(range(len(chain.tiers))))
            response.speculation_lengths.extend(int(k) for k in chain.lengths)
            response.active_tiers.extend(chain.tiers[i].name for i in active)
            for tier, config in zip(self.engine.tiers, self.engine.config.tiers):
                response.tiers.add(tier=tier.name, model=config.model, up=getattr(tier, "up", True), busy_s=getattr(tier, "busy_s", 0.0))
        return response


# --------------------------------------------------------------------------- auth


class TokenAuth(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <token>` on every Polyspec call (health and reflection stay open)."""

    def __init__(self, token: str, metrics: Metrics) -> None:
        self.expected = f"Bearer {token}".encode()
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self.expected):
            return await continuation(details)
        message = "missing authorization token" if not given else "wrong authorization token"
        self.metrics.request_finished("unauthenticated")

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if details.method.rsplit("/", 1)[-1] in STREAMING_METHODS:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


# -------------------------------------------------------------------------- serve


def _read_file(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not content.strip():
        raise ConfigError(f"{what} {path} is empty")
    return content


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "polyspec")


def cmd_serve(args) -> int:
    token = _read_file(args.auth_token_file, "auth token file")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    tls = (_read_file(args.tls_key, "TLS key"), _read_file(args.tls_cert, "TLS certificate")) if args.tls_cert else None
    from polyspec.orchestrator.config import load_config  # imports torch: after the quick checks

    config = load_config(args.config)
    state_dir = args.state_dir or default_state_dir()
    try:
        store = JobStore(state_dir)
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(f"cannot use state dir {state_dir}: {exc}") from None
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    options = {
        "config": config,
        "host": host,
        "port": port,
        "store": store,
        "token": token.decode().strip() if token else None,
        "tls": tls,
        "metrics_port": args.metrics_port,
        "http_port": getattr(args, "http_port", None),
        "grace_s": args.grace,
    }
    try:
        return asyncio.run(_serve(**options))
    finally:
        store.close()


def _check_bindable(host: str, port: int) -> None:
    """A clear one-line error before gRPC tries (and logs its own multi-line complaint)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise ConfigError(f"cannot listen on {host}:{port}: unknown host") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _log(message: str) -> None:
    print(f"polyspec serve: {message}", file=sys.stderr, flush=True)


async def _serve(config, host, port, store, token, tls, metrics_port, http_port, grace_s) -> int:
    metrics = Metrics()
    service = PolyspecService(store, metrics, config.server.max_queue)
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.aio.server(
        interceptors=[TokenAuth(token, metrics)] if token else None,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    pb_grpc.add_PolyspecServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _add_reflection(server)
    address = f"{host}:{port}"
    _check_bindable(host, port)
    try:
        if tls:
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise ConfigError(f"cannot listen on {address} (in use, or not an address of this machine)")
    await server.start()
    _log(f"listening on {host}:{bound}{' (TLS)' if tls else ''}; loading models")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    try:
        engine = await asyncio.to_thread(_load_and_warm, config)
    except PolyspecError:
        await server.stop(0)
        raise
    scheduler = RoundScheduler(engine, store, metrics, config.server.max_queue, service.jobs_changed, service.tokenizer_lock)
    scheduler.start()
    service.attach(engine, scheduler)
    for tier in engine.tiers:
        metrics.tier_up(tier.name, True)
    scheduler.publish_speculation()
    if metrics_port:
        try:
            metrics.serve_http(metrics_port, host)
            _log(f"metrics on http://{host}:{metrics_port}/metrics")
        except OSError as exc:
            _log(f"warning: no metrics: cannot listen on {host}:{metrics_port} ({exc.strerror or exc})")
    if http_port:
        from polyspec.orchestrator.serving.http import start_openai_http

        try:
            start_openai_http(service, host, http_port, token)
            _log(f"OpenAI-compatible API on http://{host}:{http_port}/v1")
        except OSError as exc:
            _log(f"warning: no OpenAI-compatible API: cannot listen on {host}:{http_port} ({exc.strerror or exc})")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    pending = store.pending_count()
    _log(f"ready{f'; resuming {pending} job item(s)' if pending else ''}")

    await stop.wait()
    _log(f"draining (up to {grace_s:g}s)")
    service.draining = True
    await health_servicer.enter_graceful_shutdown()
    scheduler.drain()
    deadline = time.monotonic() + grace_s
    await asyncio.to_thread(scheduler.idle.wait, grace_s)
    await server.stop(max(0.0, deadline - time.monotonic()))
    scheduler.stop()
    await asyncio.to_thread(scheduler.join, 10.0)
    _log("stopped")
    return 0


def _add_reflection(server) -> None:
    """Server reflection under both names clients ask for: grpc.reflection.v1alpha (what
    grpcio-reflection ships) and grpc.reflection.v1 (the same messages, renamed)."""
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.reflection.v1.ServerReflection", {"ServerReflectionInfo": v1}),))


def _load_and_warm(config):
    """Load the chain and run one short generation so the first request pays no start-up cost."""
    from polyspec.orchestrator.engine import Engine

    engine = Engine(config)
    engine.generate(engine.parse_request({"prompt_ids": [0], "max_new_tokens": 2}))
    return engine
