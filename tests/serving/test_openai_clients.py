"""The OpenAI API as clients use it, through the official `openai` package against a real
`polyspec serve` of the demo chain (configs/demo.yaml; its target copied with a chat template):
served names and 404 model_not_found, GET /v1/models/{id}, stop strings, n > 1, usage (in
streams too), max_tokens errors named as sent. Greedy choices are compared with the target
alone, run in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from serving_helpers import demo_chat_config, http_server

openai = pytest.importorskip("openai")

NAMES = ("demo", "polyspec-demo")
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory) -> Path:
    return demo_chat_config(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def demo_server(demo_config, tmp_path_factory):
    names = [flag for name in NAMES for flag in ("--served-model-name", name)]
    with http_server(str(demo_config), tmp_path_factory.mktemp("demo-state") / "state", *names) as process:
        yield process


@pytest.fixture(scope="module")
def api(demo_server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{demo_server.http_port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def target_alone(demo_config):
    """Greedy text of the target alone (no drafters), in this process."""
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(load_config(str(demo_config)), speculative=False)

    def generate(max_tokens: int, prompt: str | None = None, messages: list | None = None) -> dict:
        raw = {"messages": messages} if messages is not None else {"prompt": prompt}
        return engine.generate(engine.parse_request({**raw, "max_new_tokens": max_tokens, "temperature": 0}))

    generate.decode = engine.decode
    return generate


def _get(server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_served_names_and_unknown_models(api, demo_server):
    assert [model.id for model in api.models.list().data] == list(NAMES)
    assert api.models.retrieve("polyspec-demo").id == "polyspec-demo"
    completion = api.completions.create(model="polyspec-demo", prompt=PROMPT, max_tokens=4, temperature=0)
    assert completion.model == "polyspec-demo"
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert caught.value.body["code"] == "model_not_found" and "'gpt-4o' does not exist" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4o")
    huge = "m" * 100_000  # never echoed back whole
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model=huge, prompt=PROMPT, max_tokens=4)
    assert len(caught.value.body["message"]) < 300
    status, body = _get(demo_server, "/v1/models/" + "x" * 5000)
    assert status == 404 and body["error"]["code"] == "model_not_found" and len(body["error"]["message"]) < 300


def test_max_tokens_errors_name_the_field_sent(api):
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be >= 1, got 0"):
        api.completions.create(model="demo", prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="'max_completion_tokens' must be >= 1, got 0"):
        api.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0)
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be >= 1, got -1"):
        api.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=-1)


def test_n_choices_at_temperature_zero_are_each_the_target_alone(api, target_alone):
    expected = target_alone(24, PROMPT)
    completion = api.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.text for c in completion.choices] == [expected["text"]] * 3
    assert completion.usage.completion_tokens == 3 * len(expected["token_ids"])
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens

    messages = [{"role": "user", "content": "write a loop"}]
    chat_expected = target_alone(16, messages=messages)
    chat = api.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0, n=3)
    assert [c.message.content for c in chat.choices] == [chat_expected["text"]] * 3


def test_n_choices_sample_independently_from_derived_seeds(api):
    def sample(seed: int) -> list[str]:
        completion = api.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed, n=3)
        return [choice.text for choice in completion.choices]

    first = sample(11)
    assert sample(11) == first  # the same seed, the same choices
    assert len(set(first)) > 1  # ... but each choice its own stream
    single = api.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11)
    assert single.choices[0].text == first[0]  # choice 0 keeps the request's seed


def test_stop_ends_the_text_before_the_stop_string(api, target_alone):
    expected = target_alone(32, PROMPT)["text"]
    stop = expected[6:10]
    cut = expected.find(stop)
    assert cut >= 0 and stop.strip(), expected
    completion = api.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "never here"])
    assert completion.choices[0].text == expected[:cut] and completion.choices[0].finish_reason == "stop"
    ids = target_alone(32, PROMPT)["token_ids"]
    # the request ends at the token that completes the stop string: its tokens are counted up to that one
    assert completion.usage.completion_tokens == next(n for n in range(1, len(ids) + 1) if stop in target_alone.decode(ids[:n]))

    chunks = list(api.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True))
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert streamed == expected[:cut]  # never past the stop, not even for a moment
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"

    with pytest.raises(openai.BadRequestError, match="'stop' holds 5 strings"):
        api.completions.create(model="demo", prompt=PROMPT, max_tokens=4, stop=["a", "b", "c", "d", "e"])


def test_the_sdk_and_grpc_take_stop_strings_too(demo_server, target_alone):
    from polyspec.client import Client, InvalidArgument

    expected = target_alone(32, PROMPT)["text"]
    stop = expected[6:10]
    with Client(demo_server.address) as client:
        before = client.stats()["requests"]
        result = client.generate(PROMPT, max_new_tokens=32, temperature=0, stop=[stop, "never here"])
        assert result["text"] == expected[: expected.find(stop)] and result["finish_reason"] == "stop"
        after = client.stats()["requests"]  # a stop string's end is a request that went well, not a cancelled one
        assert after["ok"] == before["ok"] + 1 and after["cancelled"] == before["cancelled"]
        shown = ""
        for delta in client.stream(PROMPT, max_new_tokens=32, temperature=0, stop=stop):
            shown += delta.text
            assert expected.startswith(shown) and len(shown) <= expected.find(stop)  # never past the stop
        with pytest.raises(InvalidArgument, match="stop strings must not be empty"):
            client.generate(PROMPT, max_new_tokens=4, stop=[""])
    import grpc

    from polyspec.client import request_message
    from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
    from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc

    item = request_message({"id": "a", "prompt": PROMPT})
    item.stop.append("x")
    with grpc.insecure_channel(demo_server.address) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.PolyspecStub(channel).SubmitJob(pb.SubmitJobRequest(requests=[item], idempotency_key="stop-in-a-job"), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop strings are for Generate" in caught.value.details()


def test_streams_carry_usage_when_asked(api, target_alone):
    expected = target_alone(12, PROMPT)
    chunks = list(api.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, n=2, stream=True,
                                         stream_options={"include_usage": True}))
    by_choice = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            by_choice[choice.index] += choice.text
    assert by_choice == {0: expected["text"], 1: expected["text"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(expected["token_ids"])
    assert all(chunk.usage is None for chunk in chunks[:-1])

    messages = [{"role": "user", "content": "hi"}]
    stream = api.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == target_alone(8, messages=messages)["text"]
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens > 0


def _reference_logprobs(demo_config, prompt_ids: list[int], token_ids: list[int], temperature: float) -> list[list[float]]:
    """The target's log-softmax at `temperature` for each completion position, from transformers directly."""
    import torch
    from transformers import AutoModelForCausalLM

    target = yaml.safe_load(demo_config.read_text())["tiers"][0]["model"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).tolist()


