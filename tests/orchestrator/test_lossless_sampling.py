"""Sampling through the whole chain is distributed exactly as the target (statistical).

Exact reference: P(x1, x2) = p_target(x1 | prompt) * p_target(x2 | prompt, x1), computed from
the target model itself (one batched forward over every x1). Each chain configuration is
sampled N times with different seeds, PER_BATCH requests in each batched step (a request's
draws are the same batched or alone: tests/orchestrator/test_batched.py checks that seed by
seed); a chi-square test compares the counts of the first two tokens with the exact probabilities. Cells with expected count < MIN_EXPECTED are pooled
into one cell (standard practice for chi-square). The test fails only if p < ALPHA: a
correct chain fails with probability ALPHA per configuration.
"""

from __future__ import annotations

import collections

import pytest
import torch

from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.sampling import SamplingParams

from family_chains import tier_specs
from lossless_stats import ALPHA, chi_square_p_value, exact_two_token_probs

PROMPT = "def f(x):\n    return x +"


PER_BATCH = 60


def sample_first_two(engine: Engine, prompt_ids, params, samples: int) -> collections.Counter:
    """The first two tokens of `samples` seeded requests, PER_BATCH of them in each batched step."""
    engine.scheduler.eos_token_ids = frozenset()
    sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    counts: collections.Counter = collections.Counter()
    for first in range(0, samples, PER_BATCH):
        requests = [engine.parse_request({"prompt_ids": prompt_ids, "max_new_tokens": 3, "seed": seed, "id": f"s{seed}", **sampling})
                    for seed in range(first, min(samples, first + PER_BATCH))]
        run_requests(engine, requests, lambda result: counts.update([tuple(result["token_ids"][:2])]))
    assert sum(counts.values()) == samples
    return counts


CASES = {
    # name: (tiers, speculation, sampling params, samples)
    "3-tier chain": (["target", "mid", "small"], {"lengths": [3, 2]}, SamplingParams(temperature=1.0), 2000),
    "3-tier chain top-k/top-p": (["target", "mid", "small"], {"lengths": [3, 2]}, SamplingParams(temperature=0.8, top_k=12, top_p=0.9), 1200),
    "int8 + ngram": (["target", "int8", "ngram"], {"lengths": [3, 3]}, SamplingParams(temperature=1.0), 1200),
    "tree specinfer": (["target", "mid", "small"], {"lengths": [3, 2], "tree_width": 3, "verifier": "specinfer"}, SamplingParams(temperature=1.0), 1200),
    "tree rsd": (["target", "mid", "small"], {"lengths": [3, 2], "tree_width": 3, "verifier": "rsd"}, SamplingParams(temperature=1.0), 1200),
    "tree spectr": (["target", "small"], {"lengths": [3], "tree_width": 3, "verifier": "spectr"}, SamplingParams(temperature=1.0), 1200),
    "tree importance": (["target", "small"], {"lengths": [3], "tree_width": 3, "verifier": "importance"}, SamplingParams(temperature=1.0), 1200),
    # trained drafters (tests/conftest.py: tiny_drafters)
    "feature head": (["target", "feature"], {"lengths": [3]}, SamplingParams(temperature=1.0), 1200),
    "early exit (dynamic length)": (["target", "early_exit_noisy"], {"lengths": [3]}, SamplingParams(temperature=1.0), 1200),
    "feature head + early exit": (["target", "feature", "early_exit_noisy"], {"lengths": [3, 2]}, SamplingParams(temperature=0.8, top_k=12), 1200),
    "tree feature head": (["target", "feature"], {"lengths": [2], "tree_width": 3, "verifier": "specinfer"}, SamplingParams(temperature=1.0), 1200),
}


def make_engine(family, names, speculation, batched: bool = False) -> Engine:
    batching = {"max_requests": PER_BATCH} if batched else {}
    return Engine(parse_config({"tiers": tier_specs(family, names), "speculation": speculation, "batching": batching}), batched=batched)


# Extended (opt-in): importance sampling's rule end to end (it is checked against the reference walk in
# tests/workers/test_verification.py and test_device_tree_verify.py by default; its batched rows cost the most here).
EXTENDED = {"tree importance"}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.extended) if case in EXTENDED else case for case in CASES])
def test_first_two_tokens_match_target(tiny_drafters, case):
    names, speculation, params, samples = CASES[case]
    engine = make_engine(tiny_drafters, names, speculation, batched=True)
    prompt_ids = engine.tokenizer(PROMPT)["input_ids"]
    joint = exact_two_token_probs(engine.tiers[0].model, engine.vocab_size, prompt_ids, params)
    counts = sample_first_two(engine, prompt_ids, params, samples)
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"{case}: chi-square p={p_value:.2e} over {samples} samples"
    if params.top_k or params.top_p < 1.0:
        # every sampled pair lies inside the warped support (top-k / top-p mask)
        assert all(joint[a, b] > 0 for a, b in counts), "a token outside the top-k/top-p mask was emitted"


def test_chi_square_detects_a_wrong_sampler(tiny_family):
    """The instrument itself: the same check must reject samples from a different distribution."""
    engine = make_engine(tiny_family, ["target"], {})
    prompt_ids = engine.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=1.0)
    joint = exact_two_token_probs(engine.tiers[0].model, engine.vocab_size, prompt_ids, params)
    wrong = exact_two_token_probs(engine.tiers[0].model, engine.vocab_size, prompt_ids, SamplingParams(temperature=1.3))
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(wrong.flatten(), 3000, replacement=True, generator=generator)
    counts = collections.Counter(divmod(int(d), joint.shape[1]) for d in draws)
    assert chi_square_p_value(counts, joint, 3000) < ALPHA
