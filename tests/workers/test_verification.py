"""Tests for the verification rules' references (tests/reference_verification.py): exact unit cases and statistical
losslessness checks.

Statistical conventions (all seeds fixed, so every outcome is deterministic):
- distributions: chi-square goodness of fit (scipy.stats.chisquare) over the target's
  support, failing below P_VALUE_THRESHOLD; a sample outside the support fails outright.
- rates: within NUM_STANDARD_ERRORS standard errors sqrt(a (1 - a) / n).
Sample sizes are the *_DRAWS constants below. Candidate tokens are drawn in bulk up front
(torch.multinomial costs ~20 us a call) but every trial calls the function under test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import scipy.optimize
import scipy.stats
import torch

import reference_verification as verification
from core_helpers import make_generator
from reference_verification import (
    MULTI_DRAFT_SCHEMES,
    NO_CANDIDATE_ACCEPTED,
    _importance_induced_distribution,
    _spectr_rho,
    draw_without_replacement,
    select_multi_draft,
    verify_chain,
    verify_greedy,
)

torch.set_num_threads(1)

SEED = 20240611
VOCAB = 8  # random-distribution tests
JOINT_VOCAB = 6  # joint test: VOCAB^2 cells
P_VALUE_THRESHOLD = 1e-3
NUM_STANDARD_ERRORS = 4.0
LP_TOLERANCE = 1e-6  # HiGHS feasibility tolerance and float32 rows summing to 1 +- 1e-7
DRAFT_SCALE = 2.0  # peakier drafts than targets: lower acceptance exercises the residual paths

CHAIN_DRAWS = 100_000  # verify_chain first-token distribution and acceptance rate (k = 1)
JOINT_DRAWS = 30_000  # verify_chain first two tokens (k = 2), 36 cells
MULTI_DRAFT_DRAWS = {2: 20_000, 3: 100_000}  # per (scheme, K); K = 3 at 100-300 us a call: ~20 s a scheme
MIXED_DRAFT_DRAWS = 20_000  # K = 3 candidates from different drafters
POOR_DRAFT_DRAWS = 5_000  # acceptance-rate comparisons; the gap to single-draft is ~14 SE
SMALL_DRAWS = 10_000  # k = 0 distribution, draw_without_replacement pair law (20 cells)
EXACT_TRIALS = 300  # deterministic properties checked trial by trial


# ---------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------


def _random_probs(
    shape: tuple[int, ...], generator: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    """Rows of softmax(scale * N(0, 1)) logits: full support, min prob well above 1e-3."""
    return torch.softmax(scale * torch.randn(shape, generator=generator), dim=-1)


def _assert_distributed_as(tokens: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Chi-square test of observed tokens [N] against a [V] distribution."""
    vocab = expected_probs.shape[-1]
    counts = torch.bincount(tokens.reshape(-1), minlength=vocab).double()  # [V]
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"samples outside the support: {counts.tolist()}"
    expected = expected_probs[support].double()
    expected = expected / expected.sum() * counts.sum()
    assert expected.min() >= 5, "cells too small for a chi-square test"
    p_value = scipy.stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert p_value > P_VALUE_THRESHOLD, (
        f"p = {p_value:.2e}; counts {counts.tolist()} vs {expected.tolist()}"
    )


def _assert_rate_close(successes: int, trials: int, expected_rate: float) -> None:
    standard_error = max(expected_rate * (1 - expected_rate) / trials, 1.0 / trials**2) ** 0.5
    rate = successes / trials
    assert abs(rate - expected_rate) <= NUM_STANDARD_ERRORS * standard_error, (rate, expected_rate)


def _standard_error(rate: float, trials: int) -> float:
    return max(rate * (1 - rate), 1.0 / trials) ** 0.5 / trials**0.5


def _iid_tuple_probs(draft_probs: torch.Tensor, num_candidates: int) -> dict[tuple[int, ...], float]:
    """P(ordered candidate tuple) for K i.i.d. draws from one [V] row."""
    vocab = draft_probs.shape[0]
    row = draft_probs.double().tolist()
    return {
        tup: math.prod(row[token] for token in tup)
        for tup in itertools.product(range(vocab), repeat=num_candidates)
    }


