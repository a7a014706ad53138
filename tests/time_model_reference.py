"""Reference forms of the time model that only the tests use.

The textbook form of the cost, C_i = (t_i(k_i+1) + k_i C_{i+1}) / E_i(k_i), with every block
exactly k tokens: the scheduler's model (polyspec.harness.time_model /
chain_model) must reproduce it where the two coincide (one stage, a drafter's own table).
And small inverses and wrappers of the model's functions that the tests check it with.
"""

from __future__ import annotations

from typing import Sequence

from polyspec.harness.chain_model import round_models
from polyspec.harness.time_model import (
    AHEAD_THRESHOLD,
    LatencyTable,
    RoundModel,
    StageSpec,
    expected_emitted,
    latency,
    pipelined_round,
    pipelined_shape,
    whole_probability,
)


def expected_emitted_scalar(rate: float, k: int) -> float:
    """E(k) for one acceptance rate at every position: (1 - a^(k+1)) / (1 - a)."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def tree_accept_rates(first_rate_with_width: float, chain_rates: Sequence[float]) -> list[float]:
    """Per-position rates of a tree of candidate chains: the first position is accepted if any
    of the candidates is (measured with that many candidates); deeper ones follow the chain."""
    deeper = list(chain_rates[1:]) if len(chain_rates) > 1 else list(chain_rates)
    return [first_rate_with_width] + deeper


def ideal_stage_cost(stage: StageSpec, length: int, below_ms: float) -> float:
    """C_i = (t_i(k+1) + cost of the k-token block) / E_i(k); `below_ms` is that block's cost."""
    rates = stage.at_length(length).accept_rates
    return (latency(stage.forward_ms, length + 1) + below_ms) / expected_emitted(rates, length)


def ideal_cost_per_token(stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int]) -> float:
    """C_0 of the textbook form (stages target first, one length per stage), bottom-up."""
    assert len(stages) == len(lengths) >= 1
    per_token = None  # C_{i+1}
    for stage, length in zip(reversed(stages), reversed(lengths)):
        below_ms = latency(draft_ms, length) if per_token is None else length * per_token
        per_token = ideal_stage_cost(stage, length, below_ms)
    return per_token


def ideal_bottom_up(stages: Sequence[StageSpec], draft_ms: LatencyTable, max_length: int) -> tuple[list[int], float]:
    """Optimal lengths of the ideal form: C_i grows with C_{i+1} for any k_i, so choosing
    k_{n-2}, then k_{n-3} given it, ... minimises C_0 exactly. Returns (lengths, C_0)."""
    lengths: list[int] = []
    per_token = None
    for stage in reversed(stages):
        costs = {
            k: ideal_stage_cost(stage, k, latency(draft_ms, k) if per_token is None else k * per_token)
            for k in range(1, max_length + 1)
        }
        best = min(costs, key=costs.get)
        lengths.insert(0, best)
        per_token = costs[best]
    return lengths, per_token


def best_stage_cost(stage: StageSpec, below_ms_per_token: float, max_length: int) -> tuple[int, float]:
    """min over k of (t_i(k+1) + k * C_below) / E(k): (k*, cost per token)."""
    costs = {k: ideal_stage_cost(stage, k, k * below_ms_per_token) for k in range(1, max_length + 1)}
    best = min(costs, key=costs.get)
    return best, costs[best]


def tier_pays_off(direct: StageSpec, via: StageSpec, direct_below_ms: float, via_below_ms: float, max_length: int) -> bool:
    """The textbook insertion / bypass condition for a tier m between i and i+1.

    `direct`: tier i verifying i+1 (acceptance a_{i,i+1}); `via`: tier i verifying m
    (acceptance a_{i,m}); `*_below_ms`: C_{i+1}* and C_m* per token. True iff inserting m
    (equivalently, not bypassing it) lowers tier i's best cost per token."""
    return best_stage_cost(via, via_below_ms, max_length)[1] < best_stage_cost(direct, direct_below_ms, max_length)[1]


def fitted_slowdown(measured_ms: float, block_ms: float, forward_ms: float) -> float:
    """The slow-down that makes `contended_block_ms(block_ms, forward_ms, s)` = `measured_ms`
    (the inverse, clamped to 1/3..3)."""
    if block_ms <= 0:
        return 1.0
    if measured_ms <= forward_ms:  # (the block fitted in the overlap iff it ended within it)
        return min(max(measured_ms / block_ms, 1.0 / 3), 3.0)
    shared = (measured_ms - block_ms) / forward_ms  # = 1 - 1 / s
    return min(max(1.0 / (1.0 - shared), 1.0 / 3), 3.0) if shared < 2.0 / 3 else 3.0


def pipelined_round_model(stage: StageSpec, block_pmf: Sequence[float], block_ms: float, bet: bool = False) -> RoundModel | None:
    """A round of a draft-ahead stage (docs/time-model.md), or None when its drafter would
    not bet on whole blocks (then the stage runs as in serial mode; `round_model` mixes the
    two by `ahead_share`).

    While the verifier scores block n the drafter drafts block n+1, betting that n is accepted
    whole (P = P[A = L]). Accepted whole: the next block is ready after max(t + o, D) and the
    round emits L tokens (no bonus: the drafter's continuation is verified next, and the
    next forward covers L new tokens, not L + 1). Otherwise the draft-ahead work is lost and
    the next block costs D after the verdict: t + o + D, and the round emits A + 1 tokens.
    By renewal-reward, with outcomes independent from block to block:

        round_ms = P * E[max(t_avg + o, D_ahead)] + (1 - P) * (t_avg + o + D)
        t_avg    = P * t(L) + (1 - P) * t(L + 1)      (the previous round's outcome)
        D_ahead  = contended_block_ms(D, t_avg + o, s)  (drafted beside the verifier)

    (with L the tokens really proposed: fill * L for a drafter that proposes less than asked;
    E[max] of two normal times with the stage's `jitter_cv`, `expected_max`)
    """
    whole = whole_probability(tuple(stage.accept_rates), block_pmf)
    if whole < AHEAD_THRESHOLD and not bet:  # `bet`: the round as it runs when the drafter does bet
        return None
    emitted, forward_ms = pipelined_shape(stage, block_pmf, whole)
    return pipelined_round(stage, whole, emitted, forward_ms, block_ms)


def cost_per_token(stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int], tree_width: int = 1) -> float:
    """C_0 as the scheduler runs the chain, far from max_new_tokens (ms per target token)."""
    return round_models(stages, draft_ms, lengths, tree_width)[0].ms_per_token