def test_logprobs_are_the_targets_own(api, demo_config, target_alone):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(yaml.safe_load(demo_config.read_text())["tiers"][0]["model"])
    expected = target_alone(12, PROMPT)
    completion = api.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text == expected["text"]
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reference = _reference_logprobs(demo_config, prompt_ids, expected["token_ids"], 1.0)  # greedy: reported at temperature 1
    assert logprobs.token_logprobs == pytest.approx([row[t] for row, t in zip(reference, expected["token_ids"])], abs=1e-3)
    for row, alternatives, token in zip(reference, logprobs.top_logprobs, expected["token_ids"]):
        assert len(alternatives) == 3
        best = max(alternatives.values())
        assert best == pytest.approx(max(row), abs=1e-3) and best == pytest.approx(row[token], abs=1e-3)  # greedy took the argmax
    assert logprobs.text_offset[0] == 0

    sampled = api.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=3, logprobs=0)
    again = api.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=3)
    assert sampled.choices[0].text == again.choices[0].text
    token_ids = tokenizer(PROMPT + sampled.choices[0].text)["input_ids"][len(prompt_ids):]
    # (this seed's text tokenizes back to the tokens sampled: the same count, the same pieces)
    assert [tokenizer.decode([t]) for t in token_ids] == sampled.choices[0].logprobs.tokens
    reference = _reference_logprobs(demo_config, prompt_ids, token_ids, 0.7)  # under the request's temperature
    assert sampled.choices[0].logprobs.token_logprobs == pytest.approx([row[t] for row, t in zip(reference, token_ids)], abs=1e-3)

    messages = [{"role": "user", "content": "write a loop"}]
    chat = api.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, n=2)
    for choice in chat.choices:
        content = choice.logprobs.content
        assert "".join(entry.token for entry in content) == choice.message.content
        assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
                   and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4) for entry in content)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        api.chat.completions.create(model="demo", messages=messages, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="with stream: true is not supported"):
        api.completions.create(model="demo", prompt=PROMPT, max_tokens=2, logprobs=1, stream=True)


def test_serve_says_what_it_loads_before_ready(demo_server):
    log = demo_server.output()
    ready = log.index("polyspec serve: ready")
    for tier in ("target", "mid"):
        assert -1 < log.index(f"polyspec serve: tier {tier}: loading") < log.index(f"polyspec serve: tier {tier}: loaded in") < ready
    assert -1 < log.index("polyspec serve: models loaded in") < ready


def test_serve_help_names_the_chat_route():
    proc = subprocess.run([sys.executable, "-m", "polyspec", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "/v1/chat/completions" in proc.stdout and "--served-model-name" in proc.stdout
