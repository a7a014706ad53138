"""A careless or hostile client against the shared server: every mistake is the right status
with one line, nothing it sends breaks the connection for the next request, and nothing it
abandons keeps running."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
import urllib.request

import grpc
import pytest
from serving_helpers import polyspec_command, server_env

from polyspec.client import InvalidArgument, NotFound
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc

LONG = 240


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def post(connection: http.client.HTTPConnection, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    return response.status, json.loads(payload) if payload else {}


def read_to_eof(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def one_line_error(payload: dict) -> str:
    message = payload["error"]["message"]
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    return message


@pytest.fixture
def conn(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    yield connection
    connection.close()


# ------------------------------------------------------------------------ 4: bad bodies


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not valid UTF-8"),
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "lone surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (b'{"prompt": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", "nested deeper"),
        (b'{"prompt": "x", "stream": true, "stream_options": "x"}', "stream_options"),
        (b'{"prompt": "x", "seed": 1000000000000000000000000000000}', "seed must be in [0, 2^63)"),
        (b'{"prompt": "x", "seed": 9223372036854775808}', "seed must be in [0, 2^63)"),
        (b'{"prompt": "x", "seed": -1}', "seed must be in [0, 2^63)"),
        (b'{"prompt": "x", "temperature": 1e38}', "temperature must be finite"),
        (b'{"prompt": "x", "temperature": Infinity}', "temperature must be finite"),
        (b'{"prompt": "x", "temperature": 1e400}', "temperature must be finite"),
        (b'{"prompt": "x", "max_tokens": "many"}', "'max_tokens' must be an integer"),
        (b'{"prompt": "x"', "malformed JSON"),
        (b'"just a string"', "must be a JSON object"),
    ],
)
def test_malformed_bodies_are_400_and_the_connection_lives_on(conn, body, message):
    status, payload = post(conn, "/v1/completions", body)
    assert status == 400 and message in one_line_error(payload)
    status, payload = post(conn, "/v1/completions", json.dumps({"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}).encode())
    assert status == 200 and payload["choices"][0]["finish_reason"] in ("length", "stop")


def test_bad_content_length_is_400_without_a_traceback(server):
    for header in (b"Content-Length: abc", b"Content-Length: -5", b"Content-Length: 1, 2"):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n{}")
            reply = read_to_eof(sock)
        assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert "Traceback" not in server.output()


# ----------------------------------------------------------- 5: early errors and keep-alive


def test_an_error_before_the_body_is_read_does_not_poison_keep_alive(conn):
    # the body of a 404 looks like a request: it must be skipped, not run as the next one
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    status, payload = post(conn, "/v1/chat/nothing", smuggled)
    assert status == 404 and "no route" in one_line_error(payload)
    status, payload = post(conn, "/v1/completions", json.dumps({"prompt": "import os", "max_tokens": 2}).encode())
    assert status == 200 and payload["object"] == "text_completion"


def test_an_oversized_body_is_413_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{")
        reply = read_to_eof(sock)  # the server hangs up instead of reading 100 GB (a timeout here otherwise)
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()


# ------------------------------------------------------------ 2: list prompts, all or none


def test_a_prompt_list_over_the_limit_queues_nothing(conn, client):
    before = client.stats()
    status, payload = post(conn, "/v1/completions", json.dumps({"prompt": ["x"] * 300, "max_tokens": 2}).encode())
    assert status == 413 and "300 prompts" in one_line_error(payload)
    after = client.stats()
    assert after["generated_tokens"] == before["generated_tokens"]
    assert after["requests"]["ok"] == before["requests"]["ok"]


# ------------------------------------------------------------- 3: disconnects cancel


def test_a_non_streaming_client_that_disconnects_cancels_its_request(server, client):
    before = client.stats()
    body = json.dumps({"prompt": "class A:", "max_tokens": LONG, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: client.stats()["queue"]["running"] > 0, what="the request to start")
    stats = wait_until(lambda: (s := client.stats())["requests"]["cancelled"] > before["requests"]["cancelled"]
                       and s["queue"]["running"] == 0 and s, what="the request to be cancelled")
    assert stats["generated_tokens"] - before["generated_tokens"] < LONG


# ------------------------------------------------------------------- 7: bounded ids


def test_ids_are_bounded(server, client):
    with pytest.raises(InvalidArgument, match="id has 4000000 characters"):
        client.generate("x", max_new_tokens=2, id="i" * 4_000_000)
    with pytest.raises(NotFound) as caught:
        client.job("j" * 100_000)
    assert len(caught.value.details) < 200
    with pytest.raises(InvalidArgument, match="id has 300 characters"):
        client.submit_job([{"id": "i" * 300, "prompt": "x"}])


# --------------------------------------------------------------------- 8: seeds


def test_every_bit_of_the_seed_counts(client):
    texts = [client.generate("import", max_new_tokens=16, temperature=1.5, seed=seed)["token_ids"]
             for seed in (5, 5 + 2**32, 5 + 2**40, 5)]
    assert texts[0] == texts[3]  # the same seed samples the same tokens
    assert len({tuple(t) for t in texts[:3]}) == 3, texts
    with pytest.raises(InvalidArgument, match=r"seed must be in \[0, 2\^63\)"):  # int64 on the wire: no 2^63 here
        client.generate("x", max_new_tokens=2, seed=-1)


def test_batch_writes_every_line_when_one_seed_is_out_of_range(serving_config, tmp_path):
    lines = [{"id": "a", "prompt": "x", "max_new_tokens": 2, "seed": 1},
             {"id": "big", "prompt": "x", "max_new_tokens": 2, "seed": 2**64},
             {"id": "hot", "prompt": "x", "max_new_tokens": 2, "temperature": 1e38},
             {"id": "c", "prompt": "y", "max_new_tokens": 2, "seed": 2**63 - 1}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.run(polyspec_command() + ["batch", "-c", serving_config, "-i", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, env=server_env())
    assert "Traceback" not in proc.stderr, proc.stderr
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {"a", "big", "hot", "c"}
    assert "seed must be in [0, 2^63)" in results["big"]["error"] and "\n" not in results["big"]["error"]
    assert "temperature must be finite" in results["hot"]["error"]
    assert results["a"]["token_ids"] and results["c"]["token_ids"]


# ------------------------------------------------------------ 9: garbage to a method


def test_garbage_bytes_are_invalid_argument(server):
    with grpc.insecure_channel(server.address) as channel:
        for method in ("GetJob", "SubmitJob", "Generate", "GetStats"):
            streaming = method == "Generate"
            call = (channel.unary_stream if streaming else channel.unary_unary)(f"/polyspec.v1.Polyspec/{method}")
            # a truncated varint, a field longer than the message, a string field 1 that is not UTF-8
            # (GetStatsRequest has no field 1: there it is an unknown field, which protobuf keeps)
            for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05ab") + ((b"\x0a\x02\xc3\x28",) if method != "GetStats" else ()):
                with pytest.raises(grpc.RpcError) as caught:
                    reply = call(garbage, timeout=10)
                    if streaming:
                        list(reply)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, caught.value)
                assert "Error" not in caught.value.details() and "\n" not in caught.value.details()
        stub = pb_grpc.PolyspecStub(channel)
        assert stub.GetStats(pb.GetStatsRequest(), timeout=10).ready  # still healthy


# ------------------------------------------------------------------ 10: queue gauge


def test_queue_depth_gauge_follows_the_queue(server, client):
    client.generate("def f(x):", max_new_tokens=4)
    # the client hears "done" before the loop takes the request off its running list: let the queue settle
    deadline = time.monotonic() + 10
    while client.stats()["queue"]["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    stats = client.stats()["queue"]
    assert f'polyspec_queue_depth{{state="running"}} {float(stats["running"])}' in text
    assert f'polyspec_queue_depth{{state="waiting"}} {float(stats["waiting"])}' in text
    assert stats["running"] == 0
