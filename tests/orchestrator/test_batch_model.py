"""The goodput planner: speculation when a batched block is nearly free, off when it costs in proportion."""

from __future__ import annotations

import collections
import math
import random
import time
import types

import pytest

from polyspec.orchestrator.tuning.batch_model import (BATCH_GRID, EXPLORE_BEST_SHARE, EXPLORE_FLOOR, MIN_STEPS, PROBE_STEPS,
                                                      REPROBE_FIRST, RETRY_STEPS, SWITCH_ON, WIDTH_GRID,
                                                      Acceptance, BatchPlanner, ForwardTable, Pending, Plan, bucket, decide,
                                                      expected_tokens)
from polyspec.orchestrator.decode.contract import ShadowObservation
from polyspec.orchestrator.tuning.batch_acceptance import middle_rounds
from polyspec.orchestrator.tuning.batch_model import HOST_MIN_STEPS, LENGTHS, HostTime


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
    assert t.estimate(128, 16) == 2 * 64 * 16  # beyond the grid: proportional to the rows ...
    assert t.estimate(4, 25) == 4 * 25  # ... and past the widest block, the last step's cost per token
    assert table(lambda b, w: 10.0 + 0.5 * w).estimate(1, 32) == 10.0 + 0.5 * 32
    t.observe(16, 8, 2 * 128.0)
    assert t.estimate(16, 8) == 128  # one forward of a shape does not speak for it yet ...
    t.observe(16, 8, 2 * 128.0)
    assert t.estimate(16, 8) == 2 * 128 and t.ms[(16, 8)] == 128  # ... two do: the profile x their ratio to it
    assert t.estimate(16, 3) == 2 * 48 and t.estimate(12, 8) == 2 * 96  # the nearest measured shape's ratio
    assert t.estimate(1, 1) == 2.0  # a batch with none measured: the mean over every shape measured
    t.observe(16, 4, 64.0)
    t.observe(16, 4, 64.0)
    assert t.estimate(16, 6) == 96 * 1.5 and t.estimate(16, 2) == 32  # linear between the widths measured, theirs beyond


def test_each_shape_that_runs_is_priced_from_its_own_forwards():
    """The profile's line between two grid widths is not the machine's: forwards of 1 and 2 tokens measured at 2.1
    and 2.7 ms where the profile's line says 2.0 and 2.3 are priced at what they measured; moving the nearest grid
    cell (cell 1 for both) toward each left both wrong."""
    t = table(lambda b, w: 2.0 + 0.1 * (w - 1))  # 2.0 at 1 token, 2.3 at 4
    for _ in range(40):
        t.observe(1, 1, 2.1)
        t.observe(1, 2, 2.7)
    assert abs(t.estimate(1, 1) - 2.1) < 1e-9 and abs(t.estimate(1, 2) - 2.7) < 1e-9


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


def test_max_batched_tokens():
    plan = planner(lambda b, w: 10.0, max_batched_tokens=64)
    accept(plan, 0, 1, 0.95)
    accept(plan, 1, 2, 0.9)
    best = plan.predicted_best(16)
    assert not best.speculating or 16 * (best.lengths[0] + 1) <= 64
    for _ in range(40):
        lengths, active = plan.plan_batch(16)
        assert len(active) == 1 or 16 * (lengths[0] + 1) <= 64
        plan.observe_step(16, 16 * len(active), 0.01, lengths, active)


def test_decision_rule_has_hysteresis():
    assert not decide(None, 100.0, 100.0 * SWITCH_ON)  # a tie is not a reason to speculate
    assert decide(None, 100.0, 100.0 * SWITCH_ON + 1)
    assert not decide(False, 100.0, 104.0)
    assert decide(True, 100.0, 101.0)  # once on, a small edge keeps it on ...
    assert not decide(True, 100.0, 99.0)  # ... and losing turns it off


def run_steps(plan: BatchPlanner, batch: int, steps: int, tokens_per_s) -> tuple[int, float, list[bool]]:
    """Drive the planner as the scheduler does; `tokens_per_s(active)` is the synthetic machine (per
    request). Returns tokens, seconds and, per step, whether it speculated."""
    tokens, seconds, speculated = 0, 0.0, []
    for _ in range(steps):
        lengths, active = plan.plan_batch(batch)
        emitted = batch * (1 if len(active) == 1 else 4)
        step_s = emitted / (batch * tokens_per_s(active))
        plan.observe_step(batch, emitted, step_s, lengths, active)
        tokens, seconds = tokens + emitted, seconds + step_s
        speculated.append(len(active) > 1)
    return tokens, seconds, speculated


WINS = lambda active: 200.0 if len(active) > 1 else 100.0  # speculating doubles tokens/s
LOSES = lambda active: 50.0 if len(active) > 1 else 100.0  # ... or halves them


def test_ab_keeps_speculation_when_it_measures_faster_whatever_the_model_says():
    """The profile says speculating costs (a block costs its length), the machine says it pays 2x: the A/B follows the machine."""
    plan = planner(lambda b, w: 1.0 * w + 1.0, mid_cost=lambda b, w: 1.0 * w)
    accept(plan, 0, 1, 0.5)
    tokens, seconds, speculated = run_steps(plan, 1, 400, WINS)
    assert sum(speculated[: 2 * MIN_STEPS]) == MIN_STEPS  # the first steps alternate: each side measured
    assert sum(speculated) > 0.9 * len(speculated)
    assert tokens / seconds > 1.8 * 100.0  # within 10% of always speculating, probes of "off" included


def test_ab_turns_speculation_off_when_it_measures_slower_whatever_the_model_says():
    """The model predicts a big win (blocks free, acceptance high), the machine measures a loss: off, re-probed rarely.
    The new load measures each set of tiers once (a 3-tier plan's loss says nothing of its tiers alone), MIN_STEPS
    steps each, each step 8 of off's in time here (4 tokens a request at half off's rate); over 2000 steps that and
    the re-probes cost under 5 %."""
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.95)
    accept(plan, 1, 2, 0.9)
    assert plan.predicted_best(16).speculating
    tokens, seconds, speculated = run_steps(plan, 16, 2000, LOSES)
    assert sum(speculated[-300:]) <= PROBE_STEPS  # intervals between re-probes have doubled
    assert sum(speculated[:200]) <= 3 * MIN_STEPS + PROBE_STEPS  # each set once, then off and its first re-probe
    assert tokens / seconds >= 0.95 * 16 * 100.0  # the whole run, measuring included, within 5% of "off"


def test_reprobe_notices_a_change_of_load():
    """Speculation wins, then (same batch size, a busier machine) loses, then wins again: the re-probes follow."""
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.9)
    _, _, first = run_steps(plan, 4, 100, WINS)
    assert sum(first[-20:]) >= 20 - PROBE_STEPS
    _, _, second = run_steps(plan, 4, 400, LOSES)
    assert sum(second[-100:]) <= PROBE_STEPS
    _, _, third = run_steps(plan, 4, 2000, WINS)  # off for a while: the re-probes have spread out
    assert sum(third[-100:]) >= 100 - PROBE_STEPS


def test_each_load_has_its_own_ab_and_a_new_one_starts_from_its_neighbour():
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.9)
    run_steps(plan, 1, 60, WINS)
    run_steps(plan, 16, 60, LOSES)
    assert plan.arms[(1, 0)].speculate and not plan.arms[(16, 0)].speculate
    assert plan.plan_batch(32)[1] == (0,) and plan.arms[(32, 0)].speculate is False  # larger than a load that runs off: off
    assert plan.plan_batch(2)[1] == (0,) and plan.arms[(2, 0)].speculate is None  # larger than a load that speculates: measured, off first
    plan.arms[(16, 0)].speculate = True  # had 16 measured speculation faster ...
    assert len(plan.plan_batch(8)[1]) > 1 and plan.arms[(8, 0)].speculate  # ... so 8, smaller, starts speculating


