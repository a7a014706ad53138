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
