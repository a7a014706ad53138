"""Running an ASGI app (the OpenAI-compatible API, /metrics) with uvicorn on the server's event loop.

uvicorn (h11) gives HTTP/1.1 keep-alive, pipelining, the request body left unread by an
early error drained instead of parsed as the next request, malformed requests answered
400, TLS, and a cap on connections (`limit_concurrency`: 503 past it). Added here:

- a client that connects and does not finish its request headers within
  `request_timeout_s` is disconnected (uvicorn's keep-alive timer covers only the time
  between requests);
- the socket is bound here, so a port in use is an OSError for the caller to report, not
  a `sys.exit` inside uvicorn;
- uvicorn leaves the process's signal handlers alone: `polyspec serve` drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 15  # an idle keep-alive connection is closed after this
STARTUP_TIMEOUT_S = 10.0


def _protocol(request_timeout_s: float) -> type:
    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.loop.call_later(request_timeout_s, self._headers_overdue)

        def _headers_overdue(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no complete request yet
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
        http=_protocol(request_timeout_s),
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
