"""The tuner on a distributed chain: the stage reports of protos tier.proto in, as the driver's
typed observations (driver.round_observations, then the round's StepObservation), lengths out
(Tuner.plan); overheads per target round and per other round fitted from the driver's
residuals; a pipelined drafter's measured block time."""

from __future__ import annotations

import pytest

from polyspec.orchestrator.decode.contract import StepInput, StepObservation
from polyspec.orchestrator.distributed.driver import round_observations
from polyspec.orchestrator.tuning.profiler import LatencyProfile
from polyspec.orchestrator.tuning.time_model import contended_block_ms, fit_slowdown, latency
from polyspec.orchestrator.tuning.chain_model import chain_cost
from time_model_reference import cost_per_token, fitted_slowdown
import polyspec.orchestrator.tuning.timing as timing_module
from polyspec.orchestrator.tuning.tuner import Tuner
from polyspec.protos.polyspec.v1 import tier_pb2
from polyspec.workers.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def remote_tuner(pipelined: bool = False) -> Tuner:
    profile = LatencyProfile(
        ["target", "mid", "ngram"],
        forward=[{m: 8.0 + 0.3 * m for m in range(1, 14)}, {m: 4.0 + 0.2 * m for m in range(1, 14)}, None],
        draft=[None, {k: 3.5 * k for k in range(1, 7)}, {k: 0.05 for k in range(1, 7)}],
    )
    tuner = Tuner(profile, max_length=6, distributed=True, pipelined=pipelined)
    return tuner


def plan_round(tuner: Tuner, new_tokens: int | None = None) -> list[int]:
    """The driver's plan of a round (`new_tokens`: given, a request's first round, asking for that many)."""
    first = new_tokens is not None
    lengths, active = tuner.plan(StepInput((GREEDY,), (32,), remaining=(new_tokens,) if first else (), first=(first,)))
    assert active == tuple(range(tuner.num_tiers))
    return lengths


def hear(tuner: Tuner, reports, wall_s: float, model_s: float, first: bool, lengths=None) -> None:
    """What the driver tells the tuner of a round: its reports, then the step (by default with the last plan's lengths)."""
    for observation in round_observations(reports, GREEDY, 32, 1):
        tuner.observe(observation)
    if lengths is None:
        lengths = tuner.running.lengths if tuner.running is not None else ()
    tuner.observe(StepObservation(((),), wall_s, tuple(lengths), tuple(range(tuner.num_tiers)), first=(first,), model_s=model_s))


def report(tier, drafter, length, proposed, accepted, seconds=0.0, **extra) -> tier_pb2.StageReport:
    return tier_pb2.StageReport(tier=tier, drafter=drafter, length=length, proposed=proposed, accepted=accepted,
                                seconds=seconds, **extra)


def test_overheads_per_target_round_and_per_other_round():
    """Residual (driver wall - model time) = a + b * (other rounds on the path): the fit recovers
    a = 3 ms and b = 1.5 ms from exact data; with no other rounds ever on the path (pipelined),
    the prior a = 2 b splits it."""
    tuner = remote_tuner()
    for step in range(200):
        others = step % 4
        reports = [report(0, 1, 4, 4, 4, 0.010)] + [report(1, 2, 3, 3, 1, 0.005)] * others
        model_s = 0.010 + 0.005 * others
        hear(tuner, reports, model_s + (3.0 + 1.5 * others) / 1000.0, model_s, first=False)
    assert tuner.timing.step_overhead_ms == pytest.approx(3.0, rel=0.02)
    assert tuner.timing.round_overhead_ms == pytest.approx(1.5, rel=0.02)
    stages, _ = tuner.stages("greedy", (0, 1, 2))
    assert [s.overhead_ms for s in stages] == pytest.approx([3.0, 1.5], rel=0.02)

    only_target = remote_tuner(pipelined=True)
    for _ in range(200):
        hear(only_target, [report(0, 1, 4, 4, 4, 0.010)], 0.010 + 0.004, 0.010, first=False)
    assert only_target.timing.step_overhead_ms == pytest.approx(4.0, rel=0.02)
    assert only_target.timing.round_overhead_ms == pytest.approx(2.0, rel=0.02)


def test_first_round_gives_acceptance_but_no_latency():
    tuner = remote_tuner()
    hear(tuner, [report(0, 1, 4, 4, 2, 0.5), report(2, 2, 3, 3, 0, 0.5)], 1.0, 0.9, first=True)
    assert tuner.estimates("greedy")[(0, 1)].blocks == pytest.approx(1.0)
    assert not tuner.profile.online_forward and not tuner.profile.online_draft
    assert tuner.timing.step_overhead_ms == 0.0


