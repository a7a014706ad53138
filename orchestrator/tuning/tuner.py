"""The online tuner: chooses every speculation length (and which tiers to use) from the time model.

ChainScheduler consults it before each target round (`plan`) and reports to it after every
verification round (`observe_round`), bottom-tier proposal (`observe_draft`) and target
round (`observe_commit`). From those reports it keeps

- latency: `profiler.LatencyProfile` (start-up profile, refined by an EMA per (tier, m));
- acceptance: per request class ("greedy" / "sampling"), per (verifier, drafter) pair, per
  position in the block, a recency-weighted Beta posterior (`AcceptanceEstimate`), kept per
  position of the text (each round weighted by the tokens it covers) so that one table
  predicts rounds at every length (`time_model.renewal_rates`); every
  count decays by `decay` per observed block, so after a shift (repetitive code -> prose)
  the estimates, and with them the lengths, move within a few rounds. Position 1's prior
  is Beta(prior_mean, strength); position j's prior mean is position j-1's posterior mean,
  so rarely reached positions fall back on their neighbours. Deep positions get fresh data
  only from blocks that reach them, so after a shift they would lag: a likelihood-ratio test
  on position 1's last outcomes detects the shift and the old counts are then mostly forgotten.
  Acceptance differs more between prompts than along one, so the same counts are also kept
  with a long memory (SLOW_DECAY), and each new request starts from those (`_restart`).

Pairs the chain does not run directly are estimated from data it already has: while a
middle tier sits between the target and the bottom drafter, the bottom's first proposal of
every target round (made at the committed context) is matched against the tokens the
target then commits. For greedy decoding and for deterministic drafters (the n-gram tier)
the matched prefix has exactly the distribution of the target's accepted prefix; for a
sampled model drafter it is a lower bound (P[match] = sum p_t p_d <= sum min(p_t, p_d)).
The full chain samples contexts evenly along the text, a chain running the pair once per
round, so position 1 of each shadow sample is weighted 1 / (matched + 1) (see observe_commit).
Shadow estimates only count once they have MIN_BLOCKS blocks, and only until the pair has as
many of its own. A tier that is bypassed gets no data, so every
so often (`_set_probing`) the full chain runs for one round (a probe).

Time outside the reported rounds (the scheduler's bookkeeping, a streaming callback) is
measured too: wall time between two target rounds minus what the rounds reported, per
round, as an EMA (`round_overhead_ms`), added to every round the model predicts.

Every round of a class's warm-up (`warmup_rounds`; its searches see acceptance one posterior
sd optimistic, so the deeper positions get tried), then every `retune_every` rounds (as the
re-tune budget allows), the tuner searches lengths for each usable set of tiers: every
combination (time_model.search_lengths) in the warm-up, after a shift and every
FULL_SEARCH_EVERY rounds, else near the set's last lengths (time_model.local_search). It
switches only when the predicted gain exceeds `hysteresis` for new lengths on the same
tiers (none in the full search a detected shift calls for, nor once the plan's own
predicted time has drifted `replan_drift` from its last weighing: `_switch_margin`),
`switch_hysteresis` for another set of tiers (then the best lengths on the current
tiers are still taken if they clear `hysteresis`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time

from polyspec.orchestrator.tuning.profiler import LatencyProfile
from polyspec.orchestrator.tuning.time_model import StageSpec, chain_cost, contended_block_ms, fit_slowdown, latency, local_search, round_models, search_lengths
from polyspec.workers.core.sampling import SamplingParams

MAX_POSITIONS = 32
MIN_PRIOR_WEIGHT = 0.5
SHIFT_WINDOWS = (8, 24)  # position 1's last outcomes (a big shift shows in 8, a moderate one in 24) ...
SETTLED_DECAY = 0.97  # ... against its slow tracker (~30 blocks) as it stood before them
SHIFT_LOG_RATIO = 4.0  # log likelihood ratio that counts as a shift in the text (~55:1)
SHIFT_FORGET = 0.1  # what a shift leaves of the old counts
UNASKED_DECAY = 0.8  # extra forgetting per step of positions no block asked for, rated below the position above (AcceptanceEstimate.age)
OVERHEAD_SMOOTHING = 0.1
SLOW_DECAY = 0.99  # the class's long-run acceptance (~100 target rounds): where each request starts from
STALE_BLOCKS = 2.0  # an estimate without new data (a bypassed tier's) forgets down to this many blocks' weight
MIN_BLOCKS = 4  # a skip pair's shadow estimate counts from this many blocks on, and only until it has as many of its own
PROBE_BUDGET = 0.01  # probes of bypassed tiers may cost this share of the predicted time
MAX_PENDING = 256  # requests the tuner follows at once (round-robin serving)
OVERHEAD_DECAY = 0.98  # distributed chains: the overhead fit's memory (~50 target rounds)
OVERHEAD_PRIOR = 2.0  # ... and the weight, in target rounds, of its prior a = 2 b
JITTER_SMOOTHING = 0.05  # pipelined: memory of the spread of round and block times (~20 samples)
CATCH_UP_SMOOTHING = 0.3  # memory of what a returning tier's re-feeding costs (~3 probes)
RETUNE_BUDGET = 0.02  # routine re-tunes may take this share of the wall time (a search: ~0.7 ms of Python on the demo chain)
PROBE_OPTIMISM = 1.0  # the probes' schedule sees the full chain's acceptance this many posterior sd above the mean (Tuner._set_probing)
WARMUP_OPTIMISM = 1.0  # a class's warm-up searches on acceptance one posterior sd above the mean (see Tuner._search)
OPTIMISTIC_CAP = 0.99
AHEAD_WINDOW = 64  # pipelined: blocks drafted ahead that the drafter's slow-down is fitted to ...
AHEAD_DECAY = 0.97  # ... each weighed this much less than the next (~33 blocks)
REQUEST_SMOOTHING = 0.2  # pipelined: memory of requests' lengths and prompt forwards (~5 requests)
FULL_SEARCH_EVERY = 32  # target rounds between full searches (every length); re-tunes between them search near the last lengths


def _ema(previous: float | None, value: float, smoothing: float) -> float:
    """An exponential moving average's next value (the first value as is: `previous` None)."""
    return value if previous is None else previous + smoothing * (value - previous)


