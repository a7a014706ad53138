"""Running an ASGI app (the OpenAI-compatible API, /metrics) with uvicorn on the server's event loop.

uvicorn (h11) gives HTTP/1.1 keep-alive, pipelining, the request body left unread by an
early error drained instead of parsed as the next request, malformed requests answered
400, TLS, and a cap on connections (`limit_concurrency`: 503 past it). Added here, as
docs/serving.md ("Slow clients", the status table) describes them: a deadline on each
request's headers (uvicorn's keep-alive timer covers only the idle time between requests,
and any byte stops it); past `max_connections`, connections waiting over `IDLE_EVICT_S` for
their next request closed before a complete request is refused; a request with both
`Content-Length` and `Transfer-Encoding` answered 400 and its connection closed (RFC 9112
section 6.1: h11 would take the chunked framing, and what follows could be a smuggled
request). The socket is bound here, so a port in use is an OSError for the caller to report,
not a `sys.exit` inside uvicorn; uvicorn leaves the signal handlers alone (`polyspec serve`
drains on SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 15  # an idle keep-alive connection is closed after this
STARTUP_TIMEOUT_S = 10.0
IDLE_EVICT_S = 1.0  # at the connection limit, connections waiting longer than this for a request's headers are closed


class _Connection(h11.Connection):
    """h11's server side, which refuses ambiguous framing and reports each request's headers."""

    def __init__(self, *args, on_request) -> None:
        super().__init__(*args)
        self._on_request = on_request

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # h11 lower-cases header names
            if b"content-length" in names and b"transfer-encoding" in names:
                # uvicorn answers a RemoteProtocolError 400 with `connection: close` and closes
                raise h11.RemoteProtocolError("a request with both Content-Length and Transfer-Encoding")
            self._on_request()
        return event


def _protocol(request_timeout_s: float, max_connections: int) -> type:
    class Protocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            size = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn's own
            self.conn = _Connection(h11.SERVER, size, on_request=self._request_arrived)
            self._waiting_since: float | None = None  # waiting for a request's headers since (loop time)
            self._headers_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_request()
            self._arm_headers_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_headers_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting_since is not None and self._headers_timer is None:  # the first byte of the next request
                self._arm_headers_timer()
            super().data_received(data)

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._await_request()  # before super(): it parses a pipelined request at once
            super().on_response_complete()

        def _await_request(self) -> None:
            self._waiting_since = self.loop.time()

        def _arm_headers_timer(self) -> None:
            self._headers_timer = self.loop.call_later(request_timeout_s, self._headers_overdue)

        def _disarm_headers_timer(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_overdue(self) -> None:
            self._headers_timer = None
            if self._waiting_since is not None and not self.transport.is_closing():
                self.transport.close()

        def _request_arrived(self) -> None:
            self._waiting_since = None
            self._disarm_headers_timer()
            if len(self.connections) >= max_connections:  # uvicorn answers 503 next, unless room is made
                self._make_room()

        def _make_room(self) -> None:
            now = self.loop.time()
            waiting = sorted(
                (other for other in self.connections
                 if getattr(other, "_waiting_since", None) is not None and now - other._waiting_since >= IDLE_EVICT_S),
                key=lambda other: other._waiting_since,
            )
            for other in waiting[: len(self.connections) - max_connections + 1]:
                other._evict()

        def _evict(self) -> None:
            self._disarm_headers_timer()
            self.connections.discard(self)  # at once: connection_lost comes a loop turn later
            if not self.transport.is_closing():
                self.transport.close()

    return Protocol


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the serve loop owns SIGTERM / SIGINT
        yield


class AsgiServer:
    def __init__(self, server: _Server, task: asyncio.Task, port: int) -> None:
        self._server, self._task, self.port = server, task, port

    async def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


async def start_asgi(app, host: str, port: int, *, tls: tuple[str, str] | None = None, max_connections: int = 256,
                     request_timeout_s: float = 30.0) -> AsgiServer:
    """Serve `app` on host:port (TLS with (cert file, key file)); OSError when it cannot bind."""
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        http=_protocol(request_timeout_s, max_connections),
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level="warning",
        limit_concurrency=max_connections,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=5,
        server_header=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
    while not server.started:
        if task.done():
            sock.close()
            error = task.exception() if not task.cancelled() else None
            raise OSError(f"the HTTP server did not start: {error or 'cancelled'}")
        if asyncio.get_running_loop().time() > deadline:
            task.cancel()
            sock.close()
            raise OSError("the HTTP server did not start in time")
        await asyncio.sleep(0.01)
    return AsgiServer(server, task, sock.getsockname()[1])