def test_first_rounds_give_the_head_start_and_the_request_length():
    """A pipelined chain: the prompt's forward (the first round's target report less a round's
    forward) is the head start of the second block, and the plan's remaining tokens (given at a
    request's first round) the request's length; the target's stage carries both, and the
    searches then weigh the first rounds (time_model.chain_cost)."""
    tuner = remote_tuner(pipelined=True)
    prompt_ms = 30.0
    for request in range(12):
        plan_round(tuner, new_tokens=64 if request < 6 else 32)
        forward_s = (latency(tuner.profile.forward_ms(0, (0, 1, 2)), 5) + prompt_ms) / 1000.0
        hear(tuner, [report(0, 1, 4, 4, 4, forward_s)], 0.1, 0.09, first=True)
        for _ in range(3):
            plan_round(tuner)  # later rounds leave both alone
            hear(tuner, [report(0, 1, 4, 4, 4, 0.009)], 0.02, 0.014, first=False)
    assert tuner.head_start_ms == pytest.approx(prompt_ms)
    assert 32 < tuner.request_tokens < 32 + 32 * 0.8 ** 6 + 0.5  # an EMA moving to the recent requests' 32
    stages, draft_ms = tuner.stages("greedy", (0, 1, 2))
    assert stages[0].head_start_ms == pytest.approx(prompt_ms) and stages[0].request_tokens == round(tuner.request_tokens)
    assert stages[1].head_start_ms == 0.0 and stages[1].request_tokens == 0
    assert tuner.predict("greedy", (0, 1, 2), (4, 3)) == pytest.approx(chain_cost(stages, draft_ms, [4, 3]))
    serial = remote_tuner()  # no draft-ahead: nothing to weigh, C_0 alone
    plan_round(serial, new_tokens=64)
    hear(serial, [report(0, 1, 4, 4, 4, 0.05)], 0.1, 0.09, first=True)
    stages, draft_ms = serial.stages("greedy", (0, 1, 2))
    assert stages[0].head_start_ms == 0.0 and serial.head_start_ms == 0.0
    assert serial.predict("greedy", (0, 1, 2), (4, 3)) == pytest.approx(cost_per_token(stages, draft_ms, [4, 3]))


def test_drafted_ahead_blocks_set_the_drafters_slowdown(monkeypatch):
    """A pipelined drafter's blocks (block_seconds reports) take what the model says they cost
    with the drafter 1.5x slower while the target scores beside it: the slow-down converges
    there and the pipelined model's round grows with it."""
    tuner = remote_tuner(pipelined=True)
    lengths = [4, 3]

    def step(block_ms: float | None = None) -> None:
        reports = [report(0, 1, 4, 4, 4, 0.009), report(1, 2, 3, 3, 1, 0.005, ahead=True)]
        if block_ms is not None:
            reports.append(report(1, 1, 4, 4, 0, ahead=True, block_seconds=block_ms / 1000.0))
        hear(tuner, reports, 0.02, 0.014, first=False)

    for _ in range(200):  # the same rounds again and again: the estimates settle
        step()
    stages, draft_ms = tuner.stages("greedy", (0, 1, 2))
    modelled_block_ms = 4 * cost_per_token(stages[1:], draft_ms, lengths[1:])
    beside_ms = latency(tuner.profile.forward_ms(0, (0, 1, 2)), 4) + tuner.timing.step_overhead_ms
    before = cost_per_token(stages, draft_ms, lengths)
    fits = []
    real_fit = timing_module.fit_slowdown
    monkeypatch.setattr(timing_module, "fit_slowdown", lambda *args: fits.append(1) or real_fit(*args))
    for _ in range(60):
        step(contended_block_ms(modelled_block_ms, beside_ms, 1.5))
    assert not fits  # fitted when read, not on every block (it was most of the hook's driver CPU)
    assert tuner.timing.ahead_slowdown[1] == pytest.approx(1.5, rel=0.02)
    assert len(fits) == 1
    tuner.stages("greedy", (0, 1, 2))
    assert len(fits) == 1  # no new block: no refit
    stages, draft_ms = tuner.stages("greedy", (0, 1, 2))
    assert stages[0].drafter_slowdown == pytest.approx(1.5, rel=0.02)
    assert cost_per_token(stages, draft_ms, lengths) > before


