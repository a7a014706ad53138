"""Trained drafters in Ray mode: a feature head and an early-exit drafter run in their
target's actor (ray_runtime.actor_groups), cheaper tiers in actors of their own.

Greedy equality against the target's own `generate`, and seeded sampling equal to the
embedded chain's (same per-tier seeds, so the same draws), on one small local cluster
that the module's finalizer stops whatever fails.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from polyspec.orchestrator.config import parse_config  # noqa: E402
from polyspec.orchestrator.engine import Engine  # noqa: E402
from polyspec.orchestrator.tokenization import encode_prompt  # noqa: E402
from polyspec.workers.core.errors import ConfigError  # noqa: E402
from polyspec.workers.core.sampling import SamplingParams  # noqa: E402
from tiny_models import EOS  # noqa: E402
from ray_cluster import shutdown_cluster  # noqa: E402
from core_helpers import generate_alone  # noqa: E402

PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(i)\nfor i in", "class Point:\n    def __init__(self"]
MAX_NEW = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
    yield cluster
    shutdown_cluster(cluster)


@pytest.fixture(scope="module")
def expected(tiny_drafters):
    """The target's own greedy `generate` for each prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_drafters["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_drafters["target"]).eval()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    out = []
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens = generated[0, len(ids):].tolist()
        out.append((ids, tokens[: tokens.index(eos) + 1] if eos in tokens else tokens))  # the chain stops at EOS
    return out


def chain(tiny_drafters, drafters: list[dict], lengths, backend: str, address: str | None = None, pipeline: bool = False,
          **speculation) -> dict:
    runtime = {"backend": backend, "pipeline": pipeline}
    if address:
        runtime["address"] = address
    return {"tiers": [{"name": "target", "model": tiny_drafters["target"]}, *drafters],
            "speculation": {"lengths": list(lengths), **speculation}, "runtime": runtime}


def feature(tiny_drafters):
    return {"name": "feature", "model": {"feature_head": tiny_drafters["feature"]}}


def early(tiny_drafters, threshold=0.3):
    return {"name": "early", "model": {"early_exit": tiny_drafters["early_exit_noisy"], "layers": 1, "exit_threshold": threshold}}


def ngram():
    return {"name": "ngram", "model": "ngram"}


