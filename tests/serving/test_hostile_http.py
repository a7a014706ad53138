"""Hostile HTTP clients against a real `polyspec serve` on the demo chain: headers trickled on a
kept-alive connection are cut at `--request-timeout-s`, connections held that way do not starve
clients that send requests, and a request with both Content-Length and Transfer-Encoding is
answered 400 and its connection closed, so nothing smuggled behind it is answered."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
from serving_helpers import DEMO_CONFIG, http_server

REQUEST_TIMEOUT_S = 4.0
MAX_CONNECTIONS = 8
LINE_EVERY_S = 2.0  # the trickling client's pace: each line well inside the timeout, the whole never


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    with http_server(DEMO_CONFIG, tmp_path_factory.mktemp("hostile_http") / "state", "--request-timeout-s", str(REQUEST_TIMEOUT_S),
                     "--max-connections", str(MAX_CONNECTIONS)) as process:
        yield process


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a Content-Length body: (status line, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return lines[0], body


def kept_alive_connection(port: int) -> socket.socket:
    """A connection that has had one complete request answered."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _ = read_response(sock)
    assert status == b"HTTP/1.1 200 OK", status
    return sock


def trickle_headers(sock: socket.socket, lines: int = 30) -> float | None:
    """Send the next request's headers one line every LINE_EVERY_S; seconds from the first
    line until the server closed the connection, None if it never did."""
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    for number in range(lines):
        sock.settimeout(LINE_EVERY_S)
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except socket.timeout:
            pass
        except OSError:
            return time.monotonic() - started
        try:
            sock.sendall(b"X-Slow-%d: y\r\n" % number)
        except OSError:
            return time.monotonic() - started
    return None


def completion(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "def f(x):", "max_tokens": 2}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_headers_trickled_on_a_kept_alive_connection_are_cut_at_the_request_timeout(demo_server):
    sock = kept_alive_connection(demo_server.http_port)
    try:
        closed_after = trickle_headers(sock)
    finally:
        sock.close()
    # the timer starts at the first byte of the second request; one recv wait of slack
    assert closed_after is not None, "the trickled headers kept the connection open"
    assert REQUEST_TIMEOUT_S - 0.5 <= closed_after <= REQUEST_TIMEOUT_S + LINE_EVERY_S + 1, closed_after


def test_connections_held_with_slow_headers_do_not_starve_other_clients(demo_server):
    port = demo_server.http_port
    holders = [kept_alive_connection(port) for _ in range(MAX_CONNECTIONS - 1)]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]  # never send a byte
    closed_after: list[float | None] = [None] * len(holders)

    def hold(index: int) -> None:
        closed_after[index] = trickle_headers(holders[index])

    threads = [threading.Thread(target=hold, args=(index,), daemon=True) for index in range(len(holders))]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # every held connection has waited past the eviction grace for its request
        # 11 connections held against a limit of 8: a client that sends a whole request is served
        statuses = [completion(port) for _ in range(5)]
        assert statuses == [200] * 5
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S + 3 * LINE_EVERY_S)
        # every held connection was closed: made room for the others, or cut at the header timeout
        latest = REQUEST_TIMEOUT_S + LINE_EVERY_S + 1
        assert all(seconds is not None and seconds <= latest for seconds in closed_after), closed_after
        assert completion(port) == 200
    finally:
        for sock in holders + silent:
            sock.close()


def test_content_length_with_transfer_encoding_is_400_and_closes_the_connection(demo_server):
    body = b"0\r\n\r\n"
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", demo_server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body) + body + smuggled)
        reply = b""
        while chunk := sock.recv(65536):  # the server closes: a timeout here otherwise
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"connection: close" in reply.lower()
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # the smuggled GET got no answer
    assert b'"object":"list"' not in reply
    assert "Traceback" not in demo_server.output()
