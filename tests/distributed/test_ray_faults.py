"""Faults on a multi-node Ray cluster simulated in one machine (ray.cluster_utils.Cluster:
every node a real raylet process, tiers pinned by custom resources): start-up under faults,
and a poison request in a batched step.

A drafter that cannot be placed, or whose node dies while the chain starts, is left out: the
chain runs without it, says so (stderr and runtime_stats' `tier_events`) and wires it in when
a node that can hold it joins. A target whose node dies while the chain starts is one
ConfigError, as soon as Ray lists the node dead. Nodes are killed as the issue's run killed
them: SIGKILL to the node's raylet, no graceful exit.

The cluster detects a dead node in ~3 s (health checks every second, 3 misses) instead of
Ray's ~15 s default, so the tests stay short; the code under test does not depend on it.
"""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.distributed.ray_runtime import RayMembership
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.core.sampling import SamplingParams
from ray.cluster_utils import Cluster
from ray_cluster import shutdown_cluster
from core_helpers import generate_alone

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in",
           "class Point:\n    def __init__(self", "while True:\n    line ="]
MAX_NEW = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A head (tier_target, where the driver connects) and nothing else: each test adds the
    worker nodes it kills and removes them in its finalizer."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"tier_target": 1},
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 1000}})
    ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
    yield cluster
    shutdown_cluster(cluster)


def wait_listed(node, alive: bool, what: str, timeout_s: float = 60.0) -> None:
    """Until Ray lists `node` alive (or, with `alive` False, no longer alive); `what` fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()) != alive:
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture
def nodes(cluster):
    """add(label) -> a worker node with one CPU and resource `label`, once Ray lists it alive (not
    cluster.wait_for_nodes, which counts the nodes a test killed); all are removed after the test."""
    added = []

    def add(label):
        node = cluster.add_node(num_cpus=1, resources={label: 1})
        added.append(node)
        wait_listed(node, alive=True, what=f"node with {label} not alive")
        return node

    yield add
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="module")
def greedy(tiny_family):
    """Each prompt's ids and the target's own greedy tokens (embedded, target alone)."""
    engine = Engine(parse_config({"tiers": [{"name": "target", "model": tiny_family["target"]}]}))
    out = []
    for prompt in PROMPTS:
        ids = encode_prompt(engine.tokenizer, prompt)
        out.append((ids, generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids))
    return out


def chain_config(family, address, pins: dict, lengths, placement="pack"):
    tiers = [{"name": name, "model": family[name], "resources": {label: 1}} for name, label in pins.items()]
    return parse_config({"tiers": tiers, "speculation": {"lengths": lengths if lengths == "auto" else list(lengths)},
                         "sampling": {"max_new_tokens": MAX_NEW},
                         "runtime": {"backend": "ray", "address": address, "pipeline": True, "placement": placement}})


def kill_during_start(monkeypatch, node):
    """SIGKILL `node`'s raylet right after the chain has asked Ray for its actors, before any answered."""
    real = RayMembership._wait_infos

    def wait_infos(self, unplaced):
        node.kill_raylet()
        return real(self, unplaced)

    monkeypatch.setattr(RayMembership, "_wait_infos", wait_infos)


