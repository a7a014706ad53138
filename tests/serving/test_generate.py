"""Generate through a real `polyspec serve`: same output as the CLI, streaming per round,
concurrent streams, cancel and deadline, health, reflection, a client built from the .proto alone."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest

from polyspec.client import AsyncClient, DeadlineExceeded

from serving_helpers import polyspec_command, server_env

LONG = 240  # tokens (the tiny models hold 256): far more than the test waits for


def wait_until(condition, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_sdk_greedy_output_equals_polyspec_generate(server, client, serving_config):
    proc = subprocess.run(
        polyspec_command() + ["generate", "-c", serving_config, "-p", "def f(x):", "-n", "10", "--json"],
        capture_output=True, text=True, timeout=120, env=server_env(),
    )
    assert proc.returncode == 0, proc.stderr
    expected = json.loads(proc.stdout)
    result = client.generate("def f(x):", max_new_tokens=10)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert (result["token_ids"], result["text"], result["finish_reason"]) == (
        expected["token_ids"], expected["text"], expected["finish_reason"])
    assert set(expected["stats"]) <= set(result["stats"])
    assert result["stats"]["stages"][0]["tier"] == "target"
    sampled = [client.generate(prompt_ids=[10, 20, 30], max_new_tokens=5, temperature=1.0, seed=3, id="r1") for _ in range(2)]
    assert sampled[0]["id"] == "r1" and sampled[0]["token_ids"] == sampled[1]["token_ids"]  # same seed, same tokens


def test_one_message_per_target_round(client):
    deltas = list(client.stream("import os", max_new_tokens=24))
    *rounds, last = deltas
    assert last.finish_reason in ("length", "eos") and last.stats is not None
    assert all(d.token_ids for d in rounds) and not any(d.finish_reason for d in rounds)
    assert len(rounds) == last.stats["stages"][0]["blocks"]  # one target verification each
    whole = client.generate("import os", max_new_tokens=24)
    assert [t for d in deltas for t in d.token_ids] == whole["token_ids"]
    assert "".join(d.text for d in deltas) == whole["text"]


def test_twenty_concurrent_streams_all_complete_and_match(client, server):
    prompts = [f"def f{i}(x):" for i in range(20)]
    expected = [client.generate(p, max_new_tokens=16)["token_ids"] for p in prompts]

    async def run_all():
        async with AsyncClient(server.address) as aclient:
            return await asyncio.gather(*(aclient.generate(p, max_new_tokens=16) for p in prompts))

    results = asyncio.run(asyncio.wait_for(run_all(), 120))
    assert [r["token_ids"] for r in results] == expected
    assert all(r["finish_reason"] in ("length", "eos") for r in results)


def test_a_long_request_does_not_hold_a_short_one_back(server):
    async def run():
        async with AsyncClient(server.address) as aclient:
            finished = []

            async def one(name, n):
                await aclient.generate("import sys", max_new_tokens=n)
                finished.append(name)

            # the short request goes in once the long one is running (a fixed head start can
            # outlast all 240 tokens of the long one on a fast CPU)
            started = asyncio.Event()

            async def long_one():
                async for _ in aclient.stream("import sys", max_new_tokens=LONG):
                    started.set()
                finished.append("long")

            long_task = asyncio.create_task(long_one())
            await asyncio.wait_for(started.wait(), 60)
            await one("short", 4)
            await long_task
            return finished

    assert asyncio.run(asyncio.wait_for(run(), 120)) == ["short", "long"]


def test_cancel_and_deadline_stop_the_work(client):
    # the deadline is a quarter of what the whole request takes here (a fixed deadline can
    # outlast the whole request on a fast CPU: the tiny models reach EOS within ~100 tokens)
    started = time.monotonic()
    whole = client.generate("import sys", max_new_tokens=LONG)
    deadline = (time.monotonic() - started) / 4
    assert len(whole["token_ids"]) == LONG  # greedy: the request below runs as long
    before = client.stats()
    stream = client.stream("class A:", max_new_tokens=LONG)
    first = next(stream)
    assert first.token_ids
    stream.close()  # cancels the call
    with pytest.raises(DeadlineExceeded):
        for _ in client.stream("import sys", max_new_tokens=LONG, timeout=deadline):
            pass
    stats = wait_until(lambda: (s := client.stats())["requests"]["cancelled"] >= before["requests"]["cancelled"] + 2
                       and s["queue"]["running"] == 0 and s,
                       what="both requests cancelled")
    assert stats["queue"]["waiting"] == 0
    tokens_then = stats["generated_tokens"]
    time.sleep(0.3)
    assert client.stats()["generated_tokens"] == tokens_then  # nothing runs on for them
    assert tokens_then - before["generated_tokens"] < 2 * LONG  # neither ran to its end


def test_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "polyspec.v1.Polyspec"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "polyspec.v1.Polyspec" in database.get_services()
        methods = {m.name for m in database.FindFileContainingSymbol("polyspec.v1.Polyspec").service[0].method}
        assert {"Generate", "SubmitJob", "GetJob", "ListJobs", "CancelJob", "StreamJobResults", "GetStats"} <= methods
        # grpc.reflection.v1 (newer tools ask for it first): the same messages under the new name
        from grpc_reflection.v1alpha import reflection_pb2

        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        answer = next(v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        assert "polyspec.v1.Polyspec" in [s.name for s in answer.list_services_response.service]


def test_a_client_built_from_the_proto_alone_gets_the_same_text(server, client, tmp_path):
    from grpc_tools import protoc

    from polyspec.protos.generate import PROTO_ROOT

    assert protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        "polyspec/v1/polyspec.proto"]) == 0
    script = (
        "import sys, grpc\n"
        "from polyspec.v1 import polyspec_pb2 as pb, polyspec_pb2_grpc as rpc\n"
        f"stub = rpc.PolyspecStub(grpc.insecure_channel('{server.address}'))\n"
        "out = list(stub.Generate(pb.GenerateRequest(prompt='def g(y):', max_new_tokens=9), timeout=60))\n"
        "print(''.join(m.text for m in out)); print(out[-1].finish_reason, sum(len(m.token_ids) for m in out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = client.generate("def g(y):", max_new_tokens=9)
    text, last = proc.stdout.rsplit("\n", 2)[:2]
    assert text == expected["text"] and last == f"{expected['finish_reason']} {len(expected['token_ids'])}"


def test_stats_report_stages_lengths_tiers_and_queue(client):
    client.generate("x = 1", max_new_tokens=6)
    stats = client.stats()
    assert stats["ready"] and not stats["draining"]
    assert [(s["tier"], s["drafter"]) for s in stats["stages"]] == [("target", "mid"), ("mid", "ng")]
    assert stats["stages"][0]["blocks"] > 0 and stats["stages"][0]["proposed"] >= stats["stages"][0]["accepted"]
    assert stats["speculation_lengths"] == [4, 2] and stats["active_tiers"] == ["target", "mid", "ng"]
    assert [t["tier"] for t in stats["tiers"]] == ["target", "mid", "ng"] and all(t["up"] for t in stats["tiers"])
    assert stats["queue"]["max_queue"] == 64 and stats["requests"]["ok"] >= 1 and stats["generated_tokens"] >= 6
    assert stats["plans"] == [] and stats["recent_plans"] == []  # fixed lengths: no planner