def test_contention_slows_only_the_part_of_a_block_drafted_beside_the_verifier():
    # a block that fits in the verifier's 10 ms: all of it slowed; a longer one: only its
    # first 10 ms are shared (6.67 ms of work done in them at 1.5x), the rest at full speed
    assert contended_block_ms(4.0, 10.0, 1.5) == pytest.approx(6.0)
    assert contended_block_ms(30.0, 10.0, 1.5) == pytest.approx(30.0 + 10.0 / 3)
    assert contended_block_ms(30.0, 10.0, 1.5) < 1.5 * 30.0
    for block_ms in (2.0, 6.0, 12.0, 40.0):
        for slowdown in (0.8, 1.0, 1.3, 2.0):
            measured = contended_block_ms(block_ms, 10.0, slowdown)
            assert fitted_slowdown(measured, block_ms, 10.0) == pytest.approx(slowdown, rel=1e-6)


def test_a_distributed_plan_never_bypasses():
    tuner = remote_tuner()
    for _ in range(40):
        lengths = plan_round(tuner)
        assert len(lengths) == 2
        # the n-gram tier never helps here: an embedded tuner would bypass it
        hear(tuner, [report(0, 1, lengths[0], lengths[0], lengths[0], 0.009),
                                      report(1, 2, lengths[1], lengths[1], 0, 0.005)], 0.02, 0.014, first=False)
    assert tuner.history and all(entry["active"] == ["target", "mid", "ngram"] for entry in tuner.history)
    described = tuner.describe()  # a run's stats (polyspec batch --stats): the plan and the rates it rests on
    assert described["classes"]["greedy"]["plan"]["tiers"] == ["target", "mid", "ngram"]
    assert described["classes"]["greedy"]["rates"]["mid<-ngram"][0] < 0.5 and described["history"] == tuner.history


def test_pipelined_round_without_a_block_is_no_latency_sample():
    """Pipelined, the verifier shares the cores with its drafter drafting ahead, except in a
    round without a block (a request's last token): that forward is not what the model charges
    and must not pull the table down; serially it is an ordinary sample."""
    for pipelined, expected in ((True, 20.0), (False, None)):
        tuner = remote_tuner(pipelined)
        for _ in range(30):
            hear(tuner, [report(0, 1, 4, 4, 4, 0.020)], 0.025, 0.020, first=False)
        for _ in range(5):
            hear(tuner, [report(0, 1, 4, 0, 0, 0.005)], 0.008, 0.005, first=False)
        table = tuner.profile.online_forward[(0, (0, 1, 2))]
        if expected is not None:
            assert table.online[5] == pytest.approx(expected, rel=0.01)
            assert 1 not in table.online
        else:
            assert 1 in table.online  # sampled (the serial form charges it as it runs)
    # a middle stage's empty block (the n-gram tier found no match) is an ordinary round: the
    # middle tier's t(1) is learned from it (on sampled text most of its rounds are such)
    tuner = remote_tuner(pipelined=True)
    for _ in range(30):
        hear(tuner, [report(0, 1, 4, 4, 4, 0.020), report(1, 2, 3, 0, 0, 0.007, ahead=True)],
                             0.025, 0.020, first=False)
    assert tuner.profile.online_forward[(1, (0, 1, 2))].online[1] == pytest.approx(7.0, rel=0.01)


def test_first_rounds_are_kept_for_calibration():
    """The first round's wall time goes to `first_rounds` (what polyspec tune calibrates the
    per-request cost from); `calibrate_first_rounds` keeps measured / modelled."""
    from polyspec.orchestrator.tuning.chain_model import first_round_ms
    from polyspec.harness.tune import calibrate_first_rounds
    from polyspec.orchestrator.tuning.tuner import Plan

    tuner = remote_tuner(pipelined=True)
    for number in range(3):
        plan_round(tuner)
        hear(tuner, [report(0, 1, 6, 6, 6, 0.05)], 0.060 + 0.01 * number, 0.05, first=True)
    assert list(tuner.first_rounds) == pytest.approx([60.0, 70.0, 80.0])
    plan = Plan((4, 4), (0, 1, 2))
    stages, draft_ms = tuner.stages("greedy", plan.active)
    modelled = first_round_ms(stages, draft_ms, [4, 4], 48)
    prefill = [[10.0, 5.0, 0.0]] * 3
    calibrate_first_rounds(tuner, "greedy", [(plan, [1.5 * (modelled + 15.0)] * 2 + [9.0 * (modelled + 15.0)])], prefill, 48)
    assert tuner.first_round_scale == pytest.approx(1.5)  # the median: one outlier does not move it


def test_proposal_fill_from_the_bottom_tiers_reports():
    """A distributed chain's bottom tier reports `length` asked and `proposed`: an n-gram tier
    that proposes nothing in 3 of 4 asks has fill 1/4; a model drafter's stays 1."""
    tuner = remote_tuner(pipelined=True)
    for step in range(200):
        proposed = 3 if step % 4 == 0 else 0
        reports = [report(0, 1, 4, 4, 4, 0.009), report(1, 2, 3, proposed, 0, 0.005, ahead=True),
                   report(2, 2, 3, proposed, 0, 0.0001)]
        hear(tuner, reports, 0.02, 0.014, first=False)
    assert tuner.fill("greedy", 2) == pytest.approx(0.25, abs=0.03)
    assert tuner.fill("greedy", 1) == 1.0
    stages, _ = tuner.stages("greedy", (0, 1, 2))
    assert [s.fill for s in stages] == pytest.approx([1.0, 0.25], abs=0.03)


