"""Acceptance as the batched planner sees it: per (verifier, drafter, greedy) pair, the tokens a round emits.

Chain rounds: a per-token rate a, estimated as accepted tokens / (accepted tokens + rounds
that ended in a rejection), the geometric model's maximum likelihood, with a prior worth
PRIOR_WEIGHT tokens. A round of block k emits E(a, k) = (1 - a^(k+1)) / (1 - a).

Tree rounds (`tree_width` w > 1: the bottom drafter proposes w candidate chains of depth d
sharing the root, grown as `draft_tree_batch` grows them, w nodes per level): the accepted
path reaches depth i + 1 given it reached depth i with a conditional rate q_i, counted per
depth from each round's accepted length. Priors: depth 0 picks the best of w candidates,
1 - (1 - a)^w; a deeper level continues one candidate chain, a (the chain rate, which tree
rounds feed with their acceptance past depth 0, so depths no tree has reached yet are priced
from what the shallower ones measured). A round of depth d emits 1 + sum_{i<d} prod_{j<=i} q_j.
The statistics are those of the engine's one tree width (they are not kept per width).

Acceptance moves: a lookup drafter's grows with the request's own text, a model drafter's differs between
prose, code and math. So a pair's chain counts fade (by 1 / MEMORY_ROUNDS per round of that pair, or to
`tuning.decay` of themselves where the config sets it): the
rate follows the last ~MEMORY_ROUNDS rounds, and `spread` says how sure one is (the posterior's standard
deviation over the counts kept, prior included). A tree's per-depth counts do not fade: its deeper levels
are reached by few rounds, and they are priced from the chain rate until they have been.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

PRIOR_RATE = 0.8  # acceptance rate before any round is seen (a model drafter; the lookup's is LOOKUP_PRIOR_RATE)
LOOKUP_PRIOR_RATE = 0.5
PRIOR_WEIGHT = 4.0  # ... worth this many observed tokens (rounds, for a tree depth's rate)
MEMORY_ROUNDS = 128  # a pair's chain counts fade by 1 / MEMORY_ROUNDS per round: at 4 requests, ~32 steps weigh most


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one round with a block of k emits (accepted + correction or bonus)."""
    if k <= 0:
        return 1.0
    if rate >= 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def first_passage(step_pmf: Sequence[float], need: int) -> tuple[list[float], float]:
    """Add i.i.d. steps (step_pmf[x] = P(step = x), x >= 1) until the total reaches `need`.

    Returns (pmf of the final total: [s] = P(total = s), s >= need; expected number of steps).
    """
    if need <= 0:
        return [1.0], 0.0
    reach = [0.0] * need  # [s] = P(some partial sum equals s), s < need
    reach[0] = 1.0
    totals = [0.0] * (need + len(step_pmf))
    for partial in range(need):
        mass = reach[partial]
        if mass == 0.0:
            continue
        for step, p in enumerate(step_pmf):
            if step == 0 or p == 0.0:
                continue
            if partial + step < need:
                reach[partial + step] += mass * p
            else:
                totals[partial + step] += mass * p
    while totals and totals[-1] == 0.0:
        totals.pop()
    return totals, sum(reach)  # steps taken = partial sums visited below `need`


def rate_at(accept_rates: Sequence[float], position: int) -> float:
    """Acceptance of `position` (1-based) given the earlier ones; the last rate repeats."""
    if not accept_rates:
        return 0.0
    return float(accept_rates[min(position, len(accept_rates)) - 1])


def accepted_pmf(accept_rates: Sequence[float], block_len: int) -> list[float]:
    """[j] = P(exactly j of a `block_len`-token block are accepted), j = 0..block_len."""
    pmf = []
    survive = 1.0  # P(positions 1..j all accepted)
    for position in range(1, block_len + 1):
        rate = rate_at(accept_rates, position)
        pmf.append(survive * (1.0 - rate))
        survive *= rate
    pmf.append(survive)
    return pmf


@functools.lru_cache(maxsize=4096)
def middle_rounds(need: int, k: int, per_round: float) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A middle tier asked for `need` tokens runs rounds of block k until it has them, and hands up all it emitted
    (docs/time-model.md, "A middle tier overshoots"): (its expected rounds, the pmf of the block it hands up as
    (length, probability) pairs). A round emits its accepted tokens and one more (`accepted_pmf` at the one rate
    whose expected tokens are `per_round`: the pair's, a tree's included). (The planner priced ceil(need / per_round) rounds and a
    block of `need`: a step in the prediction wherever the ratio crossed an integer, 21 % between two inner lengths
    measured 0.2 % apart on the demo chain, and the overshoot's tokens left out.)"""
    low, high = 0.0, 1.0
    for _ in range(40):  # expected_tokens rises with the rate, from 1 to k + 1
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, k) < per_round else (low, middle)
    totals, rounds = first_passage([0.0] + accepted_pmf(((low + high) / 2,), k), need)  # [x]: x tokens emitted
    return rounds, tuple((length, p) for length, p in enumerate(totals) if p > 0.0)


