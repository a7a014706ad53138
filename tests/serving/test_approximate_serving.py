"""Approximate decoding modes through `polyspec serve` (docs/approximate.md): the HTTP extension
field, gRPC's approximate_json (Generate and jobs), the answers marked, the metric counted, and
`--exact-only` refusing them."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import pytest
from serving_helpers import free_port

from polyspec.client import Client, request_message

BILD = {"mode": "bild", "rollback_threshold": 3.0}


def post(port: int, path: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read().decode()
            return response.status, (json.loads(raw) if not body.get("stream") else raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def generate_stats(client: Client, raw: dict) -> dict:
    """A Generate call with any request dict (approximate included); the last message's stats."""
    stats = None
    for message in client._stub.Generate(request_message(raw), timeout=60):
        if message.stats_json:
            stats = json.loads(message.stats_json)
    return stats


def test_http_marks_approximate_answers(server):
    status, plain = post(server.http_port, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
    assert status == 200 and "approximate" not in plain  # absent: exact
    status, answer = post(server.http_port, "/v1/completions",
                          {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "approximate": BILD})
    assert status == 200 and answer["approximate"] == {"mode": "bild", "fallback_threshold": 0.5, "rollback_threshold": 3.0}
    status, steps = post(server.http_port, "/v1/completions",
                         {"prompt": "def f(x):", "max_tokens": 6, "approximate": {"mode": "specreason", "score_threshold": 0}})
    assert status == 200 and steps["approximate"]["mode"] == "specreason"
    status, stream = post(server.http_port, "/v1/completions",
                          {"prompt": "def f(x):", "max_tokens": 6, "stream": True, "approximate": {"mode": "reflective"}})
    chunks = [json.loads(line[len("data: "):]) for line in stream.splitlines() if line.startswith("data: {")]
    assert status == 200 and chunks and all(chunk["approximate"]["mode"] == "reflective" for chunk in chunks)
    status, error = post(server.http_port, "/v1/completions", {"prompt": "x", "approximate": {"mode": "fast"}})
    assert status == 400 and "approximate.mode must be one of exact, bild" in error["error"]["message"]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    counted = dict(re.findall(r'polyspec_approximate_requests_total\{mode="([^"]+)"\} (\S+)', metrics))
    assert float(counted["bild"]) >= 1 and float(counted["specreason"]) >= 1 and float(counted["reflective"]) >= 1


def test_grpc_generate_and_jobs_carry_the_mode(client):
    stats = generate_stats(client, {"prompt": "def f(x):", "max_new_tokens": 8, "approximate": BILD})
    assert stats["approximate"]["mode"] == "bild"
    assert "approximate" not in generate_stats(client, {"prompt": "def f(x):", "max_new_tokens": 8})
    job = client.submit_job([{"id": "a", "prompt": "def f(x):", "max_new_tokens": 6,
                              "approximate": {"mode": "speculative-thinking", "trigger_words": ["a"]}},
                             {"id": "b", "prompt": "def f(x):", "max_new_tokens": 6}])
    client.wait(job.job_id)
    results = {r["id"]: r for r in client.results(job.job_id)}
    assert results["a"]["stats"]["approximate"]["mode"] == "speculative-thinking"
    assert "approximate" not in results["b"]["stats"]
    with pytest.raises(grpc.RpcError) as error:
        generate_stats(client, {"prompt": "x", "approximate": {"mode": "bild", "score_threshold": 2}})
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "approximate.score_threshold applies to mode specreason, not bild" in error.value.details()


def test_exact_only_refuses(start_server, serving_config):
    http_port = free_port()
    process = start_server(serving_config, None, "--exact-only", "--http-port", str(http_port))
    with process.wait_ready() as client:
        status, error = post(http_port, "/v1/completions", {"prompt": "x", "max_tokens": 4, "approximate": BILD})
        assert status == 400
        assert error["error"]["message"] == ("approximate mode bild refused: this server runs exact decoding only "
                                             "(serve --exact-only)")
        status, _ = post(http_port, "/v1/completions", {"prompt": "x", "max_tokens": 4})
        assert status == 200
        with pytest.raises(grpc.RpcError) as refused:
            list(client._stub.Generate(request_message({"prompt": "x", "approximate": BILD}), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--exact-only" in refused.value.details()
        assert client.generate("x", max_new_tokens=4)["finish_reason"] in ("length", "eos")


def test_exact_only_will_not_serve_an_approximate_config(tmp_path, serving_config):
    import subprocess
    import sys

    import yaml

    config = yaml.safe_load(open(serving_config))
    config["approximate"] = {"mode": "bild"}
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "polyspec", "serve", "-c", str(path), "--exact-only", "--port", "0",
                           "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ("polyspec: error: --exact-only, but the config's approximate.mode is bild: "
                                                    "remove that section or serve without --exact-only")