def test_a_load_smaller_than_a_speculating_one_speculates_at_once_and_leaves_off_to_the_re_probes():
    """A batch job's tail: 4 requests measured speculation at twice off's tokens/s, then one request is left. At
    1 the plan speculates from its first step, and off runs only as re-probes (PROBE_STEPS at a time, the first
    after REPROBE_FIRST probes' times), not as a bar measured at once: a block costs less at a smaller batch.
    (One length a tier, so no other lengths are measured at 1.)"""
    plan = planner(lambda b, w: 10.0, max_length=3)
    accept(plan, 0, 1, 0.9)
    run_steps(plan, 4, 60, WINS)
    assert plan.arms[(4, 0)].speculate
    _, _, tail = run_steps(plan, 1, 80, WINS)
    assert all(tail[:REPROBE_FIRST]) and plan.arms[(1, 0)].speculate
    off_runs = "".join("s" if s else "o" for s in tail).replace("s", " ").split()
    assert off_runs and all(run == "o" * PROBE_STEPS for run in off_runs)  # re-probes only, each of PROBE_STEPS


def test_the_speculating_side_is_the_best_measured_plan():
    """Two speculating plans measured: the A/B runs the faster one, and the model's guess does not displace it lightly."""
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.9)
    accept(plan, 1, 2, 0.9)
    truth = lambda active: {1: 100.0, 2: 300.0, 3: 150.0}[len(active)]  # the two-tier plans are best
    _, _, speculated = run_steps(plan, 4, 300, truth)
    assert sum(speculated[-100:]) >= 100 - 2 * PROBE_STEPS
    assert len(plan.chosen[4].active) == 2


def scan_continuations(context: list[int], num_tokens: int, limit: int, min_ngram: int = 1, max_ngram: int = 3) -> list[list[int]]:
    """The slow, obvious lookup: scan the whole context for the suffix, longest n-gram first, latest match first;
    up to `limit` continuations with distinct first tokens (copied on through the copy itself, as LZ77)."""
    from polyspec.workers.tiers.tier import copy_forward

    found, first_tokens, length = [], set(), len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == context[length - n :]:
                continuation = copy_forward(context, start + n, num_tokens)
                if continuation and continuation[0] not in first_tokens:
                    first_tokens.add(continuation[0])
                    found.append(continuation)
                    if len(found) == limit:
                        return found
    return found


def test_ngram_index_proposes_what_the_scan_does():
    """The indexed lookup (chains and trees) against a scan of the whole context, as contexts grow and roll back."""
    import random

    from polyspec.workers.core.sampling import SamplingParams
    from polyspec.workers.tiers.batched import BatchedNGramTier
    from polyspec.workers.tiers.tier import NGramTier

    indexed = BatchedNGramTier(NGramTier("ng", 12, max_ngram=3, min_ngram=1))
    rng = random.Random(0)
    context = [rng.randrange(6) for _ in range(5)]
    for step in range(300):
        if rng.random() < 0.3:
            context = context[: rng.randrange(2, len(context) + 1)]  # a rejection rolls the context back
        else:
            context = context + [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        count = rng.randrange(0, 7)
        expected = (scan_continuations(context, count, 1) or [[]])[0] if count else []
        (got,) = indexed.draft_batch(["r"], [context], [count], [SamplingParams()], [None])
        assert got.tokens == expected, (step, context, count)
        width = rng.randrange(1, 4)
        tree, = indexed.draft_tree_batch(["r"], [context], width, [count], [SamplingParams()], "specinfer", [None])
        chains = scan_continuations(context, count, width) if count else []
        assert tree.tokens == [t for chain in chains for t in chain], (step, context, count, width)


def test_profile_outliers_are_flattened():
    from polyspec.orchestrator.tuning.profiler import monotone

    ms = {(b, w): float(b * w) for b in BATCH_GRID for w in WIDTH_GRID}
    ms[(1, 4)] = 500.0  # one slow measurement
    fixed = monotone(ms)
    assert fixed[(1, 4)] == ms[(1, 8)] and fixed[(16, 8)] == ms[(16, 8)]
    assert all(fixed[(b, w)] <= fixed[(b, w2)] for b in BATCH_GRID for w, w2 in zip(WIDTH_GRID, WIDTH_GRID[1:]))


def test_a_new_load_measures_each_set_of_tiers_the_model_ranks_low_included():
    """The model prefers the mid tier (its profile made the lookup look slow); the machine says the lookup alone
    pays: exploring a new load measures each set of tiers, and the A/B settles on the lookup."""
    plan = planner(lambda b, w: 10.0, mid_cost=lambda b, w: 1.0, lookup_ms=5.0)
    accept(plan, 0, 1, 0.9)
    accept(plan, 1, 2, 0.9)
    assert plan.predicted_best(1).active != (0, 2)
    truth = lambda active: 300.0 if active == (0, 2) else 110.0 if len(active) > 1 else 100.0
    _, _, speculated = run_steps(plan, 1, 200, truth)
    assert plan.arms[(1, 0)].speculate and plan.chosen[1].active == (0, 2)
    assert sum(speculated[-100:]) >= 100 - PROBE_STEPS


def test_a_load_next_to_a_decided_one_tries_only_its_best_plan():
    plan = planner(lambda b, w: 10.0, mid_cost=lambda b, w: 1.0, lookup_ms=5.0)
    accept(plan, 0, 1, 0.9)
    accept(plan, 1, 2, 0.9)
    truth = lambda active: 300.0 if active == (0, 2) else 110.0 if len(active) > 1 else 100.0
    run_steps(plan, 1, 100, truth)
    winner = plan.chosen[1]
    steps = []
    for _ in range(2 * MIN_STEPS + 2):
        lengths, active = plan.plan_batch(4)
        steps.append(active)
        plan.observe_step(4, 4 * (4 if len(active) > 1 else 1), 0.01 * (1 if len(active) > 1 else 0.3), lengths, active)
    assert steps[0] == (0,)  # larger than a speculating load: off measured first
    assert {a for a in steps if len(a) > 1} == {winner.active}
    assert plan.arms[(4, 0)].speculate


def test_lengths_next_to_the_models_choice_are_measured():
    """The profile says a block's cost grows steeply (short blocks best); on the machine long blocks are
    nearly free: the planner measures the lengths next to its choice and climbs to the longest."""
    plan = planner(lambda b, w: 1.0 + 2.0 * w, mid_cost=lambda b, w: 50.0)  # the mid tier: predicted hopeless
    accept(plan, 0, 2, 0.9)
    assert plan.predicted_best(1).lengths[0] == 3
    truth = {3: 150.0, 6: 200.0, 12: 260.0}  # tokens/s of the lookup plan by block length; off is 100
    chosen = []
    for _ in range(200):
        lengths, active = plan.plan_batch(1)
        rate = 100.0 if len(active) == 1 else truth.get(lengths[0], 100.0) if active == (0, 2) else 50.0
        plan.observe_step(1, 4, 4 / rate, lengths, active)
        chosen.append((active, lengths[0]))
    best = plan.arms[(1, 0)].best_measured()
    assert plan.arms[(1, 0)].speculate and best.active == (0, 2) and best.lengths[0] == 12
    assert sum(c == ((0, 2), 12) for c in chosen[-100:]) >= 100 - 2 * PROBE_STEPS  # off's re-probes aside


def test_a_plan_is_measured_only_if_the_running_requests_can_pay_for_it():
    """As above, but the running requests have few tokens left: measuring a length costs MIN_STEPS of its
    step time, and a plan whose measurement would take more than EXPLORE_TIME_SHARE of the time they
    still need is not run (the first speculating plan aside: the A/B needs one); with many tokens left
    the lengths next to it are measured, and the longest wins."""
    truth = {3: 150.0, 6: 200.0, 12: 260.0}  # tokens/s of the lookup plan by block length; off is 100

    def run(remaining: int) -> list[tuple]:
        plan = planner(lambda b, w: 1.0 + 2.0 * w, mid_cost=lambda b, w: 50.0)
        accept(plan, 0, 2, 0.9)
        chosen = []
        for _ in range(120):
            lengths, active = plan.plan_batch(1, remaining=(remaining,))
            rate = 100.0 if len(active) == 1 else truth.get(lengths[0], 100.0) if active == (0, 2) else 50.0
            plan.observe_step(1, 4, 4 / rate, lengths, active)
            chosen.append((active, lengths[0]))
        return chosen

    short, long = run(remaining=20), run(remaining=10_000)  # tokens each running request still needs
    assert ((0, 2), 3) in short and ((0, 2), 6) not in short and ((0, 2), 12) not in short
    assert ((0, 2), 12) in long and long[-1] in (((0, 2), 12), ((0,), 0))  # the longest won (or off's re-probe)


def test_a_set_of_tiers_the_model_calls_hopeless_is_not_run_to_find_out():
    """At a batch where the mid tier's forward costs 50x the target's (a drafter served row by row), exploring
    measures off and the lookup, never a plan through the mid tier."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 500.0)
    accept(plan, 0, 1, 0.9)
    accept(plan, 0, 2, 0.6)
    accept(plan, 1, 2, 0.6)
    _, _, speculated = run_steps(plan, 16, 60, lambda active: 100.0 if len(active) == 1 else 120.0)
    ran = {p.active for p in plan.arms[(16, 0)].rates}
    assert (0,) in ran and (0, 2) in ran and not any(1 in active for active in ran)


def test_no_plan_is_run_where_the_model_calls_every_one_hopeless():
    """At batch 64 every block costs in proportion to its tokens and the drafter is slow: the model, checked
    against off's measured rate, rules every speculating plan out, so none is run (or re-probed) at all."""
    plan = planner(lambda b, w: 1.0 * b * w, mid_cost=lambda b, w: 5.0 * b * w, lookup_ms=2.0)
    accept(plan, 0, 1, 0.5)
    accept(plan, 0, 2, 0.3)
    accept(plan, 1, 2, 0.3)
    _, _, speculated = run_steps(plan, 64, 500, lambda active: 100.0 if len(active) == 1 else 20.0)
    assert not any(speculated)


def test_a_drafter_far_behind_is_not_started_to_find_out():
    """The mid tier is cheap per step, but has cached none of 64 requests' 200-token contexts: a probe would
    start with a 12,800-token catch-up, so the planner measures off and the lookup only; caught up, it may try the mid tier."""
    def run(behind_tokens):
        plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 2.0 + 0.2 * w)
        accept(plan, 0, 1, 0.9)
        accept(plan, 0, 2, 0.6)
        accept(plan, 1, 2, 0.6)
        for _ in range(60):
            lengths, active = plan.plan_batch(64, None, {1: behind_tokens})
            emitted = 64 * (1 if len(active) == 1 else 3)
            plan.observe_step(64, emitted, emitted / (64 * (100.0 if len(active) == 1 else 120.0)), lengths, active)
        return {p.active for p in plan.arms[(64, 0)].rates}

    assert not any(1 in active for active in run(64 * 200)) and (0, 2) in run(64 * 200)
    assert any(1 in active for active in run(0))


