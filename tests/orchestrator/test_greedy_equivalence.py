"""Greedy speculative output equals the target's own greedy output, token for token."""

from __future__ import annotations

import pytest
import torch

from family_chains import tier_specs
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in"]
MAX_NEW = 48


CHAINS = {
    "target+small": (["target", "small"], {}),
    "target+mid": (["target", "mid"], {}),
    "target+mid+small": (["target", "mid", "small"], {"lengths": [4, 3]}),
    "target+mid+ngram": (["target", "mid", "ngram"], {"lengths": [5, 2]}),
    "target+ngram": (["target", "ngram"], {}),
    "target+int8": (["target", "int8"], {}),
    "target+int8+ngram": (["target", "int8", "ngram"], {"lengths": [6, 3]}),
    "target+fp8+small": (["target", "fp8", "small"], {"lengths": [4, 3]}),
    "tree:target+mid": (["target", "mid"], {"tree_width": 3}),
    "tree:target+small": (["target", "small"], {"tree_width": 2, "lengths": [3]}),
    "tree:target+mid+small": (["target", "mid", "small"], {"tree_width": 2}),
    "tree:target+int8+ngram": (["target", "int8", "ngram"], {"tree_width": 3}),
    # trained drafters (tests/conftest.py: tiny_drafters)
    "target+feature": (["target", "feature"], {"lengths": [4]}),
    "target+feature+ngram": (["target", "feature", "ngram"], {"lengths": [4, 3]}),
    "target+feature+small": (["target", "feature", "small"], {"lengths": [3, 2]}),
    "target+early_exit": (["target", "early_exit"], {"lengths": [5]}),
    "target+early_exit_noisy": (["target", "early_exit_noisy"], {"lengths": [4]}),
    "target+early_exit_noisy+ngram": (["target", "early_exit_noisy", "ngram"], {"lengths": [4, 3]}),
    "target+feature+early_exit_noisy": (["target", "feature", "early_exit_noisy"], {"lengths": [3, 2]}),
    "tree:target+feature": (["target", "feature"], {"tree_width": 3, "lengths": [3]}),
    "tree:target+early_exit_noisy": (["target", "early_exit_noisy"], {"tree_width": 2, "lengths": [3]}),
}


def build(family, names, speculation):
    return Engine(parse_config({"tiers": tier_specs(family, names), "speculation": speculation}))


@pytest.fixture(scope="module")
def reference(tiny_family):
    """The target's own greedy continuation: plain transformers generate()."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_family["target"])
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out[prompt] = generated[0, len(ids) :].tolist()
    return out


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_greedy_equals_target(tiny_drafters, reference, chain):
    names, speculation = CHAINS[chain]
    engine = build(tiny_drafters, names, speculation)
    engine.scheduler.eos_token_ids = frozenset()  # compare full-length continuations
    for prompt in PROMPTS:
        result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": MAX_NEW}))
        assert result["token_ids"] == reference[prompt], (chain, prompt)
        stages = result["stats"]["stages"]
        assert len(stages) == len(names) - 1
        assert all(s["accepted"] <= s["proposed"] for s in stages)


def test_no_speculation_equals_target(tiny_family, reference):
    engine = build(tiny_family, ["target", "mid"], {})
    baseline = Engine(engine.config, speculative=False)
    baseline.scheduler.eos_token_ids = frozenset()
    assert len(baseline.tiers) == 1
    for prompt in PROMPTS:
        result = baseline.generate(baseline.parse_request({"prompt": prompt, "max_new_tokens": MAX_NEW}))
        assert result["token_ids"] == reference[prompt]
        assert result["stats"]["stages"] == []


def test_perfect_drafter_accepts_everything(tiny_family):
    # the target drafting for itself: every draft token must be accepted
    engine = Engine(parse_config({"tiers": [*tier_specs(tiny_family, ["target"]), {"name": "copy", "model": tiny_family["target"]}], "speculation": {"lengths": [5]}}))
    engine.scheduler.eos_token_ids = frozenset()
    result = engine.generate(engine.parse_request({"prompt": PROMPTS[0], "max_new_tokens": 36}))
    stage = result["stats"]["stages"][0]
    assert stage["accepted"] == stage["proposed"] and stage["blocks"] == 6  # 6 rounds x (5 + bonus)