# each chain costs a Ray start of its actors (several seconds): these cover both tier types,
# a cheaper tier under each, draft-ahead (pipeline: the co-located tiers share one model
# lock while the n-gram tier drafts past its blocks) and trees; the serial feature <- n-gram
# chain is the restart test's, below
CHAINS = {
    "feature<-ngram pipelined": (lambda d: [feature(d), ngram()], [3, 2], {"pipeline": True}),
    "early<-ngram": (lambda d: [early(d), ngram()], [4, 2], {}),
    "early-tree": (lambda d: [early(d)], [3], {"tree_width": 2}),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_greedy_equals_generate_with_trained_drafters(cluster, tiny_drafters, expected, name):
    drafters, lengths, speculation = CHAINS[name]
    engine = Engine(parse_config(chain(tiny_drafters, drafters(tiny_drafters), lengths, "ray", cluster.address, **speculation)))
    try:
        membership = engine.scheduler.membership
        infos = [ray.get(membership.actors[i].info.remote(i)) for i in range(len(membership.views))]
        trained = [i for i, t in enumerate(engine.config.tiers) if t.drafter]
        assert {infos[i]["pid"] for i in trained} == {infos[0]["pid"]}, "trained drafters run in the target's actor"
        assert len({info["address"] for info in infos}) == len(infos), "each tier serves on its own port"
        for ids, want in expected:
            assert generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids == want
        stats = engine.scheduler.runtime_stats()
        assert all(tier["sent"]["grpc"]["messages"] > 0 for tier in stats["tiers"][:-1]), "every tier drafted for the one above"
    finally:
        engine.close()


def test_seeded_sampling_equals_the_embedded_chain(cluster, tiny_drafters, expected):
    """target <- feature <- early exit. T = 1 with per-tier seeds: the Ray chain draws exactly
    the embedded chain's tokens, so the feature head's rows (from predicted features,
    recomputed from the target's once it has them) and the early-exit tier's dynamic blocks
    are the same in both modes; and T = 0 gives the target's own continuation."""
    drafters = [feature(tiny_drafters), early(tiny_drafters)]
    engine = Engine(parse_config(chain(tiny_drafters, drafters, [3, 2], "ray", cluster.address)))
    local = Engine(parse_config(chain(tiny_drafters, drafters, [3, 2], "local")))
    try:
        for ids, want in expected:
            assert generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids == want
        params = SamplingParams(temperature=1.0)
        for seed, (ids, _) in enumerate(expected):
            want = generate_alone(local.scheduler, ids, MAX_NEW, params, seed=seed).token_ids
            assert generate_alone(engine.scheduler, ids, MAX_NEW, params, seed=seed).token_ids == want
    finally:
        engine.close()
        local.close()


def run_batched(raw: dict, expected) -> dict:
    """Every prompt at once through a batched Ray engine of `raw` (every running request in one VerifyBatch a step);
    asserts each greedy output is the target's; the results by id."""
    from polyspec.orchestrator.batch_runner import run_requests

    engine = Engine(parse_config(raw), batched=True)
    try:
        assert engine.batched
        requests = [engine.parse_request({"id": str(i), "prompt_ids": ids, "max_new_tokens": MAX_NEW}) for i, (ids, _) in enumerate(expected)]
        out = {}
        run_requests(engine, requests, lambda result: out.__setitem__(result["id"], result))
        for i, (_, want) in enumerate(expected):
            assert out[str(i)]["token_ids"] == want, i
        return out
    finally:
        engine.close()


def test_an_early_exit_chain_runs_batched_on_device_tiers(cluster, tiny_drafters, expected):
    """`batching.round: device`: the target's actor serves the target and its early-exit drafter as device tiers
    (ray_runtime.actor_device_slots), every running request in one VerifyBatch a step; greedy output is the target's."""
    raw = chain(tiny_drafters, [early(tiny_drafters)], [3], "ray", cluster.address)
    raw["batching"] = {"round": "device", "max_requests": 4, "max_context": 128}
    out = run_batched(raw, expected)
    assert out["0"]["stats"]["stages"][0]["proposed"] > 0


def test_a_feature_head_chain_runs_batched(cluster, tiny_drafters, expected):
    """target <- feature <- n-gram, ragged batched rounds: the target's actor serves the target and its feature head
    batched together (model_lock.LockedTiers: the head a BatchedFeatureTier reading the target's slot cache), every
    running request in one VerifyBatch a step, the head scoring the n-gram's blocks as a middle tier; greedy output
    is the target's."""
    raw = chain(tiny_drafters, [feature(tiny_drafters), ngram()], [3, 2], "ray", cluster.address)
    raw["batching"] = {"max_requests": 4}
    out = run_batched(raw, expected)
    assert all(out[str(i)]["stats"]["stages"][0]["proposed"] > 0 for i in range(len(expected))), "the head drafted for every request"


def test_ray_mode_rules_for_trained_drafters(tiny_drafters):
    pinned = {**feature(tiny_drafters), "resources": {"gpu_node": 1}}
    with pytest.raises(ConfigError, match="runs in its target's Ray actor; set resources on the target"):
        parse_config(chain(tiny_drafters, [pinned], [3], "ray"))
    raw = chain(tiny_drafters, [early(tiny_drafters)], [3], "ray")
    raw["runtime"]["tensor_transport"] = "gloo"
    with pytest.raises(ConfigError, match="tensor_transport must be auto or grpc"):
        parse_config(raw)


@pytest.mark.extended
def test_target_restart_brings_its_drafters_back(cluster, tiny_drafters, expected):
    """target <- feature <- n-gram, serial: the target's greedy output; then the target's actor
    is killed between requests: Ray restarts it with its feature head (new ports), the driver
    rewires target -> feature -> n-gram, and decoding gives the target's greedy output again
    with every tier back up."""
    engine = Engine(parse_config(chain(tiny_drafters, [feature(tiny_drafters), ngram()], [3, 2], "ray", cluster.address)))
    try:
        membership = engine.scheduler.membership
        for ids, want in expected:
            assert generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids == want
        before = ray.get(membership.actors[1].info.remote(1))
        assert before["pid"] == ray.get(membership.actors[0].info.remote(0))["pid"], "the feature head runs in the target's actor"
        ray.kill(membership.actors[0], no_restart=False)
        for ids, want in expected:
            assert generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids == want
        after = ray.get(membership.actors[1].info.remote(1))
        assert after["pid"] != before["pid"], "the feature head restarted with its target"
        assert membership.views[1].address == after["address"] and all(view.up for view in membership.views)
        stats = engine.scheduler.runtime_stats()
        assert stats["tiers"][0]["sent"]["grpc"]["messages"] > 0, "the restarted target drafts with its feature head again"
    finally:
        engine.close()
