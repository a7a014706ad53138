"""`polyspec serve` with `lengths: auto`: the planner's chains and their predicted and measured tokens/s in each
response's stats (gRPC) and usage (HTTP's `polyspec_plans`), in /metrics and in GetStats (`plans`, `recent_plans`);
a `tuning:` option the batched planner does not read is named in its log."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import yaml

from polyspec.client import AsyncClient, Client

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

    # GetStats: per chain the same sums as /metrics, and the plans themselves (as the results listed them)
    with Client(server.address) as client:
        stats = client.stats()
    assert {plan["chain"]: plan["rounds"] for plan in stats["plans"]} == {chain: int(count) for chain, count in rounds.items()}
    for plan in stats["plans"]:
        assert plan["tiers"][0] == "target" and set(plan["tiers"]) <= {"target", "mid", "ng"}
        assert "<-".join(plan["tiers"]) == plan["chain"]
        assert plan["predicted_tokens_per_s"] > 0
        for source in ("measured", "predicted"):
            series = rf'^polyspec_plan_tokens_per_second\{{chain="{re.escape(plan["chain"])}",source="{source}"\}} (\S+)$'
            value = re.search(series, text, re.M)
            assert float(value.group(1)) == plan[f"{source}_tokens_per_s"], (plan, source)
    run = [plan for result in results for plan in result["stats"]["plans"]] + http_plans
    recent = stats["recent_plans"]
    assert len(recent) == min(len(run), 32) and recent
    key = lambda plan: json.dumps(plan, sort_keys=True)  # noqa: E731
    assert {key(plan) for plan in recent} <= {key(plan) for plan in run}
    if len(run) <= 32:
        assert sorted(map(key, recent)) == sorted(map(key, run))
    for plan in recent:
        assert set(plan["tiers"]) <= {"target", "mid", "ng"} and len(plan["lengths"]) == len(plan["tiers"]) - 1
        assert max(plan["lengths"], default=0) <= 6 and plan["predicted_tokens_per_s"] > 0


def test_recent_plans_keep_the_last_ones_and_a_missing_prediction_stays_missing():
    from polyspec.client import message_dict
    from polyspec.orchestrator.serving.metrics import RECENT_PLANS, Metrics
    from polyspec.orchestrator.serving.server import chain_plan_message, plan_record_message
    from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb

    metrics = Metrics()
    records = [{"new_tokens": i, "tiers": ["target", "ng"], "lengths": [3], "rounds": 1, "tokens": 2, "seconds": 0.5,
                "measured_tokens_per_s": 4.0, **({"predicted_tokens_per_s": 5.0} if i % 2 else {})}
               for i in range(RECENT_PLANS + 8)]
    metrics.plan_stats(records)
    snapshot = metrics.snapshot()
    assert snapshot["recent_plans"] == records[-RECENT_PLANS:]
    response = pb.StatsResponse(plans=[chain_plan_message(chain, total) for chain, total in snapshot["plans"].items()],
                                recent_plans=[plan_record_message(record) for record in snapshot["recent_plans"]])
    stats = message_dict(pb.StatsResponse.FromString(response.SerializeToString()))
    assert stats["recent_plans"] == records[-RECENT_PLANS:]  # the records as results list them, unset prediction absent
    (chain,) = stats["plans"]
    assert chain == {"chain": "target<-ng", "tiers": ["target", "ng"], **snapshot["plans"]["target<-ng"]}
