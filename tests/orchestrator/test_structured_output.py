"""Structured output (polyspec.workers.core.grammar) stays lossless under speculation, against the independent
reference of tests/grammar_reference.py (the target through transformers, xgrammar's own matcher and kernel):
greedy replies equal the target's constrained greedy decode; at T = 1 the first two tokens follow the target's
restricted joint (chi-square as tests/lossless_stats.py)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import jsonschema
import pytest

from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.config import load_config, parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import RequestError
from polyspec.workers.core.sampling import SamplingParams

from family_chains import tier_specs
from grammar_reference import constrained_greedy, matcher_for, restricted_two_token_probs
from lossless_stats import ALPHA, chi_square_p_value

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"

PERSON = {  # nested objects, arrays, enums; bounded strings so a small model's reply ends inside the budget
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
CONSTRAINTS = {
    "json_schema": {"json_schema": PERSON},
    "regex": {"regex": "(def|class) [a-z_]{1,12}\\([a-z, ]{0,20}\\):"},
    "grammar": {"grammar": 'root ::= "return " expr\nexpr ::= [a-z] | [a-z] " + " expr | "(" expr ")"'},
}
PROMPTS = ["def add(a, b):\n    ", "import os\n\nclass Config:\n", "for i in range(10):\n"]


def reference_matcher(engine: Engine, raw: dict):
    return matcher_for(engine.tokenizer, engine.vocab_size, sorted(engine.scheduler.eos_token_ids), raw)


# ------------------------------------------------------------------------ the demo chain


@pytest.fixture(scope="module")
def demo():
    """The demo chain (target <- int8 copy <- n-gram), batched, and the target's model."""
    return Engine(load_config(str(DEMO)), batched=True)


def _generate_all(engine: Engine, raws: list[dict]) -> list[dict]:
    requests = [engine.parse_request({**raw, "id": str(i)}) for i, raw in enumerate(raws)]
    results: dict[str, dict] = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result),
                 max_requests=min(len(requests), engine.max_requests))
    return [results[str(i)] for i in range(len(raws))]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_demo_chain_greedy_equals_the_targets_constrained_decode(demo, kind):
    """Constrained and free requests side by side in one batch of rounds (int8 drafter, n-gram below it):
    each constrained reply equals the target's own constrained greedy decode; each free one its free reply."""
    raws = [{"prompt": p, "max_new_tokens": 48, **CONSTRAINTS[kind]} for p in PROMPTS]
    free = [{"prompt": p, "max_new_tokens": 24} for p in PROMPTS[:2]]
    results = _generate_all(demo, raws + free)
    model, vocab, eos = demo.tiers[0].model, demo.vocab_size, set(demo.scheduler.eos_token_ids)
    for raw, result in zip(raws, results):
        prompt_ids = demo.parse_request(raw).prompt_ids
        expected = constrained_greedy(model, vocab, list(prompt_ids), raw["max_new_tokens"], eos, reference_matcher(demo, raw))
        assert result["token_ids"] == expected, (kind, raw["prompt"], result["text"])
    alone = _generate_all(demo, free)
    assert [r["token_ids"] for r in results[len(raws):]] == [r["token_ids"] for r in alone]


@pytest.mark.slow
def test_json_schema_reply_parses_and_validates(demo):
    results = _generate_all(demo, [{"prompt": p, "max_new_tokens": 120, "json_schema": PERSON} for p in PROMPTS])
    for result in results:
        assert result["finish_reason"] == "eos", result
        jsonschema.validate(json.loads(result["text"]), PERSON)


def test_bad_constraints_are_refused_before_model_work(demo):
    for bad in [{"json_schema": {"type": "objekt"}}, {"regex": "(["}, {"grammar": "root ::= undefined_rule"},
                {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}]:
        with pytest.raises(RequestError) as caught:
            demo.parse_request({"prompt": "x", **bad})
        assert "\n" not in str(caught.value) and str(caught.value).startswith("invalid ")


# ----------------------------------------------------------------- other tier kinds (tiny family)

CHAINS = {
    "model drafters": (["target", "mid", "small"], {"lengths": [3, 2]}),
    "int8 + ngram": (["target", "int8", "ngram"], {"lengths": [3, 3]}),
    "tree specinfer": (["target", "mid", "small"], {"lengths": [3, 2], "tree_width": 3, "verifier": "specinfer"}),
    "feature head": (["target", "feature"], {"lengths": [3]}),
}
TINY_REGEX = {"regex": "[a-f][0-9a-f]"}  # byte tokens: 6 x 16 allowed pairs, then only the end


