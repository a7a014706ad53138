"""Structured output through every interface of a real `polyspec serve` of the demo chain (configs/demo.yaml,
its target copied with a chat template) and the CLI: OpenAI `response_format` (json_schema, json_object) and
polyspec's own `regex` over HTTP, `json_schema` / `regex` through the SDK over gRPC, job items, `polyspec batch`
lines and `polyspec generate --json-schema`. Greedy replies equal the target alone's constrained reply (run in
this process); bad constraints get 400 / INVALID_ARGUMENT / a job item error / one line and exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import jsonschema
import pytest
from serving_helpers import demo_chat_config, http_server, polyspec_command

from polyspec.client import Client, InvalidArgument

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")  # the server compiles the constraints with it (pyproject's pin)

SCHEMA = {  # nested object, array, enum; bounded strings so the small demo model ends inside the budget
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["file", "dir"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"uid": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["uid"]},
    },
    "required": ["name", "kind", "sizes", "owner"],
}
MESSAGES = [{"role": "user", "content": "describe a file as JSON"}]
REGEX = "(def|class) [a-z_]{1,10}\\(\\):"
BAD = [({"json_schema": {"type": "objekt"}}, "invalid json_schema"), ({"regex": "(["}, "invalid regex"),
       ({"grammar": "root ::= nowhere"}, "invalid grammar")]


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory) -> Path:
    return demo_chat_config(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def demo_server(demo_config, tmp_path_factory):
    with http_server(str(demo_config), tmp_path_factory.mktemp("demo-state") / "state") as process:
        yield process


@pytest.fixture(scope="module")
def api(demo_server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{demo_server.http_port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def target_alone(demo_config):
    """The target alone's greedy reply to a raw request (no drafters), in this process."""
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(load_config(str(demo_config)), speculative=False)
    return lambda raw: engine.generate(engine.parse_request({"temperature": 0, **raw}))


def test_openai_response_format_json_schema(api, target_alone):
    response_format = {"type": "json_schema", "json_schema": {"name": "file", "schema": SCHEMA, "strict": True}}
    chat = api.chat.completions.create(model="target", messages=MESSAGES, max_tokens=96, temperature=0, response_format=response_format)
    reply = chat.choices[0]
    assert reply.finish_reason == "stop", reply
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    assert reply.message.content == target_alone({"messages": MESSAGES, "max_new_tokens": 96, "json_schema": SCHEMA})["text"]
    sampled = api.chat.completions.create(model="target", messages=MESSAGES, max_tokens=96, temperature=1.0, seed=3, n=3,
                                          response_format=response_format)
    for choice in sampled.choices:
        if choice.finish_reason == "stop":  # (a sampled reply may run out of tokens inside a string)
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_parse_with_a_pydantic_model(api):
    """The openai package's own structured-output helper: `chat.completions.parse(response_format=Model)` sends the
    model's strict JSON schema and parses the reply into it."""
    from pydantic import BaseModel

    class Owner(BaseModel):
        uid: int

    class File(BaseModel):
        name: str
        kind: str
        owner: Owner
        sizes: list[int]

    reply = api.chat.completions.parse(model="target", messages=MESSAGES, response_format=File, max_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, File)