def _without_replacement_tuple_probs(
    draft_probs: torch.Tensor, num_candidates: int
) -> dict[tuple[int, ...], float]:
    """P(ordered tuple) for sequential draws without replacement from one [V] row."""
    row = draft_probs.double().tolist()
    probs = {}
    for tup in itertools.permutations(range(len(row)), num_candidates):
        prob, removed = 1.0, 0.0
        for token in tup:
            prob *= row[token] / (1.0 - removed)
            removed += row[token]
        probs[tup] = prob
    return probs


def _lp_optimal_acceptance(
    target_probs: torch.Tensor, tuple_probs: dict[tuple[int, ...], float]
) -> float:
    """Max P(output in candidate tuple) over lossless selection rules: a max-flow LP.

    Sources: ordered tuples with capacity P(tuple); sinks: tokens y with capacity
    target(y); a tuple may route only to its own tokens.
    """
    edges = [(source, token) for source, tup in enumerate(tuple_probs) for token in sorted(set(tup))]
    num_sources, vocab = len(tuple_probs), target_probs.shape[0]
    constraints = torch.zeros(num_sources + vocab, len(edges), dtype=torch.float64)
    for edge, (source, token) in enumerate(edges):
        constraints[source, edge] = 1.0
        constraints[num_sources + token, edge] = 1.0
    bounds = list(tuple_probs.values()) + target_probs.double().tolist()
    result = scipy.optimize.linprog(
        -torch.ones(len(edges)).numpy(),
        A_ub=constraints.numpy(),
        b_ub=bounds,
        bounds=(0, None),
        method="highs",
    )
    assert result.status == 0, result.message
    return -result.fun


def _min_cut_acceptance(target_probs: torch.Tensor, tuple_probs: dict[tuple[int, ...], float]) -> float:
    """min over token sets T of target(T) + P(tuple not inside T) (max-flow = min-cut)."""
    vocab = target_probs.shape[0]
    total = sum(tuple_probs.values())  # 1 up to float32 rounding of the draft row
    best = float("inf")
    for size in range(vocab + 1):
        for subset in itertools.combinations(range(vocab), size):
            inside = set(subset)
            prob_inside = sum(prob for tup, prob in tuple_probs.items() if set(tup) <= inside)
            best = min(best, float(target_probs[list(subset)].sum()) + total - prob_inside)
    return best


def _draw_candidates(
    scheme: str, draft_probs: torch.Tensor, num_trials: int, generator: torch.Generator
) -> torch.Tensor:
    """[num_trials, K] candidates drawn the way `scheme` requires."""
    num_candidates = draft_probs.shape[0]
    if scheme == "rsd":  # without replacement, by the drafter's own Gumbel-top-k
        draws = [draw_without_replacement(draft_probs[0], num_candidates, generator) for _ in range(num_trials)]
        return torch.stack(draws)
    # candidate j ~ draft_probs[j] independently (i.i.d. when rows are equal)
    draws = torch.multinomial(draft_probs, num_trials, replacement=True, generator=generator)  # [K, N]
    return draws.T.contiguous()