class Acceptance:
    """Observed acceptance per (verifier level, drafter, greedy): a chain rate and per-depth tree rates."""

    def __init__(self, priors: list[float], prior_weight: float = PRIOR_WEIGHT, keep: float = 1.0 - 1.0 / MEMORY_ROUNDS) -> None:
        """`priors`: per tier index, its prior chain rate as a drafter, worth `prior_weight` tokens; `keep`: what a
        pair's chain counts keep per round of it (`tuning.decay` where the config sets it; 1.0: plain counts)."""
        self.priors = priors
        self.prior_weight = prior_weight
        self.keep = keep
        self.accepted: dict[tuple, float] = {}  # chain tokens accepted ...
        self.rejected: dict[tuple, float] = {}  # ... and chain rounds ended by a rejection
        self.reached: dict[tuple, list[float]] = {}  # tree rounds whose walk reached depth i ...
        self.passed: dict[tuple, list[float]] = {}  # ... and accepted a node there
        self.asked: dict[tuple, float] = {}  # tokens asked of the drafter ...
        self.given: dict[tuple, float] = {}  # ... and proposed, up to what was asked (`fill`)

    def observe(self, level: int, drafter: int, proposed: int, accepted: int, greedy: bool = True,
                depth: int | None = None, ended: bool | None = None, length: int | None = None) -> None:
        """A round of `proposed` drafted nodes with an accepted path of `accepted`; `depth`: a tree's depth (None: a chain).
        `ended`: whether the round ended within its block (None: accepted < proposed, a rejection). A chain's round
        that emits accepted + 1 tokens counts one end whatever ended it: a rejection, or a block shorter than asked
        (a lookup that found a short continuation or none, an early exit), so E(a, k) prices the tokens a round of
        k really emits. (Counting a lookup's misses and short blocks as nothing, the demo chain's n-gram tier was
        priced at 3.5 tokens a round of 6 where it gave 2.3.) `length`: the block asked for (the fill: `fill`)."""
        ended = accepted < proposed if ended is None else ended
        if proposed <= 0 and not ended:
            return
        key = (level, drafter, greedy)
        for counts in (self.accepted, self.rejected, self.asked, self.given):
            if key in counts:
                counts[key] *= self.keep
        if length:
            self.asked[key] = self.asked.get(key, 0.0) + length
            self.given[key] = self.given.get(key, 0.0) + min(proposed, length)
        if depth is None:
            self.accepted[key] = self.accepted.get(key, 0.0) + accepted
            self.rejected[key] = self.rejected.get(key, 0.0) + (1.0 if ended else 0.0)
            return
        reached, passed = self.reached.setdefault(key, []), self.passed.setdefault(key, [])
        while len(reached) < depth:
            reached.append(0.0)
            passed.append(0.0)
        for i in range(min(accepted + 1, depth)):
            reached[i] += 1.0
            passed[i] += 1.0 if i < accepted else 0.0
        if depth > 1 and accepted >= 1:  # past depth 0 the walk follows one candidate chain: a chain round of depth - 1
            self.accepted[key] = self.accepted.get(key, 0.0) + accepted - 1
            self.rejected[key] = self.rejected.get(key, 0.0) + (1.0 if accepted < depth else 0.0)

    def fill(self, level: int, drafter: int, greedy: bool = True) -> float:
        """The share of the tokens asked that the drafter proposed (1 until a round is heard; a lookup's misses and
        short continuations make it less): its verifier's forward takes fill x k tokens of a block of k."""
        key = (level, drafter, greedy)
        asked = self.asked.get(key, 0.0)
        return self.given.get(key, 0.0) / asked if asked > 0 else 1.0

    def rate(self, level: int, drafter: int, greedy: bool = True) -> float:
        key = (level, drafter, greedy)
        prior = self.priors[drafter]
        accepted = self.accepted.get(key, 0.0) + prior * self.prior_weight
        rejected = self.rejected.get(key, 0.0) + (1 - prior) * self.prior_weight
        return accepted / (accepted + rejected)

    def spread(self, level: int, drafter: int, greedy: bool = True) -> float:
        """The chain rate's uncertainty: the standard deviation of its Beta posterior over the counts kept."""
        key = (level, drafter, greedy)
        seen = self.accepted.get(key, 0.0) + self.rejected.get(key, 0.0) + self.prior_weight
        rate = self.rate(level, drafter, greedy)
        return math.sqrt(rate * (1.0 - rate) / (seen + 1.0))

    def depth_rates(self, level: int, drafter: int, greedy: bool, width: int, depth: int) -> list[float]:
        """q_0 .. q_{depth-1} of a tree of `width` candidates: measured per depth, a prior where few rounds reached it."""
        key = (level, drafter, greedy)
        chain = self.rate(level, drafter, greedy)
        reached, passed = self.reached.get(key, []), self.passed.get(key, [])
        out = []
        for i in range(depth):
            prior = 1.0 - (1.0 - chain) ** width if i == 0 else chain
            seen = reached[i] if i < len(reached) else 0.0
            hits = passed[i] if i < len(passed) else 0.0
            out.append((hits + prior * self.prior_weight) / (seen + self.prior_weight))
        return out

    def expected(self, level: int, drafter: int, greedy: bool, k: int, width: int = 1) -> float:
        """Tokens a round emits: a chain block of k, or (width > 1) a tree of depth k."""
        if width <= 1:
            return expected_tokens(self.rate(level, drafter, greedy), k)
        total, reach = 1.0, 1.0
        for q in self.depth_rates(level, drafter, greedy, width, k):
            reach *= q
            total += reach
        return total

    def pairs(self) -> list[tuple]:
        return sorted(set(self.accepted) | set(self.reached))
