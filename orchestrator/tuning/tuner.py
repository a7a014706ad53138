"""The online tuner: chooses every speculation length (and which tiers to use) from the time model.

It is the `contract.RoundPlanner` of a chain that runs one request at a time. Embedded, the chain
scheduler consults it before each target round (`plan`) and reports every verification round,
bottom-tier proposal and target round through `observe` as they happen. Distributed, the driver
(driver.DistributedChain) plans each round, maybe while the one before is in flight, and reports
it whole after it ran, the tiers' stage reports as the same typed observations
(`_observe_remote_round`: overheads, first rounds and blocks drafted ahead besides). The tuner is
built on estimates.py (acceptance per (verifier, drafter) pair and per position of the text,
`AcceptanceEstimate`: a recency-weighted Beta posterior per position, with a shift detector; the
bottom drafter's fill, `FillEstimate`), timing.py (`Timing`, its clocks: overheads outside the
forwards, a pipelined chain's jitter and drafting-ahead slow-downs) and the time model
(time_model.py, chain_model.py); this module holds the hooks, the per-class state they feed,
and the decisions.

Its knobs are one frozen `polyspec.orchestrator.config.TuningConfig` (the config file's
`tuning:` section); facts about the chain (tree width, distributed, pipelined) are
constructor arguments. Nothing is set on a tuner from outside after construction but `fix`,
which pins a plan, and `first_round_scale`, a calibration (both polyspec tune's).

Estimates are kept per request class ("greedy" / "sampling"), per (verifier, drafter)
pair, per position of the text (each round weighted by the tokens it covers), so that one
table predicts rounds at every length (`time_model.renewal_rates`). Acceptance differs more
between prompts than along one, so the same counts are also kept with a long memory
(SLOW_DECAY), and each new request starts from those (`restart_class`).

Pairs the chain does not run directly are estimated from data it already has: while a
middle tier sits between the target and the bottom drafter, the bottom's first proposal of
every target round (made at the committed context) is matched against the tokens the
target then commits. For greedy decoding and for deterministic drafters (the n-gram tier)
the matched prefix has exactly the distribution of the target's accepted prefix; for a
sampled model drafter it is a lower bound (P[match] = sum p_t p_d <= sum min(p_t, p_d)).
The full chain samples contexts evenly along the text, a chain running the pair once per
round, so position 1 of each shadow sample is weighted 1 / (matched + 1) (see `_observe_commit`).
Shadow estimates only count once they have MIN_BLOCKS blocks, and only until the pair has as
many of its own.

Which tiers run, at which lengths: every round of a class's warm-up (`warmup_rounds`; its searches see acceptance one posterior
sd optimistic, so the deeper positions get tried), then every `retune_every` rounds (as the
re-tune budget allows), the tuner searches lengths for each usable set of tiers: every
combination (time_model.search_lengths) in the warm-up, after a shift and every
FULL_SEARCH_EVERY rounds, else near the set's last lengths (time_model.local_search). It
switches only when the predicted gain exceeds `hysteresis` for new lengths on the same
tiers (none in the full search a detected shift calls for, nor once the plan's own
predicted time has drifted `replan_drift` from its last weighing: `_switch_margin`),
`switch_hysteresis` for another set of tiers (then the best lengths on the current
tiers are still taken if they clear `hysteresis`). A tier that is bypassed gets no data, so
every so often (`_set_probing`) the full chain runs for one round (a probe).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import math
import time
from typing import Callable

from polyspec.orchestrator.config import TuningConfig
from polyspec.orchestrator.decode.contract import DraftObservation, RoundObservation, StepInput, StepObservation, common_prefix
from polyspec.orchestrator.tuning.chain_model import chain_cost, local_search, round_models, search_lengths
from polyspec.orchestrator.tuning.estimates import MIN_BLOCKS, AcceptanceEstimate, FillEstimate, ema, request_class
from polyspec.orchestrator.tuning.profiler import LatencyProfile
from polyspec.orchestrator.tuning.time_model import StageSpec, latency
from polyspec.orchestrator.tuning.timing import OVERHEAD_SMOOTHING, Timing

__all__ = ["Tuner", "Plan", "AcceptanceEstimate", "FillEstimate", "request_class", "TuningConfig"]

SLOW_DECAY = 0.99  # the class's long-run acceptance (~100 target rounds): where each request starts from
STALE_BLOCKS = 2.0  # an estimate without new data (a bypassed tier's) forgets down to this many blocks' weight
MAX_PENDING = 256  # requests the tuner follows at once (round-robin serving)
CATCH_UP_SMOOTHING = 0.3  # memory of what a returning tier's re-feeding costs (~3 probes)
REQUEST_SMOOTHING = 0.2  # distributed, pipelined: memory of requests' lengths and prompt forwards (~5 requests)
RETUNE_BUDGET = 0.02  # routine re-tunes may take this share of the wall time (a search: about a millisecond of Python)
FULL_SEARCH_EVERY = 32  # target rounds between full searches (every length); re-tunes between them search near the last lengths
PROBE_BUDGET = 0.01  # probes of bypassed tiers may cost this share of the predicted time


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the scheduler runs: a length per verifying level and the tiers in use."""

    lengths: tuple[int, ...]  # [level] = block length tier `level` verifies (unused levels keep a value)
    active: tuple[int, ...]  # tier indices in use, target first
    predicted_ms: float = dataclasses.field(default=float("nan"), compare=False)  # predicted ms per target token (C_0)


