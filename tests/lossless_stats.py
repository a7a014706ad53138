"""Statistical instruments shared by the losslessness tests (embedded and distributed).

Exact reference: P(x1, x2) = p_target(x1 | prompt) * p_target(x2 | prompt, x1), computed from
the target model itself (one batched forward over every x1). A chi-square test compares the
sampled counts of the first two tokens with it; cells with expected count < MIN_EXPECTED are
pooled into one cell. A test fails only if p < ALPHA: a correct sampler fails with
probability ALPHA per configuration.
"""

from __future__ import annotations

import collections

import torch
from scipy.stats import chisquare

from polyspec.workers.core.sampling import SamplingParams, warp_logits

ALPHA = 1e-3
MIN_EXPECTED = 5.0


def exact_two_token_probs(model, vocab: int, prompt_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V] joint probability of the first two tokens under the warped target."""
    with torch.inference_mode():
        first = warp_logits(model(torch.tensor([prompt_ids])).logits[0, -1, :vocab], params)  # [V]
        batch = torch.tensor([prompt_ids + [x] for x in range(vocab)])  # [V, T+1]
        second = warp_logits(model(batch).logits[:, -1, :vocab], params)  # [V, V]
    return first[:, None] * second


def chi_square_p_value(counts: collections.Counter, joint: torch.Tensor, samples: int) -> float:
    expected = (joint * samples).flatten()
    big = (expected >= MIN_EXPECTED).nonzero().flatten().tolist()
    observed = [counts.get(divmod(cell, joint.shape[1]), 0) for cell in big]
    expected_big = [float(expected[cell]) for cell in big]
    rest_observed = samples - sum(observed)
    rest_expected = samples - sum(expected_big)
    if rest_expected > 1e-9:
        observed.append(rest_observed)
        expected_big.append(rest_expected)
    scale = sum(observed) / sum(expected_big)  # guard float drift in the totals
    return float(chisquare(observed, [e * scale for e in expected_big]).pvalue)


def exact_two_token_probs_top_k(model, vocab: int, prompt_ids: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """{(x1, x2): P} for a top-k warp (params.top_k > 0): only k first tokens are possible, so
    k sequences are scored instead of the whole vocabulary (a real model's 49k-152k rows)."""
    assert params.top_k > 0, "the sparse reference needs a top-k warp"
    with torch.inference_mode():
        first = warp_logits(model(torch.tensor([prompt_ids])).logits[0, -1, :vocab].float(), params)  # [V]
        support = first.nonzero().flatten().tolist()
        batch = torch.tensor([prompt_ids + [x] for x in support])  # [k, T+1]
        second = warp_logits(model(batch).logits[:, -1, :vocab].float(), params)  # [k, V]
    joint = {}
    for row, x1 in enumerate(support):
        for x2 in second[row].nonzero().flatten().tolist():
            joint[(x1, x2)] = float(first[x1] * second[row, x2])
    return joint


def chi_square_p_value_sparse(counts: collections.Counter, joint: dict[tuple[int, int], float], samples: int) -> float:
    """`chi_square_p_value` over a sparse reference; a sampled pair outside it fails outright (p = 0)."""
    if any(pair not in joint for pair in counts):
        return 0.0
    big = [pair for pair, p in joint.items() if p * samples >= MIN_EXPECTED]
    observed = [counts.get(pair, 0) for pair in big]
    expected = [joint[pair] * samples for pair in big]
    rest_expected = samples - sum(expected)
    if rest_expected > 1e-9:
        observed.append(samples - sum(observed))
        expected.append(rest_expected)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)