def _run_multi_draft(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, scheme: str, num_trials: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns candidates [N, K], output tokens [N], accepted indices [N]."""
    generator = make_generator(seed)
    candidates = _draw_candidates(scheme, draft_probs, num_trials, generator)  # [N, K]
    outcomes = [
        select_multi_draft(target_probs, draft_probs, candidates[trial], scheme, generator)
        for trial in range(num_trials)
    ]
    tokens, accepted = torch.tensor(outcomes).T  # [N], [N]
    return candidates, tokens, accepted


# ---------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target_argmax", "draft_tokens", "expected"),
    [
        ([4, 5, 6, 7], [4, 5, 6], (3, 7)),  # all accepted -> bonus
        ([4, 5, 6, 7], [1, 5, 6], (0, 4)),  # first rejected; later matches do not count
        ([4, 5, 6, 7], [4, 9, 6], (1, 5)),  # correction at position 1
        ([4, 5, 6, 7], [4, 5, 0], (2, 6)),
        ([3], [], (0, 3)),  # k = 0
    ],
)
def test_verify_greedy(target_argmax, draft_tokens, expected):
    result = verify_greedy(torch.tensor(target_argmax), torch.tensor(draft_tokens, dtype=torch.long))
    assert result == expected


def test_verify_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([1, 2]), torch.tensor([1, 2]))


# ---------------------------------------------------------------------------------
# chain speculative sampling
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_k1_run():
    """CHAIN_DRAWS trials of verify_chain with k = 1, draft token ~ draft row each trial."""
    generator = make_generator(SEED)
    target_probs = _random_probs((2, VOCAB), generator)  # [2, V]
    draft_probs = _random_probs((1, VOCAB), generator)  # [1, V]
    draft_tokens = torch.multinomial(draft_probs[0], CHAIN_DRAWS, True, generator=generator)  # [N]
    outcomes = [
        verify_chain(target_probs, draft_probs, draft_tokens[trial : trial + 1], generator)
        for trial in range(CHAIN_DRAWS)
    ]
    num_accepted, next_tokens = torch.tensor(outcomes).T  # [N], [N]
    return target_probs, draft_probs, draft_tokens, num_accepted, next_tokens


def test_verify_chain_first_token_is_target_distributed(chain_k1_run):
    target_probs, _, draft_tokens, num_accepted, next_tokens = chain_k1_run
    first_tokens = torch.where(num_accepted == 1, draft_tokens, next_tokens)  # [N]
    _assert_distributed_as(first_tokens, target_probs[0])
    # after an accepted draft the bonus comes from the next target row
    _assert_distributed_as(next_tokens[num_accepted == 1], target_probs[1])


def test_verify_chain_acceptance_rate_is_sum_of_min(chain_k1_run):
    target_probs, draft_probs, _, num_accepted, _ = chain_k1_run
    expected_rate = float(torch.minimum(target_probs[0], draft_probs[0]).sum())
    _assert_rate_close(int(num_accepted.sum()), CHAIN_DRAWS, expected_rate)


def test_verify_chain_joint_of_first_two_tokens():
    """Markov target and draft (row depends on the previous token), k = 2, JOINT_DRAWS runs.

    A run calls verify_chain rounds until two tokens are emitted; the pair must be
    distributed as target_first(a) * target_next[a](b).
    """
    generator = make_generator(SEED + 1)
    vocab = JOINT_VOCAB
    # row 0: first position; row 1 + a: next-token row after token a
    target_rows = _random_probs((vocab + 1, vocab), generator)  # [V+1, V]
    draft_rows = _random_probs((vocab + 1, vocab), generator)  # [V+1, V]
    # draws from one row are i.i.d., so each row gets a pool consumed in order;
    # a run uses row 0 at most once and any other row at most 3 times
    pools = [
        iter(torch.multinomial(row, 3 * JOINT_DRAWS, True, generator=generator).tolist())
        for row in draft_rows
    ]

    pair_ids = []
    for _ in range(JOINT_DRAWS):
        emitted: list[int] = []
        while len(emitted) < 2:
            row = 0 if not emitted else 1 + emitted[-1]
            first = next(pools[row])
            second = next(pools[1 + first])
            rows = torch.tensor([row, 1 + first, 1 + second])
            num_accepted, next_token = verify_chain(
                target_rows[rows], draft_rows[rows[:2]], torch.tensor([first, second]), generator
            )
            emitted += [first, second][:num_accepted] + [next_token]
        pair_ids.append(emitted[0] * vocab + emitted[1])

    joint = (target_rows[0][:, None] * target_rows[1:]).reshape(-1)  # [V*V]
    _assert_distributed_as(torch.tensor(pair_ids), joint)


def test_verify_chain_draft_equal_to_target_accepts_everything():
    generator = make_generator(SEED + 2)
    num_drafts = 5
    target_probs = _random_probs((num_drafts + 1, VOCAB), generator)  # [k+1, V]
    draft_probs = target_probs[:num_drafts].clone()  # [k, V]
    for _ in range(EXACT_TRIALS):
        draft_tokens = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1)  # [k]
        num_accepted, _ = verify_chain(target_probs, draft_probs, draft_tokens, generator)
        assert num_accepted == num_drafts


def test_verify_chain_bonus_only_when_all_accepted():
    """Bonus row supported on {V-2, V-1}, every other row on the rest: the emitted
    next token reveals which row it came from."""
    generator = make_generator(SEED + 3)
    num_drafts = 2
    bonus_tokens = {VOCAB - 2, VOCAB - 1}
    target_probs = torch.zeros(num_drafts + 1, VOCAB)  # [k+1, V]
    target_probs[:num_drafts, : VOCAB - 2] = _random_probs((num_drafts, VOCAB - 2), generator)
    target_probs[num_drafts, VOCAB - 2 :] = torch.tensor([0.3, 0.7])
    draft_probs = torch.zeros(num_drafts, VOCAB)  # [k, V]
    draft_probs[:, : VOCAB - 2] = _random_probs((num_drafts, VOCAB - 2), generator)
    seen_accepted = set()
    for _ in range(EXACT_TRIALS):
        draft_tokens = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1)  # [k]
        num_accepted, next_token = verify_chain(target_probs, draft_probs, draft_tokens, generator)
        assert (next_token in bonus_tokens) == (num_accepted == num_drafts)
        seen_accepted.add(num_accepted)
    assert seen_accepted == {0, 1, 2}


def test_verify_chain_k_zero_samples_target():
    generator = make_generator(SEED + 4)
    target_probs = _random_probs((1, VOCAB), generator)  # [1, V]
    no_drafts = torch.zeros(0, VOCAB)
    no_tokens = torch.zeros(0, dtype=torch.long)
    outcomes = [verify_chain(target_probs, no_drafts, no_tokens, generator) for _ in range(SMALL_DRAWS)]
    num_accepted, tokens = torch.tensor(outcomes).T
    assert (num_accepted == 0).all()
    _assert_distributed_as(tokens, target_probs[0])


def test_verify_chain_rejects_zero_draft_probability_token():
    generator = make_generator(SEED + 5)
    target_probs = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.3, 0.5]])  # [2, 3]
    draft_probs = torch.tensor([[0.0, 0.5, 0.5]])  # token 0 impossible under the draft
    for _ in range(EXACT_TRIALS):
        num_accepted, next_token = verify_chain(target_probs, draft_probs, torch.tensor([0]), generator)
        # residual = norm(max(0, target - draft)) = one-hot at token 0
        assert (num_accepted, next_token) == (0, 0)


def test_verify_chain_identical_rows_with_impossible_draft_falls_back_to_target():
    """Residual all zero (target == draft) after rejecting a zero-probability draft."""
    generator = make_generator(SEED + 6)
    target_probs = torch.tensor([[0.0, 0.4, 0.6], [1.0, 0.0, 0.0]])
    draft_probs = target_probs[:1].clone()
    for _ in range(EXACT_TRIALS):
        num_accepted, next_token = verify_chain(target_probs, draft_probs, torch.tensor([0]), generator)
        assert num_accepted == 0 and next_token in (1, 2)


def test_verify_chain_rejects_bad_shapes():
    with pytest.raises(ValueError):
        verify_chain(torch.rand(2, 5), torch.rand(2, 5), torch.tensor([1]), make_generator(0))
    with pytest.raises(ValueError):
        verify_chain(torch.rand(2, 5), torch.rand(1, 4), torch.tensor([1]), make_generator(0))


def test_same_seed_gives_same_results():
    setup = make_generator(SEED + 7)
    target_probs = _random_probs((4, VOCAB), setup)
    draft_probs = _random_probs((3, VOCAB), setup)
    draft_tokens = torch.multinomial(draft_probs, 1, generator=setup).squeeze(1)

    def chain_outcomes(seed: int) -> list[tuple[int, int]]:
        generator = make_generator(seed)
        return [verify_chain(target_probs, draft_probs, draft_tokens, generator) for _ in range(50)]

    def multi_draft_outcomes(scheme: str, seed: int) -> list[tuple[int, int]]:
        generator = make_generator(seed)
        rows = draft_probs[:1].expand(3, VOCAB)
        candidates = _draw_candidates(scheme, rows, 50, generator)
        return [
            select_multi_draft(target_probs[0], rows, tokens, scheme, generator) for tokens in candidates
        ]

    assert chain_outcomes(11) == chain_outcomes(11)
    assert chain_outcomes(11) != chain_outcomes(12)
    for scheme in MULTI_DRAFT_SCHEMES:
        assert multi_draft_outcomes(scheme, 11) == multi_draft_outcomes(scheme, 11), scheme


# ---------------------------------------------------------------------------------
# multi-draft selection
# ---------------------------------------------------------------------------------


# every scheme with 2 candidates by default; 3 candidates (minutes of draws) with -m extended
@pytest.fixture(scope="module", params=[pytest.param((s, k), marks=[pytest.mark.extended] if k == 3 else [])
                                        for s in MULTI_DRAFT_SCHEMES for k in (2, 3)], ids=str)
def multi_draft_run(request):
    """MULTI_DRAFT_DRAWS trials of one scheme with K candidates from one draft row q."""
    scheme, num_candidates = request.param
    generator = make_generator(SEED + 10)
    target_probs = _random_probs((VOCAB,), generator)  # [V]
    draft_row = _random_probs((1, VOCAB), generator, DRAFT_SCALE)  # [1, V]
    draft_probs = draft_row.expand(num_candidates, VOCAB)  # [K, V]
    candidates, tokens, accepted = _run_multi_draft(
        target_probs, draft_probs, scheme, MULTI_DRAFT_DRAWS[num_candidates], seed=SEED + 11 + num_candidates
    )
    return scheme, target_probs, draft_probs, candidates, tokens, accepted


def test_multi_draft_output_is_target_distributed(multi_draft_run):
    _, target_probs, _, _, tokens, _ = multi_draft_run
    _assert_distributed_as(tokens, target_probs)


def test_multi_draft_accepted_index_names_the_output(multi_draft_run):
    _, _, draft_probs, candidates, tokens, accepted = multi_draft_run
    num_candidates = draft_probs.shape[0]
    assert ((accepted >= NO_CANDIDATE_ACCEPTED) & (accepted < num_candidates)).all()
    hit = accepted >= 0
    assert hit.any() and (~hit).any()
    assert (candidates[hit, accepted[hit]] == tokens[hit]).all()


def test_multi_draft_acceptance_at_most_lp_optimum(multi_draft_run):
    scheme, target_probs, draft_probs, _, _, accepted = multi_draft_run
    num_candidates = draft_probs.shape[0]
    if scheme == "rsd":
        tuple_probs = _without_replacement_tuple_probs(draft_probs[0], num_candidates)
    else:
        tuple_probs = _iid_tuple_probs(draft_probs[0], num_candidates)
    optimum = _lp_optimal_acceptance(target_probs, tuple_probs)
    assert optimum == pytest.approx(_min_cut_acceptance(target_probs, tuple_probs), abs=LP_TOLERANCE)
    rate = float((accepted >= 0).double().mean())
    assert rate <= optimum + NUM_STANDARD_ERRORS * _standard_error(rate, MULTI_DRAFT_DRAWS[num_candidates])


@pytest.mark.parametrize("scheme", ["specinfer", "importance"])
def test_different_draft_rows_per_candidate(scheme):
    """K = 3 candidates from three different drafters, MIXED_DRAFT_DRAWS trials."""
    generator = make_generator(SEED + 20)
    target_probs = _random_probs((VOCAB,), generator)  # [V]
    draft_probs = _random_probs((3, VOCAB), generator, DRAFT_SCALE)  # [K, V], one drafter per candidate
    _, tokens, _ = _run_multi_draft(
        target_probs, draft_probs, scheme, MIXED_DRAFT_DRAWS, seed=SEED + 21
    )
    _assert_distributed_as(tokens, target_probs)


POOR_TARGET = torch.tensor([0.45, 0.45, 0.05, 0.05])
POOR_DRAFT = torch.tensor([0.05, 0.05, 0.45, 0.45])  # single-draft acceptance sum(min) = 0.2


@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
def test_poor_drafts_acceptance_vs_single_draft_and_lp(scheme):
    """V = 4, K = 2 i.i.d. (without replacement for rsd) drafts that cover the target badly."""
    num_candidates = 2
    draft_probs = POOR_DRAFT.expand(num_candidates, 4)
    if scheme == "rsd":
        tuple_probs = _without_replacement_tuple_probs(POOR_DRAFT, num_candidates)
    else:
        tuple_probs = _iid_tuple_probs(POOR_DRAFT, num_candidates)
    optimum = _lp_optimal_acceptance(POOR_TARGET, tuple_probs)
    assert optimum == pytest.approx(_min_cut_acceptance(POOR_TARGET, tuple_probs), abs=LP_TOLERANCE)

    _, _, accepted = _run_multi_draft(
        POOR_TARGET, draft_probs, scheme, POOR_DRAFT_DRAWS, seed=SEED + 30
    )
    rate = float((accepted >= 0).double().mean())
    margin = NUM_STANDARD_ERRORS * _standard_error(rate, POOR_DRAFT_DRAWS)
    assert rate <= optimum + margin
    single_draft_rate = float(torch.minimum(POOR_TARGET, POOR_DRAFT).sum())
    if scheme in ("importance", "spectr"):
        assert rate > single_draft_rate + margin, (rate, single_draft_rate, optimum)


def test_importance_induced_distribution_matches_enumeration():
    """Exact check of the r_j recursion, different rows per candidate, against brute force
    over every candidate tuple and every accept/stay path of the Barker chain."""
    generator = make_generator(SEED + 40)
    vocab, num_candidates = 5, 3
    target_probs = _random_probs((vocab,), generator)  # [V]
    draft_probs = _random_probs((num_candidates, vocab), generator, scale=2.0)  # [K, V]
    draft_probs[1, 0] = 0.0  # a token one drafter never proposes
    draft_probs[1] /= draft_probs[1].sum()
    target_list, draft_list = target_probs.double().tolist(), draft_probs.double().tolist()

    def move_prob(state: int, proposal: int, row: list[float]) -> float:
        forward = target_list[proposal] * row[state]
        total = forward + target_list[state] * row[proposal]
        return forward / total if total > 0 else 0.5

    expected = [0.0] * vocab
    for tup in itertools.product(range(vocab), repeat=num_candidates):
        tuple_prob = 1.0
        for index, token in enumerate(tup):
            tuple_prob *= draft_list[index][token]
        state_probs = {tup[0]: 1.0}  # token -> probability along the chain
        for index in range(1, num_candidates):
            moved = {}
            for state, prob in state_probs.items():
                move = move_prob(state, tup[index], draft_list[index])
                moved[tup[index]] = moved.get(tup[index], 0.0) + prob * move
                moved[state] = moved.get(state, 0.0) + prob * (1 - move)
            state_probs = moved
        for token, prob in state_probs.items():
            expected[token] += tuple_prob * prob

    induced = _importance_induced_distribution(target_probs, draft_probs)
    assert torch.allclose(induced, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("num_candidates", [1, 2, 3, 5])
def test_spectr_rho_is_smallest_feasible(num_candidates):
    generator = make_generator(SEED + 50 + num_candidates)
    target_row = _random_probs((VOCAB,), generator).double()
    draft_row = _random_probs((VOCAB,), generator, scale=2.0).double()

    def slack(rho: float) -> float:  # >= 0 iff rho is feasible
        beta = float(torch.minimum(draft_row, target_row / rho).sum())
        return rho * beta - (1.0 - (1.0 - beta) ** num_candidates)

    rho = _spectr_rho(target_row, draft_row, num_candidates)
    assert 1.0 <= rho <= num_candidates
    assert slack(float(num_candidates)) >= 0
    assert slack(rho) >= 0
    if rho > 1.0:
        assert slack(rho - 1e-9) < 0


def test_multi_draft_identical_target_and_draft_accepts_first_candidate():
    generator = make_generator(SEED + 60)
    target_probs = _random_probs((VOCAB,), generator)
    draft_probs = target_probs.expand(3, VOCAB)
    for scheme in ("specinfer", "rsd", "spectr"):  # importance may move the chain first
        candidates = _draw_candidates(scheme, draft_probs, 50, generator)
        for tokens in candidates:
            outcome = select_multi_draft(target_probs, draft_probs, tokens, scheme, generator)
            assert outcome == (int(tokens[0]), 0), scheme


def test_spectr_disjoint_supports_samples_target():
    generator = make_generator(SEED + 61)
    target_probs = torch.tensor([0.5, 0.5, 0.0, 0.0])
    draft_probs = torch.tensor([0.0, 0.0, 0.5, 0.5]).expand(2, 4)
    for _ in range(EXACT_TRIALS):
        candidates = torch.tensor([2, 3])
        token, index = select_multi_draft(target_probs, draft_probs, candidates, "spectr", generator)
        assert index == NO_CANDIDATE_ACCEPTED and token in (0, 1)


# ---------------------------------------------------------------------------------
# draw_without_replacement
# ---------------------------------------------------------------------------------


def test_draw_without_replacement_pair_law():
    """Ordered pairs ~ q(a) q(b) / (1 - q(a)), SMALL_DRAWS draws, V = 5 (20 cells)."""
    generator = make_generator(SEED + 70)
    vocab = 5
    draft_probs = _random_probs((vocab,), generator)
    draws = [draw_without_replacement(draft_probs, 2, generator) for _ in range(SMALL_DRAWS)]
    pairs = torch.stack(draws)  # [N, 2]
    assert (pairs[:, 0] != pairs[:, 1]).all()
    pair_probs = torch.zeros(vocab * vocab)
    for (first, second), prob in _without_replacement_tuple_probs(draft_probs, 2).items():
        pair_probs[first * vocab + second] = prob
    _assert_distributed_as(pairs[:, 0] * vocab + pairs[:, 1], pair_probs)


def test_draw_without_replacement_only_from_support():
    generator = make_generator(SEED + 71)
    draft_probs = torch.tensor([0.0, 0.6, 0.0, 0.4, 0.0])
    for _ in range(EXACT_TRIALS):
        tokens = draw_without_replacement(draft_probs, 4, generator)
        assert sorted(tokens.tolist()) == [1, 3]


# ---------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------


def test_select_multi_draft_errors():
    target_probs = torch.full((4,), 0.25)
    draft_probs = torch.full((2, 4), 0.25)
    tokens = torch.tensor([0, 1])
    generator = make_generator(0)
    with pytest.raises(ValueError, match="unknown multi-draft scheme"):
        select_multi_draft(target_probs, draft_probs, tokens, "typical", generator)
    with pytest.raises(ValueError):  # K == 0
        no_tokens = torch.zeros(0, dtype=torch.long)
        select_multi_draft(target_probs, torch.zeros(0, 4), no_tokens, "specinfer", generator)
    with pytest.raises(ValueError):  # K mismatch
        select_multi_draft(target_probs, draft_probs, torch.tensor([0, 1, 2]), "specinfer", generator)
    with pytest.raises(ValueError):  # V mismatch
        select_multi_draft(torch.full((5,), 0.2), draft_probs, tokens, "importance", generator)
    different_rows = torch.tensor([[0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
    for scheme in ("rsd", "spectr"):
        with pytest.raises(ValueError, match="same distribution"):
            select_multi_draft(target_probs, different_rows, tokens, scheme, generator)
    with pytest.raises(ValueError, match="distinct"):
        select_multi_draft(target_probs, draft_probs, torch.tensor([1, 1]), "rsd", generator)


def test_importance_induced_distribution_chunked_equals_whole(monkeypatch):
    """Row blocks (used when the draft support is large) give the same induced law."""
    generator = make_generator(SEED + 80)
    target_probs = _random_probs((VOCAB,), generator)  # [V]
    draft_probs = _random_probs((3, VOCAB), generator, DRAFT_SCALE)  # [K, V]
    whole = _importance_induced_distribution(target_probs, draft_probs)
    monkeypatch.setattr(verification, "INDUCED_CHUNK_ELEMENTS", 3 * VOCAB)  # 3-row blocks
    chunked = _importance_induced_distribution(target_probs, draft_probs)
    assert torch.allclose(whole, chunked, atol=1e-14)
    assert float(whole.sum()) == pytest.approx(1.0, abs=1e-6)


def test_a_lookup_chain_without_draft_rows_is_verified_against_point_masses():
    """A lookup's proposals carry no draft rows: the runtime's verdict (`verify_blocks`) checks them as one-hot rows,
    drawing exactly what it draws given those rows (the same generator state)."""
    import torch

    from polyspec.workers.core.sampling import SamplingParams
    from polyspec.workers.core.tree import Blocks, DraftTree
    from polyspec.workers.core.verdicts import ScoredRows, verify_blocks

    target_probs = torch.softmax(torch.randn(4, 11, generator=torch.Generator().manual_seed(3)), dim=-1)  # [k + 1, V]
    tokens = [2, 7, 5]
    rows = torch.nn.functional.one_hot(torch.tensor(tokens), 11).float()
    sampled = SamplingParams(temperature=1.0)
    verdicts = set()
    for seed in range(20):
        got = verify_blocks(ScoredRows.of([target_probs]), Blocks.of([DraftTree.chain(tokens, None)]), [sampled], [torch.Generator().manual_seed(seed)],
                            "specinfer")[0]
        given = verify_blocks(ScoredRows.of([target_probs]), Blocks.of([DraftTree.chain(tokens, rows)]), [sampled], [torch.Generator().manual_seed(seed)],
                              "specinfer")[0]
        assert got == given
        verdicts.add((len(got.path), got.next_token))
    assert len(verdicts) > 1  # the seeds do draw differently: the equality above is not one fixed verdict


def test_a_calls_verdicts_are_device_tensors_with_offsets():
    """`verify_blocks` over a greedy chain, a tree, a sampled chain and an empty block at once: the accepted paths
    flattened with offsets and the next tokens, as tensors on the rows' device, read per request as each request's
    verdict alone."""
    from polyspec.workers.core.sampling import SamplingParams
    from polyspec.workers.core.tree import Blocks, DraftTree
    from polyspec.workers.core.verdicts import ScoredRows, Verdicts, verify_blocks

    vocab = 11
    torch.manual_seed(0)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    target = torch.softmax(torch.randn(4, vocab), -1)
    blocks = [DraftTree.chain([int(target[0].argmax()), int(target[1].argmax()), 3], None),
              DraftTree([int(target[0].argmax()), 5, 6], [-1, -1, 0], None),
              DraftTree.chain([2, 7], torch.softmax(torch.randn(2, vocab), -1)),
              DraftTree([], [], None)]
    scored = [target[: len(b) + 1] for b in blocks]
    params = [greedy, greedy, sampled, greedy]
    verdicts = verify_blocks(ScoredRows.of(scored), Blocks.of(blocks), params, [torch.Generator().manual_seed(r) for r in range(4)], "specinfer")
    assert isinstance(verdicts, Verdicts) and verdicts.paths.device == target.device and len(verdicts) == 4
    alone = [verify_blocks(ScoredRows.of([s]), Blocks.of([b]), [p], [torch.Generator().manual_seed(r)], "specinfer")[0]
             for r, (s, b, p) in enumerate(zip(scored, blocks, params))]
    assert [(v.path, v.next_token) for v in verdicts] == [(v.path, v.next_token) for v in alone]
    lengths = [len(v.path) for v in alone]
    assert verdicts.offsets.tolist() == [0] + list(itertools.accumulate(lengths))
    assert verdicts.paths.tolist() == [node for v in alone for node in v.path]
    assert verdicts.next_tokens.tolist() == [v.next_token for v in alone]
    assert alone[0].path[:2] == [0, 1] and alone[1].path[:1] == [0] and alone[3].path == []
