"""The goodput planner: speculation when a batched block is nearly free, off when it costs in proportion."""

from __future__ import annotations

import types

from polyspec.orchestrator.tuning.batch_model import (BATCH_GRID, EXPLORE_EVERY, WIDTH_GRID, BatchPlanner, ForwardTable,
                                                      bucket, expected_tokens)


def table(cost) -> ForwardTable:
    return ForwardTable({(b, w): cost(b, w) for b in BATCH_GRID for w in WIDTH_GRID})


def chain():
    """target <- mid <- lookup, as the planner sees them."""
    tier = lambda name, weights=True, verify=True: types.SimpleNamespace(name=name, has_weights=weights, can_verify=verify, forward_log=[])
    return [tier("target"), tier("mid"), tier("ng", weights=False, verify=False)]


def planner(target_cost, mid_cost=lambda b, w: 1.0, lookup_ms=0.05, **kwargs) -> BatchPlanner:
    return BatchPlanner(chain(), [table(target_cost), table(mid_cost), None], [0.0, 0.0, lookup_ms], **kwargs)


def accept(plan: BatchPlanner, level: int, drafter: int, rate: float, rounds: int = 400, k: int = 8) -> None:
    for j in range(rounds):  # a geometric number accepted per round: the MLE recovers `rate`
        accepted = 0
        while accepted < k and ((j * 7919 + accepted * 104729) % 1000) / 1000 < rate:
            accepted += 1
        plan.observe_round(level, drafter, k, accepted)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert [bucket(b) for b in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


def test_table_interpolates_and_refines():
    t = table(lambda b, w: b * w)
    assert t.estimate(4, 8) == 32 and t.estimate(8, 4) == 32  # between grid points: linear
    assert t.estimate(128, 16) == 2 * 64 * 16  # beyond the grid: proportional to the rows
    before = t.ms[(16, 8)]
    t.observe(16, 8, 2 * before)
    assert t.ms[(16, 8)] > before


def test_memory_bound_target_speculates_and_compute_bound_does_not():
    cheap_blocks = planner(lambda b, w: 10.0 + 0.01 * b * w)  # a block costs about what one token does
    accept(cheap_blocks, 0, 1, 0.9)
    accept(cheap_blocks, 1, 2, 0.8)
    best = cheap_blocks.predicted_best(1)
    assert best.speculating and best.lengths[0] >= 4
    proportional = planner(lambda b, w: 1.0 * b * w, mid_cost=lambda b, w: 0.5 * b * w)  # every row costs the same
    accept(proportional, 0, 1, 0.6)
    accept(proportional, 0, 2, 0.5)
    accept(proportional, 1, 2, 0.5)
    assert not proportional.predicted_best(64).speculating


def test_load_turns_speculation_off():
    """Same acceptance, different batch sizes: the block's cost grows with the batch."""
    plan = planner(lambda b, w: 4.0 + 0.4 * b * w, mid_cost=lambda b, w: 2.0 + 0.2 * b * w)
    accept(plan, 0, 1, 0.7)
    accept(plan, 0, 2, 0.5)
    accept(plan, 1, 2, 0.5)
    assert plan.predicted_best(1).speculating
    assert not plan.predicted_best(64).speculating


def test_max_batched_tokens_and_exploration():
    plan = planner(lambda b, w: 10.0, max_batched_tokens=64)
    accept(plan, 0, 1, 0.95)
    accept(plan, 1, 2, 0.9)
    best = plan.predicted_best(16)
    assert not best.speculating or 16 * (best.lengths[0] + 1) <= 64
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.95)
    chosen = []
    for _ in range(EXPLORE_EVERY + 1):
        lengths, active = plan.plan(1)
        chosen.append(active)
        plan.observe_step(1, 1 if active == (0,) else 4, 0.01, lengths, active)  # speculating measures 4x faster
    assert chosen[0] == (0,)  # "off" is measured first: the bar to clear
    offs = [j for j, a in enumerate(chosen) if a == (0,)]
    assert offs == [0, EXPLORE_EVERY - 1]  # ... and again every EXPLORE_EVERY steps