def test_pipelined_jitter_from_the_targets_rounds():
    """The spread of the target's forwards around the profile (here 0.8x and 1.2x in turn: a
    coefficient of variation of 0.2) becomes the target stage's jitter_cv; serial chains have none."""
    tuner = remote_tuner(pipelined=True)
    base = tuner.profile.forward_ms(0, (0, 1, 2))[5]
    for step in range(200):
        ms = base * (0.8 if step % 2 else 1.2)
        hear(tuner, [report(0, 1, 4, 4, 4, ms / 1000.0)], 0.03, ms / 1000.0, first=False)
    assert tuner.timing.jitter_cv == pytest.approx(0.2, abs=0.04)
    stages, _ = tuner.stages("greedy", (0, 1, 2))
    assert stages[0].jitter_cv == pytest.approx(tuner.timing.jitter_cv) and stages[1].jitter_cv == 0.0
    serial = remote_tuner(pipelined=False)
    for step in range(50):
        ms = base * (0.8 if step % 2 else 1.2)
        hear(serial, [report(0, 1, 4, 4, 4, ms / 1000.0)], 0.03, ms / 1000.0, first=False)
    assert all(stage.jitter_cv == 0.0 for stage in serial.stages("greedy", (0, 1, 2))[0])


def test_a_new_request_starts_from_the_long_run_acceptance():
    """Distributed: a request's first round (`first=True`) resets the recent estimates to the
    class's long-run ones and the next plan re-tunes (Tuner.restart_class)."""
    tuner = remote_tuner()
    for _ in range(60):  # the int8-like pair agrees: long blocks
        lengths = plan_round(tuner)
        hear(tuner, [report(0, 1, lengths[0], lengths[0], lengths[0], 0.01),
                                      report(1, 2, lengths[1], lengths[1], lengths[1], 0.005)], 0.02, 0.015, first=False)
    long_plan = plan_round(tuner)
    for _ in range(16):  # one hard request: the target rejects its drafter's first token
        lengths = plan_round(tuner)
        hear(tuner, [report(0, 1, lengths[0], lengths[0], 0, 0.01),
                                      report(1, 2, lengths[1], lengths[1], lengths[1], 0.005)], 0.02, 0.015, first=False)
    assert tuner.accept_rates("greedy", 0, 1)[0] < 0.5
    short = plan_round(tuner)
    assert short != long_plan
    hear(tuner, [], 0.05, 0.04, first=True)  # a new request's first round
    assert tuner.accept_rates("greedy", 0, 1)[0] > 0.7
    after = plan_round(tuner)  # re-tuned at once, on the long-run rates
    assert after != short and after == list(tuner.choose("greedy").lengths)


def test_the_slowdown_fit_matches_the_blocks_mean_time():
    """Blocks drafted ahead vary (the drafter's rounds, the estimates behind the modelled time):
    the fit matches their weighted mean time, where averaging each block's own inverse is biased
    upwards (s = 1 / (1 - excess / forward) is convex) and swings with single stalls."""
    import random

    rng = random.Random(0)
    samples = []
    for _ in range(64):
        block_ms, forward_ms = rng.uniform(15.0, 45.0), rng.uniform(12.0, 18.0)
        measured = contended_block_ms(block_ms, forward_ms, 1.25) + rng.gauss(0.0, 5.0)  # excess ~ N(3.2, 5)
        samples.append((1.0, measured, block_ms, forward_ms))
    s = fit_slowdown(samples, start=1.0)
    mean_gap = sum(contended_block_ms(b, f, s) - m for _, m, b, f in samples) / len(samples)
    assert abs(mean_gap) < 1e-3
    assert 1.1 < s < 1.45
    per_block = sum(fitted_slowdown(m, b, f) for _, m, b, f in samples) / len(samples)
    assert per_block > s + 0.1
    # exact data in both regimes (blocks within the verifier's forward and longer): s recovered
    exact = [(1.0, contended_block_ms(b, 10.0, 1.6), b, 10.0) for b in (2.0, 5.0, 8.0, 20.0, 40.0)]
    assert fit_slowdown(exact, start=1.0) == pytest.approx(1.6, rel=1e-3)
    assert fit_slowdown(exact, start=2.9) == pytest.approx(1.6, rel=1e-3)
