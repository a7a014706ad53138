"""`polyspec serve` with `lengths: auto`: the planner's chains and their predicted and measured tokens/s in each
response's stats and in /metrics; a `tuning:` option the batched planner does not read is named in its log."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import yaml

from polyspec.client import AsyncClient

from serving_helpers import free_port


def test_the_planners_chains_reach_the_stats_and_metrics(start_server, tiny_family, tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text(yaml.safe_dump({
        "tiers": [{"name": "target", "model": tiny_family["target"], "threads": 1},
                  {"name": "mid", "model": tiny_family["mid"], "threads": 1}, {"name": "ng", "model": "ngram"}],
        "speculation": {"lengths": "auto"}, "sampling": {"max_new_tokens": 16},
        "tuning": {"warmup_rounds": 4, "max_length": 6}}))
    metrics_port = free_port()
    server = start_server(str(config), None, "--metrics-port", str(metrics_port))
    server.wait_ready().close()
    assert "polyspec: tuning: warmup_rounds set, but batched steps are planned by the goodput planner" in server.log_path.read_text()

    async def run_all():
        async with AsyncClient(server.address) as client:
            return await asyncio.gather(*(client.generate(f"def f{i}(x):", max_new_tokens=16) for i in range(6)))

    results = asyncio.run(asyncio.wait_for(run_all(), 120))
    chains = {}
    for result in results:
        plans = result["stats"]["plans"]
        assert sum(plan["tokens"] for plan in plans) == len(result["token_ids"])
        for plan in plans:
            assert plan["measured_tokens_per_s"] > 0 and plan["predicted_tokens_per_s"] > 0
            assert max(plan["lengths"], default=0) <= 6  # tuning.max_length reached the planner
            chains["<-".join(plan["tiers"])] = chains.get("<-".join(plan["tiers"]), 0) + plan["rounds"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    rounds = {chain: float(value) for chain, value in re.findall(r'^polyspec_plan_rounds_total\{chain="([^"]+)"\} (\S+)$', text, re.M)}
    assert rounds == {chain: float(count) for chain, count in chains.items()}
    for chain in chains:
        for source in ("measured", "predicted"):
            value = re.search(rf'^polyspec_plan_tokens_per_second\{{chain="{re.escape(chain)}",source="{source}"\}} (\S+)$', text, re.M)
            assert value and float(value.group(1)) > 0, (chain, source)
    assert float(re.search(r"^polyspec_plan_prediction_ratio_count (\S+)$", text, re.M).group(1)) == \
        sum(len(result["stats"]["plans"]) for result in results)