@pytest.mark.slow
@pytest.mark.parametrize("chain", list(CHAINS))
def test_tiny_chains_greedy_equal_the_targets_constrained_decode(tiny_drafters, chain):
    names, speculation = CHAINS[chain]
    engine = Engine(parse_config({"tiers": tier_specs(tiny_drafters, names), "speculation": speculation}), batched=True)
    raws = [{"prompt": p, "max_new_tokens": 24, "regex": "[a-z]{2,6}(, [a-z]{2,6}){1,3}"} for p in PROMPTS]
    model, vocab, eos = engine.tiers[0].model, engine.vocab_size, set(engine.scheduler.eos_token_ids)
    for raw, result in zip(raws, _generate_all(engine, raws + [{"prompt": "free", "max_new_tokens": 16}])):
        prompt_ids = list(engine.parse_request(raw).prompt_ids)
        assert result["token_ids"] == constrained_greedy(model, vocab, prompt_ids, 24, eos, reference_matcher(engine, raw)), chain


SAMPLED = {  # name: (chain, samples); chi-square at ALPHA (tests/lossless_stats.py), cells under 5 expected pooled
    "model drafters": ("model drafters", 1200),
    "int8 + ngram": ("int8 + ngram", 1200),
    "tree specinfer": ("tree specinfer", 1200),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAMPLED))  # (the demo chain's test below runs by default too)
def test_sampled_output_is_the_targets_restricted_distribution(tiny_drafters, case):
    """At T = 1 the first two tokens (96 allowed pairs) are distributed as the target's restricted, renormalised
    joint: chi-square over `samples` seeded requests (60 per batched step), failing only at p < ALPHA (1e-3)."""
    chain, samples = SAMPLED[case]
    names, speculation = CHAINS[chain]
    engine = Engine(parse_config({"tiers": tier_specs(tiny_drafters, names), "speculation": speculation,
                                  "batching": {"max_requests": 60}}), batched=True)
    params = SamplingParams(temperature=1.0)
    prompt_ids = list(engine.parse_request({"prompt": PROMPTS[0]}).prompt_ids)
    joint = restricted_two_token_probs(engine.tiers[0].model, engine.vocab_size, prompt_ids, params,
                                       reference_matcher(engine, TINY_REGEX))
    results = _generate_all(engine, [{"prompt_ids": prompt_ids, "max_new_tokens": 2, "temperature": 1.0, "seed": seed, **TINY_REGEX}
                                     for seed in range(samples)])
    counts = collections.Counter(tuple(result["token_ids"][:2]) for result in results)
    assert all(joint[a, b] > 0 for a, b in counts), "a pair the grammar refuses was emitted"
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"{case}: chi-square p={p_value:.2e} over {samples} samples"


def test_refused_in_approximate_modes(demo):
    """Structured output is exact only: an approximate mode refuses a constrained request with one line."""
    with pytest.raises(RequestError, match="exact only"):
        demo.parse_request({"prompt": "x", "regex": "[a-z]+", "approximate": {"mode": "bild"}})


@pytest.mark.slow
def test_demo_chain_sampled_output_is_the_targets_restricted_distribution(demo):
    """The demo family (models/stdlib: 4096-token BPE; target <- int8 copy <- n-gram, lengths [12, 10]) at T = 1: the
    first two tokens of a regex-constrained reply (a token spelling one or two of its characters, then the rest or
    the end) follow the target's restricted, renormalised joint. Chi-square over 1500 seeded requests, failing only
    at p < ALPHA (1e-3); cells under 5 expected pooled."""
    samples, params = 1500, SamplingParams(temperature=1.0)
    prompt_ids = list(demo.parse_request({"prompt": PROMPTS[0]}).prompt_ids)
    joint = restricted_two_token_probs(demo.tiers[0].model, demo.vocab_size, prompt_ids, params, reference_matcher(demo, TINY_REGEX))
    results = _generate_all(demo, [{"prompt_ids": prompt_ids, "max_new_tokens": 2, "temperature": 1.0, "seed": seed, **TINY_REGEX}
                                   for seed in range(samples)])
    counts = collections.Counter(tuple(result["token_ids"][:2]) for result in results)
    assert all(len(pair) == 2 and joint[pair] > 0 for pair in counts), "a pair the grammar refuses was emitted"
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"demo chain: chi-square p={p_value:.2e} over {samples} samples"
