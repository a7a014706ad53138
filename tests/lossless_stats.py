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
