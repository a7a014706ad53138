"""`polyspec serve` with `lengths: auto`: the planner's chains and their predicted and measured tokens/s in each
response's stats (gRPC) and usage (HTTP's `polyspec_plans`) and in /metrics; a `tuning:` option the batched planner does not read is named in its log."""

from __future__ import annotations

import asyncio
import json
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
        "tuning": {"explore_every": 16, "max_length": 6}}))
    metrics_port, http_port = free_port(), free_port()
    server = start_server(str(config), None, "--metrics-port", str(metrics_port), "--http-port", str(http_port))
    server.wait_ready().close()
    assert "polyspec: tuning:" not in server.log_path.read_text()  # the planner reads both options

    async def run_all():
        async with AsyncClient(server.address) as client:
            return await asyncio.gather(*(client.generate(f"def f{i}(x):", max_new_tokens=16) for i in range(6)))

    results = asyncio.run(asyncio.wait_for(run_all(), 120))
    body = json.dumps({"prompt": "def g(x):", "max_tokens": 8, "n": 2}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    usage = json.loads(urllib.request.urlopen(request, timeout=120).read())["usage"]  # polyspec's extension: each choice's plans
    assert len(usage["polyspec_plans"]) == 2 and usage["completion_tokens"] == sum(
        plan["tokens"] for plans in usage["polyspec_plans"] for plan in plans)
    http_plans = [plan for plans in usage["polyspec_plans"] for plan in plans]
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
    for plan in http_plans:
        chains["<-".join(plan["tiers"])] = chains.get("<-".join(plan["tiers"]), 0) + plan["rounds"]
    assert rounds == {chain: float(count) for chain, count in chains.items()}
    for chain in chains:
        for source in ("measured", "predicted"):
            value = re.search(rf'^polyspec_plan_tokens_per_second\{{chain="{re.escape(chain)}",source="{source}"\}} (\S+)$', text, re.M)
            assert value and float(value.group(1)) > 0, (chain, source)
    assert float(re.search(r"^polyspec_plan_prediction_ratio_count (\S+)$", text, re.M).group(1)) == \
        sum(len(result["stats"]["plans"]) for result in results) + len(http_plans)