# ----------------------------------------------------------------- draft trees (tree_width > 1)


def tree_rounds(plan: BatchPlanner, level: int, drafter: int, rates: list[float], width: int, rounds: int = 600) -> None:
    """Tree rounds of depth len(rates) whose walk gets past depth i with probability rates[i] (seeded)."""
    draw = random.Random(0)
    for _ in range(rounds):
        accepted = 0
        while accepted < len(rates) and draw.random() < rates[accepted]:
            accepted += 1
        plan.observe_round(level, drafter, width * len(rates), accepted, depth=len(rates))


def test_tree_rounds_give_per_depth_acceptance():
    """600 rounds: each depth's conditional rate within 0.06 of the truth (its binomial sd at the
    rounds reaching it is under 0.025); the expected tokens are the tree's, 1 + sum of the products."""
    plan = planner(lambda b, w: 10.0, tree_width=2)
    truth = [0.9, 0.7, 0.5, 0.5, 0.5, 0.5]
    tree_rounds(plan, 0, 1, truth, 2)
    measured = plan.acceptance.depth_rates(0, 1, True, 2, 6)
    assert all(abs(m - t) < 0.06 for m, t in zip(measured, truth)), measured
    expected, reach = 1.0, 1.0
    for q in measured[:3]:
        reach *= q
        expected += reach
    assert abs(plan.emitted(0, 1, 3, 2) - expected) < 1e-9
    # past depth 0 the walk follows one candidate chain: the chain rate learns from the deeper levels
    assert abs(plan.rate(0, 1) - 0.55) < 0.06
    # a depth no tree reached yet is priced at that chain rate, not at the prior
    assert plan.acceptance.depth_rates(0, 1, True, 2, 8)[7] == plan.rate(0, 1)


def test_tree_plans_price_their_nodes():
    """A tree of width w and depth k: the verifier's forward takes w k + 1 tokens per row, the drafter runs
    its root forward then k - 1 level forwards of w nodes per row; max_batched_tokens bounds the nodes."""
    plan = planner(lambda b, w: float(w), mid_cost=lambda b, w: 10.0 * w, lookup_ms=0.5, tree_width=3, max_batched_tokens=64)
    target, mid = plan.tables[0], plan.tables[1]
    two_tier = next(p for p in plan.plans if p.active == (0, 1) and p.lengths[0] == 3)
    assert plan.step_ms(two_tier, 1)[0] == target.estimate(1, 3 * 3 + 1) + mid.estimate(1, 2) + 2 * mid.estimate(1, 3)
    three_tier = next(p for p in plan.plans if p.active == (0, 1, 2) and p.lengths == (6, 4))
    ms, _ = plan.step_ms(three_tier, 1)  # the mid tier verifies the lookup's trees of depth 4; the target a chain of 6
    # it runs rounds until it has 6 tokens and hands up all of them: the target verifies a block of 6 or more
    rounds, blocks = middle_rounds(6, 4, round(plan.emitted(1, 2, 4, 3), 3))
    assert 1.0 < rounds < 6.0 and abs(sum(p for _, p in blocks) - 1.0) < 1e-9 and min(length for length, _ in blocks) == 6
    verify = sum(p * target.estimate(1, length + 1) for length, p in blocks)
    assert abs(ms - (verify + rounds * (mid.estimate(1, 3 * 4 + 1) + 0.5))) < 1e-9
    assert plan.fits(two_tier, 6) and not plan.fits(two_tier, 7)  # 7 rows of 9 nodes + 1 > 64
    assert plan.fits(Plan((0, 2), (3, 0)), 2) and not plan.fits(Plan((0, 2), (12, 0)), 2)


def test_deeper_trees_win_where_acceptance_holds_and_lose_where_it_falls():
    """Blocks nearly free (a memory-bound target), the same cheap drafter: with acceptance holding at every
    depth the deepest tree is best; with the walk rarely getting past depth 2, the shallowest. Where every
    row costs the same (batch 64), no tree pays and speculation is off."""
    def best(rates, cost, batch):
        plan = BatchPlanner(chain()[:2], [table(cost), table(lambda b, w: 0.5 + 0.01 * b * w)], [0.0, 0.0], tree_width=2)
        tree_rounds(plan, 0, 1, rates, 2)
        return plan.predicted_best(batch)

    cheap = lambda b, w: 10.0 + 0.01 * b * w
    holds = best([0.95] * 12, cheap, 1)
    assert holds.speculating and holds.lengths[0] == 12
    falls = best([0.95, 0.9, 0.05] + [0.5] * 9, cheap, 1)
    assert falls.speculating and falls.lengths[0] == 3
    assert not best([0.95] * 12, lambda b, w: 1.0 * b * w, 64).speculating