@dataclasses.dataclass
class AcceptanceEstimate:
    """Per-position acceptance of one (verifier, drafter) pair per position of the text,
    recency weighted.

    successes[j] / trials[j]: decayed counts for position j+1 (blocks that reached it), each
    block weighted by the tokens its round covers (accepted + 1), which turns the rounds'
    sample of contexts into an even sample along the text (renewal-reward: a chain's rounds
    visit a context in proportion to 1 / the tokens a round from it emits). Rates per text
    position do not depend on the length the chain ran at; `time_model.renewal_rates` turns
    them into the rates of rounds at any length. A shadow sample (Tuner.observe_commit) is
    already an even sample along the text, but not one a chain's rounds would take (they enter
    a repeated run at its start and jump through it, and rarely start near its end where the
    matches are short), so shadow estimates stay per round (`along_text=False`) with their own
    position-1 weighting (Tuner.observe_commit).
    Position 1's prior, Beta(prior_mean * w, (1 - prior_mean) * w), decays like the data
    (down to MIN_PRIOR_WEIGHT) so it cannot cap a rate the data keep showing; position j's
    prior is position j-1's posterior mean with a fixed weight `prior_strength`."""

    prior_mean: float = 0.6
    prior_strength: float = 2.0
    decay: float = 0.93  # per age() step (an observed block, or the tuner's target round); 1.0 = plain counts
    successes: list[float] = dataclasses.field(default_factory=lambda: [0.0] * MAX_POSITIONS)
    trials: list[float] = dataclasses.field(default_factory=lambda: [0.0] * MAX_POSITIONS)
    blocks: float = 0.0  # decayed number of observed blocks
    prior_weight: float = dataclasses.field(init=False)  # position 1's prior weight now
    recent: list[float] = dataclasses.field(default_factory=list)  # position 1's last outcomes (shift detector)
    recent_settled: list[float] = dataclasses.field(default_factory=list)  # the slow tracker before each of them
    settled: float | None = None  # slow EMA of position 1's acceptance
    shifts: int = 0  # shifts detected so far
    age_per_block: bool = True  # False: the owner calls age() (the tuner: once per target round it was observed in)
    observed: bool = False  # a block came since the last age() (the tuner ages only such estimates)
    asked: int = 0  # the longest block since the last age(): deeper positions got no chance to be seen
    along_text: bool = True  # counts per position of the text (rounds weighted by accepted + 1); False: per round
    detect_shifts: bool = True  # False: a long-run estimate, which follows shifts by its decay alone

    def __post_init__(self) -> None:
        self.prior_weight = self.prior_strength

    def observe(self, proposed: int, accepted: int, first_weight: float = 1.0) -> None:
        """A round's block of `proposed` positions (missing proposals count as rejected) with
        `accepted` kept: weight accepted + 1 at every position (`along_text`), else weight 1,
        position 1 counted `first_weight` times (a shadow sample's weight, see Tuner)."""
        assert 0 <= accepted <= proposed
        if self.age_per_block:
            self.age()
        self.observed = True
        self.asked = max(self.asked, proposed)
        self.blocks += first_weight
        for position in range(min(accepted + 1, proposed, MAX_POSITIONS)):
            if self.along_text:
                weight = accepted + 1.0
            else:
                weight = first_weight if position == 0 else 1.0
            self.trials[position] += weight
            if position < accepted:
                self.successes[position] += weight
        if proposed > 0 and self.detect_shifts:
            self._track_shift(1.0 if accepted > 0 else 0.0)

    def age(self) -> None:
        """One step of forgetting (per observed block, or per target round when the tuner ages it).

        Positions deeper than every block of the step asked for, and rated below the position
        above them, forget UNASKED_DECAY faster. The lengths in use decide which positions get
        data: after one rejection at position p (weighted p, a round that emitted p tokens),
        the lengths fall below p, position p gets no more data, and at the common decay its
        rate came back from the rejection in ~40 rounds. The Ray demo chain at T = 1 (int8
        drafter, 0.99 at every position) ran a fresh tuner's first two held-out prompts at
        k_0 = 2 after one rejection at position 3, 1.13-1.29x the best fixed lengths' time.
        Faster, such a position's rate returns to the one above it (its prior) in ~8 rounds,
        and the lengths try it again; a position that really is worse pays for that with a
        round at the longer length now and then. Only evidence against a position is trapped
        this way (evidence for it makes the lengths ask for it, and fresh data follow), and a
        drafter whose deeper positions really are better (an n-gram tier continuing a match:
        0.09 at position 1, 0.31 at 2) keeps what it showed there."""
        asked, self.asked = self.asked, 0
        observed, self.observed = self.observed, False
        if self.decay < 1.0:
            decay = self.decay
            self.successes = [s * decay for s in self.successes]
            self.trials = [t * decay for t in self.trials]
            if observed and 0 < asked < MAX_POSITIONS and self.trials[asked] > 0.0:
                rates = self.rates()
                for position in range(asked, MAX_POSITIONS):
                    if self.trials[position] == 0.0:
                        break  # (deeper positions were never reached either)
                    if rates[position] < rates[position - 1]:
                        self.successes[position] *= UNASKED_DECAY
                        self.trials[position] *= UNASKED_DECAY
            self.blocks *= decay
            self.prior_weight = max(MIN_PRIOR_WEIGHT, self.prior_weight * decay)

    def _track_shift(self, first_accepted: float) -> None:
        """Generalised likelihood ratio of position 1's last outcomes, in windows of each
        SHIFT_WINDOWS length: their own rate against the slow tracker's before the window (the
        tracker drifts towards the new rate inside it). A big ratio means the text changed:
        forget. Eight outcomes show a big shift (0.9 -> 0.1: log ratio ~12), not a moderate one
        (0.38 -> 0.1, an n-gram drafter on code, then on prose, sampling: ~1.6 in 8, ~4.9 in 24)."""
        if self.settled is None:
            self.settled = self.rates()[0]
        self.recent.append(first_accepted)
        self.recent_settled.append(min(max(self.settled, 0.02), 0.98))
        longest = SHIFT_WINDOWS[-1]
        if len(self.recent) > 2 * longest:  # trim in batches (this runs for every observed block)
            del self.recent[:-longest], self.recent_settled[:-longest]
        self.settled = SETTLED_DECAY * self.settled + (1.0 - SETTLED_DECAY) * first_accepted
        if self.decay >= 1.0:
            return
        for window in SHIFT_WINDOWS:
            if len(self.recent) < window:
                break
            ones = sum(self.recent[-window:])
            recent = min(max(ones / window, 0.02), 0.98)
            settled = self.recent_settled[-window]
            log_ratio = ones * math.log(recent / settled) + (window - ones) * math.log((1.0 - recent) / (1.0 - settled))
            if log_ratio > SHIFT_LOG_RATIO:
                self.successes = [s * SHIFT_FORGET for s in self.successes]
                self.trials = [t * SHIFT_FORGET for t in self.trials]
                self.settled = recent
                self.recent, self.recent_settled = [], []
                self.shifts += 1
                return

    def restart_from(self, long_run: "AcceptanceEstimate") -> None:
        """A request starts: take `long_run`'s counts, scaled to this estimate's weight now
        (its rates, this estimate's confidence), and start the shift detector afresh."""
        if long_run.blocks <= 0.0:
            return
        scale = min(1.0, self.blocks / long_run.blocks)
        self.successes = [value * scale for value in long_run.successes]
        self.trials = [value * scale for value in long_run.trials]
        self.blocks = long_run.blocks * scale
        self.recent, self.recent_settled = [], []
        self.settled = long_run.rates()[0]

    def rates(self, prior_mean: float | None = None, optimism: float = 0.0) -> tuple[float, ...]:
        """Posterior mean acceptance per text position 1..MAX_POSITIONS (the priors' weights
        are in the same units: tokens of text); with `optimism` z, each position's mean plus
        z standard deviations of its Beta posterior (capped at OPTIMISTIC_CAP; the next
        position's prior is still the mean)."""
        mean = self.prior_mean if prior_mean is None else prior_mean
        weight = self.prior_weight
        out = []
        for successes, trials in zip(self.successes, self.trials):
            mean = (mean * weight + successes) / (weight + trials)
            out.append(mean if not optimism else min(OPTIMISTIC_CAP, mean + optimism * math.sqrt(mean * (1.0 - mean) / (weight + trials + 1.0))))
            weight = self.prior_strength
        return tuple(out)


