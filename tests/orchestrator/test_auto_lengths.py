"""`lengths: auto` one request at a time (generate, chat, bench): the goodput planner plans each request's
rounds as steps of one, and the output is the target's own."""

from __future__ import annotations

import pytest

from core_helpers import greedy_references
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tuning.batch_model import BatchPlanner

PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(i)\nfor i in"]
MAX_NEW = 40


@pytest.fixture(scope="module")
def reference(tiny_family):
    """The target's own greedy continuation of each prompt (transformers' generate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_family["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()
    by_ids = greedy_references(model, [tokenizer(prompt)["input_ids"] for prompt in PROMPTS], MAX_NEW)
    return {prompt: tokens for prompt, tokens in zip(PROMPTS, by_ids.values())}


def auto_engine(family, names, **speculation):
    tiers = [{"name": n, "model": "ngram" if n == "ngram" else family[n]} for n in names]
    engine = Engine(parse_config({"tiers": tiers, "speculation": {"lengths": "auto", **speculation}}))
    engine.scheduler.eos_token_ids = frozenset()
    return engine


@pytest.mark.parametrize("names,extra", [(["target", "mid", "ngram"], {}), (["target", "mid", "small"], {"tree_width": 2})])
def test_auto_lengths_keep_greedy_output(tiny_family, reference, names, extra):
    engine = auto_engine(tiny_family, names, **extra)
    planner = engine.scheduler.planner
    assert isinstance(planner, BatchPlanner)
    for _ in range(2):  # the second pass runs on learned acceptance (and probably other plans)
        for prompt in PROMPTS:
            result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": MAX_NEW}))
            assert result["token_ids"] == reference[prompt]
            assert result["stats"]["plans"] and result["stats"]["plans"][0]["new_tokens"] == 0
    assert planner.history and {entry["batch"] for entry in planner.history} == {1}
    assert any(plan.speculating for plan in planner.arms[(1, 0)].rates)  # the A/B measured speculation against off


def test_auto_lengths_sampling_runs(tiny_family):
    engine = auto_engine(tiny_family, ["target", "mid", "ngram"])
    result = engine.generate(engine.parse_request({"prompt": PROMPTS[0], "max_new_tokens": 24, "temperature": 1.0, "seed": 3}))
    assert len(result["token_ids"]) == 24
    assert (1, 1) in engine.scheduler.planner.arms  # a sampling load of one request: its own A/B
