"""The round-by-round API: interleaved requests give the same output as one at a time."""

from __future__ import annotations

from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine


def make_engine(family) -> Engine:
    return Engine(parse_config({
        "tiers": [{"name": "t", "model": family["target"]}, {"name": "m", "model": family["mid"]}, {"name": "n", "model": "ngram"}],
        "speculation": {"lengths": [4, 2]},
    }))


def open_slots(engine) -> int:
    """Sequences the chain's KV pools still hold (the n-gram tier keeps none)."""
    return sum(tier.cache.open_sequences for tier in engine.scheduler.tiers if tier.has_weights)


def test_interleaved_requests_match_sequential(tiny_family):
    engine = make_engine(tiny_family)
    raw = [
        {"id": "greedy", "prompt": "import os\n", "max_new_tokens": 30},
        {"id": "sampled", "prompt": "def f(x):", "max_new_tokens": 25, "temperature": 1.0, "seed": 5},
        {"id": "short", "prompt": "class A:", "max_new_tokens": 3},
    ]
    requests = [engine.parse_request(r) for r in raw]
    sequential = {r.id: engine.generate(r)["token_ids"] for r in requests}
    states = [engine.start(r) for r in requests]
    streamed = {r.id: [] for r in requests}
    while any(not s.done for s in states):
        for request, state in zip(requests, states):
            streamed[request.id] += engine.step(state)
    results = {r.id: engine.finish(s) for r, s in zip(requests, states)}
    assert {k: v["token_ids"] for k, v in results.items()} == sequential
    assert streamed == sequential
    assert open_slots(engine) == 0  # caches freed


def test_cancel_frees_caches_and_reports_cancelled(tiny_family):
    engine = make_engine(tiny_family)
    state = engine.start(engine.parse_request({"prompt": "import os", "max_new_tokens": 50}))
    first = engine.step(state)
    assert first and not state.done
    result = engine.cancel(state)
    assert result["finish_reason"] == "cancelled" and result["token_ids"] == first
    assert engine.step(state) == []
    assert open_slots(engine) == 0
