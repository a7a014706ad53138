"""`polyspec serve`: gRPC (server.py), the OpenAI-compatible HTTP API (http.py) and /metrics,
all on one event loop; the models on the RoundScheduler thread (request_loop.py).

The gRPC server starts first and answers health NOT_SERVING while the models load; SERVING once
they are loaded and warm. SIGTERM (or Ctrl-C) drains (docs/serving.md, "Jobs survive crashes").
TLS and tokens cover gRPC, HTTP and /metrics alike (security.py; docs/serving.md's flags); binding
an address other than loopback without a token prints a warning.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.request_loop import RoundScheduler
from polyspec.orchestrator.serving.security import is_loopback
from polyspec.orchestrator.serving.guard import SERVICE_NAME, Guard
from polyspec.orchestrator.serving.server import PolyspecService
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc
from polyspec.workers.core.errors import ConfigError, PolyspecError, first_line
from polyspec.workers.core.heartbeat import heartbeat

PURGE_EVERY_S = 300.0  # how often jobs past their retention are looked for


def cmd_serve(options: dict) -> int:
    """Serve with `options`, checked and prepared before torch loads (serving.serve_options)."""
    store, lock = options["store"], options.pop("state_lock", None)
    try:
        return asyncio.run(_serve(**options))
    finally:
        store.close()
        if lock is not None:
            lock.release()  # (the kernel drops it anyway when the process ends)


def _log(message: str) -> None:
    print(f"polyspec serve: {message}", file=sys.stderr, flush=True)


async def _serve(config, host, port, store, tenants, limits, tls, tls_files, metrics_port, http_port, grace_s,
                 auth_reflection, auth_metrics, served_model_names=None, reprofile=False, exact_only=False) -> int:
    metrics = Metrics()
    service = PolyspecService(store, metrics, config.server.max_queue, tenants, limits)
    service.served_model_names = served_model_names
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.aio.server(
        interceptors=[Guard(tenants, metrics, protect_reflection=auth_reflection)],
        maximum_concurrent_rpcs=limits.max_rpcs,
        # gRPC refuses a larger message itself (RESOURCE_EXHAUSTED) before any of it reaches Python
        options=[("grpc.max_receive_message_length", limits.max_message_bytes), ("grpc.max_send_message_length", -1)],
    )
    pb_grpc.add_PolyspecServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _add_reflection(server)
    address = f"{host}:{port}"
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
    if not tenants.enabled and not is_loopback(host):
        _log(f"warning: {host} is reachable from other machines and no --auth-token-file / --tenants-file is set: "
             "anyone who can reach it may generate, and read and cancel every job")
    if tenants.enabled and not tls and not is_loopback(host):
        _log(f"warning: tokens cross the network in clear text to {host} (no --tls-cert / --tls-key)")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    try:
        engine = await asyncio.to_thread(_load_and_warm, config, reprofile, exact_only)
    except PolyspecError:
        await server.stop(0)
        raise
    scheduler = RoundScheduler(engine, store, metrics, config.server.max_queue, service.jobs_changed, tenants)
    scheduler.start()
    service.attach(engine, scheduler)
    for tier in engine.tiers:
        metrics.tier_up(tier.name, True)
    scheduler.publish_speculation()
    web = await _start_web(service, host, metrics_port, http_port, tls_files, limits, auth_metrics)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    retention = asyncio.ensure_future(_purge_old_jobs(store, limits.job_retention_s))
    pending = await asyncio.to_thread(store.pending_count)
    _log(f"ready{f'; resuming {pending} job item(s)' if pending else ''}")

    await stop.wait()
    retention.cancel()
    _log(f"draining (up to {grace_s:g}s)")
    service.draining = True
    await health_servicer.enter_graceful_shutdown()
    scheduler.drain()
    deadline = time.monotonic() + grace_s
    await asyncio.to_thread(scheduler.idle.wait, grace_s)
    await server.stop(max(0.0, deadline - time.monotonic()))
    for running in web:
        await running.stop()
    scheduler.stop()
    await asyncio.to_thread(scheduler.join, 10.0)
    _log("stopped")
    return 0


async def _start_web(service, host, metrics_port, http_port, tls_files, limits, auth_metrics) -> list:
    """The HTTP servers (metrics, OpenAI API); a port that cannot be bound is a warning."""
    from polyspec.orchestrator.serving.asgi import start_asgi
    from polyspec.orchestrator.serving.http import build_app
    from polyspec.orchestrator.serving.metrics import build_metrics_app

    scheme = "https" if tls_files else "http"
    started = []
    wanted = []
    if metrics_port:
        wanted.append(("metrics", metrics_port, build_metrics_app(service.metrics, service.tenants if auth_metrics else None),
                       "/metrics"))
    if http_port:
        wanted.append(("OpenAI-compatible API", http_port, build_app(service), "/v1"))
    for what, port, app, path in wanted:
        try:
            running = await start_asgi(app, host, port, tls=tls_files, max_connections=limits.max_connections,
                                       request_timeout_s=limits.request_timeout_s)
        except OSError as exc:
            _log(f"warning: no {what}: cannot listen on {host}:{port} ({exc.strerror or exc})")
            continue
        started.append(running)
        _log(f"{what} on {scheme}://{host}:{running.port}{path}")
    return started


async def _purge_old_jobs(store, retention_s: float) -> None:
    """Delete jobs that ended more than `retention_s` ago: now, then every PURGE_EVERY_S (or sooner,
    for a short retention). A store that cannot be written now is tried again next time."""
    while True:
        try:
            purged = await asyncio.to_thread(store.purge, time.time() - retention_s)
        except Exception as exc:  # noqa: BLE001 - a full or damaged store is reported where it is written
            _log(f"could not delete old jobs: {first_line(exc, 200)}")
            purged = 0
        if purged:
            _log(f"deleted {purged} job(s) that ended over {retention_s:g}s ago (--job-retention-s)")
        await asyncio.sleep(min(PURGE_EVERY_S, max(1.0, retention_s / 4)))


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


def _load_and_warm(config, reprofile: bool = False, exact_only: bool = False):
    """Load the chain (a line per tier, then the profile) and run one short generation so the
    first request pays no start-up cost."""
    from polyspec.orchestrator.engine import Engine

    # every active request in one batched round (batching.enabled)
    engine = Engine(config, batched=True, log=_log, cache_profiles=True, reprofile=reprofile)
    engine.exact_only = exact_only
    with heartbeat(_log, "warming up"):
        engine.generate(engine.parse_request({"prompt_ids": [0], "max_new_tokens": 2}))
    _log(f"models loaded in {engine.load_s:.1f}s" + (f", profiled in {engine.profile_s:.1f}s" if engine.profile_s else ""))
    return engine
