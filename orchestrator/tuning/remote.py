"""A distributed chain's hooks into the tuner (the `RemoteHooks` part of `Tuner`).

The driver of a distributed chain plans each target round with `plan_remote` and reports it
whole, with the stage reports every tier sent up, to `observe_remote`. Rounds of concurrent
requests arrive whole, so no per-round state is kept between the two calls (the embedded
scheduler's hooks, in tuner.py, follow a round as it runs instead).
"""

from __future__ import annotations

import collections

from polyspec.orchestrator.tuning.estimates import ema, request_class
from polyspec.orchestrator.tuning.time_model import latency
from polyspec.workers.core.sampling import SamplingParams

REQUEST_SMOOTHING = 0.2  # pipelined: memory of requests' lengths and prompt forwards (~5 requests)


class RemoteHooks:
    """`plan_remote` / `observe_remote` (part of `Tuner`)."""

    def __init__(self) -> None:
        # a distributed chain's first target round of each request (prefills, sequence set-up on
        # every tier): its wall ms, for `polyspec tune` to calibrate the per-request cost
        self.first_rounds: collections.deque[float] = collections.deque(maxlen=256)
        self.first_round_scale = 1.0  # measured / modelled first rounds (`set_first_round_scale`)
        # pipelined: a request's first round scores the prompt, and the drafter drafts the second
        # block beside it; the searches charge the first rounds' extra time (StageSpec.head_start_ms)
        # over a request's length (`request_tokens`: new tokens asked for, an EMA; 0 = unknown, C_0
        # alone). Both from a distributed chain's first rounds (plan_remote / observe_remote).
        self.head_start_ms = 0.0
        self.request_tokens = 0.0

    def set_first_round_scale(self, scale: float) -> None:
        """A distributed chain's first rounds cost `scale` times their model (`polyspec tune`
        calibrates it; the searches of `polyspec tune` charge it)."""
        self.first_round_scale = scale

    def plan_remote(self, params: SamplingParams, new_tokens: int | None = None) -> list[int]:
        """Before a distributed chain's target round: the lengths to send with it. Rounds of
        concurrent requests arrive whole (`observe_remote`), so no per-round state is kept
        here; the caller serialises the two calls. `new_tokens`: given before a request's first
        round, the tokens it asks for (a pipelined chain's searches weigh its first rounds by
        them: `request_tokens`)."""
        if new_tokens:
            self.request_tokens = ema(self.request_tokens or None, new_tokens, REQUEST_SMOOTHING)
        key = request_class(params)
        state = self.class_state(key)
        self.age_class(state)
        self.earn_retune_credit(state)
        if self.fixed is not None:
            plan = self.fixed
        else:
            if self.retune_due(state):
                self.retune(key, state)
            plan = state.plan
        state.rounds += 1
        self.running = plan
        return list(plan.lengths)

    def observe_remote(self, params: SamplingParams, reports, wall_s: float, model_s: float, first: bool,
                       lengths: list[int] | None = None) -> None:
        """After a distributed chain's target round: its stage reports (protos tier.proto
        StageReport: verification rounds, and the bottom tier's proposals with tier == drafter),
        the round's wall time at the driver and the model time in it. `first`: the request's
        first round (it prefilled the prompt: no latency sample). `lengths`: the ones the round
        was sent with (default: the last plan_remote's; the driver reports a round during the
        next one, after that has been planned)."""
        key = request_class(params)
        config = tuple(range(self.num_tiers))
        rounds = 0
        if lengths is None:
            lengths = self.running.lengths if self.running is not None else []
        lengths = dict(enumerate(lengths))
        lengths.update({report.tier: report.length for report in reports if report.tier < report.drafter})
        if first:
            self.first_rounds.append(1000.0 * wall_s)
            self.restart_class(self.class_state(key))  # (the request's first round has already run on the old plan)
        for report in reports:
            if report.block_seconds > 0:  # a block drafted ahead: the pipelined model's D, measured
                if not first:
                    self.observe_ahead_block(key, report.tier, report.proposed, report.block_seconds * 1000.0, lengths)
                continue
            if report.drafter == report.tier:
                self.observe_fill(key, report.tier, report.length, report.proposed)
                if not first:
                    self.profile.observe_draft(report.tier, report.length, report.seconds * 1000.0, config)
                continue
            is_tree = self.tree_width > 1 and report.drafter == self.num_tiers - 1
            proposed = report.length if is_tree else max(report.length, report.proposed)
            self.observe_pair(key, report.tier, report.drafter, proposed, min(report.accepted, proposed))
            # pipelined: the target's round without a block (the last token of a request) had no
            # drafter running beside it, unlike the rounds the model charges (the verifier shares
            # the cores with the drafter drafting ahead: measured 1.3-1.5x slower on the demo
            # chain). A lower stage's empty block (an n-gram tier with no match) is an ordinary round.
            if first and self.pipelined and report.tier == 0:
                # the prompt's forward: how long the drafter drafts the second block beside it
                extra = max(0.0, report.seconds * 1000.0 - latency(self.profile.forward_ms(0, config), report.proposed + 1))
                self.head_start_ms = ema(self.head_start_ms or None, extra, REQUEST_SMOOTHING)
            if not first and not (self.pipelined and report.proposed == 0 and report.tier == 0):
                if self.pipelined and report.tier == 0:
                    modelled = latency(self.profile.forward_ms(0, config), report.proposed + 1)
                    self.observe_jitter(report.seconds * 1000.0 / modelled - 1.0)
                self.profile.observe_forward(report.tier, report.proposed + 1, report.seconds * 1000.0, config)
            rounds += not report.ahead  # rounds run while drafting ahead were off this round's critical path
        if not first and rounds:
            self.fit_overheads(rounds - 1, 1000.0 * max(0.0, wall_s - model_s))