@dataclasses.dataclass
class FillEstimate:
    """The share of an asked block a bottom drafter really proposes (1.0 for a model drafter;
    an n-gram lookup proposes nothing when the context has no match): the mean of
    proposed / asked over recent proposals, forgetting like the acceptance estimates, with
    a prior of `prior_weight` proposals in full."""

    decay: float = 0.93
    prior_weight: float = 2.0
    total: float = 0.0  # decayed sum of proposed / asked
    count: float = 0.0  # decayed number of proposals
    observed: bool = False  # a proposal came since the last age()

    def observe(self, asked: int, proposed: int) -> None:
        if asked > 0:
            self.total += min(1.0, max(0, proposed) / asked)
            self.count += 1.0
            self.observed = True

    def age(self) -> None:
        self.observed = False
        self.total *= self.decay
        self.count *= self.decay

    @property
    def fill(self) -> float:
        return (self.prior_weight + self.total) / (self.prior_weight + self.count)

    def restart_from(self, long_run: "FillEstimate") -> None:
        """A request starts: `long_run`'s mean, at this estimate's weight now."""
        if long_run.count > 0.0:
            self.total = self.count * long_run.total / long_run.count


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the scheduler runs: a length per verifying level and the tiers in use."""

    lengths: tuple[int, ...]  # [level] = block length tier `level` verifies (unused levels keep a value)
    active: tuple[int, ...]  # tier indices in use, target first
    predicted_ms: float = dataclasses.field(default=float("nan"), compare=False)  # predicted ms per target token (C_0)


def request_class(params: SamplingParams) -> str:
    return "greedy" if params.greedy else "sampling"


@dataclasses.dataclass
class _ClassState:
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
class _Shadow:
    """The bottom tier's proposal at a committed context, waiting for the target's tokens."""

    key: str
    drafter: int
    proposal: list[int]
    requested: int
    committed: list[int] = dataclasses.field(default_factory=list)


class Tuner:
    def __init__(
        self,
        profile: LatencyProfile,
        max_length: int = 8,
        tree_width: int = 1,
        retune_every: int = 4,
        hysteresis: float = 0.03,
        switch_hysteresis: float = 0.2,
        replan_drift: float = 0.1,
        decay: float = 0.93,
        prior_mean: float = 0.6,
        prior_strength: float = 2.0,
        allow_bypass: bool = True,
        warmup_rounds: int = 8,
        explore_every: int = 64,
    ) -> None:
        self.profile = profile
        self.num_tiers = len(profile.names)
        self.max_length = max_length
        self.tree_width = tree_width
        self.retune_every = retune_every
        self.hysteresis = hysteresis
        self.switch_hysteresis = switch_hysteresis
        self.replan_drift = replan_drift
        self.decay = decay
        self.prior_mean = prior_mean
        self.prior_strength = prior_strength
        self.allow_bypass = allow_bypass
        self.warmup_rounds = warmup_rounds
        self.explore_every = explore_every
        self.fixed: Plan | None = None  # set to run one plan while still learning (polyspec tune)
        self.pipelined = False  # the chain's drafters draft ahead (runtime pipeline: true): the pipelined time model
        # A distributed chain (tier workers): every tier runs every round (no bypass; its repair
        # loop routes around dead tiers), and the time outside forwards is gRPC hops and the
        # workers' Python: per target round `step_overhead_ms` (the driver's call, the target's
        # call to its drafter), per round of any other stage on the critical path
        # `round_overhead_ms` (a verifier's call to its drafter), fitted to each round's residual
        # (driver wall - model time) by a recency-weighted least squares (`_fit_overheads`).
        self.distributed = False
        self.step_overhead_ms = 0.0
        # pipelined: per drafting tier, how much longer its blocks take to draft ahead than the
        # model's own cost of them (cores shared with the verifier, calls below, waiting while
        # real calls go first): the slow-down that matches its recent blocks (`_observe_ahead_block`)
        self._slowdown: dict[int, float] = {}  # (`ahead_slowdown`: fitted when read, not on every block)
        self._slowdown_stale: set[int] = set()  # drafters with blocks since their last fit
        self._ahead_blocks: dict[int, collections.deque] = {}  # per drafter: (measured, modelled, beside ms) of its last blocks
        # a distributed chain's first target round of each request (prefills, sequence set-up on
        # every tier): its wall ms, for `polyspec tune` to calibrate the per-request cost
        self.first_rounds: collections.deque[float] = collections.deque(maxlen=256)
        self.first_round_scale = 1.0  # measured / modelled first rounds (set by polyspec tune's calibration)
        # pipelined: a request's first round scores the prompt, and the drafter drafts the second
        # block beside it; the searches charge the first rounds' extra time (StageSpec.head_start_ms)
        # over a request's length (`request_tokens`: new tokens asked for, an EMA; 0 = unknown, C_0
        # alone). Both from a distributed chain's first rounds (plan_remote / observe_remote).
        self.head_start_ms = 0.0
        self.request_tokens = 0.0
        # pipelined: how much the target's forwards and the blocks drafted ahead vary around the
        # model (EMA of squared relative deviations, pooled): StageSpec.jitter_cv
        self._jitter_sq = 0.0
        self._overhead_sums = [0.0] * 5  # decayed sums of 1, n, n^2, r, n*r (n: other rounds on the path, r: residual ms)
        self.shadow = True  # estimate skip pairs from committed tokens (polyspec tune measures them directly)
        self.history: list[dict] = []  # every plan change: {"class", "round", "lengths", "active", "predicted_ms_per_token"}
        self._classes: dict[str, _ClassState] = {}
        self._key = "greedy"
        self._running: Plan | None = None
        # requests may interleave round by round (a server): they are told apart by their
        # committed length, which each target round moves from `_round_start` to the next
        self._round_start = -1  # committed tokens when the current target round began
        self._continuing: dict[int, None] = {}  # committed lengths a known request resumes at (insertion ordered)
        self._prefilling = False  # the current target round is a request's first (it feeds the prompt)
        self._catching_up: frozenset[int] = frozenset()  # tiers back from bypass: this round re-feeds what they missed
        self._shadows: dict[int, _Shadow] = {}  # pending skip-pair proposals, by the committed length they resume at
        self.round_overhead_ms = 0.0
        # per model tier: the extra ms of its first forward when it returns from a bypass (it
        # re-feeds what it missed: the tokens since it last ran, and the prompt when a request
        # began without it), an EMA; what a probe of a bypassed tier costs (`_set_probing`)
        self.catch_up_ms: dict[int, float] = {}
        # Routine re-tunes are paid from a budget: each target round earns RETUNE_BUDGET of its
        # wall time, a search costs what it took (an EMA). On a chain whose rounds take a few
        # ms, a search every `retune_every` rounds cost 9 % of the time (the demo chain on a
        # fast Xeon). Searches that must happen (a class's first rounds, a request's start, a
        # shift in the text) run regardless and draw the budget down.
        self.clock = time.perf_counter
        self.warmup_optimism = WARMUP_OPTIMISM
        self.probe_optimism = PROBE_OPTIMISM
        self._optimism = 0.0  # z of the acceptance rates the time model sees (warmup_optimism in a class's warm-up searches)
        self._optimistic_pairs: frozenset[tuple[int, int]] | None = None  # the pairs it applies to (None: all)
        self.retune_ms = 0.0  # a full search's cost (EMA; a local one costs about a third)
        self._retune_credit_ms = 0.0
        self._last_plan_at: float | None = None
        self._last_commit = 0
        self._round_started: float | None = None  # perf_counter when the current target round began
        self._reported_s = 0.0  # seconds the rounds since then reported
        self._reported_rounds = 0

    # ------------------------------------------------------------- scheduler hook

    def plan(self, params: SamplingParams, committed_len: int) -> tuple[list[int], tuple[int, ...]]:
        """Before each target round: the lengths (one per level) and the tiers to use."""
        continues_last = committed_len == self._round_start + self._last_commit
        self._prefilling = committed_len not in self._continuing
        self._continuing.pop(committed_len, None)
        self._measure_overhead(continues_last)
        self._round_start = committed_len
        self._key = request_class(params)
        state = self._state(self._key)
        self._age(state)
        self._earn_retune_credit(state)
        if self._prefilling:
            self._restart(state)
        if self.fixed is not None:
            plan = self.fixed
        else:
            if self._retune_due(state):
                self._retune(self._key, state)
            plan = state.plan
            if state.probe_every:
                state.since_probe += 1
                if state.since_probe >= state.probe_every:
                    state.since_probe = 0
                    plan = self.choose(self._key, bypass=False)  # a probe: the bypassed tiers' stages get data
        state.rounds += 1
        previous = self._running.active if self._running is not None else plan.active
        self._catching_up = frozenset(plan.active) - frozenset(previous)
        self._running = plan
        self._round_started = time.perf_counter()
        return list(plan.lengths), plan.active

    def observe_round(self, level: int, drafter: int, length: int, block_len: int, accepted: int, seconds: float) -> None:
        """After tier `level` verified a block of `block_len` tokens (asked for `length`) from `drafter`."""
        is_tree = self.tree_width > 1 and self._running is not None and drafter == self._running.active[-1]
        proposed = length if is_tree else max(length, block_len)
        self._observe_pair(self._key, level, drafter, proposed, min(accepted, proposed))
        if level in self._catching_up:  # a tier back from bypass: what its re-feeding cost
            extra = max(0.0, seconds * 1000.0 - latency(self.profile.forward_ms(level, self._config()), block_len + 1))
            previous = self.catch_up_ms.get(level)
            self.catch_up_ms[level] = _ema(previous, extra, CATCH_UP_SMOOTHING)
        elif not self._prefilling:  # such forwards also feed a long tail
            self.profile.observe_forward(level, block_len + 1, seconds * 1000.0, self._config())
        self._reported_s += seconds
        self._reported_rounds += 1

    def observe_draft(self, tier: int, length: int, context_len: int, tokens: list[int] | None, seconds: float) -> None:
        """After the bottom tier proposed `tokens` (asked for `length`) continuing `context_len` tokens."""
        if not self._prefilling and tier not in self._catching_up:
            self.profile.observe_draft(tier, length, seconds * 1000.0, self._config())
        if tokens is not None:
            self._observe_fill(self._key, tier, length, len(tokens))
        self._reported_s += seconds
        running = self._running
        at_committed = context_len == self._round_start and context_len not in self._shadows
        skips_tiers = running is not None and len(running.active) > 2 and tier == running.active[-1]
        if self.shadow and tokens is not None and at_committed and skips_tiers:
            self._shadows[context_len] = _Shadow(self._key, tier, list(tokens), length)
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
            estimate = self._estimate(shadow.key, 0, shadow.drafter, shadow=True)
            estimate.observe(max(shadow.requested, len(shadow.proposal)), matched, 1.0 / (matched + 1))
        else:
            self._shadows[resume_at] = shadow  # all matched so far: wait for the next round

    # ------------------------------------------------------- a distributed chain's hook

    def plan_remote(self, params: SamplingParams, new_tokens: int | None = None) -> list[int]:
        """Before a distributed chain's target round: the lengths to send with it. Rounds of
        concurrent requests arrive whole (`observe_remote`), so no per-round state is kept
        here; the caller serialises the two calls. `new_tokens`: given before a request's first
        round, the tokens it asks for (a pipelined chain's searches weigh its first rounds by
        them: `request_tokens`)."""
        if new_tokens:
            self.request_tokens = _ema(self.request_tokens or None, new_tokens, REQUEST_SMOOTHING)
        key = request_class(params)
        state = self._state(key)
        self._age(state)
        self._earn_retune_credit(state)
        if self.fixed is not None:
            plan = self.fixed
        else:
            if self._retune_due(state):
                self._retune(key, state)
            plan = state.plan
        state.rounds += 1
        self._running = plan
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
            lengths = self._running.lengths if self._running is not None else []
        lengths = dict(enumerate(lengths))
        lengths.update({report.tier: report.length for report in reports if report.tier < report.drafter})
        if first:
            self.first_rounds.append(1000.0 * wall_s)
            self._restart(self._state(key))  # (the request's first round has already run on the old plan)
        for report in reports:
            if report.block_seconds > 0:  # a block drafted ahead: the pipelined model's D, measured
                if not first:
                    self._observe_ahead_block(key, report.tier, report.proposed, report.block_seconds * 1000.0, lengths)
                continue
            if report.drafter == report.tier:
                self._observe_fill(key, report.tier, report.length, report.proposed)
                if not first:
                    self.profile.observe_draft(report.tier, report.length, report.seconds * 1000.0, config)
                continue
            is_tree = self.tree_width > 1 and report.drafter == self.num_tiers - 1
            proposed = report.length if is_tree else max(report.length, report.proposed)
            self._observe_pair(key, report.tier, report.drafter, proposed, min(report.accepted, proposed))
            # pipelined: the target's round without a block (the last token of a request) had no
            # drafter running beside it, unlike the rounds the model charges (the verifier shares
            # the cores with the drafter drafting ahead: measured 1.3-1.5x slower on the demo
            # chain). A lower stage's empty block (an n-gram tier with no match) is an ordinary round.
            if first and self.pipelined and report.tier == 0:
                # the prompt's forward: how long the drafter drafts the second block beside it
                extra = max(0.0, report.seconds * 1000.0 - latency(self.profile.forward_ms(0, config), report.proposed + 1))
                self.head_start_ms = _ema(self.head_start_ms or None, extra, REQUEST_SMOOTHING)
            if not first and not (self.pipelined and report.proposed == 0 and report.tier == 0):
                if self.pipelined and report.tier == 0:
                    modelled = latency(self.profile.forward_ms(0, config), report.proposed + 1)
                    self._observe_jitter(report.seconds * 1000.0 / modelled - 1.0)
                self.profile.observe_forward(report.tier, report.proposed + 1, report.seconds * 1000.0, config)
            rounds += not report.ahead  # rounds run while drafting ahead were off this round's critical path
        if not first and rounds:
            self._fit_overheads(rounds - 1, 1000.0 * max(0.0, wall_s - model_s))

    def _observe_ahead_block(self, key: str, drafter: int, tokens: int, block_ms: float, lengths: dict[int, int]) -> None:
        """A block of `tokens` drafted ahead by `drafter` in `block_ms`: against the model's cost of
        the same block on cores of its own (the drafter's cost per token with the lengths in
        use) and its verifier's round beside it, the slow-down while the two share the cores
        (`time_model.fit_slowdown` over the last AHEAD_WINDOW blocks, each weighed AHEAD_DECAY
        less than the next)."""
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
        if modelled <= 0:
            return
        beside_ms = latency(self.profile.forward_ms(verifier, full), lengths[verifier]) + self._stage_overhead_ms(verifier)
        if drafter == 1:  # the target's drafter: its blocks are what the target's rounds wait for
            # (against the slow-down as last fitted: refitting it on every block, to read it
            # here, was two thirds of this hook's driver CPU on the Ray demo chain)
            self._observe_jitter(block_ms / contended_block_ms(modelled, beside_ms, self._slowdown_of(drafter, refit=False)) - 1.0)
        blocks = self._ahead_blocks.setdefault(drafter, collections.deque(maxlen=AHEAD_WINDOW))
        blocks.append((block_ms, modelled, beside_ms))
        self._slowdown_stale.add(drafter)

    @property
    def ahead_slowdown(self) -> dict[int, float]:
        """Per pipelined drafter, the slow-down of its blocks drafted ahead (`_observe_ahead_block`),
        fitted when read: the searches read it a few times a second, blocks arrive every round."""
        for drafter in list(self._slowdown_stale):
            self._slowdown_of(drafter)
        return self._slowdown

    def _slowdown_of(self, drafter: int, refit: bool = True) -> float:
        if refit and drafter in self._slowdown_stale:
            self._slowdown_stale.discard(drafter)
            samples = [(AHEAD_DECAY ** age, *sample) for age, sample in enumerate(reversed(self._ahead_blocks[drafter]))]
            self._slowdown[drafter] = fit_slowdown(samples, self._slowdown.get(drafter, 1.0))
        return self._slowdown.get(drafter, 1.0)

    def _observe_jitter(self, deviation: float) -> None:
        deviation = min(max(deviation, -1.0), 1.0)  # one stall (a GC pause, a page fault) is not the spread
        self._jitter_sq += JITTER_SMOOTHING * (deviation * deviation - self._jitter_sq)

    @property
    def jitter_cv(self) -> float:
        """Coefficient of variation of the target's rounds and its drafter's blocks drafted ahead."""
        return math.sqrt(self._jitter_sq)

    def _fit_overheads(self, other_rounds: int, residual_ms: float) -> None:
        """residual = a + b * other_rounds, a = step_overhead_ms, b = round_overhead_ms: least
        squares over recent target rounds (each weight decays by OVERHEAD_DECAY per round),
        shrunk towards a = 2 b (a target round is two calls, another stage's round one) with the
        weight of OVERHEAD_PRIOR rounds, so a pipelined chain, whose other rounds are almost never
        on the critical path, still gets a sensible b."""
        sums = self._overhead_sums
        n, r = float(other_rounds), residual_ms
        for i, value in enumerate((1.0, n, n * n, r, n * r)):
            sums[i] = OVERHEAD_DECAY * sums[i] + value
        s0, sn, snn, sr, snr = sums
        lam = OVERHEAD_PRIOR
        # normal equations of sum w (r - a - b n)^2 + lam (a - 2 b)^2
        a11, a12, a22 = s0 + lam, sn - 2 * lam, snn + 4 * lam
        det = a11 * a22 - a12 * a12
        if det <= 1e-9:
            return
        a = (sr * a22 - a12 * snr) / det
        b = (a11 * snr - a12 * sr) / det
        if b < 0.0:  # no evidence that other rounds cost anything: all of it per target round
            a, b = sr / s0, 0.0
        self.step_overhead_ms, self.round_overhead_ms = max(0.0, a), b

    def _config(self) -> tuple[int, ...]:
        return self._running.active if self._running is not None else ()

    def _measure_overhead(self, continues_last: bool) -> None:
        """Wall time of the target round that just ended, less what its rounds and drafts reported
        (only when this round continues the same request: in between, a server may do other work)."""
        if continues_last and self._round_started is not None and self._reported_rounds:
            residual_ms = 1000.0 * (time.perf_counter() - self._round_started - self._reported_s) / self._reported_rounds
            self.round_overhead_ms += OVERHEAD_SMOOTHING * (max(0.0, residual_ms) - self.round_overhead_ms)
        self._reported_s, self._reported_rounds = 0.0, 0

    # ---------------------------------------------------------------- decisions

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
                self.profile.forward_ms(a, config), rates, self._stage_overhead_ms(a), self.pipelined,
                self._slowdown_of(b, refit) if self.pipelined else 1.0,
                self.fill(key, b) if b == active[-1] and self.tree_width == 1 else 1.0,
                self.jitter_cv if self.pipelined and a == 0 else 0.0, per_text_position=per_text,
                # the target's stage of a pipelined chain: a request's first rounds
                head_start_ms=self.head_start_ms if self.pipelined and a == 0 else 0.0,
                request_tokens=int(round(self.request_tokens)) if self.pipelined and a == 0 else 0))
        return stages, self.profile.draft_ms(active[-1], config)

    def _stage_overhead_ms(self, verifier: int) -> float:
        """Time outside forwards per round of the stage verified by `verifier` (see __init__)."""
        if not self.distributed:
            return self.round_overhead_ms
        return self.step_overhead_ms if verifier == 0 else self.round_overhead_ms

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
        state = self._state(key)
        direct = state.estimates.get((verifier, drafter))
        shadow = state.shadow_estimates.get((verifier, drafter))
        direct_known = direct is not None and direct.blocks >= MIN_BLOCKS
        if not direct_known and shadow is not None and shadow.blocks >= MIN_BLOCKS:
            return shadow.rates(prior), shadow.along_text  # a fallback only (docs/time-model.md §4)
        estimate = self._estimate(key, verifier, drafter)
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
        return latency(self.profile.forward_ms(0, (0,)), 1) + self._stage_overhead_ms(0)

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
            bypass = self.allow_bypass
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
        current = self._state(key).plan
        plans = {}
        for active in sets:
            if len(active) == 1:
                plans[active] = Plan(tuple(current.lengths if current else [self.max_length] * (self.num_tiers - 1)), active, self.alone_ms())
                continue
            stages, draft_ms = self.stages(key, active)
            start = (near or {}).get(active)
            if start is None:
                chosen, cost = search_lengths(stages, draft_ms, self.max_length, self.tree_width)
            else:
                chosen, cost = local_search(stages, draft_ms, [start.lengths[level] for level in active[:-1]], self.max_length, self.tree_width)
            lengths = list(current.lengths if current else [self.max_length] * (self.num_tiers - 1))
            for level, k in zip(active, chosen):
                lengths[level] = k
            plans[active] = Plan(tuple(lengths), active, cost)
        return plans

    def _retune(self, key: str, state: _ClassState) -> None:
        """A full search (`_search`) during the warm-up, after a shift in the text and every
        FULL_SEARCH_EVERY rounds; otherwise (a request's start, the routine re-tunes) a local one
        (`_search(local=True)`): on the demo chain a full search took 0.9-1.8 ms of Python, and at a
        2 % budget the rounds of a 48-token request earned about one, so the lengths stayed
        where the request's start put them (a code prompt ran [3] on target+n-gram for all of
        its 20 rounds with every block accepted)."""
        full = state.plan is None or state.full_now or state.rounds < self.warmup_rounds or state.since_full >= FULL_SEARCH_EVERY
        started = self.clock()
        try:
            self._search(key, state, local=not full)
        finally:
            spent_ms = 1000.0 * (self.clock() - started)
            if full:
                self.retune_ms = _ema(self.retune_ms or None, spent_ms, OVERHEAD_SMOOTHING)
                state.since_full = 0
                state.full_now = False
            if state.rounds >= self.warmup_rounds:  # (a class's warm-up is paid once)
                self._retune_credit_ms -= spent_ms
            state.retune_now = False
            state.since_retune = 0

    def _earn_retune_credit(self, state: _ClassState) -> None:
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

    def _search(self, key: str, state: _ClassState, local: bool = False) -> None:
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
        (Optimism ends with the warm-up: an opening round at max_length alone, tried in session 8,
        left one rejected position standing.)
        """
        with self._optimistic(self.warmup_optimism if state.rounds < self.warmup_rounds else 0.0):
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

    def _search_plans(self, key: str, state: _ClassState, local: bool) -> None:
        bypass = self.allow_bypass and state.rounds >= self.warmup_rounds
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

    def _adopt(self, key: str, state: _ClassState, best: Plan) -> None:
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

    def _retune_due(self, state: _ClassState) -> bool:
        """Every round during the warm-up (a fresh tuner's first plan rests on priors alone, and
        each round's data moves it most: waiting 4 rounds kept the demo chain at [1, 1] for 8
        rounds), when a request starts or the text shifts; and while the re-tune budget allows
        (see __init__), every `retune_every` rounds, or every round for `retune_every` rounds
        after a shift (the forgetting leaves a tenth of the old counts, which the next rounds'
        data outweigh)."""
        if state.plan is None or state.retune_now or state.rounds < self.warmup_rounds:
            return True
        return (state.eager_rounds > 0 or state.since_retune >= self.retune_every) and self._retune_credit_ms >= 0.0

    def _drifted(self, state: _ClassState, current_ms: float) -> bool:
        """The plan's predicted time has moved by more than `replan_drift` since it was last
        weighed with no margin (adopted, or kept by such a search): the estimates it was cut
        for have moved, whether or not the shift detector saw it happen."""
        anchor = state.anchor_ms
        return bool(anchor) and math.isfinite(anchor) and abs(current_ms / anchor - 1.0) > self.replan_drift

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
            return self.switch_hysteresis
        return 0.0 if afresh else self.hysteresis

    def _set_probing(self, key: str, state: _ClassState, plans: dict[tuple[int, ...], Plan] | None = None) -> None:
        """While the plan bypasses tiers their acceptance goes stale, so every so often a round
        runs all of them (a probe). The closer the plan with all tiers is predicted to come, the
        likelier stale estimates hide a better plan and the cheaper a probe is: probes come
        every (gap + catch-up) / PROBE_BUDGET rounds (at least 2, at most `explore_every`), so
        they cost about PROBE_BUDGET of the predicted time. The catch-up: a bypassed model tier
        re-feeds what it missed in one forward when it returns, measured (`catch_up_ms`; t(1)
        until it is). With short requests that is mostly the prompt: a request that began
        without the tier has it re-fed at the probe (the demo chain at T = 0 on a fast CPU:
        probes of the int8 tier every 16 rounds cost ~13 ms each, 9 % of the time). An n-gram
        tier (no forward) is probed as often as its gap allows."""
        full_set = tuple(range(self.num_tiers))
        if not self.explore_every or state.plan.active == full_set:
            state.probe_every = 0
            return
        plan = state.plan
        # the full chain as it may be: the pairs the plan does not run at acceptance
        # PROBE_OPTIMISM posterior sd above the mean, so a bypassed pair whose counts have thinned
        # to STALE_BLOCKS (what it showed before the bypass, on little weight) is probed sooner
        # than one measured lately
        unrun = frozenset(itertools.combinations(full_set, 2)) - frozenset(zip(plan.active, plan.active[1:]))
        with self._optimistic(self.probe_optimism, unrun):
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
        state.probe_every = int(min(self.explore_every, max(2, math.ceil(share / PROBE_BUDGET))))

    # ---------------------------------------------------------------- state

    def _state(self, key: str) -> _ClassState:
        state = self._classes.get(key)
        if state is None:
            state = self._classes[key] = _ClassState({})
        return state

    @staticmethod
    def _age(state: _ClassState) -> None:
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

    def _observe_pair(self, key: str, verifier: int, drafter: int, proposed: int, accepted: int) -> None:
        """A verification round of the pair: into its estimate and its long-run estimate (a
        shift in the text, seen by the estimate's detector, calls for a re-tune now)."""
        estimate = self._estimate(key, verifier, drafter)
        shifts = estimate.shifts
        estimate.observe(proposed, accepted)
        state = self._state(key)
        if estimate.shifts != shifts:
            state.retune_now = state.full_now = True
            state.eager_rounds = self.retune_every
        long_run = state.long_run.get((verifier, drafter))
        if long_run is None:
            long_run = state.long_run[(verifier, drafter)] = AcceptanceEstimate(
                self.prior_mean, self.prior_strength, max(self.decay, SLOW_DECAY), age_per_block=False, detect_shifts=False)
        long_run.observe(proposed, accepted)

    def _observe_fill(self, key: str, drafter: int, asked: int, proposed: int) -> None:
        self._fill(key, drafter).observe(asked, proposed)
        fills = self._state(key).long_run_fills
        if drafter not in fills:
            fills[drafter] = FillEstimate(max(self.decay, SLOW_DECAY))
        fills[drafter].observe(asked, proposed)

    def _restart(self, state: _ClassState) -> None:
        """A request of the class starts. Acceptance differs more between prompts than along
        one: on the demo chain the n-gram tier's position-1 rate ran from 0.31 to 0.89 across
        eight held-out prompts. The recent estimates are the last request's, so a request
        after a hard one started on lengths cut for it (fixed [6, 3] cost 13 % over [6, 6] on
        the next prompt). Each request starts from the class's long-run estimates (at the
        recent ones' weight, so its own rounds move them as fast as before) and re-tunes."""
        if self.fixed is not None or self.decay >= 1.0 or state.plan is None:  # polyspec tune's calibration: plain counts
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

    def _estimate(self, key: str, verifier: int, drafter: int, shadow: bool = False) -> AcceptanceEstimate:
        state = self._state(key)
        estimates = state.shadow_estimates if shadow else state.estimates
        estimate = estimates.get((verifier, drafter))
        if estimate is None:
            estimate = estimates[(verifier, drafter)] = AcceptanceEstimate(
                self.prior_mean, self.prior_strength, self.decay, age_per_block=False, along_text=not shadow)
        return estimate

    def _fill(self, key: str, drafter: int) -> FillEstimate:
        fills = self._state(key).fills
        if drafter not in fills:
            fills[drafter] = FillEstimate(self.decay)
        return fills[drafter]

    def fill(self, key: str, drafter: int) -> float:
        """Expected share of an asked block the bottom drafter `drafter` proposes (StageSpec.fill)."""
        return self._fill(key, drafter).fill

    def estimates(self, key: str, shadow: bool = False) -> dict[tuple[int, int], AcceptanceEstimate]:
        state = self._state(key)
        return dict(state.shadow_estimates if shadow else state.estimates)
