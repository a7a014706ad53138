"""The official `openai` package against /v1/completions and /v1/models."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")


@pytest.fixture
def api(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_match_the_sdk(api, client):
    models = [m.id for m in api.models.list().data]
    assert len(models) == 1
    expected = client.generate("def f(x):", max_new_tokens=10)
    completion = api.completions.create(model=models[0], prompt="def f(x):", max_tokens=10, temperature=0)
    assert completion.choices[0].text == expected["text"]
    assert completion.choices[0].finish_reason == ("length" if expected["finish_reason"] == "length" else "stop")
    assert completion.usage.completion_tokens == len(expected["token_ids"])

    chunks = list(api.completions.create(model=models[0], prompt="def f(x):", max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")

    batch = api.completions.create(model=models[0], prompt=["def f(x):", "import os"], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == client.generate("import os", max_new_tokens=6)["text"]


def test_errors_are_openai_shaped(api, server):
    model = api.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        api.completions.create(model=model, prompt="x", max_tokens=3, top_p=2.0)
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer from 1 to 16, got 17"):
        api.completions.create(model=model, prompt="x", max_tokens=3, n=17)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.completions.create(model="m", prompt="x", max_tokens=3)
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/nothing", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 404 and "no route" in json.loads(caught.value.read())["error"]["message"]
