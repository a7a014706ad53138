"""Tenants that cannot see each other, limits, idempotent job submission, the chat route,
HTTP timeouts: one private server with a tenants file, a chat template and small limits."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import stat
import time
import urllib.error
import urllib.request

import grpc
import pytest
import yaml
from serving_helpers import ServerProcess, free_port

from polyspec.client import Client, NotFound, ResourceExhausted, Unauthenticated

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
LONG = 240


@pytest.fixture(scope="module")
def tenant_server(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    target = root / "target"
    shutil.copytree(tiny_family["target"], target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    config = root / "chain.yaml"
    config.write_text(yaml.safe_dump({
        "tiers": [{"name": "target", "model": str(target), "threads": 1},
                  {"name": "mid", "model": tiny_family["mid"], "threads": 1}],
        "speculation": {"lengths": [4]},
        "sampling": {"max_new_tokens": 8},
        "server": {"max_queue": 4},
    }))
    tenants = root / "tenants.txt"
    tenants.write_text(f"# tenant token\nalice {ALICE}\nbob {BOB}\n")
    http_port, metrics_port = free_port(), free_port()
    process = ServerProcess(str(config), root / "state", "--tenants-file", str(tenants), "--http-port", str(http_port),
                            "--metrics-port", str(metrics_port), "--auth-metrics", "--auth-reflection",
                            "--max-live-jobs", "2", "--max-prompt-bytes", "2000", "--max-job-items", "5",
                            "--max-prompts", "8", "--request-timeout-s", "2", "--max-connections", "16")
    process.http_port, process.metrics_port, process.root, process.target = http_port, metrics_port, root, str(target)
    try:
        process.wait_ready(token=ALICE).close()
        yield process
    finally:
        process.stop()


@pytest.fixture
def alice(tenant_server):
    with Client(tenant_server.address, token=ALICE) as client:
        yield client


@pytest.fixture
def bob(tenant_server):
    with Client(tenant_server.address, token=BOB) as client:
        yield client


def test_a_tenant_sees_reads_and_cancels_only_its_own_jobs(alice, bob, tenant_server):
    job = alice.submit_job([{"id": "a1", "prompt": "def f(x):", "max_new_tokens": 4}])
    alice.wait(job.job_id, timeout=120)
    assert [r["id"] for r in alice.results(job.job_id)] == ["a1"]
    for call in (bob.job, bob.cancel, lambda j: list(bob.results(j))):
        with pytest.raises(NotFound):
            call(job.job_id)
    assert job.job_id in [j.job_id for j in alice.jobs()]
    assert job.job_id not in [j.job_id for j in bob.jobs()]
    with Client(tenant_server.address) as stranger:
        assert stranger.ready()  # health is open
        with pytest.raises(Unauthenticated, match="missing authorization token"):
            stranger.jobs()
    state = tenant_server.root / "state"
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for name in os.listdir(state):
        assert stat.S_IMODE(os.stat(state / name).st_mode) == 0o600, name


def test_the_same_idempotency_key_makes_one_job_per_tenant(alice, bob):
    requests = [{"id": "k", "prompt": "import os", "max_new_tokens": 2}]
    first = alice.submit_job(requests, idempotency_key="retry-me")
    again = alice.submit_job(requests, idempotency_key="retry-me")
    other = bob.submit_job(requests, idempotency_key="retry-me")
    assert again.job_id == first.job_id and other.job_id != first.job_id
    assert sum(j.job_id == first.job_id for j in alice.jobs()) == 1
    for client, job in ((alice, first), (bob, other)):
        client.wait(job.job_id, timeout=120)


def test_limits_are_resource_exhausted(alice, bob):
    with pytest.raises(ResourceExhausted, match="prompt has 3000 bytes"):
        alice.generate("x" * 3000, max_new_tokens=2)
    with pytest.raises(ResourceExhausted, match="at most 5 requests"):
        alice.submit_job([{"prompt": "x"}] * 6)
    long_job = [{"prompt": f"class A{i}:", "max_new_tokens": LONG} for i in range(5)]
    first = alice.submit_job(long_job)
    second = bob.submit_job(long_job[:1])
    try:
        with pytest.raises(ResourceExhausted, match="unfinished jobs"):
            alice.submit_job(long_job[:1])  # two live jobs already, the limit
    finally:
        alice.cancel(first.job_id)
        bob.cancel(second.job_id)


def test_reflection_and_metrics_need_the_token(tenant_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(tenant_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=(("authorization", f"Bearer {BOB}"),)))
        assert "polyspec.v1.Polyspec" in [s.name for s in replies[0].list_services_response.service]
    url = f"http://127.0.0.1:{tenant_server.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(url, timeout=10)
    assert denied.value.code == 401
    allowed = urllib.request.Request(url, headers={"Authorization": f"Bearer {ALICE}"})
    assert "polyspec_requests_total" in urllib.request.urlopen(allowed, timeout=10).read().decode()


# ------------------------------------------------------------------------------ HTTP


def _post(connection, path: str, body: dict | bytes, token: str | None = ALICE) -> tuple[int, dict | bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    connection.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body).encode(), headers=headers)
    response = connection.getresponse()
    payload = response.read()
    if response.getheader("content-type", "").startswith("application/json"):
        return response.status, json.loads(payload)
    return response.status, payload


def test_http_401_413_429_and_keep_alive(tenant_server, alice):
    connection = http.client.HTTPConnection("127.0.0.1", tenant_server.http_port, timeout=60)
    try:
        status, payload = _post(connection, "/v1/completions", b"GET /v1/models HTTP/1.1\r\n\r\n", token=None)
        assert status == 401 and payload["error"]["message"] == "missing authorization token"
        status, payload = _post(connection, "/v1/completions", {"prompt": "x" * 3000, "max_tokens": 2})
        assert status == 413 and "3000 bytes" in payload["error"]["message"]
        before = alice.stats()
        status, payload = _post(connection, "/v1/completions", {"prompt": ["def f(x):"] * 6, "max_tokens": 2})
        assert status == 429 and "for 6 more" in payload["error"]["message"]  # max_queue 4: none of the 6 is queued
        assert alice.stats()["generated_tokens"] == before["generated_tokens"]
        status, payload = _post(connection, "/v1/completions", {"prompt": ["def f(x):"] * 3, "max_tokens": 2})
        assert status == 429 and "this tenant's share" in payload["error"]["message"]  # max_queue 4, two tenants: 2 each
        status, payload = _post(connection, "/v1/completions", {"prompt": ["def f(x):"] * 2, "max_tokens": 2, "temperature": 0})
        assert status == 200 and len(payload["choices"]) == 2
        health = urllib.request.urlopen(f"http://127.0.0.1:{tenant_server.http_port}/health", timeout=10)
        assert json.loads(health.read()) == {"status": "ok"}  # open, no token
    finally:
        connection.close()


def test_chat_completions_streaming_and_not(tenant_server, alice):
    from polyspec.orchestrator.tokenization import encode_chat
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A function f."}]
    ids = encode_chat(AutoTokenizer.from_pretrained(tenant_server.target), messages)
    assert ids[-len("<assistant>"):] == list(AutoTokenizer.from_pretrained(tenant_server.target)("<assistant>")["input_ids"])
    expected = alice.generate(prompt_ids=ids, max_new_tokens=10, temperature=0)
    connection = http.client.HTTPConnection("127.0.0.1", tenant_server.http_port, timeout=60)
    try:
        status, payload = _post(connection, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0})
        assert status == 200, payload
        assert payload["object"] == "chat.completion"
        assert payload["choices"][0]["message"] == {"role": "assistant", "content": expected["text"]}
        assert payload["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected["token_ids"]),
                                    "total_tokens": len(ids) + len(expected["token_ids"])}
        status, raw = _post(connection, "/v1/chat/completions",
                            {"messages": messages, "max_tokens": 10, "temperature": 0, "stream": True,
                             "stream_options": {"include_usage": True}})
        assert status == 200
        events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == expected["text"]
        assert chunks[-1]["usage"]["completion_tokens"] == len(expected["token_ids"])
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        for body, message in (({"messages": []}, "non-empty list"),
                              ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
                              ({"messages": messages, "tools": [{"type": "function"}]}, "'tools' is not supported")):
            status, payload = _post(connection, "/v1/chat/completions", body)
            assert status == 400 and message in payload["error"]["message"]
    finally:
        connection.close()


def _read_to_eof(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def test_half_sent_requests_are_capped_and_dropped_and_the_server_stays_up(tenant_server):
    socks = []
    try:
        for _ in range(20):  # more than --max-connections 16
            sock = socket.create_connection(("127.0.0.1", tenant_server.http_port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            socks.append(sock)
        with socket.create_connection(("127.0.0.1", tenant_server.http_port), timeout=30) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_to_eof(extra).startswith(b"HTTP/1.1 503")  # past the connection cap
        for sock in socks:  # each closed by the server (request timeout 2 s), none answered
            assert _read_to_eof(sock) == b""
    finally:
        for sock in socks:
            sock.close()
    with socket.create_connection(("127.0.0.1", tenant_server.http_port), timeout=30) as body_half:
        body_half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ALICE.encode()
                          + b"\r\nContent-Length: 100\r\n\r\n{")
        assert _read_to_eof(body_half).startswith(b"HTTP/1.1 408")
    health = urllib.request.urlopen(f"http://127.0.0.1:{tenant_server.http_port}/health", timeout=10)
    assert health.status == 200


def test_a_non_loopback_bind_without_a_token_warns(serving_config, tmp_path):
    process = ServerProcess(serving_config, tmp_path / "state", "--host", "0.0.0.0")
    try:
        deadline = time.monotonic() + 60
        while "warning: 0.0.0.0 is reachable from other machines" not in process.output():
            assert time.monotonic() < deadline and process.proc.poll() is None, process.output()
            time.sleep(0.1)
    finally:
        process.stop()
