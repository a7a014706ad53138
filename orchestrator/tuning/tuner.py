"""The online tuner: chooses every speculation length (and which tiers to use) from the time model.

It is the `contract.RoundPlanner` of a chain that runs one request at a time. Embedded, the chain
scheduler consults it before each target round (`plan`) and reports every verification round,
bottom-tier proposal and target round through `observe` as they happen. Distributed, the driver
(driver.DistributedChain) plans each round, maybe while the one before is in flight, and reports
it whole after it ran, the tiers' stage reports as the same typed observations
(`observe_remote_round`: overheads, first rounds and blocks drafted ahead besides). The tuner is
composed of parts, each in its own module:

- estimates.py: acceptance per (verifier, drafter) pair and per position of the text
  (`AcceptanceEstimate`, a recency-weighted Beta posterior per position, with a shift
  detector), and the bottom drafter's fill (`FillEstimate`);
- planner.py (`Planner`): the searches over sets of tiers and lengths, the switch margins,
  the probes of bypassed tiers;
- timing.py (`Timing`): overheads outside the forwards, a pipelined chain's jitter and
  drafting-ahead slow-downs;
- this module: the planner hooks, and the per-class state they feed.

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
round, so position 1 of each shadow sample is weighted 1 / (matched + 1) (see observe_commit).
Shadow estimates only count once they have MIN_BLOCKS blocks, and only until the pair has as
many of its own.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import time
from typing import Callable

from polyspec.orchestrator.config import TuningConfig
from polyspec.orchestrator.decode.contract import DraftObservation, RoundObservation, StepInput, StepObservation
from polyspec.orchestrator.tuning.estimates import AcceptanceEstimate, FillEstimate, ema, request_class
from polyspec.orchestrator.tuning.planner import ClassState, Plan, Planner
from polyspec.orchestrator.tuning.profiler import LatencyProfile
from polyspec.orchestrator.tuning.time_model import latency
from polyspec.orchestrator.tuning.timing import Timing
from polyspec.workers.core.sampling import SamplingParams

__all__ = ["Tuner", "Plan", "AcceptanceEstimate", "FillEstimate", "request_class", "TuningConfig"]

SLOW_DECAY = 0.99  # the class's long-run acceptance (~100 target rounds): where each request starts from
STALE_BLOCKS = 2.0  # an estimate without new data (a bypassed tier's) forgets down to this many blocks' weight
MAX_PENDING = 256  # requests the tuner follows at once (round-robin serving)
CATCH_UP_SMOOTHING = 0.3  # memory of what a returning tier's re-feeding costs (~3 probes)
REQUEST_SMOOTHING = 0.2  # distributed, pipelined: memory of requests' lengths and prompt forwards (~5 requests)


@dataclasses.dataclass
class Shadow:
    """The bottom tier's proposal at a committed context, waiting for the target's tokens."""

    key: str
    drafter: int
    proposal: list[int]
    requested: int
    committed: list[int] = dataclasses.field(default_factory=list)


class Tuner(Planner, Timing):
    """One chain's online tuner: the planner's hooks (here), the searches (`Planner`) and the
    clocks (`Timing`) over one shared state, each part declaring its own fields in its own `__init__`."""

    def __init__(self, profile: LatencyProfile, config: TuningConfig | None = None, *, tree_width: int = 1,
                 distributed: bool = False, pipelined: bool = False, clock: Callable[[], float] = time.perf_counter,
                 **knobs) -> None:
        """`config`: the knobs (default: TuningConfig()); `knobs` override single fields of it
        (`Tuner(profile, max_length=6)`). `distributed`: the chain runs as tier workers (every
        tier runs every round: no bypass, its repair loop routes around dead tiers; per-call
        overheads: timing.py). `pipelined`: its drafters draft ahead (the pipelined time model).
        `clock`: what re-tunes are timed with (their budget: planner.py)."""
        Planner.__init__(self)
        Timing.__init__(self)
        self.config = dataclasses.replace(config or TuningConfig(), **knobs)
        self.profile = profile
        self.num_tiers = len(profile.names)
        self.tree_width = tree_width
        self.distributed = distributed
        self.pipelined = pipelined
        self.clock = clock
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

    def plan(self, step: StepInput) -> tuple[list[int], tuple[int, ...]]:
        """`contract.RoundPlanner.plan` for a step of one request."""
        if step.batch != 1:
            raise ValueError(f"the online tuner plans one request's rounds, got a step of {step.batch}")
        if self.distributed and step.first[:1] == (True,) and step.remaining:  # weighs a pipelined chain's first rounds
            self.request_tokens = ema(self.request_tokens or None, step.remaining[0], REQUEST_SMOOTHING)
        return self.plan_request(step.params[0], step.context_lens[0])

    def observe(self, observation) -> None:
        """`contract.RoundPlanner.observe`, in the order the round makes them. A distributed chain's
        round arrives whole after it ran, maybe while the next one is planned (driver.DistributedChain):
        its observations are heard together at its StepObservation (`observe_remote_round`)."""
        if self.distributed:
            if isinstance(observation, StepObservation):
                heard, self._heard = self._heard, []
                self.observe_remote_round(heard, observation)
            else:
                self._heard.append(observation)
        elif isinstance(observation, RoundObservation):
            self.observe_round(observation.level, observation.drafter, observation.length, observation.proposed,
                               observation.accepted, observation.seconds)
        elif isinstance(observation, DraftObservation):
            self.observe_draft(observation.tier, observation.length, observation.context_len,
                               None if observation.tokens is None else list(observation.tokens), observation.seconds)
        elif isinstance(observation, StepObservation):
            self.observe_commit(list(observation.committed[0]))

    def plan_request(self, params: SamplingParams, committed_len: int) -> tuple[list[int], tuple[int, ...]]:
        """Before each target round: the lengths (one per level) and the tiers to use. (Distributed, no
        state is kept for the round: rounds of concurrent requests are planned, maybe ahead, and heard
        whole, apart: `observe_remote_round`.)"""
        key = request_class(params)
        if not self.distributed:
            continues_last = committed_len == self._round_start + self._last_commit
            self._prefilling = committed_len not in self._continuing
            self._continuing.pop(committed_len, None)
            self.measure_overhead(continues_last)
            self._round_start, self._key = committed_len, key
        state = self.class_state(key)
        self.age_class(state)
        self.earn_retune_credit(state)
        if self._prefilling:
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
        self.round_begins()
        return list(plan.lengths), plan.active

    def observe_round(self, level: int, drafter: int, length: int, block_len: int, accepted: int, seconds: float) -> None:
        """After tier `level` verified a block of `block_len` tokens (asked for `length`) from `drafter`."""
        is_tree = self.tree_width > 1 and self.running is not None and drafter == self.running.active[-1]
        proposed = length if is_tree else max(length, block_len)
        self.observe_pair(self._key, level, drafter, proposed, min(accepted, proposed))
        if level in self._catching_up:  # a tier back from bypass: what its re-feeding cost
            extra = max(0.0, seconds * 1000.0 - latency(self.profile.forward_ms(level, self._config()), block_len + 1))
            previous = self.catch_up_ms.get(level)
            self.catch_up_ms[level] = ema(previous, extra, CATCH_UP_SMOOTHING)
        elif not self._prefilling:  # such forwards also feed a long tail
            self.profile.observe_forward(level, block_len + 1, seconds * 1000.0, self._config())
        self.report_time(seconds, rounds=1)

    def observe_draft(self, tier: int, length: int, context_len: int, tokens: list[int] | None, seconds: float) -> None:
        """After the bottom tier proposed `tokens` (asked for `length`) continuing `context_len` tokens."""
        if not self._prefilling and tier not in self._catching_up:
            self.profile.observe_draft(tier, length, seconds * 1000.0, self._config())
        if tokens is not None:
            self.observe_fill(self._key, tier, length, len(tokens))
        self.report_time(seconds, rounds=0)
        running = self.running
        at_committed = context_len == self._round_start and context_len not in self._shadows
        skips_tiers = running is not None and len(running.active) > 2 and tier == running.active[-1]
        if self.config.shadow and tokens is not None and at_committed and skips_tiers:
            self._shadows[context_len] = Shadow(self._key, tier, list(tokens), length)
            while len(self._shadows) > MAX_PENDING:
                self._shadows.pop(next(iter(self._shadows)))

    def observe_commit(self, tokens: list[int]) -> None:
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
        matched = 0
        while matched < min(len(shadow.proposal), len(shadow.committed)) and shadow.proposal[matched] == shadow.committed[matched]:
            matched += 1
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
        return self.running.active if self.running is not None else ()

    def observe_remote_round(self, heard: list, step: StepObservation) -> None:
        """A distributed chain's round of one request (every tier runs): its verification rounds, the
        bottom tier's proposals and the blocks drafted ahead (`heard`: driver.round_observations), then
        the step: the lengths it was sent with, its wall time at the driver and the model time in it
        (the overheads' fit), and whether it was the request's first (it prefilled the prompt: no
        latency sample; its wall time goes to `first_rounds`, and the class's estimates restart)."""
        rounds = [o for o in heard if isinstance(o, RoundObservation)]
        key = "greedy" if all(o.greedy for o in rounds) else "sampling"  # (request_class)
        first = step.first[:1] == (True,)
        config = tuple(range(self.num_tiers))
        lengths = dict(enumerate(step.lengths))
        lengths.update({o.level: o.length for o in rounds})
        if first:
            self.first_rounds.append(1000.0 * step.seconds)
            self.restart_class(self.class_state(key))  # (the request's first round has already run on the old plan)
        critical = 0  # rounds on the step's critical path
        for o in heard:
            if isinstance(o, DraftObservation):
                if o.ahead:  # a block drafted ahead: the pipelined model's D, measured
                    if not first:
                        self.observe_ahead_block(key, o.tier, o.proposed, o.seconds * 1000.0, lengths)
                    continue
                self.observe_fill(key, o.tier, o.length, o.proposed)
                if not first:
                    self.profile.observe_draft(o.tier, o.length, o.seconds * 1000.0, config)
                continue
            is_tree = self.tree_width > 1 and o.drafter == self.num_tiers - 1
            proposed = o.length if is_tree else max(o.length, o.proposed)
            self.observe_pair(key, o.level, o.drafter, proposed, min(o.accepted, proposed))
            # pipelined: the target's round without a block (the last token of a request) had no
            # drafter running beside it, unlike the rounds the model charges (the verifier shares
            # the cores with the drafter drafting ahead: measured 1.3-1.5x slower on the demo
            # chain). A lower stage's empty block (an n-gram tier with no match) is an ordinary round.
            if first and self.pipelined and o.level == 0:
                # the prompt's forward: how long the drafter drafts the second block beside it
                extra = max(0.0, o.seconds * 1000.0 - latency(self.profile.forward_ms(0, config), o.proposed + 1))
                self.head_start_ms = ema(self.head_start_ms or None, extra, REQUEST_SMOOTHING)
            if not first and not (self.pipelined and o.proposed == 0 and o.level == 0):
                if self.pipelined and o.level == 0:
                    modelled = latency(self.profile.forward_ms(0, config), o.proposed + 1)
                    self.observe_jitter(o.seconds * 1000.0 / modelled - 1.0)
                self.profile.observe_forward(o.level, o.proposed + 1, o.seconds * 1000.0, config)
            critical += not o.ahead  # rounds run while drafting ahead were off this round's critical path
        if not first and critical:
            self.fit_overheads(critical - 1, 1000.0 * max(0.0, step.seconds - (step.model_s or 0.0)))

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
