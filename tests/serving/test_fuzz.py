"""Fuzzing (hypothesis, bounded: a fixed number of examples each) against the shared server:
proto messages with any field values, raw bytes to each method, HTTP JSON bodies, and
batch / job JSONL lines. The server never answers UNKNOWN / INTERNAL or HTTP 500, never
crashes, and is healthy afterwards."""

from __future__ import annotations

import http.client
import json
import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc
from polyspec.workers.core.errors import RequestError

FUZZ = settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
ALLOWED_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.FAILED_PRECONDITION}  # a fuzzed idempotency key drawn twice with other requests
CALL_TIMEOUT_S = 20
INT32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=40)
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70))
JSON_LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
# numerically extreme but legal sampling values (the hostile run's poison rows among them): each
# must get a defined answer, never fail the request or its neighbours
EXTREME = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-40, 1.1754944e-38, 1e-30, 9.99e-6, 1e-5, 1.0000001, 0.99999994,
                           999.99, 1000.0, 1e308])
SAMPLING_VALUE = st.one_of(EXTREME, JSON_LEAF)
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)


def small_or_any(strategy, small):
    return st.one_of(small, small, small, strategy)


REQUEST = st.builds(
    pb.GenerateRequest,
    id=small_or_any(st.text(max_size=300), st.just("")),
    prompt=small_or_any(st.text(max_size=400), st.sampled_from(["", "def f(x):", "import os"])),
    prompt_ids=small_or_any(st.lists(INT32, max_size=20), st.lists(st.integers(0, 256), min_size=1, max_size=5)),
    max_new_tokens=small_or_any(INT32, st.integers(-2, 6)),
    temperature=st.one_of(st.none(), EXTREME, st.floats(width=32, allow_nan=True, allow_infinity=True)),
    top_p=st.one_of(st.none(), EXTREME, st.floats(width=32, allow_nan=True, allow_infinity=True)),
    top_k=st.one_of(st.none(), INT32),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)


def _code(call) -> grpc.StatusCode:
    try:
        reply = call()
        if hasattr(reply, "__iter__") and not isinstance(reply, (bytes, pb.Job)):
            for _ in reply:
                pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert "\n" not in (exc.details() or ""), exc.details()
        return exc.code()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as opened:
        yield opened


def _healthy(channel) -> None:
    stats = pb_grpc.PolyspecStub(channel).GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
    assert stats.ready and not stats.draining


def test_fuzz_proto_messages(channel):
    stub = pb_grpc.PolyspecStub(channel)

    @FUZZ
    @given(request=REQUEST, as_job=st.booleans(), key=st.text(max_size=200))
    def check(request, as_job, key):
        if as_job:
            code = _code(lambda: stub.SubmitJob(pb.SubmitJobRequest(requests=[request], idempotency_key=key), timeout=CALL_TIMEOUT_S))
        else:
            code = _code(lambda: stub.Generate(request, timeout=CALL_TIMEOUT_S))
        assert code in ALLOWED_GRPC, code

    check()
    _healthy(channel)


def test_fuzz_raw_bytes_to_every_method(channel):
    methods = ["Generate", "SubmitJob", "GetJob", "ListJobs", "CancelJob", "StreamJobResults", "GetStats"]

    @FUZZ
    @given(method=st.sampled_from(methods), data=st.binary(max_size=64))
    def check(method, data):
        streaming = method in ("Generate", "StreamJobResults")
        call = (channel.unary_stream if streaming else channel.unary_unary)(f"/polyspec.v1.Polyspec/{method}")
        code = _code(lambda: call(data, timeout=CALL_TIMEOUT_S))
        assert code in ALLOWED_GRPC, (method, data, code)

    check()
    _healthy(channel)


COMPLETION_BODY = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(TEXT, st.lists(st.integers(-5, 300), max_size=5), st.lists(TEXT, max_size=3), JSON),
        "messages": st.one_of(JSON, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", 5]),
                                                                     "content": st.one_of(TEXT, JSON)}), max_size=3)),
        "max_tokens": st.one_of(st.integers(-3, 6), JSON_LEAF),
        "temperature": SAMPLING_VALUE, "top_p": SAMPLING_VALUE, "top_k": JSON_LEAF, "seed": JSON_LEAF,
        "stream": st.one_of(st.booleans(), JSON_LEAF), "stream_options": JSON, "n": JSON_LEAF, "model": JSON_LEAF,
    },
)


def test_fuzz_http_bodies(server, channel):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=CALL_TIMEOUT_S * 3)

    @FUZZ
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           body=st.one_of(COMPLETION_BODY, JSON, st.binary(max_size=40)))
    def check(path, body):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        assert response.status in (200, 400, 404, 413, 429), (response.status, payload[:300])
        if response.status != 200:
            message = json.loads(payload)["error"]["message"]
            assert "\n" not in message and "Traceback" not in message

    try:
        check()
    finally:
        connection.close()
    _healthy(channel)


@pytest.fixture(scope="module")
def engine(serving_config):
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    return Engine(load_config(serving_config), auto_tune=False)


def test_fuzz_batch_and_job_lines(engine, tmp_path_factory):
    """A JSONL line, as `polyspec batch` and `polyspec submit` read it: validation raises
    RequestError (one line in the output) or gives a request; nothing else."""
    from polyspec.orchestrator.serving_cli import read_requests

    folder = tmp_path_factory.mktemp("lines")
    line_object = st.fixed_dictionaries({}, optional={key: st.one_of(EXTREME, JSON) if key in ("temperature", "top_p") else JSON
                                                      for key in ("id", "prompt", "prompt_ids", "max_new_tokens", "temperature",
                                                                  "top_p", "top_k", "seed", "extra")})

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(value=st.one_of(line_object, JSON), raw_line=st.one_of(st.text(max_size=60), st.binary(max_size=60)))
    def check(value, raw_line):
        try:
            request = engine.parse_request(value)
        except RequestError as exc:
            assert "\n" not in str(exc)
        else:
            assert request.prompt_ids and request.max_new_tokens > 0
            assert math.isfinite(request.params.temperature)
        for line in (json.dumps(value), raw_line):
            path = folder / "in.jsonl"
            path.write_bytes((line if isinstance(line, bytes) else line.encode()) + b"\n")
            try:
                read_requests(str(path))
            except RequestError as exc:
                assert "\n" not in str(exc)

    check()
