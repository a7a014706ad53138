"""What the tuner knows of acceptance: per (verifier, drafter) pair and per position of the
text, a recency-weighted Beta posterior (`AcceptanceEstimate`); per bottom drafter, the share
of an asked block it really proposes (`FillEstimate`).

Every count decays by `decay` per observed block (or per target round, when the tuner ages
it), so after a shift (repetitive code -> prose) the estimates, and with them the lengths,
move within a few rounds. Position 1's prior is Beta(prior_mean, strength); position j's
prior mean is position j-1's posterior mean, so rarely reached positions fall back on their
neighbours. Deep positions get fresh data only from blocks that reach them, so after a shift
they would lag: a likelihood-ratio test on position 1's last outcomes detects the shift and
the old counts are then mostly forgotten.
"""

from __future__ import annotations

import dataclasses
import math

from polyspec.workers.core.sampling import SamplingParams

MAX_POSITIONS = 32
MIN_PRIOR_WEIGHT = 0.5
SHIFT_WINDOWS = (8, 24)  # position 1's last outcomes (a big shift shows in 8, a moderate one in 24) ...
SETTLED_DECAY = 0.97  # ... against its slow tracker (~30 blocks) as it stood before them
SHIFT_LOG_RATIO = 4.0  # log likelihood ratio that counts as a shift in the text (~55:1)
SHIFT_FORGET = 0.1  # what a shift leaves of the old counts
UNASKED_DECAY = 0.8  # extra forgetting per step of positions no block asked for, rated below the position above (AcceptanceEstimate.age)
OPTIMISTIC_CAP = 0.99
MIN_BLOCKS = 4  # a skip pair's shadow estimate counts from this many blocks on, and only until it has as many of its own


def ema(previous: float | None, value: float, smoothing: float) -> float:
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
    them into the rates of rounds at any length. A shadow sample (the tuner's commit hook) is
    already an even sample along the text, but not one a chain's rounds would take (they enter
    a repeated run at its start and jump through it, and rarely start near its end where the
    matches are short), so shadow estimates stay per round (`along_text=False`) with their own
    position-1 weighting (the tuner's commit hook).
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


def request_class(params: SamplingParams) -> str:
    return "greedy" if params.greedy else "sampling"