def test_a_tree_plan_is_gated_as_a_chain_plan_is():
    """Off is measured first; a tree plan the model calls hopeless at a load (batch 64, every row costs) is never run."""
    tables = [table(lambda b, w: 4.0 + 0.4 * b * w), table(lambda b, w: 0.1 + 0.05 * b * w)]
    plan = BatchPlanner(chain()[:2], tables, [0.0, 0.0], tree_width=3)
    tree_rounds(plan, 0, 1, [0.9, 0.8, 0.8], 3)
    assert plan.predicted_best(1).speculating  # at batch 1 the model calls a tree worthwhile ...
    _, _, speculated = run_steps(plan, 1, MIN_STEPS + 1, lambda active: 100.0)
    assert speculated == [False] * MIN_STEPS + [True]  # ... but off is measured first
    _, _, speculated = run_steps(plan, 64, 200, lambda active: 100.0 if len(active) == 1 else 20.0)
    assert not any(speculated)


def test_a_drafter_catching_up_inside_its_calls_is_priced_at_its_measured_catch_up():
    """A drafter served row by row that conditions on a whole context in one forward (a feature head) catches
    up far cheaper per token than its table's widest block (one token at a time): the measured cost is used."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 2.0 * w)
    accept(plan, 0, 1, 0.9)
    mid_plan = next(p for p in plan.plans if p.active == (0, 1) and p.lengths[0] == 3)
    plan.behind = {1: 3000}
    assert plan.tables[1].catch_up() == 2.0  # unmeasured: the widest block's per-token cost
    estimated = plan.entry_goodput(mid_plan, 1)
    plan.tables[1].catch_up_ms = 0.05
    assert plan.entry_goodput(mid_plan, 1) == plan.goodput(mid_plan, 1, 3000 * 0.05 / MIN_STEPS) > 10 * estimated


def test_where_off_wins_other_lengths_are_tried_only_if_the_corrected_model_says_they_beat_off():
    """The model overrates the lookup (it predicts every length above off); measured, its best length runs
    at 0.6x off. Re-probes then run that plan, not the other lengths one after another: scaled by the
    model's error on the measured one, none would beat off."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 500.0)
    accept(plan, 0, 2, 0.8)
    for _ in range(400):
        lengths, active = plan.plan_batch(1)
        rate = 100.0 if len(active) == 1 else 60.0  # whatever the length
        plan.observe_step(1, 4, 4 / rate, lengths, active)
    arm = plan.arms[(1, 0)]
    assert arm.speculate is False
    assert len([p for p in arm.rates if p.speculating]) == 1, [p.lengths for p in arm.rates]


def test_a_model_drafter_behind_on_long_prompts_is_measured_when_its_requests_have_tokens_left():
    """A drafter's catch-up on prompts it has not cached is paid once per request and repays over the rest
    of its tokens. Spread over the steps the requests have left, a drafter of real use is measured at a new
    load; charged to one probe of MIN_STEPS steps, the model called it hopeless and only the lookup (no
    catch-up) was ever tried: the Qwen2.5-Coder 1.5B <- 0.5B <- n-gram chain at 4 HumanEval prompts. Requests with
    few tokens left cannot pay for it: the catch-up is part of what measuring the drafter costs them (`affordable`),
    and 64 short requests of the demo chain spent as long catching its int8 copy up as they did decoding."""
    def measured_sets(remaining):
        plan = planner(lambda b, w: 400.0 + 10.0 * w, mid_cost=lambda b, w: 150.0 + 5.0 * w)  # a CPU-like 1.5B and 0.5B
        plan.tables[1].catch_up_ms = 20.0  # per prompt token
        accept(plan, 0, 1, 0.9)
        accept(plan, 0, 2, 0.4)
        for _ in range(4 * MIN_STEPS):
            lengths, active = plan.plan_batch(4, behind={1: 600}, remaining=remaining)  # 4 prompts of 150 tokens
            seconds = plan.step_ms(Plan(active, tuple(lengths)), 4)[0] / 1000.0
            plan.observe_step(4, 4 * (1 if len(active) == 1 else 2), seconds, lengths, active)
        return {p.active for p in plan.arms[(4, 0)].rates if p.speculating}

    assert (0, 1) not in measured_sets(remaining=())  # unknown horizon: the catch-up charged to the probe alone
    # 12 s of catch-up (600 tokens x 20 ms) and 3 steps of ~0.5 s: over a quarter of 120 tokens' ~49 s at off's rate
    assert (0, 1) not in measured_sets(remaining=(120, 120, 120, 120))
    assert (0, 1) in measured_sets(remaining=(240, 240, 240, 240))


def test_one_drafter_measured_far_below_its_prediction_does_not_hide_the_others():
    """The int8 copy is predicted cheap but measures as slow as the target (its dynamic quantization on a CPU
    where the target runs in bfloat16): that error is the int8 tier's. The other drafters are still judged
    by the model corrected on off, and the one that pays is measured (4-tier Qwen2.5-Coder chain at 4 prompts)."""
    tiers = chain() + [types.SimpleNamespace(name="small", has_weights=True, can_verify=True, forward_log=[])]
    cheap = lambda b, w: 1.0 + 0.1 * w
    plan = BatchPlanner(tiers, [table(lambda b, w: 10.0 + 0.1 * w), table(cheap), None, table(cheap)], [0.0, 0.0, 5.0, 0.0])
    accept(plan, 0, 1, 0.95)  # the int8 copy: the model's favourite
    accept(plan, 0, 3, 0.8)
    truth = lambda active: 35.0 if 1 in active else 160.0 if active == (0, 3) else 100.0 if active == (0,) else 90.0
    run_steps(plan, 4, 60, truth)
    measured = {p.active for p in plan.arms[(4, 0)].rates if p.speculating}
    assert (0, 1) in measured and (0, 3) in measured, measured
    assert plan.arms[(4, 0)].speculate and plan.chosen[4].active == (0, 3)


def test_a_new_load_does_not_measure_sets_the_model_puts_well_below_the_best_measured():
    """4-tier chain (target <- int8 copy <- lookup, and a small model), the machine as the model predicts it: once the
    int8 copy's plan is measured, the sets predicted under EXPLORE_BEST_SHARE of it are not run for MIN_STEPS each to
    find out, though predicted above EXPLORE_FLOOR of off (six sets at MIN_STEPS each are 18 steps; a run of 4 prompts of 128
    tokens has about 30)."""
    tiers = chain() + [types.SimpleNamespace(name="small", has_weights=True, can_verify=True, forward_log=[])]
    plan = BatchPlanner(tiers, [table(lambda b, w: 10.0 + 0.1 * w), table(lambda b, w: 2.0 + 0.1 * w), None,
                                table(lambda b, w: 3.0 + 0.1 * w)], [0.0, 0.0, 0.05, 0.0])
    for level, drafter, rate in ((0, 1, 0.95), (0, 2, 0.3), (0, 3, 0.6), (1, 2, 0.25), (1, 3, 0.6)):
        accept(plan, level, drafter, rate)
    batch = 4
    predicted = {}  # per set of tiers: its best plan's tokens/s per request
    for p in plan.allowed(batch):
        predicted[p.active] = max(predicted.get(p.active, 0.0), plan.goodput(p, batch) / batch)
    best = max(predicted, key=predicted.get)
    worth = {a for a, rate in predicted.items() if rate >= EXPLORE_BEST_SHARE * predicted[best]}
    floor = {a for a, rate in predicted.items() if len(a) > 1 and rate >= EXPLORE_FLOOR * predicted[(0,)]}
    assert best == (0, 1) and len(floor - worth) >= 2  # the old rule measured these as well

    run_steps(plan, batch, 40, predicted.get)  # the machine as the model predicts it
    measured = {p.active for p in plan.arms[(batch, 0)].rates if p.speculating}
    assert measured == worth - {(0,)}, (measured, worth, predicted)
    assert plan.arms[(batch, 0)].speculate and plan.chosen[batch].active == (0, 1)


