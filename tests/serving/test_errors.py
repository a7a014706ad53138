"""Each error has its status and one clear message; auth token, TLS, the bounded queue, /metrics."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from serving_helpers import free_port, polyspec_command, server_env, write_config

from polyspec.client import Client, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.PolyspecStub(channel)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "request has no 'prompt'"),
        ({"prompt": "x", "prompt_ids": [1, 2]}, "give one of 'prompt', 'prompt_ids' or 'messages', not several"),
        ({"prompt": "x", "max_new_tokens": -1}, "max_new_tokens must be > 0"),
        ({"prompt": "x", "temperature": -0.5}, "temperature must be >= 0"),
        ({"prompt": "x", "top_p": 2.0}, "top_p must be in [0, 1]"),
        ({"prompt": "x", "top_k": -2}, "top_k must be an integer >= 0"),
        ({"prompt_ids": [5, 99999]}, "prompt_ids contains 99999, outside the vocabulary"),
        ({"prompt": "y" * 300}, "prompt has 300 tokens but the model context holds 256"),
    ],
)
def test_bad_parameters_are_invalid_argument(stub, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details() and "\n" not in caught.value.details()


def test_job_errors(stub, client):
    for request, code, message in [
        (pb.SubmitJobRequest(), grpc.StatusCode.INVALID_ARGUMENT, "at least one request"),
        (pb.SubmitJobRequest(requests=[pb.GenerateRequest(id="a", prompt="x")] * 2), grpc.StatusCode.INVALID_ARGUMENT, "'a' appears twice"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.SubmitJob(request, timeout=10)
        assert caught.value.code() == code and message in caught.value.details()
    for job_id in ("job-missing", "../../etc/passwd", ""):
        for call in (client.job, client.cancel, lambda j: list(client.results(j))):
            with pytest.raises(NotFound) as caught:
                call(job_id)
            assert caught.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(InvalidArgument) as caught:
        client.generate("x", top_p=2.0)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in caught.value.details


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_token_tls_queue_limit_and_metrics(start_server, tiny_family, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    (tmp_path / "token").write_text(TOKEN + "\n")
    config = write_config(tmp_path / "queue1.yaml", tiny_family, max_queue=1)
    metrics_port = free_port()
    server = start_server(config, tmp_path / "state", "--auth-token-file", str(tmp_path / "token"),
                          "--tls-cert", str(cert), "--tls-key", str(key), "--metrics-port", str(metrics_port))
    client = server.wait_ready(token=TOKEN, tls=str(cert))
    assert client.generate("def f(x):", max_new_tokens=4)["finish_reason"] in ("length", "eos")

    for token, message in ((None, "missing authorization token"), ("wrong", "wrong authorization token")):
        with Client(server.address, token=token, tls=str(cert)) as stranger:
            assert stranger.ready()  # health stays open
            with pytest.raises(Unauthenticated, match=message):
                stranger.generate("x", max_new_tokens=2)
            with pytest.raises(Unauthenticated):
                stranger.jobs()
    with Client(server.address, token=TOKEN) as plaintext:  # a TLS server does not answer plain TCP
        assert not plaintext.ready()

    # max_queue 1: while one request runs, the next is turned away
    long_request = threading.Thread(target=lambda: client.generate("class A:", max_new_tokens=200))
    long_request.start()
    deadline = time.monotonic() + 20
    while client.stats()["queue"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="queue is full"):
        client.generate("x", max_new_tokens=2)
    long_request.join(60)

    with pytest.raises(OSError):  # with TLS configured, /metrics speaks TLS too
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    context = ssl.create_default_context(cafile=str(cert))
    text = urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}/metrics", timeout=10, context=context).read().decode()
    for line in ('polyspec_requests_total{status="ok"} 2.0', 'polyspec_requests_total{status="unauthenticated"} 4.0',
                 'polyspec_requests_total{status="resource_exhausted"} 1.0', 'polyspec_tier_up{tier="mid"} 1.0',
                 'polyspec_speculation_length{drafter="mid",tier="target"} 4.0', 'polyspec_queue_depth{state="waiting"}'):
        assert line in text, line
    for name in ("polyspec_generated_tokens_total", "polyspec_stage_proposed_tokens_total", "polyspec_stage_accepted_tokens_total",
                 "polyspec_time_to_first_token_seconds_bucket", "polyspec_request_latency_seconds_count", "polyspec_job_items_done_total"):
        assert name in text, name
    client.close()


def test_serve_mistakes_are_one_line(serving_config, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    state = ["--state-dir", str(tmp_path / "s"), "--metrics-port", "0"]
    short_token, bad_line = tmp_path / "short.txt", tmp_path / "bad.txt"
    short_token.write_text("alice short\n")
    bad_line.write_text("# tenants\nalice\n")
    cases = [
        (["-c", str(tmp_path / "none.yaml")] + state, "config file not found"),
        (["-c", serving_config, "--tls-cert", "c.pem"] + state, "--tls-cert and --tls-key go together"),
        (["-c", serving_config, "--auth-token-file", str(tmp_path / "missing")] + state, "cannot read auth token file"),
        (["-c", serving_config, "--port", port] + state, f"cannot listen on 127.0.0.1:{port}"),
        (["-c", serving_config, "--tenants-file", str(short_token)] + state, "line 1: the token is shorter than 16 characters"),
        (["-c", serving_config, "--tenants-file", str(bad_line)] + state, "line 2: expected 'TENANT TOKEN'"),
        (["-c", serving_config, "--max-live-jobs", "0"] + state, "--max-live-jobs must be > 0"),
    ]
    with busy:
        for args, message in cases:
            proc = subprocess.run(polyspec_command() + ["serve"] + args, capture_output=True, text=True, timeout=60, env=server_env())
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