def test_step_time_correction_moves_away_from_a_slow_plan():
    plan = planner(lambda b, w: 10.0)
    plan.measured[(4, False)] = 1.0  # "off" measured (slow), so the model's choice runs
    plan.plan(4)
    first = plan.chosen[4]
    assert first.speculating
    for _ in range(30):
        lengths, active = plan.plan(4)
        slow = plan.chosen[4] == first
        predicted = plan.step_ms(plan.chosen[4], 4)[0]
        plan.observe_step(4, 4, (4 if slow else 1) * predicted / 1000.0, lengths, active)  # that plan runs 4x slower than predicted
    assert plan.correction[(first, 4)] > 1.5
    assert plan.chosen[4] != first


def test_measured_slower_speculation_is_turned_off():
    """Whatever the model predicts, a batch size where speculating measured slower than off runs off."""
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.95)
    lengths, active = plan.plan(16)
    assert active == (0,)  # the first step at a batch size measures "off"
    plan.observe_step(16, 16 * 40, 16.0, lengths, active)  # off: 40 tokens/s
    lengths, active = plan.plan(16)
    assert len(active) > 1
    plan.observe_step(16, 16, 1.0, lengths, active)  # speculating: 16 tokens/s
    chosen = [plan.plan(16)[1] for _ in range(EXPLORE_EVERY)]
    assert chosen.count((0,)) >= EXPLORE_EVERY - 2 and any(len(a) > 1 for a in chosen)  # off, but speculation is re-measured
    plan.measured[(1, False)] = 1.0
    assert plan.plan(1)[1] != (0,)  # other batch sizes keep their own measurements


def test_ngram_index_proposes_what_the_scan_does():
    """The indexed lookup against `NGramTier`'s scan, as contexts grow and roll back."""
    import random

    from polyspec.workers.core.sampling import SamplingParams
    from polyspec.workers.tiers.batched import BatchedNGramTier
    from polyspec.workers.tiers.tier import NGramTier

    scan = NGramTier("ng", 12, max_ngram=3, min_ngram=1)
    indexed = BatchedNGramTier(NGramTier("ng", 12, max_ngram=3, min_ngram=1))
    rng = random.Random(0)
    context = [rng.randrange(6) for _ in range(5)]
    for step in range(300):
        if rng.random() < 0.3:
            context = context[: rng.randrange(2, len(context) + 1)]  # a rejection rolls the context back
        else:
            context = context + [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        count = rng.randrange(0, 7)
        expected, _ = scan.draft(0, context, count, SamplingParams(), None)
        (got, _), = indexed.draft_batch(["r"], [context], [count], [SamplingParams()], [None])
        assert got == expected, (step, context, count)


def test_profile_outliers_are_flattened():
    from polyspec.orchestrator.tuning.batch_model import monotone

    ms = {(b, w): float(b * w) for b in BATCH_GRID for w in WIDTH_GRID}
    ms[(1, 4)] = 500.0  # one slow measurement
    fixed = monotone(ms)
    assert fixed[(1, 4)] == ms[(1, 8)] and fixed[(16, 8)] == ms[(16, 8)]
    assert all(fixed[(b, w)] <= fixed[(b, w2)] for b in BATCH_GRID for w, w2 in zip(WIDTH_GRID, WIDTH_GRID[1:]))


def test_unmeasured_load_tries_only_cheap_speculation():
    from polyspec.orchestrator.tuning.batch_model import EXPLORE_COST

    plan = planner(lambda b, w: 1.0 * w, mid_cost=lambda b, w: 5.0 * w)  # a block of k costs k + 1 "off" steps
    accept(plan, 0, 1, 0.999)
    accept(plan, 0, 2, 0.999)
    accept(plan, 1, 2, 0.999)
    plan.measured[(4, False)] = 1.0
    lengths, active = plan.plan(4)
    off_ms = plan.step_ms(plan.plans[0], 4)[0]
    assert plan.step_ms(plan.chosen[4], 4)[0] <= EXPLORE_COST * off_ms