@dataclasses.dataclass
class ClassState:
    """What the tuner keeps per request class ("greedy" / "sampling"): its estimates, its plan,
    and the counters of its re-tunes and probes."""

    estimates: dict[tuple[int, int], AcceptanceEstimate]  # measured where the pair runs
    shadow_estimates: dict[tuple[int, int], AcceptanceEstimate] = dataclasses.field(default_factory=dict)  # skip pairs, from commits
    fills: dict[int, FillEstimate] = dataclasses.field(default_factory=dict)  # per bottom drafter: proposed / asked
    plan: Plan | None = None
    rounds: int = 0
    probe_every: int = 0  # while bypassing: rounds between probes of all tiers (0: not bypassing)
    since_probe: int = 0
    # the same counts with a long memory (SLOW_DECAY): what a new request of the class starts from
    long_run: dict[tuple[int, int], AcceptanceEstimate] = dataclasses.field(default_factory=dict)
    long_run_fills: dict[int, FillEstimate] = dataclasses.field(default_factory=dict)
    retune_now: bool = False  # a request started (its estimates were reset) or the text shifted: re-tune before the next round
    since_retune: int = 0  # target rounds since the last re-tune
    eager_rounds: int = 0  # after a shift in the text: rounds left that re-tune every round (the estimates are still moving)
    since_full: int = 0  # target rounds since the last full search
    full_now: bool = False  # the text shifted: the next re-tune is a full search
    anchor_ms: float | None = None  # the plan's predicted ms when it was last weighed with no margin (`_switch_margin`)
    set_plans: dict[tuple[int, ...], Plan] = dataclasses.field(default_factory=dict)  # the last search's best plan per set of tiers


@dataclasses.dataclass
class Shadow:
    """The bottom tier's proposal at a committed context, waiting for the target's tokens."""

    key: str
    drafter: int
    proposal: list[int]
    requested: int
    committed: list[int] = dataclasses.field(default_factory=list)


