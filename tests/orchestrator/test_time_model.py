"""The time model: hand-computed small cases, the optimiser, the bypass condition."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from polyspec.harness.time_model import StageSpec, accepted_pmf, expected_emitted, first_passage, latency
from polyspec.harness.chain_model import chain_cost, first_round_ms, generation_ms, round_models, search_lengths
from time_model_reference import best_stage_cost, cost_per_token, expected_emitted_scalar, ideal_bottom_up, ideal_cost_per_token, tier_pays_off, tree_accept_rates

TARGET_MS = {m: 10.0 + m for m in range(1, 40)}  # t_0(m) = 10 + m
MID_MS = {m: 4.0 for m in range(1, 40)}  # t_1(m) = 4
DRAFT_MS = {k: 1.0 * k for k in range(1, 40)}  # a model drafter: k forwards of 1 ms


def test_expected_emitted_by_hand():
    assert expected_emitted([0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_emitted([0.8, 0.5], 2) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert expected_emitted([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)  # the last rate repeats
    assert expected_emitted([0.3], 0) == 1.0
    assert expected_emitted_scalar(0.5, 2) == pytest.approx(1.75)
    assert expected_emitted_scalar(1.0, 4) == 5.0
    for rate, k in itertools.product([0.0, 0.2, 0.7, 0.99], range(0, 9)):
        assert expected_emitted([rate], k) == pytest.approx(expected_emitted_scalar(rate, k))


def test_accepted_pmf_by_hand():
    assert accepted_pmf([0.8, 0.5], 2) == pytest.approx([0.2, 0.4, 0.4])
    pmf = accepted_pmf([0.9, 0.6, 0.3], 5)
    assert sum(pmf) == pytest.approx(1.0)
    assert sum((j + 1) * p for j, p in enumerate(pmf)) == pytest.approx(expected_emitted([0.9, 0.6, 0.3], 5))


def test_latency_table_interpolates():
    table = {1: 2.0, 3: 4.0, 5: 10.0}
    assert latency(table, 2) == 3.0
    assert latency(table, 7) == 16.0  # slope of the last segment
    assert latency({1: 5.0}, 9) == 5.0


def test_ideal_cost_by_hand():
    target = StageSpec(TARGET_MS, (0.5,))
    mid = StageSpec(MID_MS, (0.5,))
    # two tiers: (t_0(3) + 2 * C_1) / E(2) with C_1 = t_1(1) = 1
    assert ideal_cost_per_token([target], DRAFT_MS, [2]) == pytest.approx((13 + 2) / 1.75)
    # three tiers: C_1 = (4 + 1) / 1.5; C_0 = (13 + 2 C_1) / 1.75
    c1 = (4 + 1) / 1.5
    assert ideal_cost_per_token([target, mid], DRAFT_MS, [2, 1]) == pytest.approx((13 + 2 * c1) / 1.75)


def test_two_tiers_exact_equals_ideal():
    # with the bottom drafter right below, the scheduler's block is exactly k long
    stage = StageSpec(TARGET_MS, (0.9, 0.7, 0.5))
    for k in range(1, 9):
        assert cost_per_token([stage], DRAFT_MS, [k]) == pytest.approx(ideal_cost_per_token([stage], DRAFT_MS, [k]))


def test_first_passage_by_hand():
    totals, steps = first_passage([0.0, 0.5, 0.5], 2)
    assert totals == pytest.approx([0.0, 0.0, 0.75, 0.25])
    assert steps == pytest.approx(1.5)
    assert first_passage([0.0, 1.0], 0) == ([1.0], 0.0)


def test_middle_tier_overshoot_by_hand():
    # mid: k_1 = 1, acceptance 0.5 -> each mid round emits 1 or 2 tokens (1/2 each) for 4 + 1 ms.
    # target asks for 2: blocks of 2 (p 3/4) or 3 (1/4) after 1.5 mid rounds on average.
    target = StageSpec(TARGET_MS, (0.5,))
    mid = StageSpec(MID_MS, (0.5,))
    rounds = round_models([target, mid], DRAFT_MS, [2, 1])
    assert rounds[1].emitted_pmf == pytest.approx((0.0, 0.5, 0.5))
    assert rounds[1].round_ms == pytest.approx(5.0)
    block_ms = 1.5 * 5.0
    forward_ms = 0.75 * 13 + 0.25 * 14
    assert rounds[0].round_ms == pytest.approx(block_ms + forward_ms)
    emitted = 0.75 * expected_emitted([0.5], 2) + 0.25 * expected_emitted([0.5], 3)
    assert rounds[0].expected_emitted == pytest.approx(emitted)
    assert cost_per_token([target, mid], DRAFT_MS, [2, 1]) == pytest.approx((block_ms + forward_ms) / emitted)


def test_generation_ms_clips_the_last_rounds_by_hand():
    stage = StageSpec(TARGET_MS, (0.5,))
    # 1 token left: an empty block, t_0(1) = 11. 2 left: a 1-token block (1 + 12 ms) emitting
    # 1 (p 1/2, then 1 more to go) or 2 tokens.
    assert generation_ms([stage], DRAFT_MS, [2], 1) == pytest.approx(11.0)
    assert generation_ms([stage], DRAFT_MS, [2], 2) == pytest.approx(13.0 + 0.5 * 11.0)
    # far from the end, time per token tends to C_0
    long = generation_ms([stage], DRAFT_MS, [3], 2000) / 2000
    assert long == pytest.approx(cost_per_token([stage], DRAFT_MS, [3]), rel=2e-3)


def test_ideal_bottom_up_equals_brute_force():
    for rates in [((0.9,), (0.6,)), ((0.5, 0.8), (0.95, 0.9, 0.4)), ((0.2,), (0.99,))]:
        stages = [StageSpec(TARGET_MS, rates[0]), StageSpec(MID_MS, rates[1])]
        lengths, cost = ideal_bottom_up(stages, DRAFT_MS, 8)
        brute = min(itertools.product(range(1, 9), repeat=2), key=lambda ks: ideal_cost_per_token(stages, DRAFT_MS, ks))
        assert cost == pytest.approx(ideal_cost_per_token(stages, DRAFT_MS, brute))
        assert tuple(lengths) == brute


def test_search_lengths_bottom_up_matches_brute_force():
    cheap_draft = {k: 0.05 for k in range(1, 40)}  # an n-gram lookup
    for rates in [((0.9,), (0.6,)), ((0.5, 0.6, 0.7), (0.5, 0.8)), ((0.7,), (0.3,))]:
        stages = [StageSpec(TARGET_MS, rates[0]), StageSpec(MID_MS, rates[1])]
        brute, brute_cost = search_lengths(stages, cheap_draft, 8, exhaustive_limit=10_000)
        greedy, greedy_cost = search_lengths(stages, cheap_draft, 8, exhaustive_limit=0)
        assert greedy_cost == pytest.approx(brute_cost, rel=0.01), (rates, brute, greedy)


def test_bypass_condition():
    target = StageSpec(TARGET_MS, (0.6,))
    # a middle tier as slow as the target that agrees no better than the bottom: bypass it
    slow_mid_direct = StageSpec(TARGET_MS, (0.6,))
    c_bottom = 1.0
    k_mid, c_mid = best_stage_cost(slow_mid_direct, c_bottom, 8)
    assert not tier_pays_off(direct=target, via=StageSpec(TARGET_MS, (0.6,)), direct_below_ms=c_bottom, via_below_ms=c_mid, max_length=8)
    # a cheap middle tier that agrees far better with the target than the bottom does: keep it
    mid = StageSpec(MID_MS, (0.6,))
    _, c_mid = best_stage_cost(mid, c_bottom, 8)
    weak_direct = StageSpec(TARGET_MS, (0.3,))
    strong_via = StageSpec(TARGET_MS, (0.95,))
    assert tier_pays_off(direct=weak_direct, via=strong_via, direct_below_ms=c_bottom, via_below_ms=c_mid, max_length=8)
    # the condition is the ideal model's comparison of the two chains
    with_mid = ideal_bottom_up([strong_via, mid], {k: k * c_bottom for k in range(1, 40)}, 8)[1]
    without = ideal_bottom_up([weak_direct], {k: k * c_bottom for k in range(1, 40)}, 8)[1]
    assert with_mid < without


def test_tree_rates_and_cost():
    rates = tree_accept_rates(0.9, (0.6, 0.8, 0.8))
    assert rates == [0.9, 0.8, 0.8]
    assert expected_emitted(rates, 2) == pytest.approx(1 + 0.9 + 0.72)
    # a width-3 tree of depth 2: the verifier scores 6 nodes + 1
    stage = StageSpec(TARGET_MS, tuple(rates))
    rounds = round_models([stage], DRAFT_MS, [2], tree_width=3)
    assert rounds[0].round_ms == pytest.approx(DRAFT_MS[2] + TARGET_MS[7])


@pytest.fixture
def hard_bet(monkeypatch):
    """The runtime's bet as a hard switch at AHEAD_THRESHOLD (the formulas by hand below);
    `ahead_share` smooths it (test_the_bet_is_mixed_near_the_threshold)."""
    from polyspec.harness import time_model

    monkeypatch.setattr(time_model, "ahead_share", lambda whole: 1.0 if whole >= time_model.AHEAD_THRESHOLD else 0.0)


def test_the_bet_is_mixed_near_the_threshold():
    """The runtime drafts ahead while an EMA (0.2) of whole blocks is >= 0.5: near the
    threshold it flips back and forth, and the round is the mixture of the two regimes."""
    from polyspec.harness.time_model import AHEAD_SMOOTHING, ahead_share, round_model
    from time_model_reference import pipelined_round_model

    assert ahead_share(0.5) == pytest.approx(0.5)
    sd = math.sqrt(AHEAD_SMOOTHING / (2 - AHEAD_SMOOTHING) * 0.6 * 0.4)
    assert ahead_share(0.6) == pytest.approx(0.5 * (1 + math.erf(0.1 / sd / math.sqrt(2))))
    assert ahead_share(0.99) > 0.999 and ahead_share(0.1) < 0.001 and ahead_share(1.0) == 1.0 and ahead_share(0.0) == 0.0
    stage = StageSpec(TARGET_MS, (0.55,), overhead_ms=0.5, pipelined=True)  # k = 1: whole = 0.55
    block = [0.0, 1.0]
    share = ahead_share(0.55)
    pipe = pipelined_round_model(stage, block, DRAFT_MS[1], bet=True)
    serial = round_model(dataclasses.replace(stage, pipelined=False), block, DRAFT_MS[1])
    mixed = round_model(stage, block, DRAFT_MS[1])
    assert 0.5 < share < 0.8
    assert mixed.round_ms == pytest.approx(share * pipe.round_ms + (1 - share) * serial.round_ms)
    assert mixed.expected_emitted == pytest.approx(share * 1.0 + (1 - share) * 1.55)  # a whole 1-token block: no bonus


def test_a_search_reuses_each_pipelined_round_shape_with_the_same_floats():
    """A pipelined stage's block is k tokens whatever the stages below: a search's memo keeps one
    RoundShape per (stage, k) and recomputes only what depends on the block's cost. Every
    (k_0, k_1) through one shared memo must equal the model built from scratch, float for
    float, in all three regimes (never bets, mixed near the threshold, always bets)."""
    regimes = set()
    for rates in [(0.3, 0.2), (0.75, 0.7), (0.98, 0.97)]:
        stages = [StageSpec(TARGET_MS, rates, overhead_ms=0.5, pipelined=True, drafter_slowdown=1.3, jitter_cv=0.1,
                            head_start_ms=7.0, request_tokens=48),
                  StageSpec(MID_MS, (0.6, 0.5, 0.4), overhead_ms=0.2, pipelined=True, fill=0.8, per_text_position=True)]
        memo: dict = {}
        for lengths in itertools.product(range(1, 6), repeat=2):
            fresh = round_models(stages, DRAFT_MS, lengths)
            assert round_models(stages, DRAFT_MS, lengths, memo=memo) == fresh
            assert chain_cost(stages, DRAFT_MS, lengths, memo=memo) == chain_cost(stages, DRAFT_MS, lengths)
        shapes = [key for key in memo if key[0] == "shape"]
        assert sorted(shapes) == [("shape", index, k) for index in (0, 1) for k in range(1, 6)]
        for key in shapes:
            shape = memo[key]
            assert (shape.serial_emitted is None) == (shape.share == 1.0) and (shape.pipelined_emitted is None) == (shape.share == 0.0)
            regimes.add("serial" if shape.share == 0.0 else "ahead" if shape.share == 1.0 else "mixed")
    assert regimes == {"serial", "mixed", "ahead"}


def test_pipelined_stage_by_hand(hard_bet):
    """Draft-ahead (docs/time-model.md, the pipelined form): with block length 2 and per-token acceptance 0.9 the
    block is accepted whole with P = 0.81; then the round emits 2 tokens (no bonus) and the
    next block was drafted during the forward; otherwise the draft is redone after the verdict."""
    from time_model_reference import pipelined_round_model

    stage = StageSpec(TARGET_MS, (0.9,), overhead_ms=0.5, pipelined=True)
    model = round_models([stage], DRAFT_MS, [2])[0]
    whole = 0.81
    forward = whole * TARGET_MS[2] + (1 - whole) * TARGET_MS[3] + 0.5
    assert model.round_ms == pytest.approx(whole * max(forward, DRAFT_MS[2]) + (1 - whole) * (forward + DRAFT_MS[2]))
    assert list(model.emitted_pmf) == pytest.approx([0.0, 0.1, 0.09 + 0.81, 0.0])  # whole: 2 tokens; one rejected: 1 + 1
    # a slow drafter is hidden behind the forward only when the block is accepted whole
    slow = {k: 30.0 * k for k in range(1, 40)}
    assert round_models([stage], slow, [2])[0].round_ms == pytest.approx(whole * 60.0 + (1 - whole) * (forward + 60.0))
    # the drafter does not bet (P < AHEAD_THRESHOLD): exactly the serial round
    low = StageSpec(TARGET_MS, (0.5,), overhead_ms=0.5, pipelined=True)
    assert pipelined_round_model(low, [0.0, 0.0, 1.0], DRAFT_MS[2]) is None
    serial = round_models([dataclasses.replace(low, pipelined=False)], DRAFT_MS, [2])[0]
    assert round_models([low], DRAFT_MS, [2])[0] == serial


def test_pipelining_pays_when_blocks_are_accepted_whole():
    """With a drafter as costly as the verifier and high acceptance, draft-ahead beats serial;
    the optimiser finds the pipelined optimum."""
    drafter = {k: 8.0 * k for k in range(1, 40)}
    serial = StageSpec(TARGET_MS, (0.97,))
    pipelined = dataclasses.replace(serial, pipelined=True)
    for k in range(2, 9):
        assert cost_per_token([pipelined], drafter, [k]) < cost_per_token([serial], drafter, [k])
    # k = 1: the overlap (8 ms) does not make up for the bonus token a whole block gives up
    assert cost_per_token([pipelined], drafter, [1]) > cost_per_token([serial], drafter, [1])
    (k_pipe,), best = search_lengths([pipelined], drafter, 8)
    assert best == pytest.approx(min(cost_per_token([pipelined], drafter, [k]) for k in range(1, 9)))
    assert best < min(cost_per_token([serial], drafter, [k]) for k in range(1, 9))


def test_first_round_has_nothing_drafted_ahead(hard_bet):
    """A request's first round: its block is drafted after the prompt is in, so even a
    pipelined stage pays forward + block in full; a serial stage's first round is its round.
    The block is cut to new_tokens - 1 as in generation_ms."""
    pipelined = StageSpec(TARGET_MS, (0.9,), overhead_ms=0.5, pipelined=True)
    whole = 0.81
    forward = whole * TARGET_MS[2] + (1 - whole) * TARGET_MS[3] + 0.5
    assert first_round_ms([pipelined], DRAFT_MS, [2], new_tokens=48) == pytest.approx(forward + DRAFT_MS[2])
    serial = StageSpec(TARGET_MS, (0.9,), overhead_ms=0.5)
    assert first_round_ms([serial], DRAFT_MS, [2], 48) == pytest.approx(round_models([serial], DRAFT_MS, [2])[0].round_ms)
    assert first_round_ms([serial], DRAFT_MS, [6], new_tokens=3) == pytest.approx(round_models([serial], DRAFT_MS, [2])[0].round_ms)
    assert first_round_ms([pipelined], DRAFT_MS, [2], 48) > round_models([pipelined], DRAFT_MS, [2])[0].round_ms


def test_the_second_block_is_drafted_beside_the_prompts_forward(hard_bet):
    """A pipelined request's first round scores the prompt (head_start_ms longer than a round's
    forward) while its drafter drafts the second block, so the second round waits only for what
    is left of that block (the Ray demo chain at T = 1: 15-20 ms against a steady 40 at k_0 = 6).
    By hand with a slow drafter (D = 8 k ms beside forwards of ~16 ms, slow-down 1): the
    steady round waits for the block (D), the second round for max(forward, D - head start)."""
    slow = {k: 8.0 * k for k in range(1, 40)}
    stage = StageSpec(TARGET_MS, (1.0,), overhead_ms=0.5, pipelined=True)
    for k, head_start in ((6, 40.0), (6, 20.0), (3, 40.0)):
        started = dataclasses.replace(stage, head_start_ms=head_start)
        steady = round_models([stage], slow, [k])[0]
        second = round_models([started], slow, [k])[0]
        forward = TARGET_MS[k] + 0.5  # every block accepted whole: the next forward covers k tokens
        block = 8.0 * k
        assert steady.round_ms == pytest.approx(max(forward, block))
        assert second.head_start_saving_ms == pytest.approx(max(forward, block) - max(forward, block - head_start))
        assert second.round_ms == steady.round_ms and second.cold_extra_ms == steady.cold_extra_ms  # steady rounds unchanged
        # a request: the first round pays the block in full (cold), the second saves the head start
        without = generation_ms([stage], slow, [k], 48)
        assert generation_ms([started], slow, [k], 48) == pytest.approx(without - second.head_start_saving_ms)
    assert round_models([stage], slow, [6])[0].head_start_saving_ms == 0.0
    # the searches weigh the first rounds over a request: C_0 is flat in k here (the drafter's
    # 8 ms a token sets the pace), a 24-token request runs faster the longer the blocks
    flat = [cost_per_token([stage], slow, [k]) for k in range(2, 9)]
    assert max(flat) - min(flat) < 0.01
    request = dataclasses.replace(stage, head_start_ms=40.0, request_tokens=24)
    costs = {k: chain_cost([request], slow, [k]) for k in range(2, 9)}
    # (the second round hides min(head start, D - forward): 8 ms at k = 3, 40 from k = 8 on)
    assert all(costs[k + 1] < costs[k] for k in range(2, 8)) and costs[8] < costs[2] * 0.9
    assert search_lengths([request], slow, 8)[0] == [8]
    assert chain_cost([stage], slow, [4]) == pytest.approx(cost_per_token([stage], slow, [4]))  # no request: C_0


def test_a_drafter_that_proposes_less_than_asked(hard_bet):
    """fill: the share of an asked block the bottom drafter really proposes (an n-gram lookup
    with no match proposes nothing). The verifier then scores fill * k + 1 tokens; acceptance
    (missing proposals already count as rejected) and so the emitted tokens do not change."""
    full = StageSpec(TARGET_MS, (0.5,))
    half = dataclasses.replace(full, fill=0.5)
    for k in (2, 4, 6):
        full_round = round_models([full], DRAFT_MS, [k])[0]
        half_round = round_models([half], DRAFT_MS, [k])[0]
        assert half_round.emitted_pmf == full_round.emitted_pmf
        # t(m) = 10 + m: scoring 0.5 k + 1 tokens instead of k + 1 saves 0.5 k ms
        assert full_round.round_ms - half_round.round_ms == pytest.approx(0.5 * k)
    # pipelined: the forward after a whole block covers fill * k tokens, after a rejection one more
    pipe = StageSpec(TARGET_MS, (0.9,), pipelined=True, fill=0.9)
    whole = 0.81
    forward = whole * latency(TARGET_MS, 1.8) + (1 - whole) * latency(TARGET_MS, 2.8)
    assert forward == pytest.approx(whole * 11.8 + (1 - whole) * 12.8)
    assert round_models([pipe], DRAFT_MS, [2])[0].round_ms == pytest.approx(
        whole * max(forward, DRAFT_MS[2]) + (1 - whole) * (forward + DRAFT_MS[2]))
    # an n-gram-like drafter (rarely a match, but a match is usually right) in front of a verifier
    # whose cost grows with the block: asking for long blocks costs little when most are empty
    steep = {m: 2.0 + 3.0 * m for m in range(1, 40)}
    lookup = {k: 0.05 for k in range(1, 40)}
    (k_full,), _ = search_lengths([StageSpec(steep, (0.3, 0.9))], lookup, 8)
    (k_sparse,), _ = search_lengths([StageSpec(steep, (0.3, 0.9), fill=0.3)], lookup, 8)
    assert k_full == 1 and k_sparse > 2


def test_expected_max_and_a_jittery_pipelined_round():
    """E[max(A, B)] of two normal times (Clark): equal means sd s each -> mean + s / sqrt(pi);
    far apart -> the larger mean; never below max of the means. A pipelined round accepted whole
    waits for the later of forward and block, so jitter costs most when the two are close."""
    from polyspec.harness.time_model import expected_max

    assert expected_max(10.0, 2.0, 10.0, 2.0) == pytest.approx(10.0 + 2.0 / math.sqrt(math.pi))
    assert expected_max(10.0, 1.0, 30.0, 1.0) == pytest.approx(30.0)
    assert expected_max(10.0, 0.0, 12.0, 0.0) == 12.0
    for a, b in ((10.0, 11.0), (11.0, 10.0), (5.0, 20.0)):
        assert expected_max(a, 0.2 * a, b, 0.2 * b) >= max(a, b)
    drafter_close = {k: 6.0 * k for k in range(1, 40)}  # a 2-token block costs 12 ms, the forward ~12.5
    drafter_slow = {k: 20.0 * k for k in range(1, 40)}
    steady = StageSpec(TARGET_MS, (0.95,), pipelined=True)
    jittery = dataclasses.replace(steady, jitter_cv=0.2)
    extra_close = round_models([jittery], drafter_close, [2])[0].round_ms - round_models([steady], drafter_close, [2])[0].round_ms
    extra_slow = round_models([jittery], drafter_slow, [2])[0].round_ms - round_models([steady], drafter_slow, [2])[0].round_ms
    assert extra_close > 1.0 and 0.0 <= extra_slow < 0.05
