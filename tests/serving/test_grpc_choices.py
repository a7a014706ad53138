"""`n` and `logprobs` on the gRPC API and the SDK, through the shared `polyspec serve` of the
tiny family (conftest.server): greedy choices each equal to the target alone, sampled choices
from derived seeds (the same streams the HTTP API's choices sample), the target's own
log-probabilities (the same numbers the HTTP API reports, and a forward of the target run
here), and INVALID_ARGUMENT for bad values."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
import torch

from polyspec.client import AsyncClient, InvalidArgument
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def target_alone(serving_config):
    """Greedy tokens of the target alone (no drafters), in this process."""
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(load_config(serving_config), speculative=False)

    def generate(max_new_tokens: int) -> dict:
        return engine.generate(engine.parse_request({"prompt": PROMPT, "max_new_tokens": max_new_tokens, "temperature": 0}))

    return generate


def _post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_greedy_choices_are_each_the_target_alone(client, target_alone):
    expected = target_alone(12)
    results = client.generate(PROMPT, max_new_tokens=12, temperature=0, n=3)
    assert [r["token_ids"] for r in results] == [expected["token_ids"]] * 3
    assert [r["text"] for r in results] == [expected["text"]] * 3
    deltas = list(client.stream(PROMPT, max_new_tokens=12, temperature=0, n=3))
    assert sorted({d.index for d in deltas}) == [0, 1, 2]
    assert sum(1 for d in deltas if d.finish_reason) == 3  # each choice ends with its own last message
    assert isinstance(client.generate(PROMPT, max_new_tokens=4), dict)  # no n: one result, as before


def test_sampled_choices_use_the_http_apis_derived_seeds(client, server):
    results = client.generate(prompt_ids=[10, 20, 30], max_new_tokens=10, temperature=1.0, seed=11, n=3)
    again = client.generate(prompt_ids=[10, 20, 30], max_new_tokens=10, temperature=1.0, seed=11, n=3)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in results]  # the same seed, the same choices
    assert len({tuple(r["token_ids"]) for r in results}) > 1  # ... but each choice its own stream
    single = client.generate(prompt_ids=[10, 20, 30], max_new_tokens=10, temperature=1.0, seed=11)
    assert single["token_ids"] == results[0]["token_ids"]  # choice 0 keeps the request's seed
    http = _post(server, "/v1/completions", {"prompt": [10, 20, 30], "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 3})
    assert [c["text"] for c in http["choices"]] == [r["text"] for r in results]


def _reference_logprobs(model_dir: str, prompt_ids: list[int], token_ids: list[int], temperature: float) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1].float()  # [N, V]
    return torch.log_softmax(logits / temperature, dim=-1).tolist()


def test_logprobs_are_the_targets_own_and_the_http_apis(client, server, tiny_family, target_alone):
    expected = target_alone(8)
    result = client.generate(PROMPT, max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    scored = result["logprobs"]
    assert [entry["token_id"] for entry in scored] == result["token_ids"] == expected["token_ids"]
    prompt_ids = _prompt_ids(tiny_family["target"])
    reference = _reference_logprobs(tiny_family["target"], prompt_ids, expected["token_ids"], 1.0)  # greedy: at temperature 1
    assert [entry["logprob"] for entry in scored] == pytest.approx([row[t] for row, t in zip(reference, expected["token_ids"])], abs=1e-3)
    for entry, row in zip(scored, reference):
        top = entry["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["logprob"] == pytest.approx(max(row), abs=1e-3) and top[0]["token_id"] == entry["token_id"]  # greedy: the argmax
        assert all(t["token"] == _decode(tiny_family["target"], t["token_id"]) for t in top)

    sampled = client.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=3, logprobs=True, n=2)
    http = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.7, "seed": 3, "logprobs": 0, "n": 2})
    for choice, answer in zip(sampled, http["choices"]):
        assert choice["text"] == answer["text"]
        assert [e["logprob"] for e in choice["logprobs"]] == pytest.approx(answer["logprobs"]["token_logprobs"], abs=1e-6)
        assert all(e["top_logprobs"] == [] for e in choice["logprobs"])  # top_logprobs 0: none
    assert "logprobs" not in client.generate(PROMPT, max_new_tokens=2)  # not asked, not sent


def test_logprobs_of_a_stopped_choice_cover_its_text(client, target_alone):
    expected = target_alone(12)["text"]
    stop = expected[4:7]
    assert stop.strip() and expected.find(stop) >= 0, expected
    result = client.generate(PROMPT, max_new_tokens=12, temperature=0, stop=stop, logprobs=True)
    assert result["finish_reason"] == "stop" and result["text"] == expected[: expected.find(stop)]
    assert "".join(entry["token"] for entry in result["logprobs"]) == result["text"]


def _prompt_ids(model_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def _decode(model_dir: str, token_id: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode([token_id])


@pytest.mark.parametrize("fields, message", [
    ({"n": -1}, "n must be an integer from 1 to 16, got -1"),
    ({"n": 17}, "n must be an integer from 1 to 16, got 17"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be an integer from 0 to 20, got 21"),
    ({"top_logprobs": -1, "logprobs": True}, "top_logprobs must be an integer from 0 to 20, got -1"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
])
def test_bad_values_are_invalid_argument(client, fields, message):
    with pytest.raises(InvalidArgument) as caught:
        client.generate(PROMPT, max_new_tokens=2, **fields)
    assert caught.value.details == message


def test_jobs_refuse_n_and_logprobs(server):
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.PolyspecStub(channel)
        for fields in ({"n": 2}, {"logprobs": True}):
            with pytest.raises(grpc.RpcError) as caught:
                stub.SubmitJob(pb.SubmitJobRequest(requests=[pb.GenerateRequest(prompt=PROMPT, **fields)]), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "n and logprobs are for Generate" in caught.value.details()
    finally:
        channel.close()


def test_async_client_choices(server, target_alone):
    import asyncio

    async def run() -> list[dict]:
        async with AsyncClient(server.address) as client:
            return await client.generate(PROMPT, max_new_tokens=6, temperature=0, n=2, logprobs=True)

    results = asyncio.run(run())
    expected = target_alone(6)["token_ids"]
    assert [r["token_ids"] for r in results] == [expected, expected]
    assert all([e["token_id"] for e in r["logprobs"]] == expected for r in results)