class Tuner:
    """One chain's online tuner (see the module docstring)."""

    def __init__(self, profile: LatencyProfile, config: TuningConfig | None = None, *, tree_width: int = 1,
                 distributed: bool = False, pipelined: bool = False, clock: Callable[[], float] = time.perf_counter,
                 **knobs) -> None:
        """`config`: the knobs (default: TuningConfig()); `knobs` override single fields of it
        (`Tuner(profile, max_length=6)`). `distributed`: the chain runs as tier workers (every
        tier runs every round: no bypass, its repair loop routes around dead tiers; per-call
        overheads: timing.py). `pipelined`: its drafters draft ahead (the pipelined time model).
        `clock`: what re-tunes are timed with (their budget: `earn_retune_credit`)."""
        self.config = dataclasses.replace(config or TuningConfig(), **knobs)
        self.profile = profile
        self.num_tiers = len(profile.names)
        self.tree_width = tree_width
        self.distributed = distributed
        self.pipelined = pipelined
        self.clock = clock
        self.timing = Timing(distributed)
        self.retune_ms = 0.0  # a full search's cost (EMA; a local one costs about a third)
        self.history: list[dict] = []  # every plan change: {"class", "round", "lengths", "active", "predicted_ms_per_token"}
        self._retune_credit_ms = 0.0
        self._last_plan_at: float | None = None
        self._optimism = 0.0  # z of the acceptance rates the time model sees (warmup_optimism in a class's warm-up searches)
        self._optimistic_pairs: frozenset[tuple[int, int]] | None = None  # the pairs it applies to (None: all)
        self.fixed: Plan | None = None  # a pinned plan (`fix`), run while still learning
        self.running: Plan | None = None  # the plan of the current target round
        self._classes: dict[str, ClassState] = {}
        self._key = "greedy"
        # requests may interleave round by round (a server): they are told apart by their
        # committed length, which each target round moves from `_round_start` to the next
        self._round_start = -1  # committed tokens when the current target round began
        self._continuing: dict[int, None] = {}  # committed lengths a known request resumes at (insertion ordered)
        self._prefilling = False  # the current target round is a request's first (it feeds the prompt)
        self._catching_up: frozenset[int] = frozenset()  # tiers back from bypass: this round re-feeds what they missed
        self._shadows: dict[int, Shadow] = {}  # pending skip-pair proposals, by the committed length they resume at
        self._last_commit = 0
        # per model tier: the extra ms of its first forward when it returns from a bypass (it
        # re-feeds what it missed: the tokens since it last ran, and the prompt when a request
        # began without it), an EMA; what a probe of a bypassed tier costs (`_set_probing`)
        self.catch_up_ms: dict[int, float] = {}
        # distributed: the observations of the round being heard (`observe`); each request's first round
        # (prefills, sequence set-up on every tier): its wall ms, for `polyspec tune` to calibrate the
        # per-request cost (`first_round_scale`: measured / modelled, what its searches charge)
        self._heard: list = []
        self.first_rounds: collections.deque[float] = collections.deque(maxlen=256)
        self.first_round_scale = 1.0
        # pipelined: a request's first round scores the prompt, and the drafter drafts the second
        # block beside it; the searches charge the first rounds' extra time (StageSpec.head_start_ms)
        # over a request's length (`request_tokens`: new tokens asked for, an EMA; 0 = unknown, C_0 alone)
        self.head_start_ms = 0.0
        self.request_tokens = 0.0

    def copy_with(self, **knobs) -> "Tuner":
        """A copy of this tuner (profile, estimates and all) with some knobs changed: arms of an
        experiment that start from the same measurements."""
        clone = copy.deepcopy(self)
        clone.config = dataclasses.replace(self.config, **knobs)
        return clone

    def describe(self) -> dict:
        """What it believes and chose (a run's stats: `polyspec batch --stats`): per request class, the
        plan with its predicted ms per token and the acceptance of the pairs it ran (positions 1-4);
        its last plan changes."""
        names = self.profile.names
        return {"classes": {key: {
            "plan": None if state.plan is None else {
                "tiers": [names[t] for t in state.plan.active], "lengths": [state.plan.lengths[t] for t in state.plan.active[:-1]],
                "predicted_ms_per_token": round(state.plan.predicted_ms, 4)},
            "rates": {f"{names[v]}<-{names[d]}": [round(r, 4) for r in self.accept_rates(key, v, d)[:4]] for v, d in list(state.estimates)},
        } for key, state in self._classes.items()}, "history": self.history[-64:]}

    def fix(self, plan: Plan | None) -> None:
        """Run `plan` on every round from now on, still learning from it (None: the tuner's own
        plans again). `polyspec tune` measures fixed plans this way."""
        self.fixed = plan

    # --------------------------------------------------------------- planner hooks

    one_request = True  # follows one request's text: given steps of one request (contract.RoundPlanner)
    predicted_tokens_per_s: float | None = None  # (contract.RoundPlanner) set by `plan`
    shadows = False  # it builds its skip pairs' shadow estimates from the full chain's own proposals

    def plan(self, step: StepInput) -> tuple[list[int], tuple[int, ...]]:
        """`contract.RoundPlanner.plan`: before a target round of one request, the lengths (one per
        level) and the tiers to use. (Distributed, no state is kept for the round: rounds of concurrent
        requests are planned, maybe ahead, and heard whole, apart: `_observe_remote_round`.)"""
        if step.batch != 1:
            raise ValueError(f"the online tuner plans one request's rounds, got a step of {step.batch}")
        committed_len, key = step.context_lens[0], request_class(step.params[0])
        starts = False  # a request starts (distributed: its first round restarts the class when heard)
        if not self.distributed:
            continues_last = committed_len == self._round_start + self._last_commit
            self._prefilling = starts = committed_len not in self._continuing
            self._continuing.pop(committed_len, None)
            self.timing.measure_overhead(continues_last)
            self._round_start, self._key = committed_len, key
        elif step.first[:1] == (True,) and step.remaining:  # weighs a pipelined chain's first rounds
            self.request_tokens = ema(self.request_tokens or None, step.remaining[0], REQUEST_SMOOTHING)
        state = self.class_state(key)
        self.age_class(state)
        self.earn_retune_credit(state)
        if starts:
            self.restart_class(state)
        if self.fixed is not None:
            plan = self.fixed
        else:
            if self.retune_due(state):
                self.retune(key, state)
            plan = state.plan
            if state.probe_every:
                state.since_probe += 1
                if state.since_probe >= state.probe_every:
                    state.since_probe = 0
                    plan = self.choose(key, bypass=False)  # a probe: the bypassed tiers' stages get data
        state.rounds += 1
        previous = self.running.active if self.running is not None else plan.active
        self._catching_up = frozenset(plan.active) - frozenset(previous)
        self.running = plan
        # (contract.RoundPlanner) the request's tokens/s the plan was chosen on: 1 / its predicted time per token
        self.predicted_tokens_per_s = 1000.0 / plan.predicted_ms if plan.predicted_ms > 0 and math.isfinite(plan.predicted_ms) else None
        self.timing.round_begins()
        return list(plan.lengths), plan.active

    def drafters(self, step) -> tuple[int, ...]:
        """`contract.RoundPlanner.drafters`: one request, its plan's drafter."""
        return ()

    def observe(self, observation) -> None:
        """`contract.RoundPlanner.observe`, in the order the round makes them. A distributed chain's
        round arrives whole after it ran, maybe while the next one is planned (driver.DistributedChain):
        its observations are heard together at its StepObservation (`_observe_remote_round`)."""
        if self.distributed:
            if isinstance(observation, StepObservation):
                heard, self._heard = self._heard, []
                self._observe_remote_round(heard, observation)
            else:
                self._heard.append(observation)
        elif isinstance(observation, RoundObservation):
            self._observe_round(observation)
        elif isinstance(observation, DraftObservation):
            self._observe_draft(observation)
        else:
            self._observe_commit(list(observation.committed[0]))

    def _observe_round(self, o: RoundObservation) -> None:
        """After tier `o.level` verified a block of `o.proposed` tokens (asked for `o.length`) from `o.drafter`."""
        level, block_len, ms, config = o.level, o.proposed, o.seconds * 1000.0, self._config()
        is_tree = self.tree_width > 1 and bool(config) and o.drafter == config[-1]
        proposed = o.length if is_tree else max(o.length, block_len)
        self.observe_pair(self._key, level, o.drafter, proposed, min(o.accepted, proposed))
        # pipelined: the target's round without a block (the last token of a request) had no drafter
        # running beside it, unlike the rounds the model charges (the verifier shares the cores with
        # the drafter drafting ahead: measured 1.3-1.5x slower on the demo chain). A lower stage's
        # empty block (an n-gram tier with no match) is an ordinary round.
        target_of_pipeline = self.pipelined and level == 0
        if level in self._catching_up:  # a tier back from bypass: what its re-feeding cost
            extra = max(0.0, ms - latency(self.profile.forward_ms(level, config), block_len + 1))
            self.catch_up_ms[level] = ema(self.catch_up_ms.get(level), extra, CATCH_UP_SMOOTHING)
        elif self._prefilling:  # no latency sample: such forwards also feed the prompt
            if target_of_pipeline:  # ... the target's is the head start: how long the drafter drafts the second block beside it
                extra = max(0.0, ms - latency(self.profile.forward_ms(0, config), block_len + 1))
                self.head_start_ms = ema(self.head_start_ms or None, extra, REQUEST_SMOOTHING)
        elif not (target_of_pipeline and block_len == 0):
            if target_of_pipeline:
                self.timing.observe_jitter(ms / latency(self.profile.forward_ms(0, config), block_len + 1) - 1.0)
            self.profile.observe_forward(level, block_len + 1, ms, config)
        self.timing.report_time(o.seconds, rounds=1)

    def _observe_draft(self, o: DraftObservation) -> None:
        """After the bottom tier proposed `o.tokens` (`o.proposed` of them, where they are not at hand;
        asked for `o.length`) continuing `o.context_len` tokens."""
        tier, length, context_len, tokens = o.tier, o.length, o.context_len, None if o.tokens is None else list(o.tokens)
        if not self._prefilling and tier not in self._catching_up:
            self.profile.observe_draft(tier, length, o.seconds * 1000.0, self._config())
        if tokens is not None or o.proposed is not None:
            self.observe_fill(self._key, tier, length, len(tokens) if tokens is not None else o.proposed)
        self.timing.report_time(o.seconds, rounds=0)
        running = self.running
        at_committed = context_len == self._round_start and context_len not in self._shadows
        skips_tiers = running is not None and len(running.active) > 2 and tier == running.active[-1]
        if self.config.shadow and tokens is not None and at_committed and skips_tiers:
            self._shadows[context_len] = Shadow(self._key, tier, list(tokens), length)
            while len(self._shadows) > MAX_PENDING:
                self._shadows.pop(next(iter(self._shadows)))

    def _observe_commit(self, tokens: list[int]) -> None:
        """After a target round committed `tokens`."""
        resume_at = self._round_start + len(tokens)
        self._last_commit = len(tokens)
        self._continuing[resume_at] = None
        while len(self._continuing) > MAX_PENDING:
            self._continuing.pop(next(iter(self._continuing)))
        shadow = self._shadows.pop(self._round_start, None)
        if shadow is None:
            return
        shadow.committed += tokens
        matched = common_prefix(shadow.proposal, shadow.committed)
        if matched < len(shadow.committed) or matched == len(shadow.proposal):
            # The full chain's target rounds sample contexts about evenly along the text; a chain
            # running this pair samples them once per round, and a round from a context where
            # the drafter matches `matched` tokens covers matched + 1 of them. Runs of the text
            # where the drafter fails take more of its rounds: weighting position 1 of each
            # sample by 1 / (matched + 1) turns the per-token sample into a per-round one (the
            # inverse-length weighting of renewal theory). Unweighted, the demo chain's
            # target<-n-gram position 1 read 0.60 against 0.32 measured directly. (Deeper
            # positions keep unit weights, and the estimate stays per round: an even sample of
            # the text includes the ends of repeated runs, where a chain's rounds rarely start.)
            estimate = self.pair_estimate(shadow.key, 0, shadow.drafter, shadow=True)
            estimate.observe(max(shadow.requested, len(shadow.proposal)), matched, 1.0 / (matched + 1))
        else:
            self._shadows[resume_at] = shadow  # all matched so far: wait for the next round

    def _config(self) -> tuple[int, ...]:
        """The tiers running (a distributed chain runs every one)."""
        if self.distributed:
            return tuple(range(self.num_tiers))
        return self.running.active if self.running is not None else ()

    def _observe_remote_round(self, heard: list, step: StepObservation) -> None:
        """A distributed chain's round of one request (every tier runs): its verification rounds, the
        bottom tier's proposals and the blocks drafted ahead (`heard`: driver.round_observations), then
        the step: the lengths it was sent with, its wall time at the driver and the model time in it
        (the overheads' fit), and whether it was the request's first (it prefilled the prompt: no
        latency sample; its wall time goes to `first_rounds`, and the class's estimates restart).
        The rounds and proposals are heard as an embedded chain's are, in the round's own context."""
        rounds = [o for o in heard if isinstance(o, RoundObservation)]
        self._key = "greedy" if all(o.greedy for o in rounds) else "sampling"  # (request_class)
        self._prefilling, self._catching_up = step.first[:1] == (True,), frozenset()
        lengths = dict(enumerate(step.lengths))
        lengths.update({o.level: o.length for o in rounds})
        if self._prefilling:
            self.first_rounds.append(1000.0 * step.seconds)
            self.restart_class(self.class_state(self._key))  # (the request's first round has already run on the old plan)
        for o in heard:
            if isinstance(o, RoundObservation):
                self._observe_round(o)
            elif not o.ahead:
                self._observe_draft(o)
            elif not self._prefilling:  # a block drafted ahead: the pipelined model's D, measured
                self._observe_ahead_block(self._key, o.tier, o.proposed, o.seconds * 1000.0, lengths)
        critical = sum(not o.ahead for o in rounds)  # rounds run while drafting ahead were off this round's critical path
        if not self._prefilling and critical:
            self.timing.fit_overheads(critical - 1, 1000.0 * max(0.0, step.seconds - (step.model_s or 0.0)))

    def _observe_ahead_block(self, key: str, drafter: int, tokens: int, block_ms: float, lengths: dict[int, int]) -> None:
        """A block of `tokens` drafted ahead by `drafter` in `block_ms`, against the model's cost of the
        same block on cores of its own (the drafter's cost per token with the lengths in use) and its
        verifier's round beside it (`Timing.observe_ahead_block`)."""
        chain = tuple(range(drafter, self.num_tiers))
        verifier = drafter - 1
        if tokens <= 0 or verifier < 0 or verifier not in lengths or (len(chain) > 1 and any(level not in lengths for level in chain[:-1])):
            return
        full = tuple(range(self.num_tiers))
        if len(chain) == 1:  # the bottom tier: one proposal
            modelled = latency(self.profile.draft_ms(drafter, full), tokens)
        else:
            stages, draft_ms = self.stages(key, chain, config=full, refit=False)  # the chain runs with every tier
            below = round_models(stages, draft_ms, [lengths[level] for level in chain[:-1]], self.tree_width)[0]
            modelled = below.ms_per_token * tokens
        if modelled > 0:
            beside_ms = latency(self.profile.forward_ms(verifier, full), lengths[verifier]) + self.timing.stage_overhead_ms(verifier)
            self.timing.observe_ahead_block(drafter, block_ms, modelled, beside_ms)

    # ---------------------------------------------------------------- state

    def class_state(self, key: str) -> ClassState:
        state = self._classes.get(key)
        if state is None:
            state = self._classes[key] = ClassState({})
        return state

    @staticmethod
    def age_class(state: ClassState) -> None:
        """A target round of this class begins: the estimates forget one step. (Per round, not
        per block: a middle stage verifies several blocks a round, and would otherwise forget
        several times faster than the stage above it.) An estimate that got no data since the
        last step (a bypassed tier's pairs) forgets only down to STALE_BLOCKS blocks' weight:
        aged to nothing, a bypassed pair fell to its prior between probes (the demo chain at
        T = 1: target <- int8 read 0.73 on 0.1 blocks' weight 64 rounds into a bypass, against
        0.99 measured), so a tier once bypassed was forgotten; at the floor it keeps what it
        last showed, and a probe's block (weighted by the tokens it covers) still moves it."""
        for estimate in itertools.chain(state.estimates.values(), state.shadow_estimates.values(), state.long_run.values()):
            if not estimate.age_per_block and (estimate.observed or estimate.blocks * estimate.decay >= STALE_BLOCKS):
                estimate.age()
        for fill in itertools.chain(state.fills.values(), state.long_run_fills.values()):
            if fill.observed or fill.count * fill.decay >= STALE_BLOCKS:
                fill.age()

    def observe_pair(self, key: str, verifier: int, drafter: int, proposed: int, accepted: int) -> None:
        """A verification round of the pair: into its estimate and its long-run estimate (a
        shift in the text, seen by the estimate's detector, calls for a re-tune now)."""
        estimate = self.pair_estimate(key, verifier, drafter)
        shifts = estimate.shifts
        estimate.observe(proposed, accepted)
        state = self.class_state(key)
        if estimate.shifts != shifts:
            state.retune_now = state.full_now = True
            state.eager_rounds = self.config.retune_every
        long_run = state.long_run.get((verifier, drafter))
        if long_run is None:
            long_run = state.long_run[(verifier, drafter)] = AcceptanceEstimate(
                self.config.prior_mean, self.config.prior_strength, max(self.config.decay, SLOW_DECAY), age_per_block=False, detect_shifts=False)
        long_run.observe(proposed, accepted)

    def observe_fill(self, key: str, drafter: int, asked: int, proposed: int) -> None:
        self.fill_estimate(key, drafter).observe(asked, proposed)
        fills = self.class_state(key).long_run_fills
        if drafter not in fills:
            fills[drafter] = FillEstimate(max(self.config.decay, SLOW_DECAY))
        fills[drafter].observe(asked, proposed)

    def restart_class(self, state: ClassState) -> None:
        """A request of the class starts. Acceptance differs more between prompts than along
        one: on the demo chain the n-gram tier's position-1 rate ran from 0.31 to 0.89 across
        eight held-out prompts. The recent estimates are the last request's, so a request
        after a hard one started on lengths cut for it (fixed [6, 3] cost 13 % over [6, 6] on
        the next prompt). Each request starts from the class's long-run estimates (at the
        recent ones' weight, so its own rounds move them as fast as before) and re-tunes."""
        if self.fixed is not None or self.config.decay >= 1.0 or state.plan is None:  # polyspec tune's calibration: plain counts
            return
        # Only the pairs the plan runs: a bypassed pair's long-run counts date from before the
        # bypass, and putting them back at every request's start brought the bypassed tier
        # back for a few rounds at most requests (T = 1, demo chain: held-out 0.907x).
        running = set(zip(state.plan.active, state.plan.active[1:]))
        for pair, long_run in state.long_run.items():
            if pair in state.estimates and pair in running:
                state.estimates[pair].restart_from(long_run)
        bottom = state.plan.active[-1]
        if bottom in state.long_run_fills and bottom in state.fills:
            state.fills[bottom].restart_from(state.long_run_fills[bottom])
        state.retune_now = True

    def pair_estimate(self, key: str, verifier: int, drafter: int, shadow: bool = False) -> AcceptanceEstimate:
        state = self.class_state(key)
        estimates = state.shadow_estimates if shadow else state.estimates
        estimate = estimates.get((verifier, drafter))
        if estimate is None:
            estimate = estimates[(verifier, drafter)] = AcceptanceEstimate(
                self.config.prior_mean, self.config.prior_strength, self.config.decay, age_per_block=False, along_text=not shadow)
        return estimate

    def fill_estimate(self, key: str, drafter: int) -> FillEstimate:
        fills = self.class_state(key).fills
        if drafter not in fills:
            fills[drafter] = FillEstimate(self.config.decay)
        return fills[drafter]

    def fill(self, key: str, drafter: int) -> float:
        """Expected share of an asked block the bottom drafter `drafter` proposes (StageSpec.fill)."""
        return self.fill_estimate(key, drafter).fill

    def estimates(self, key: str, shadow: bool = False) -> dict[tuple[int, int], AcceptanceEstimate]:
        state = self.class_state(key)
        return dict(state.shadow_estimates if shadow else state.estimates)

    # ------------------------------------------------------------------ decisions

    def stages(self, key: str, active: tuple[int, ...], config: tuple[int, ...] | None = None,
               refit: bool = True) -> tuple[list[StageSpec], dict[int, float]]:
        """The time model's inputs for a chain of `active` tiers: stages (first tier first) and the
        bottom's draft_ms, from the latency tables of `config` (the tiers running; default `active`).
        `refit=False`: the drafters' slow-downs as last fitted (the per-block hook)."""
        config = active if config is None else config
        stages = []
        for a, b in zip(active, active[1:]):
            rates, per_text = self.rates_of(key, a, b)
            stages.append(StageSpec(
                self.profile.forward_ms(a, config), rates, self.timing.stage_overhead_ms(a), self.pipelined,
                self.timing.slowdown_of(b, refit) if self.pipelined else 1.0,
                self.fill(key, b) if b == active[-1] and self.tree_width == 1 else 1.0,
                self.timing.jitter_cv if self.pipelined and a == 0 else 0.0, per_text_position=per_text,
                # the target's stage of a pipelined chain: a request's first rounds
                head_start_ms=self.head_start_ms if self.pipelined and a == 0 else 0.0,
                request_tokens=int(round(self.request_tokens)) if self.pipelined and a == 0 else 0))
        return stages, self.profile.draft_ms(active[-1], config)

    def accept_rates(self, key: str, verifier: int, drafter: int) -> tuple[float, ...]:
        """Posterior per-position acceptance (per position of the text, or per round for a
        shadow estimate: `rates_of`)."""
        return self.rates_of(key, verifier, drafter)[0]

    def rates_of(self, key: str, verifier: int, drafter: int) -> tuple[tuple[float, ...], bool]:
        """(posterior per-position acceptance, whether it is per position of the text); an
        unmeasured skip pair's prior is the product of the adjacent pairs' first-position
        rates (pessimistic: no bypass without evidence)."""
        prior = None
        if drafter > verifier + 1:
            prior = 1.0
            for tier in range(verifier, drafter):
                prior *= self.accept_rates(key, tier, tier + 1)[0]
        state = self.class_state(key)
        direct = state.estimates.get((verifier, drafter))
        shadow = state.shadow_estimates.get((verifier, drafter))
        direct_known = direct is not None and direct.blocks >= MIN_BLOCKS
        if not direct_known and shadow is not None and shadow.blocks >= MIN_BLOCKS:
            return shadow.rates(prior), shadow.along_text  # a fallback only (docs/time-model.md, shadow estimates)
        estimate = self.pair_estimate(key, verifier, drafter)
        optimism = self._optimism if self._optimistic_pairs is None or (verifier, drafter) in self._optimistic_pairs else 0.0
        return estimate.rates(prior, optimism), estimate.along_text

    def predict(self, key: str, active: tuple[int, ...], lengths: list[int] | tuple[int, ...]) -> float:
        """Predicted ms per target token for `active` tiers and per-level `lengths` (what the searches
        minimise: `time_model.chain_cost`)."""
        if len(active) == 1:
            return self.alone_ms()
        stages, draft_ms = self.stages(key, active)
        return chain_cost(stages, draft_ms, [lengths[level] for level in active[:-1]], self.tree_width)

    def alone_ms(self) -> float:
        """The target alone: one forward over one new token per token (plus a round's overhead)."""
        return latency(self.profile.forward_ms(0, (0,)), 1) + self.timing.stage_overhead_ms(0)

    def candidate_sets(self, bypass: bool = True) -> list[tuple[int, ...]]:
        """Tier sets the chain can run: the target plus any ordered subset of the others whose
        members above the bottom can verify and whose bottom can draft. With bypass, the target
        alone too (every drafter bypassed): where the drafters' acceptance cannot pay for the
        verification of their blocks (a CPU whose forward grows with the block, a prompt class
        the drafters do not know), `lengths: auto` must not be slower than no speculation."""
        others = range(1, self.num_tiers)
        sizes = range(1, self.num_tiers) if bypass and not self.distributed else [self.num_tiers - 1]
        sets = [(0,)] if bypass and not self.distributed and self.profile.forward[0] is not None else []
        for size in sizes:
            for subset in itertools.combinations(others, size):
                active = (0,) + subset
                if all(self.profile.forward[t] is not None for t in active[:-1]) and self.profile.draft[active[-1]] is not None:
                    sets.append(active)
        return sets

    def choose(self, key: str, bypass: bool | None = None, exclude: int | None = None, only: tuple[int, ...] | None = None) -> Plan:
        """The plan with the lowest predicted C_0 (optionally never using tier `exclude`, or
        only on the tiers `only`)."""
        if bypass is None:
            bypass = self.config.allow_bypass
        sets = [active for active in self.candidate_sets(bypass or exclude is not None or only is not None)
                if not ((exclude is not None and exclude in active) or (only is not None and active != only))]
        plans = self._best_plans(key, sets)
        if not plans:
            raise ValueError("no usable set of tiers")
        return min(plans.values(), key=lambda plan: plan.predicted_ms)

    def _best_plans(self, key: str, sets: list[tuple[int, ...]], near: dict[tuple[int, ...], Plan] | None = None) -> dict[tuple[int, ...], Plan]:
        """The best lengths on each set of tiers: every combination (`time_model.search_lengths`),
        or for a set with a plan in `near`, hill-climbed from that plan's lengths
        (`time_model.local_search`)."""
        current = self.class_state(key).plan
        plans = {}
        for active in sets:
            if len(active) == 1:
                plans[active] = Plan(tuple(current.lengths if current else [self.config.max_length] * (self.num_tiers - 1)), active, self.alone_ms())
                continue
            stages, draft_ms = self.stages(key, active)
            start = (near or {}).get(active)
            if start is None:
                chosen, cost = search_lengths(stages, draft_ms, self.config.max_length, self.tree_width)
            else:
                chosen, cost = local_search(stages, draft_ms, [start.lengths[level] for level in active[:-1]], self.config.max_length, self.tree_width)
            lengths = list(current.lengths if current else [self.config.max_length] * (self.num_tiers - 1))
            for level, k in zip(active, chosen):
                lengths[level] = k
            plans[active] = Plan(tuple(lengths), active, cost)
        return plans

    def retune(self, key: str, state: ClassState) -> None:
        """A full search (`_search`) during the warm-up, after a shift in the text and every
        FULL_SEARCH_EVERY rounds; otherwise (a request's start, the routine re-tunes) a local one
        (`_search(local=True)`): on the demo chain a full search took 0.9-1.8 ms of Python, and at a
        2 % budget the rounds of a 48-token request earned about one, so the lengths stayed
        where the request's start put them (a code prompt ran [3] on target+n-gram for all of
        its 20 rounds with every block accepted)."""
        full = state.plan is None or state.full_now or state.rounds < self.config.warmup_rounds or state.since_full >= FULL_SEARCH_EVERY
        started = self.clock()
        try:
            self._search(key, state, local=not full)
        finally:
            spent_ms = 1000.0 * (self.clock() - started)
            if full:
                self.retune_ms = ema(self.retune_ms or None, spent_ms, OVERHEAD_SMOOTHING)
                state.since_full = 0
                state.full_now = False
            if state.rounds >= self.config.warmup_rounds:  # (a class's warm-up is paid once)
                self._retune_credit_ms -= spent_ms
            state.retune_now = False
            state.since_retune = 0

    def earn_retune_credit(self, state: ClassState) -> None:
        """A target round begins: the budget earns RETUNE_BUDGET of the wall time since the last
        one (capped at two searches' worth, so an idle spell buys no burst of searches)."""
        now = self.clock()
        if self._last_plan_at is not None:
            earned = RETUNE_BUDGET * 1000.0 * (now - self._last_plan_at)
            self._retune_credit_ms = min(self._retune_credit_ms + earned, 2.0 * self.retune_ms)
        self._last_plan_at = now
        state.since_retune += 1
        state.since_full += 1
        state.eager_rounds = max(0, state.eager_rounds - 1)

    def _search(self, key: str, state: ClassState, local: bool = False) -> None:
        """The best plan on each usable set of tiers, and a switch to the best of them if it
        clears the margin (`_switch_margin`). Each set's lengths come from every combination
        (time_model.search_lengths), or with `local` from hill-climbing from the set's lengths
        at the last search (time_model.local_search: on the demo chain's three sets 0.33 ms against
        0.92 for a full search in isolation, 0.48 against 1.2 inside a generating process).
        During a class's warm-up the time model sees acceptance `warmup_optimism` posterior
        standard deviations above the mean: a block of k shows at most k positions, so lengths
        cut from the prior (0.6) leave the deeper positions unseen, and the ramp to long blocks
        took a fresh Ray chain 14 rounds at T = 0; optimistic, it reached [6, 6] in 4, and a
        poor drafter's positions, once seen, lose the optimism as their counts grow.
        (Optimism ends with the warm-up: an opening round at max_length alone instead let one
        early rejection stand for the rest of the request.)
        """
        with self._optimistic(self.config.warmup_optimism if state.rounds < self.config.warmup_rounds else 0.0):
            self._search_plans(key, state, local)

    @contextlib.contextmanager
    def _optimistic(self, z: float, pairs: frozenset[tuple[int, int]] | None = None):
        """Inside the block the time model sees acceptance `z` posterior sd above the mean (for
        the (verifier, drafter) `pairs` only; None: every pair), as it was after."""
        saved = self._optimism, self._optimistic_pairs
        self._optimism, self._optimistic_pairs = z, pairs
        try:
            yield
        finally:
            self._optimism, self._optimistic_pairs = saved

    def _search_plans(self, key: str, state: ClassState, local: bool) -> None:
        bypass = self.config.allow_bypass and state.rounds >= self.config.warmup_rounds
        sets = self.candidate_sets(bypass)
        # one search per set of tiers, reused below; a local one starts from each set's plan at
        # the last search (the current plan for the current set)
        near = {**state.set_plans, state.plan.active: state.plan} if local else None
        plans = self._best_plans(key, sets, near)
        state.set_plans = plans
        best = min(plans.values(), key=lambda plan: plan.predicted_ms)
        current = state.plan
        if current is not None:
            current_ms = self.predict(key, current.active, current.lengths)
            afresh = state.full_now or self._drifted(state, current_ms)  # no margin for new lengths on these tiers
            if not best.predicted_ms < current_ms * (1.0 - self._switch_margin(current.active, best.active, afresh)) and best.active != current.active:
                # another set of tiers is not worth the switch yet; the lengths on these tiers may be
                best = plans.get(current.active) or self.choose(key, only=current.active)
            if not best.predicted_ms < current_ms * (1.0 - self._switch_margin(current.active, best.active, afresh)):
                state.plan = dataclasses.replace(current, predicted_ms=current_ms)
                if afresh:
                    state.anchor_ms = current_ms  # weighed afresh with no margin, and kept
                self._set_probing(key, state, plans)
                return
        self._adopt(key, state, best)
        self._set_probing(key, state, plans)

    def _adopt(self, key: str, state: ClassState, best: Plan) -> None:
        state.plan = best
        state.anchor_ms = best.predicted_ms
        self.history.append(
            {
                "class": key,
                "round": state.rounds,
                "lengths": [best.lengths[level] for level in best.active[:-1]],
                "active": [self.profile.names[t] for t in best.active],
                "predicted_ms_per_token": round(best.predicted_ms, 4),
            }
        )

    def retune_due(self, state: ClassState) -> bool:
        """Every round during the warm-up (a fresh tuner's first plan rests on priors alone, and
        each round's data moves it most: waiting 4 rounds kept the demo chain at [1, 1] for 8
        rounds), when a request starts or the text shifts; and while the re-tune budget allows
        (`earn_retune_credit`), every `retune_every` rounds, or every round for `retune_every` rounds
        after a shift (the forgetting leaves a tenth of the old counts, which the next rounds'
        data outweigh)."""
        if state.plan is None or state.retune_now or state.rounds < self.config.warmup_rounds:
            return True
        return (state.eager_rounds > 0 or state.since_retune >= self.config.retune_every) and self._retune_credit_ms >= 0.0

    def _drifted(self, state: ClassState, current_ms: float) -> bool:
        """The plan's predicted time has moved by more than `replan_drift` since it was last
        weighed with no margin (adopted, or kept by such a search): the estimates it was cut
        for have moved, whether or not the shift detector saw it happen."""
        anchor = state.anchor_ms
        return bool(anchor) and math.isfinite(anchor) and abs(current_ms / anchor - 1.0) > self.config.replan_drift

    def _switch_margin(self, current: tuple[int, ...], new: tuple[int, ...], afresh: bool) -> float:
        """The predicted gain a plan on `new` tiers needs over the current plan on `current`.
        Another set of tiers needs more: a returning tier re-feeds what it missed, and the gain
        rests on ~14 rounds of a bursty drafter's acceptance, read just when it looks best (it
        then regresses): benchmarks/switch-margin-t0.md. That holds for dropping the bottom
        tier too: with 8 % for a drop, a fresh tuner at T = 0 dropped the n-gram tier after the
        first prompt's 8 rounds and ran 0.885x the best fixed lengths on held-out prompts.

        New lengths on the same tiers need none (`afresh`) in the full search a detected shift
        in the text calls for (`state.full_now`): the margin keeps a plan against noise in estimates that
        have not moved, and the plan's claim is void once the text it was cut for is gone (a
        change of lengths costs nothing: the next round asks for other ones). With the margin
        there, the Ray demo chain at T = 1 kept [3, 3] for 62 rounds of prose whose best lengths
        the model put ~3 % lower (the n-gram tier's acceptance fell from 0.77 to 0.11 and the
        shift was seen). Only that search: with no margin in the eager re-tunes after it too
        (every round for `retune_every` rounds, on estimates just forgotten to a tenth), the
        judged runs' plans changed 1.5-2.2 times a held-out prompt at T = 0 against 0.4-0.8
        with the margin, and `lengths: auto` lost 1-14 % more to the best fixed lengths.

        None either once the plan's predicted time has drifted (`_drifted`): a shift the detector
        missed, or a slow one (an n-gram tier that finds no match on prose proposes nothing, so
        the lengths hardly matter and the prose's best led the code's by under 3 %: the
        embedded demo chain at T = 1 kept target+ngram [2] for 79 prose rounds)."""
        if new != current:
            return self.config.switch_hysteresis
        return 0.0 if afresh else self.config.hysteresis

    def _set_probing(self, key: str, state: ClassState, plans: dict[tuple[int, ...], Plan] | None = None) -> None:
        """While the plan bypasses tiers their acceptance goes stale, so every so often a round
        runs all of them (a probe). The closer the plan with all tiers is predicted to come, the
        likelier stale estimates hide a better plan and the cheaper a probe is: probes come
        every (gap + catch-up) / PROBE_BUDGET rounds (at least 2, at most `explore_every`), so
        they cost about PROBE_BUDGET of the predicted time. The catch-up: a bypassed model tier
        re-feeds what it missed in one forward when it returns, measured (`catch_up_ms`; t(1)
        until it is). With short requests that is mostly the prompt: a request that began
        without the tier has it re-fed at the probe (on a chain whose rounds take a few ms,
        probes of an int8 middle tier every 16 rounds cost ~13 ms each, 9 % of the time). An n-gram
        tier (no forward) is probed as often as its gap allows."""
        full_set = tuple(range(self.num_tiers))
        if not self.config.explore_every or state.plan.active == full_set:
            state.probe_every = 0
            return
        plan = state.plan
        # the full chain as it may be: the pairs the plan does not run at acceptance
        # PROBE_OPTIMISM posterior sd above the mean, so a bypassed pair whose counts have thinned
        # to STALE_BLOCKS (what it showed before the bypass, on little weight) is probed sooner
        # than one measured lately
        unrun = frozenset(itertools.combinations(full_set, 2)) - frozenset(zip(plan.active, plan.active[1:]))
        with self._optimistic(self.config.probe_optimism, unrun):
            full = self._best_plans(key, [full_set], near=plans)[full_set]
        gap = max(0.0, full.predicted_ms / plan.predicted_ms - 1.0)
        if len(plan.active) > 1:
            stages, draft_ms = self.stages(key, plan.active)
            round_ms = round_models(stages, draft_ms, [plan.lengths[level] for level in plan.active[:-1]], self.tree_width)[0].round_ms
        else:
            round_ms = latency(self.profile.forward_ms(0, plan.active), 1)
        catch_up_ms = sum(self.catch_up_ms.get(tier, latency(self.profile.forward_ms(tier, full_set), 1))
                          for tier in full_set if tier not in plan.active and self.profile.forward[tier] is not None)
        share = gap + catch_up_ms / max(round_ms, 1e-9)
        state.probe_every = int(min(self.config.explore_every, max(2, math.ceil(share / PROBE_BUDGET))))
