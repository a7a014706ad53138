"""`polyspec serve` steps concurrent requests together: same tokens as alone, batch size in /metrics."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from polyspec.client import AsyncClient

from serving_helpers import free_port


def test_concurrent_streams_share_batched_rounds(start_server, serving_config):
    metrics_port = free_port()
    server = start_server(serving_config, None, "--metrics-port", str(metrics_port))
    client = server.wait_ready()
    prompts = [f"def g{i}(y):" for i in range(12)]
    expected = [client.generate(p, max_new_tokens=12)["token_ids"] for p in prompts]  # one at a time
    client.close()

    async def run_all():
        async with AsyncClient(server.address) as aclient:
            return await asyncio.gather(*(aclient.generate(p, max_new_tokens=12) for p in prompts))

    results = asyncio.run(asyncio.wait_for(run_all(), 120))
    assert [r["token_ids"] for r in results] == expected  # greedy: batching changes nothing
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    count = float(re.search(r"^polyspec_batch_size_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^polyspec_batch_size_sum (\S+)$", text, re.M).group(1))
    assert count > 0 and total / count > 1.0, (count, total)  # some steps carried several requests
    assert re.search(r"^polyspec_goodput_tokens_per_second \S+$", text, re.M)


def test_extreme_sampling_parameters_fail_nobody(start_server, serving_config):
    """The hostile run's poison rows (temperature 1e-45 over HTTP, 1e-40 over gRPC, top_p 1e-300),
    sent beside concurrent streams and inside a job: every request succeeds, the extreme ones decode
    greedily (documented), and the others' tokens are those they get alone."""
    import json

    http_port = free_port()
    server = start_server(serving_config, None, "--http-port", str(http_port))
    client = server.wait_ready()
    prompts = [f"def h{i}(x):" for i in range(6)]
    expected = [client.generate(p, max_new_tokens=10)["token_ids"] for p in prompts]
    greedy = client.generate("import os", max_new_tokens=10)["token_ids"]

    def http_completion(body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=120).read())

    async def run_all():
        async with AsyncClient(server.address) as aclient:
            good = [aclient.generate(p, max_new_tokens=10) for p in prompts]
            bad = [aclient.generate("import os", max_new_tokens=10, temperature=1e-40),
                   aclient.generate("import os", max_new_tokens=10, temperature=0.8, top_p=1e-38),
                   asyncio.to_thread(http_completion, {"prompt": "import os", "max_tokens": 10, "temperature": 1e-45, "top_p": 1e-300})]
            return await asyncio.gather(*good, *bad)

    job = client.submit_job([{"id": "a", "prompt": prompts[0], "max_new_tokens": 10},
                             {"id": "b", "prompt": "import os", "max_new_tokens": 10, "temperature": 5e-324, "top_p": 1e-300},
                             {"id": "c", "prompt": prompts[1], "max_new_tokens": 10}])
    results = asyncio.run(asyncio.wait_for(run_all(), 180))
    assert [r["token_ids"] for r in results[: len(prompts)]] == expected
    assert results[len(prompts)]["token_ids"] == greedy  # temperature 1e-40: greedy
    assert len(results[len(prompts) + 1]["token_ids"]) == 10  # top_p below float32: the top token each step = greedy
    assert results[len(prompts) + 1]["token_ids"] == greedy
    assert results[-1]["choices"][0]["text"] == client.generate("import os", max_new_tokens=10)["text"]
    assert client.wait(job.job_id, timeout=180).state == "succeeded"
    by_id = {r["id"]: r for r in client.results(job.job_id)}
    assert by_id["a"]["token_ids"] == expected[0] and by_id["c"]["token_ids"] == expected[1]
    assert by_id["b"].get("token_ids") == greedy, by_id["b"]
    client.close()