def test_a_drafters_catch_up_is_not_counted_in_its_plans_measured_rate():
    """The first step of a plan through the mid tier spends 10 s caching the requests' prompts in it (a one-time price,
    weighed by `entry_goodput` before the plan is tried): the A/B measures the plan's steps without it, and runs the
    plan that doubles off's tokens/s. Counted, it measured a fraction of off and was never run again."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 2.0 + 0.1 * w)
    accept(plan, 0, 1, 0.9)
    accept(plan, 0, 2, 0.3)
    accept(plan, 1, 2, 0.3)
    truth = lambda active: 200.0 if active == (0, 1) else 100.0 if active == (0,) else 90.0  # tokens/s per request
    batch, caught_up, speculated = 4, False, []
    for _ in range(60):
        lengths, active = plan.plan_batch(batch)
        emitted = batch * (1 if len(active) == 1 else 4)
        catch_up_s = 0.0 if caught_up or 1 not in active else 10.0
        caught_up = caught_up or 1 in active
        plan.observe_step(batch, emitted, emitted / (batch * truth(active)) + catch_up_s, lengths, active, catch_up_s)
        speculated.append(active == (0, 1))
    arm = plan.arms[(batch, 0)]
    assert arm.speculate and plan.chosen[batch].active == (0, 1)
    assert math.isclose(arm.measured(arm.best_measured(), batch), batch * 200.0, rel_tol=1e-6)
    assert sum(speculated[-20:]) >= 20 - PROBE_STEPS


def test_a_loads_rates_are_per_request_so_the_batch_sizes_of_a_ramp_compare():
    """A load is a range of batch sizes (33-64 requests share one A/B), and its first steps, off's, run while
    requests are still joining. Each measures its tokens per request: 100 tokens/s a request at 40, 50 and 60
    requests is 6,400 tokens/s at 64 (summed as tokens/s, 5,000 at any batch: off at three quarters of its speed,
    against a speculating plan measured at the full batch)."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w)
    for batch in (40, 50, 60):
        lengths, active = plan.plan_batch(batch)
        assert active == (0,)  # a new load measures off first
        plan.observe_step(batch, batch, 0.01, lengths, active)  # one token a request in 10 ms
    off = plan.plans[0]
    arm = plan.arms[(64, 0)]
    assert math.isclose(arm.measured(off, 64), 6400.0) and math.isclose(arm.measured(off, 40), 4000.0)