def wait_up(chain, index, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while not chain.tiers[index].up:
        assert time.monotonic() < deadline, f"tier {chain.tiers[index].name!r} was not wired in within {timeout_s:g}s"
        time.sleep(0.5)


def events(chain):
    return [(e["tier"], e["event"]) for e in chain.runtime_stats()["tier_events"]]


@pytest.mark.parametrize("placement", ["pack", pytest.param("spread", marks=pytest.mark.extended)])
def test_unplaceable_drafter_starts_without_it_and_joins_later(cluster, nodes, tiny_family, greedy, capfd, placement):
    """No node has the drafter's resource: the chain starts at once with the target alone,
    says so, gives the target's greedy output; a node with the resource joins and the drafter
    is wired in and drafts. `lengths: auto` cannot profile a tier that is not up: the chain
    runs the default lengths untuned, and says so. With `placement: spread` the drafter is kept
    out of the placement group (which would otherwise never be placed)."""
    engine = Engine(chain_config(tiny_family, cluster.address, {"target": "tier_target", "small": "tier_late"}, "auto", placement))
    try:
        chain = engine.scheduler
        assert not chain.tiers[1].up and events(chain) == [("small", "left_out")]
        err = capfd.readouterr().err
        line = next(line for line in err.splitlines() if "'small'" in line)
        assert "cannot be placed" in line and "'tier_late'" in line and "starts without it" in line
        assert "speculation.lengths: auto: not every tier is up" in err and chain.planner is None
        stats = chain.runtime_stats()
        assert stats["tiers"][1] == {"tier": "small", "up": False}
        ids, expected = greedy[0]
        out = generate_alone(chain, ids, MAX_NEW, SamplingParams(temperature=0.0))
        assert out.token_ids == expected and not out.stats["stages"], "the target alone: no drafting stage"
        assert chain.runtime_stats()["degraded_rounds"] == out.stats["rounds"], "its rounds ran on a shortened chain"

        nodes("tier_late")
        wait_up(chain, 1)
        assert events(chain) == [("small", "left_out"), ("small", "up")]
        assert "tier 'small' is up: wired into the chain" in capfd.readouterr().err
        shortened = chain.degraded_rounds
        for ids, expected in greedy:
            out = generate_alone(chain, ids, MAX_NEW, SamplingParams(temperature=0.0))
            assert out.token_ids == expected
        assert out.stats["stages"][0]["blocks"] > 0, "the drafter drafts once it has joined"
        assert chain.degraded_rounds == shortened, "the whole chain again"
    finally:
        engine.close()


def test_nodes_killed_during_start_and_during_run_lose_no_request(cluster, nodes, tiny_family, greedy, monkeypatch, capfd):
    """target <- mid <- small, one node each. The small drafter's raylet is killed while the
    chain starts: the chain starts without it (within seconds, not the 180 s start timeout).
    Then a 40-request batched run (`polyspec batch`'s path) loses the mid tier's node after a
    few results: every request finishes with the target's greedy output. A new node for the
    small drafter joins and the drafter is wired back in."""
    from polyspec.orchestrator.batch_runner import run_requests

    small = nodes("tier_small")
    mid = nodes("tier_mid")
    kill_during_start(monkeypatch, small)
    engine = Engine(chain_config(tiny_family, cluster.address, {"target": "tier_target", "mid": "tier_mid", "small": "tier_small"},
                                 [4, 2]), batched=True)
    try:
        chain = engine.scheduler
        assert engine.batched and [view.up for view in chain.tiers] == [True, True, False]
        assert events(chain) == [("small", "left_out")]
        line = next(line for line in capfd.readouterr().err.splitlines() if "tier 'small'" in line)
        assert "its node left while the chain was starting" in line and "starts without it" in line

        requests = [engine.parse_request({"id": f"r{i}", "prompt_ids": ids, "max_new_tokens": MAX_NEW, "temperature": 0.0})
                    for i, (ids, _) in enumerate(greedy * 8)]
        expected = {f"r{i}": tokens for i, (_, tokens) in enumerate(greedy * 8)}
        results, some_done, killed = {}, threading.Event(), threading.Event()

        def done(result):
            results[result["id"]] = result
            if len(results) == 5:
                some_done.set()
                # the batch's loop waits here until the node is gone: on a fast machine the other 35 requests used to
                # finish before the kill, and the loss went unnoticed (the requests were fine; the test's point was not)
                killed.wait(120)

        runner = threading.Thread(target=run_requests, args=(engine, requests, done), kwargs={"max_requests": 8})
        runner.start()
        assert some_done.wait(120), "the batch did not start"
        mid.kill_raylet()
        # the batch goes on only once Ray lists the node dead: its actor's worker process can outlive the raylet
        # for a moment, long enough on a fast machine for the other 35 requests to finish on it unnoticed
        wait_listed(mid, alive=False, what=f"Ray still lists node {mid.node_id} alive 60s after its raylet was killed")
        killed.set()
        runner.join(300)
        assert not runner.is_alive(), "the batch did not finish"
        assert [r for r in results.values() if "error" in r] == []
        assert {i: r["token_ids"] for i, r in results.items()} == expected
        assert ("mid", "down") in events(chain), "the mid tier's loss was noticed mid-run"
        assert chain.degraded_rounds >= len(requests), "every round ran on a shortened chain (small was left out)"

        nodes("tier_small")  # the small drafter's node comes back
        wait_up(chain, 2)
        assert ("small", "up") in events(chain)
        ids, tokens = greedy[1]
        out = generate_alone(chain, ids, MAX_NEW, SamplingParams(temperature=0.0))
        assert out.token_ids == tokens and any(stage["blocks"] > 0 for stage in out.stats["stages"])
    finally:
        engine.close()


def test_target_node_killed_during_start_fails_at_once(cluster, nodes, tiny_family, monkeypatch):
    """The target's only node dies while the chain starts: one ConfigError naming the tier and
    its resource once Ray lists the node dead, not a wait for the 180 s start timeout."""
    node = nodes("tier_target_only")
    nodes("tier_small")
    kill_during_start(monkeypatch, node)
    with pytest.raises(ConfigError) as error:
        Engine(chain_config(tiny_family, cluster.address, {"target": "tier_target_only", "small": "tier_small"}, [3]))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("tier 'target' cannot be placed") and "'tier_target_only'" in message
    assert "left while the chain was starting" in message
    deadline = time.monotonic() + 30  # close() killed the actors it had asked for
    while any(a["State"] != "DEAD" for a in ray.state.actors().values() if a["ActorClassName"] == "TierActor"):
        assert time.monotonic() < deadline, "the failed chain left actors behind"
        time.sleep(0.5)


def test_poison_request_in_a_batched_step_fails_alone(cluster, nodes, tiny_family, greedy):
    """A request whose context holds a token id past the vocabulary makes the tiers' batched
    forward raise (the embedding lookup) for every row of its step. The VerifyBatch carrying it
    fails with one line that is not taken for a dead tier (no failover, nothing bypassed), so
    batch_runner's isolation (step_isolated) retries each request alone: the poison one fails by
    itself and the others give exactly the target's greedy output, stepped by hand and through
    run_requests."""
    nodes("tier_small")
    engine = Engine(chain_config(tiny_family, cluster.address, {"target": "tier_target", "small": "tier_small"}, [3]), batched=True)
    try:
        chain = engine.scheduler
        assert chain.batched
        greedy_params = SamplingParams(temperature=0.0)
        good = [chain.start(ids, MAX_NEW, greedy_params) for ids, _ in greedy[:3]]
        poison = chain.start(greedy[0][0] + [engine.vocab_size + 7], MAX_NEW, greedy_params)
        chain.step_all(good)  # the good ones have state in both tiers' caches when the poison joins
        with pytest.raises(RuntimeError) as error:
            chain.step_all([good[0], poison, good[1], good[2]])
        message = str(error.value)
        assert "\n" not in message and "index out of range" in message, message
        assert chain.failovers == 0 and chain.degraded_rounds == 0 and all(view.up for view in chain.tiers)
        with pytest.raises(RuntimeError, match="index out of range"):
            chain.step_all([poison])  # alone: it fails by itself
        chain.cancel(poison)
        while not all(state.done for state in good):
            chain.step_all([state for state in good if not state.done])
        assert [chain.finish(state).token_ids for state in good] == [tokens for _, tokens in greedy[:3]]
        assert chain.failovers == 0 and chain.degraded_rounds == 0

        # the same through batch_runner's isolation (`polyspec batch`, jobs and serve step this way)
        from polyspec.orchestrator.batch_runner import run_requests
        from polyspec.orchestrator.engine import GenerationRequest

        requests = [engine.parse_request({"id": f"r{i}", "prompt_ids": ids, "max_new_tokens": MAX_NEW, "temperature": 0.0})
                    for i, (ids, _) in enumerate(greedy)]
        requests.insert(2, GenerationRequest(tuple(greedy[0][0] + [engine.vocab_size + 7]), MAX_NEW, greedy_params, id="poison"))
        results, errors = {}, {}
        run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result), max_requests=8,
                     on_error=lambda request, exc: errors.__setitem__(request.id, str(exc)))
        assert list(errors) == ["poison"] and "index out of range" in errors["poison"] and "\n" not in errors["poison"]
        assert {i: r["token_ids"] for i, r in results.items()} == {f"r{i}": tokens for i, (_, tokens) in enumerate(greedy)}
        assert chain.failovers == 0 and chain.degraded_rounds == 0
    finally:
        engine.close()