def test_openai_json_object_and_polyspec_regex(api, target_alone):
    chat = api.chat.completions.create(model="target", messages=MESSAGES, max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = api.completions.create(model="target", prompt="import os\n", max_tokens=24, temperature=0, extra_body={"regex": REGEX})
    assert completion.choices[0].text == target_alone({"prompt": "import os\n", "max_new_tokens": 24, "regex": REGEX})["text"]


def test_logprobs_are_of_the_restricted_rows(api):
    """The first token's alternatives are all tokens the grammar allows (digits), under the restricted warp."""
    completion = api.completions.create(model="target", prompt="x = ", max_tokens=2, temperature=0, logprobs=5,
                                        extra_body={"regex": "[0-9]{3}"})
    first = completion.choices[0].logprobs.top_logprobs[0]
    assert first and all(token.isdigit() for token in first), first


def test_openai_bad_constraints_are_400(api):
    for fields, message in BAD:
        with pytest.raises(openai.BadRequestError, match=message):
            api.completions.create(model="target", prompt="x", max_tokens=4, extra_body=fields)
    with pytest.raises(openai.BadRequestError, match="invalid json_schema"):
        api.chat.completions.create(model="target", messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    with pytest.raises(openai.BadRequestError, match="not supported"):
        api.chat.completions.create(model="target", messages=MESSAGES, max_tokens=4, response_format={"type": "yaml"})
    ok = api.completions.create(model="target", prompt="x", max_tokens=4)  # other requests carry on
    assert ok.choices[0].finish_reason in ("length", "stop")


def _deep(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE = [  # 21 malformed or pathological constraints: each a clean 400, while other clients' requests complete unchanged
    {"json_schema": {"type": "objekt"}}, {"json_schema": "{"}, {"json_schema": [1, 2]}, {"json_schema": 5},
    {"json_schema": _deep(200)}, {"json_schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
    {"json_schema": {"$ref": "#/nowhere"}}, {"json_schema": {"type": "string", "pattern": "(["}},
    {"json_schema": {"type": "integer", "minimum": 10, "maximum": 1}}, {"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}},
    {"json_schema": {"enum": []}}, {"regex": "(["}, {"regex": "a{5,2}"}, {"regex": "(" * 3000 + "a" + ")" * 3000}, {"regex": 42},
    {"regex": ""}, {"grammar": "root ::= nowhere"}, {"grammar": "not a grammar"}, {"grammar": "root ::= " + '"a" ' * 20000},
    {"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, {"json_schema": {}, "regex": "a"},
]


def test_hostile_constraints_get_clean_errors_while_others_complete(demo_server, target_alone):
    import threading
    import urllib.error
    import urllib.request

    expected = target_alone({"prompt": "import os\n", "max_new_tokens": 24})["text"]
    others: list[str] = []

    def other_client() -> None:
        with Client(demo_server.address) as client:
            for _ in range(3):
                others.append(client.generate("import os\n", max_new_tokens=24, temperature=0)["text"])

    beside = threading.Thread(target=other_client)
    beside.start()
    for fields in HOSTILE:
        body = json.dumps({"model": "target", "prompt": "x", "max_tokens": 4, **fields}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{demo_server.http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        message = json.loads(caught.value.read())["error"]["message"]
        assert caught.value.code == 400 and "\n" not in message and len(message) < 400, (str(fields)[:80], caught.value.code, message)
    beside.join(timeout=120)
    assert others == [expected] * 3


def test_grpc_sdk_and_jobs(demo_server, target_alone):
    with Client(demo_server.address) as client:
        result = client.generate("def area(r):\n    ", max_new_tokens=96, json_schema=SCHEMA)
        assert result["finish_reason"] == "eos", result
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
        assert result["text"] == target_alone({"prompt": "def area(r):\n    ", "max_new_tokens": 96, "json_schema": SCHEMA})["text"]
        assert client.generate("import os\n", max_new_tokens=24, regex=REGEX)["text"] == \
            target_alone({"prompt": "import os\n", "max_new_tokens": 24, "regex": REGEX})["text"]
        for fields, message in BAD:
            with pytest.raises(InvalidArgument, match=message) as caught:
                client.generate("x", max_new_tokens=4, **fields)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "\n" not in caught.value.details
        job = client.submit_job([{"id": "good", "prompt": "x = ", "max_new_tokens": 96, "json_schema": SCHEMA},
                                 {"id": "bad", "prompt": "x = ", "regex": "(["}])
        client.wait(job.job_id)
        results = {r["id"]: r for r in client.results(job.job_id)}
        assert "invalid regex" in results["bad"]["error"]
        jsonschema.validate(json.loads(results["good"]["text"]), SCHEMA)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(polyspec_command() + list(args), capture_output=True, text=True, timeout=300)


def test_cli_generate_and_batch(demo_config, tmp_path, target_alone):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    done = run_cli("generate", "-c", str(demo_config), "-p", "x = ", "-n", "96", "--json-schema", str(schema_file), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    jsonschema.validate(json.loads(result["text"]), SCHEMA)
    assert result["text"] == target_alone({"prompt": "x = ", "max_new_tokens": 96, "json_schema": SCHEMA})["text"]
    (tmp_path / "bad.json").write_text('{"type": "objekt"}')
    for flags in (["--json-schema", str(tmp_path / "bad.json")], ["--json-schema", str(tmp_path / "missing.json")]):  # (a bad regex: BAD)
        failed = run_cli("generate", "-c", str(demo_config), "-p", "x", *flags)
        errors = [line for line in failed.stderr.splitlines() if "error" in line]  # (the rest: the models loading)
        assert failed.returncode == 2 and "Traceback" not in failed.stderr and len(errors) == 1, failed.stderr
        assert errors[0].startswith("polyspec: error: ") and failed.stderr.strip().endswith(errors[0])
    lines = [{"id": "a", "prompt": "import os\n", "max_new_tokens": 24, "regex": REGEX},
             {"id": "b", "prompt": "x = ", "max_new_tokens": 96, "json_schema": SCHEMA}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = run_cli("batch", "-c", str(demo_config), "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert batch.returncode == 0, batch.stderr
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert results["a"]["text"] == target_alone({"prompt": "import os\n", "max_new_tokens": 24, "regex": REGEX})["text"]
    jsonschema.validate(json.loads(results["b"]["text"]), SCHEMA)