def test_the_catch_up_of_requests_joining_a_running_plan_counts_in_its_rate():
    """Once a plan runs, its drafters catching up on the requests that join it is a cost of the plan at that load:
    the same chain as above, but every step of the plan spends 1 s on the prompts of new requests (short requests
    with long prompts). Its first step's catch-up is the switch's and is left out; the next ones count, and off,
    at half the plan's speed between catch-ups, wins the A/B."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 2.0 + 0.1 * w)
    accept(plan, 0, 1, 0.9)
    accept(plan, 0, 2, 0.3)
    accept(plan, 1, 2, 0.3)
    truth = lambda active: 200.0 if active == (0, 1) else 100.0 if active == (0,) else 90.0  # tokens/s per request
    batch = 4
    for _ in range(60):
        lengths, active = plan.plan_batch(batch)
        emitted = batch * (1 if len(active) == 1 else 4)
        catch_up_s = 1.0 if 1 in active else 0.0
        plan.observe_step(batch, emitted, emitted / (batch * truth(active)) + catch_up_s, lengths, active, catch_up_s)
    arm = plan.arms[(batch, 0)]
    measured = {p.active: arm.measured(p, batch) for p in arm.rates if arm.measured(p, batch) is not None}
    assert arm.speculate is False and plan.chosen[batch].active == (0,)
    assert measured[(0, 1)] < 0.1 * measured[(0,)], measured  # 16 tokens in 1.02 s a step, 2 of its 3 steps


def test_the_tuning_options_reach_the_goodput_planner():
    """`tuning.max_length` caps the grids of lengths (the cap itself joins them); `allow_bypass: false`
    keeps every speculating plan on every tier (off stays the A/B's bar); `explore_every` bounds the
    time between re-probes of the side not taken (0: never); `shadow: false` stops the lookups' shadow
    proposals (tests/orchestrator/test_tuning_options.py: the options set from the config, and the rest named)."""
    capped = planner(lambda b, w: 10.0, max_length=8)
    assert capped.lengths_grid == (3, 6, 8) and capped.inner_grid == (4, 8)
    assert max(max(p.lengths) for p in capped.plans) == 8 and Plan((0, 1, 2), (8, 8)) in capped.plans
    assert planner(lambda b, w: 10.0, max_length=2).lengths_grid == (2,)
    assert planner(lambda b, w: 10.0).lengths_grid == (3, 6, 12)
    whole = planner(lambda b, w: 10.0, allow_bypass=False)
    assert {p.active for p in whole.plans} == {(0,), (0, 1, 2)}
    late_probes = {}  # once off has won (as in test_ab_turns_speculation_off_...: at most PROBE_STEPS steps at the default 64)
    for explore_every in (0, 2):
        plan = planner(lambda b, w: 10.0, explore_every=explore_every)
        accept(plan, 0, 1, 0.95)
        accept(plan, 1, 2, 0.9)
        late_probes[explore_every] = sum(run_steps(plan, 16, 1000, LOSES)[2][-300:])
    assert late_probes[0] == 0 and late_probes[2] > 3 * PROBE_STEPS  # never, or every 2 probes' times
    assert planner(lambda b, w: 10.0).shadows and not planner(lambda b, w: 10.0, shadows=False).shadows


def diffused_rounds(rate: float, rounds: int, k: int):
    """(proposed, accepted) of `rounds` blocks of k whose accept / reject decisions come in the proportion `rate`
    over any stretch of them (error diffusion): the estimate recovers `rate` from any window, faded or not."""
    credit = 0.0
    for _ in range(rounds):
        accepted = 0
        while accepted < k:
            credit += rate
            if credit < 1.0:
                break  # a rejection ends the round
            credit -= 1.0
            accepted += 1
        yield k, accepted


def test_acceptance_follows_the_recent_rounds_and_says_how_sure_it_is():
    """A drafter accepted at 0.1 for 400 rounds, then at 0.8 for 400 (a lookup warming up on the request's own
    text): the rate follows the recent rounds (never-fading counts would say ~0.45), and its spread narrows as
    rounds come in."""
    acceptance = Acceptance([0.5, 0.5])
    wide = acceptance.spread(0, 1)
    for proposed, accepted in diffused_rounds(0.1, 400, 8):
        acceptance.observe(0, 1, proposed, accepted)
    assert abs(acceptance.rate(0, 1) - 0.1) < 0.03
    for proposed, accepted in diffused_rounds(0.8, 400, 8):
        acceptance.observe(0, 1, proposed, accepted)
    assert abs(acceptance.rate(0, 1) - 0.8) < 0.03
    assert 0 < acceptance.spread(0, 1) < wide / 3


def two_drafters() -> BatchPlanner:
    """target <- mid or target <- lookup (the mid model does not verify: no three-tier plans), the mid model known
    to be accepted at 0.8, the lookup at its prior."""
    tiers = chain()
    tiers[1].can_verify = False
    plan = BatchPlanner(tiers, [table(lambda b, w: 10.0), table(lambda b, w: 2.0), None], [0.0, 0.0, 0.05])
    accept(plan, 0, 1, 0.8)
    return plan


def drive_with_shadows(plan: BatchPlanner, steps: int, truth, shadow_rate: float, batch: int = 4) -> list[tuple[int, ...]]:
    """`run_steps`, with the lookup tier (2) told what it would have proposed whenever it does not draft for the
    target (as the scheduler's ShadowObservations do): 4-token proposals matched at `shadow_rate`. The tiers run
    per step."""
    ran = []
    rounds = diffused_rounds(shadow_rate, 10**9, 4)
    for _ in range(steps):
        lengths, active = plan.plan_batch(batch)
        emitted = batch * (1 if len(active) == 1 else 4)
        plan.observe_step(batch, emitted, emitted / (batch * truth(active)), lengths, active)
        if len(active) < 2 or active[1] != 2:
            for _ in range(batch):
                proposed, accepted = next(rounds)
                plan.observe(ShadowObservation(2, proposed if accepted < proposed else accepted, accepted, True))
        ran.append(active)
    return ran


def test_a_lookup_measured_poor_early_is_measured_again_when_its_shadow_acceptance_rises():
    """The issue's run: at the requests' start the lookup finds nothing to copy (measured at off's tokens/s) and the
    mid model wins; later the requests' own text makes the lookup pay (its shadow acceptance, heard while the mid
    model runs, rises to 0.9, and the machine gives it twice the mid model's tokens/s): it is measured again and
    chosen. While the shadows stay poor it is not re-run. (That a measured plan is itself measured again: the next
    test.)"""
    plan = two_drafters()  # the lookup starts at its prior: worth measuring
    lookup = {"tokens_per_s": 100.0}
    truth = lambda active: {(0,): 100.0, (0, 1): 180.0, (0, 2): lookup["tokens_per_s"]}[active]
    run_steps(plan, 4, 40, truth)  # the load's exploration, before any shadow is heard
    arm = plan.arms[(4, 0)]
    assert any(p.active == (0, 2) for p in arm.rates) and arm.speculate and arm.best_measured().active == (0, 1)
    early = drive_with_shadows(plan, 80, truth, shadow_rate=0.05)
    assert early.count((0, 2)) == 0 and not arm.retries
    lookup["tokens_per_s"] = 360.0
    late = drive_with_shadows(plan, 120, truth, shadow_rate=0.9)
    assert plan.chosen[4].active == (0, 2)  # its other lengths as the challenger, or its measured plan again
    assert late[-30:].count((0, 2)) >= 30 - PROBE_STEPS


def test_a_lookup_written_off_before_it_was_measured_is_tried_when_its_shadow_acceptance_rises():
    """Shadows heard from the first step: the lookup's rate falls before its set is explored, so it is never
    measured; when its shadow acceptance rises it becomes the challenger the model predicts far above the best
    measured plan, is measured, and chosen."""
    plan = two_drafters()
    lookup = {"tokens_per_s": 100.0}
    truth = lambda active: {(0,): 100.0, (0, 1): 180.0, (0, 2): lookup["tokens_per_s"]}[active]
    early = drive_with_shadows(plan, 80, truth, shadow_rate=0.05)
    assert early.count((0, 2)) == 0
    lookup["tokens_per_s"] = 360.0
    late = drive_with_shadows(plan, 120, truth, shadow_rate=0.9)
    assert plan.chosen[4].active == (0, 2) and late[-30:].count((0, 2)) >= 30 - PROBE_STEPS


def test_a_plan_whose_model_value_rises_but_measures_poor_again_costs_a_bounded_share():
    """The shadows say the lookup would pay, the machine says it does not (the model is wrong about it): it is
    measured again, and again only at doubling intervals (RETRY_STEPS x 2^retries) while its model value keeps
    rising: over 400 steps the run stays within 5 % of the mid model's tokens/s."""
    plan = two_drafters()
    truth = lambda active: {(0,): 100.0, (0, 1): 180.0, (0, 2): 100.0}[active]
    run_steps(plan, 4, 40, truth)
    drive_with_shadows(plan, 80, truth, shadow_rate=0.05)
    ran = drive_with_shadows(plan, 400, truth, shadow_rate=0.9)
    retries = plan.arms[(4, 0)].retries
    assert retries and all(2 ** count - 1 <= 400 / RETRY_STEPS for count in retries.values())
    seconds = sum((4 if len(a) > 1 else 1) / truth(a) for a in ran)
    tokens = sum(4 if len(a) > 1 else 1 for a in ran)
    assert tokens / seconds >= 0.95 * 180.0


def test_a_request_whose_own_text_makes_the_lookup_pay_drafts_with_it_under_a_model_drafter_plan():
    """Four requests under target <- mid (accepted at 0.6): the two whose own shadows match at 0.9 draft with the
    lookup, the one matching at 0.1 and the one heard only 4 times (under REQUEST_MIN_ROUNDS) keep the mid model;
    one that has nothing to copy three rounds in four keeps it too (its misses count). Under a plan with the lookup
    under the target, or with no override due, the plan's drafter serves all."""
    tiers = chain()
    tiers[1].can_verify = False
    plan = BatchPlanner(tiers, [table(lambda b, w: 10.0), table(lambda b, w: 2.0), None], [0.0, 0.0, 0.05])
    accept(plan, 0, 1, 0.6)
    heard = {"a": (0.9, 16, 0), "b": (0.1, 16, 0), "c": (0.9, 4, 0), "d": (0.9, 16, 3), "e": (0.9, 16, 0)}
    for seq_id, (rate, rounds, misses_per_hit) in heard.items():
        pattern = diffused_rounds(rate, 10**9, 6)
        for j in range(rounds):
            if misses_per_hit and j % (misses_per_hit + 1):
                plan.observe(ShadowObservation(2, 0, 0, True, seq_id))
                continue
            proposed, accepted = next(pattern)
            plan.observe(ShadowObservation(2, proposed, accepted, True, seq_id))
    step = types.SimpleNamespace(seq_ids=tuple(heard), params=tuple(types.SimpleNamespace(greedy=True) for _ in heard))
    plan._pending, plan._predicted_ms = Plan((0, 1), (6, 0)), 10.0
    assert plan.drafters(step) == (2, 1, 1, 1, 2)
    predicted = plan.predicted_tokens_per_s  # each request's own: its drafter's expected tokens over the step's 10 ms
    assert predicted[1] == predicted[2] == predicted[3] and math.isclose(predicted[1], 100.0 * plan.acceptance.expected(0, 1, True, 6))
    assert predicted[0] > predicted[1] and predicted[4] > predicted[1]
    plan._pending = Plan((0, 2), (6, 0))
    assert plan.drafters(step) == ()
    plan._pending = Plan((0, 1), (6, 0))
    assert plan.drafters(types.SimpleNamespace(seq_ids=("b", "c"), params=step.params[:2])) == ()
    assert set(key[0] for key in plan.requests) == {"b", "c"}  # requests no longer in a step are forgotten


def test_a_plan_that_lost_on_a_few_noisy_steps_is_measured_again_one_that_lost_steadily_is_not():
    """Both loads measure the lookup on its first MIN_STEPS steps at the same tokens/s (133 a request, under the mid
    model's 180), with nothing heard since that would move its model value: where those steps were steady (10 or 11
    tokens each) that settles it, and it is not run again; where they were noisy (4, 4 and 24 tokens: one standard
    error is 333 tokens/s, `Rate.spread`) the benefit of that error carries it past the mid model's, so it is
    measured again after RETRY_STEPS, found at 325, and chosen. (Off: 100; steps of 4 requests; every step of a
    speculating plan 20 ms.)"""
    for noisy in (True, False):
        plan = two_drafters()
        first = iter([4, 4, 24] if noisy else [11, 11, 10])  # the lookup's first steps: tokens of the 4 requests
        ran = []
        for _ in range(200):
            lengths, active = plan.plan_batch(4)
            if active == (0,):
                tokens, seconds = 4, 0.01  # 100 tokens/s a request
            elif active == (0, 1):
                tokens, seconds = 16, 16 / (4 * 180.0)
            else:
                tokens, seconds = next(first, 26), 0.02  # then 26 tokens a step: 325 tokens/s a request
            plan.observe_step(4, tokens, seconds, lengths, active)
            ran.append(active)
        arm = plan.arms[(4, 0)]
        if noisy:
            assert arm.retries and plan.chosen[4].active == (0, 2) and ran[-30:].count((0, 2)) >= 30 - PROBE_STEPS
        else:
            assert not arm.retries and ran.count((0, 2)) == MIN_STEPS and plan.chosen[4].active == (0, 1)


def test_where_off_wins_the_speculating_side_is_priced_only_when_a_re_probe_is_due():
    """The planner's own time is the step's: where off won the A/B, the steps between two re-probes plan off without
    pricing the speculating plans, and the re-probes still come, each longer after the last."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 500.0)
    accept(plan, 0, 2, 0.8)
    run_steps(plan, 1, 60, lambda active: 100.0 if len(active) == 1 else 60.0)
    assert plan.arms[(1, 0)].speculate is False
    priced = []
    choose = plan.spec_candidate
    plan.spec_candidate = lambda *args, **kwargs: priced.append(1) or choose(*args, **kwargs)
    _, _, speculated = run_steps(plan, 1, 600, lambda active: 100.0 if len(active) == 1 else 60.0)
    probes = sum(1 for i, s in enumerate(speculated) if s and (i == 0 or not speculated[i - 1]))
    assert 2 <= probes and len(priced) <= 4 * probes * PROBE_STEPS, (probes, len(priced))


def test_a_catch_up_is_priced_from_what_the_catch_ups_heard_took():
    """A drafter's catch-up is priced per token of its profiled 16-token forward until catch-ups are heard; then by
    what they took over what they were priced at (the Qwen2.5-Coder 0.5B's catch-up on 4 prompts, priced 5.4 s,
    took 1.4-1.7 s: one forward over 600 tokens is cheaper per token than a 16-token one)."""
    plan = planner(lambda b, w: 10.0 + 0.1 * w, mid_cost=lambda b, w: 2.0 + 0.1 * w)
    plan.tables[1].catch_up_ms = 1.0  # per token
    accept(plan, 0, 1, 0.9)
    mid = next(p for p in plan.plans if p.active == (0, 1))
    plan.behind = {1: 600}
    assert math.isclose(plan.catch_up_ms(mid), 600.0)
    arm = plan.arm(4)
    for _ in range(3):  # three steps of the plan, each catching up on 600 tokens in a quarter of their price
        plan._in_flight[(mid.lengths, mid.active)] = collections.deque([Pending(mid, arm, 10.0, 1.0, time.monotonic(), 600.0)])
        plan.observe_step(4, 8, 0.2, mid.lengths, mid.active, 0.15)
    assert math.isclose(plan.catch_up_ms(mid), 150.0) and math.isclose(plan.catch_up_ms(mid, corrected=False), 600.0)


def test_a_seed_that_must_catch_up_is_measured_only_where_the_requests_can_pay_for_it():
    """The load of 16 decided for the mid model (its best plan seeds the load of 64). At 64 requests whose 160-token
    prompts the mid model has not cached (0.2 s of catch-up at 0.02 ms a token: spread over their steps, the model
    still puts the plan above off), 30 tokens left each (0.3 s at off's rate) cannot pay for measuring it: off runs
    alone (the lookup, with nothing to catch up, may still be tried); 10,000 tokens left can."""
    truth = {(0,): 100.0, (0, 1): 180.0, (0, 2): 100.0}  # tokens/s per request

    def at_64(remaining: int) -> set:
        plan = two_drafters()
        run_steps(plan, 16, 60, lambda active: truth[active])
        assert plan.arms[(16, 0)].speculate and plan.arms[(16, 0)].best_measured().active == (0, 1)
        plan.tables[1].catch_up_ms = 0.02
        for _ in range(30):
            lengths, active = plan.plan_batch(64, behind={1: 64 * 160}, remaining=(remaining,) * 64)
            emitted = 64 * (1 if len(active) == 1 else 4)
            plan.observe_step(64, emitted, emitted / (64 * truth[active]), lengths, active)
        arm = plan.arms[(64, 0)]
        assert arm.seed is not None and arm.seed.active == (0, 1)
        return {p.active for p in arm.rates}

    assert (0, 1) not in at_64(remaining=30)
    assert (0, 1) in at_64(remaining=10_000)


def test_a_plan_asked_for_again_keeps_its_measurement_until_it_runs():
    """Where off is taken, the plan `stale` asks for runs at the next re-probe, not the next step: until it runs, its
    old measurement stands (dropped at once, the plan would lose it without a new one); its first step starts the
    fresh rate and counts the retry."""
    plan = two_drafters()
    truth = lambda active: {(0,): 100.0, (0, 1): 180.0, (0, 2): 100.0}[active]
    run_steps(plan, 4, 40, truth)
    arm = plan.arms[(4, 0)]
    lookup = next(p for p in arm.rates if p.active == (0, 2) and arm.measured(p, 4) is not None)
    measured = arm.measured(lookup, 4)
    arm.steps += RETRY_STEPS  # long enough since it ran
    for proposed, accepted in diffused_rounds(0.95, 200, 6):
        plan.acceptance.observe(0, 2, proposed, accepted)  # its model value rises far past the mid model's plan
    assert plan.stale(arm, {p: arm.measured(p, 4) for p in arm.rates if p.speculating and arm.measured(p, 4)},
                      arm.best_measured(), 4) == lookup
    assert arm.measured(lookup, 4) == measured and lookup not in arm.retries
    plan._in_flight[(lookup.lengths, lookup.active)] = collections.deque([Pending(lookup, arm, 0.0, 1.0, time.monotonic())])
    plan.observe_step(4, 16, 0.01, list(lookup.lengths), lookup.active)
    assert arm.retries[lookup] == 1 and arm.rates[lookup].steps == 1 and lookup not in arm.retrying


def test_overlapping_steps_are_heard_against_the_plans_they_ran():
    """A chain whose steps overlap (a distributed chain stepping single requests concurrently) plans step B before
    step A is heard: A's time is credited to A's plan and B's to B's, whichever was planned last."""
    plan = planner(lambda b, w: 10.0)
    accept(plan, 0, 1, 0.9)
    arm = plan.arm(1)
    off = plan.plans[0]
    spec = next(p for p in plan.plans if p.speculating)
    for first, second in ((off, spec), (spec, off)):
        steps = {p: arm.rate(p).steps for p in (first, second)}
        for p in (first, second):  # both planned, as plan_batch leaves them
            plan._in_flight.setdefault((p.lengths, p.active), collections.deque()).append(Pending(p, arm, 10.0, 1.0, time.monotonic()))
        plan.observe_step(1, 1, 0.01, list(first.lengths), first.active)
        assert arm.rate(first).steps == steps[first] + 1 and arm.rate(second).steps == steps[second]
        plan.observe_step(1, 4, 0.01, list(second.lengths), second.active)
        assert arm.rate(second).steps == steps[second] + 1
    assert not any(plan._in_flight.values()), "every planned step was heard once"
    plan.observe_step(1, 1, 0.01, list(off.lengths), off.active)  # a step nobody planned: nothing to credit
    assert arm.rate(off).steps == 2


def test_a_middle_tier_runs_rounds_until_it_has_the_block_and_hands_up_all_of_it():
    """Exact first passage: at per-token acceptance 1 (5 tokens a round of 4) a need of 6 takes 2 rounds and hands up
    10; at acceptance 0 (1 token a round) 6 rounds and exactly 6; in between the mean block lies between the two."""
    rounds, blocks = middle_rounds(6, 4, 5.0)
    assert abs(rounds - 2.0) < 1e-6 and max(blocks, key=lambda b: b[1])[0] == 10
    rounds, blocks = middle_rounds(6, 4, 1.0)
    assert abs(rounds - 6.0) < 1e-6 and blocks[0][0] == 6 and abs(blocks[0][1] - 1.0) < 1e-6
    rounds, blocks = middle_rounds(6, 4, 3.0)
    mean = sum(length * p for length, p in blocks)
    assert 2.0 < rounds < 6.0 and 6.0 < mean < 10.0 and abs(sum(p for _, p in blocks) - 1.0) < 1e-9


def test_host_time_is_fitted_from_the_steps_work():
    """The host's ms around a step's forwards, a + m x middle rounds + d x drafted forwards, by least squares; a
    feature no step varied gets 0; no coefficient below 0 (the demo chain's figures: 0.3 ms a step, 1.2 a middle
    round, 0.55 a drafted forward)."""
    fit = HostTime()
    for middle, drafted in ((0, 0), (0, 6), (3, 0), (2, 0), (0, 3), (1, 4)):
        fit.add(middle, drafted, 0.3 + 1.2 * middle + 0.55 * drafted)
    a, m, d = fit.coefficients()
    assert abs(a - 0.3) < 1e-6 and abs(m - 1.2) < 1e-6 and abs(d - 0.55) < 1e-6
    assert abs(fit.estimate(3, 2) - (0.3 + 3.6 + 1.1)) < 1e-6
    off_only = HostTime()
    for _ in range(5):
        off_only.add(0, 0, 0.4)
    assert off_only.coefficients() == pytest.approx((0.4, 0.0, 0.0))
    falling = HostTime()
    for drafted, ms in ((0, 5.0), (4, 1.0), (2, 3.0)):
        falling.add(0, drafted, ms)
    a, m, d = falling.coefficients()
    assert d == 0.0 and m == 0.0 and 2.9 < a < 3.1  # a negative slope is dropped: the steps' mean


def test_steps_timed_apart_teach_the_planner_the_hosts_time():
    """Steps of off whose forward took 10 ms of 30, and of a model drafter's block of 3 whose forwards took 13 of 39:
    20 ms of host time a step and 2 a drafted forward, added to every plan's price by its work; an untimed step (a
    remote tier in the chain) teaches nothing."""
    plan = planner(lambda b, w: 10.0)
    off = plan.plans[0]
    two_tier = next(p for p in plan.plans if p.active == (0, 1) and p.lengths[0] == 3)
    before = plan.step_ms(two_tier, 1)[0]
    for _ in range(HOST_MIN_STEPS):
        plan.observe_step(1, 1, 0.030, off.lengths, off.active)
    assert plan.step_ms(two_tier, 1)[0] == before  # not timed apart: nothing learned
    for _ in range(HOST_MIN_STEPS):
        plan.observe_step(1, 1, 0.030, off.lengths, off.active, busy_s=0.010, forwards=(1, 0, 0))
        plan.observe_step(1, 4, 0.039, two_tier.lengths, two_tier.active, busy_s=0.013, forwards=(1, 3, 0))
    assert abs(plan.step_ms(off, 1)[0] - 30.0) < 1e-6
    assert abs(plan.step_ms(two_tier, 1)[0] - (before + 20.0 + 2.0 * 3)) < 1e-6
    assert abs(plan.step_ms(off, 16)[0] - (10.0 + 20.0)) < 1e-6  # another batch size: every size's fit until its own


def test_a_prefill_does_not_move_the_tables_that_price_blocks():
    """Forwards wider than any plan's (a prompt's prefill) are priced apart: folding one in moved the cell of the
    widest block toward the prefill's cost per token. Blocks within the widest plan's are folded."""
    tiers = chain()
    plan = BatchPlanner(tiers, [table(lambda b, w: 1.0 + w), table(lambda b, w: 1.0), None], [0.0, 0.0, 0.05])
    assert plan.widest == max(WIDTH_GRID[-1], max(LENGTHS) + 1)
    before = plan.tables[0].estimate(1, 16)
    tiers[0].forward_log.extend([(1, 100, 0.010)] * 2)  # 100 tokens in 10 ms: far below the line through the grid
    plan.observe_forwards()
    assert plan.tables[0].estimate(1, 16) == before and not tiers[0].forward_log
    tiers[0].forward_log.extend([(1, 7, 0.020)] * 2)  # a block of 6 and its root, 20 ms against 8 profiled
    plan.observe_forwards()
    assert abs(plan.tables[0].estimate(1, 7) - 20.0) < 1e-9


def test_a_lookups_short_blocks_and_misses_end_its_rounds():
    """A lookup asked for 6 that proposes 2, all accepted, gives rounds of 3 tokens: the round ended at its block's
    end as at a rejection, and its verifier's forward took 3 tokens, not 7. A miss (nothing proposed) ends its round
    with none accepted. Counted as nothing, both priced the lookup at nearly 7 tokens a round."""
    plan = planner(lambda b, w: 10.0)
    for _ in range(200):
        plan.observe_round(0, 2, 2, 2, length=6)
    # (the geometric law at the rate counted, 2 accepted a round and one end: 2.8 tokens)
    assert abs(plan.emitted(0, 2, 6) - 3.0) < 0.25 and abs(plan.block_width(0, 2, 6) - 3.0) < 1e-9
    untold = planner(lambda b, w: 10.0)
    for _ in range(200):
        untold.observe_round(0, 2, 2, 2)  # the block asked for unknown: no rejection, the old count
    assert untold.emitted(0, 2, 6) > 6.0
    missing = planner(lambda b, w: 10.0)
    for _ in range(200):
        missing.observe_round(0, 2, 0, 0, length=6)
    assert missing.emitted(0, 2, 6) < 1.1 and missing.block_width(0, 2, 6) == 1.0


def test_a_shadow_proposal_that_runs_out_short_of_the_block_ends_its_round():
    """What the scheduler tells the planner of a lookup it left out: a mismatch ends the shadow round, and so does a
    proposal that ran out (none at all: a miss) short of the block the committed tokens cover; where the committed
    tokens ran out first the round is cut there, with no end."""
    from polyspec.orchestrator.decode.scheduler import ChainScheduler
    from polyspec.workers.core.sampling import SamplingParams

    scheduler = ChainScheduler.__new__(ChainScheduler)
    seen = []
    scheduler.planner, scheduler.recorder = None, types.SimpleNamespace(observe=seen.append)
    run = types.SimpleNamespace(params=SamplingParams(), seq_id=7)
    for proposal, produced in (([5, 6], [5, 6, 9, 4]), ([5, 6, 7, 8], [5, 6]), ([], [5, 6, 9]), ([5, 1], [5, 6, 9]),
                               ([5, 6], [5, 6, 9])):
        scheduler._observe_shadow(2, proposal, produced, run)
    assert [(o.proposed, o.accepted, o.ended) for o in seen] == [(2, 2, True), (2, 2, False), (0, 0, True), (2, 1, True),
                                                                  (2, 2, False)]
