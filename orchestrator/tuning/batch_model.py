"""Goodput under load: the time model with a batch dimension, and the plan that maximises total tokens/s.

A batched step (polyspec.orchestrator.decode.batched) runs one round of B requests. Its
cost is built from each tier's forward time `t_i(B, W)` for B rows padded to W new tokens:

    plan "off":            t_0(B, 1)                                              -> B tokens
    target <- d, k:        t_0(B, k + 1) + draft_d(B, k)                          -> B * E(a_0, k)
    target <- m <- d, k, j: t_0(B, k + 1) + ceil(k / E(a_1, j)) * (t_m(B, j + 1) + draft_d(B, j))

with E(a, k) = (1 - a^(k+1)) / (1 - a) the expected tokens a round of block k emits at
per-token acceptance rate a, and draft_d(B, k) = k forwards t_d(B, 1) for a model drafter
or B lookups for the n-gram tier. Acceptance does not move with B, but the cost of a block
does: at B = 1 a forward of k + 1 tokens costs little more than one, at B = 64 it costs
several times more, so the same acceptance can pay at low load and lose at high load. The
planner picks, for the number of requests in the step, the plan with the most expected
tokens per second; speculation off is always a candidate.

`t_i(B, W)` comes from a start-up profile on a grid of (B, W), interpolated in between, and
is refined online from every batched forward (an EMA per grid cell). Each plan's predicted
step time is also corrected online by the ratio of measured to predicted step times for
that plan and batch size (Python overhead, rounds that overshoot), and every
`EXPLORE_EVERY` steps the planner runs one step on the other side (off when speculating,
the best speculating plan when off). The measured tokens/s of both sides are kept per batch
size: the first step at a new batch size runs with speculation off (the bar to clear), and
when speculating has measured slower than not, speculation stays off whatever the model
predicts, so under load the planner is not slower than speculation off.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import time

import torch

from polyspec.workers.core.sampling import SamplingParams

BATCH_GRID = (1, 4, 16, 64)
WIDTH_GRID = (1, 4, 8, 16)
PROFILE_CONTEXT = 128
SMOOTHING = 0.2
EXPLORE_COST = 3.0  # before speculation is measured at a batch size, no plan predicted to cost more than this many "off" steps
EXPLORE_EVERY = 24  # steps with speculation on between two steps with it off (per batch-size bucket)
PRIOR_RATE = 0.8  # acceptance rate before any round is seen (a model drafter; the lookup's is LOOKUP_PRIOR_RATE)
LOOKUP_PRIOR_RATE = 0.5
PRIOR_WEIGHT = 4.0  # ... worth this many observed tokens
LENGTHS = (3, 6, 12)
INNER_LENGTHS = (4, 10)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one round with a block of k emits (accepted + correction or bonus)."""
    if k <= 0:
        return 1.0
    if rate >= 1.0 - 1e-9:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def bucket(batch: int) -> int:
    """Batch sizes that share online corrections: powers of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch))))


def _interpolate(grid: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Indices (lo, hi) around x on `grid` and the weight of hi (clamped at the ends, linear beyond the last)."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 1, len(grid) - 1, 0.0
    hi = bisect.bisect_left(grid, x)
    lo = hi - 1
    return lo, hi, (x - grid[lo]) / (grid[hi] - grid[lo])


@dataclasses.dataclass
class ForwardTable:
    """ms of one batched forward on the (batch, width) grid, refined online."""

    ms: dict[tuple[int, int], float]

    def estimate(self, batch: int, width: int) -> float:
        bl, bh, bw = _interpolate(BATCH_GRID, batch)
        wl, wh, ww = _interpolate(WIDTH_GRID, width)

        def at(b: int, w: int) -> float:
            return self.ms[(BATCH_GRID[b], WIDTH_GRID[w])]

        low = at(bl, wl) * (1 - ww) + at(bl, wh) * ww
        high = at(bh, wl) * (1 - ww) + at(bh, wh) * ww
        value = low * (1 - bw) + high * bw
        # beyond the grid's corners: proportional to the rows fed
        scale = max(1.0, batch / BATCH_GRID[-1]) * max(1.0, width / WIDTH_GRID[-1])
        return value * scale

    def observe(self, batch: int, width: int, ms: float) -> None:
        """Move the nearest grid cell toward what this forward's size predicts for it."""
        b = min(BATCH_GRID, key=lambda g: abs(math.log(g) - math.log(max(1, batch))))
        w = min(WIDTH_GRID, key=lambda g: abs(g - width))
        predicted = self.estimate(batch, width)
        if predicted <= 0:
            return
        ratio = min(3.0, max(1 / 3.0, ms / predicted))
        self.ms[(b, w)] *= 1.0 + SMOOTHING * (ratio - 1.0)


@dataclasses.dataclass(frozen=True)
class Plan:
    active: tuple[int, ...]  # tiers in use, target first
    lengths: tuple[int, ...]  # per tier: k of the stage it verifies (0 unused)

    @property
    def speculating(self) -> bool:
        return len(self.active) > 1


class BatchPlanner:
    """Chooses the plan of each batched step from the forward tables and the acceptance seen so far."""

    def __init__(self, tiers, tables: list[ForwardTable | None], lookup_ms: list[float], max_length: int = max(LENGTHS),
                 max_batched_tokens: int | None = None) -> None:
        self.tiers = tiers
        self.max_batched_tokens = max_batched_tokens  # a plan whose widest forward would exceed it is not taken
        self.tables = tables  # per tier; None for the n-gram lookup
        self.lookup_ms = lookup_ms  # per tier: ms per request of a model-free draft
        self.max_length = max_length
        self.accepted: dict[tuple, float] = {}
        self.rejected: dict[tuple, float] = {}
        self.correction: dict[tuple, float] = {}  # (plan, bucket), (plan, 0), (None, bucket), (None, 0) -> measured / predicted step time
        self.measured: dict[tuple[int, bool], float] = {}  # (bucket, speculating) -> EMA of measured tokens/s
        self.steps: dict[int, int] = {}  # bucket -> steps since speculation was last off
        self.plans = self._candidates()
        self.chosen: dict[int, Plan] = {}
        self.history: list[dict] = []  # (batch, plan) each time a bucket's choice changed
        self.greedy_share = 1.0  # of the requests in the step being planned
        self._pending: Plan | None = None
        self._predicted_ms = 0.0

    def _candidates(self) -> list[Plan]:
        n = len(self.tiers)
        zero = (0,) * max(0, n - 1)
        plans = [Plan((0,), zero)]
        lengths = [k for k in LENGTHS if k <= self.max_length]
        for drafter in range(1, n):
            for k in lengths:
                plans.append(Plan((0, drafter), tuple(k if i == 0 else 0 for i in range(n - 1))))
        for mid, bottom in itertools.combinations(range(1, n), 2):
            if not self.tiers[mid].can_verify:
                continue
            for k, j in itertools.product(lengths, [j for j in INNER_LENGTHS if j <= self.max_length]):
                plans.append(Plan((0, mid, bottom), tuple(k if i == 0 else j if i == mid else 0 for i in range(n - 1))))
        return plans

    # ------------------------------------------------------------- observing

    def observe_round(self, level: int, drafter: int, proposed: int, accepted: int, greedy: bool = True) -> None:
        if proposed <= 0:
            return
        key = (level, drafter, greedy)
        self.accepted[key] = self.accepted.get(key, 0.0) + accepted
        self.rejected[key] = self.rejected.get(key, 0.0) + (1.0 if accepted < proposed else 0.0)

    def observe_forwards(self) -> None:
        """Fold the tiers' logged forwards into the tables."""
        for tier, table in zip(self.tiers, self.tables):
            log = getattr(tier, "forward_log", None)
            if table is None or not log:
                continue
            for rows, width, seconds in log:
                table.observe(rows, width, seconds * 1000.0)
            log.clear()

    def observe_step(self, batch: int, tokens: int, seconds: float, lengths, active) -> None:
        self.observe_forwards()
        plan = self._pending
        if plan is None or self._predicted_ms <= 0:
            return
        group = bucket(batch)
        ratio = min(4.0, max(0.25, seconds * 1000.0 / self._predicted_ms))
        for key in ((plan, group), (plan, 0), (None, group), (None, 0)):
            current = self.corrected(*key)
            self.correction[key] = current + SMOOTHING * (ratio - current)
        if seconds > 0:
            key = (group, plan.speculating)
            rate = tokens / seconds
            self.measured[key] = rate if key not in self.measured else self.measured[key] + SMOOTHING * (rate - self.measured[key])

    def corrected(self, plan, group: int) -> float:
        """Measured / predicted step time: this plan at this batch size, else this plan, else all plans at this size, else all."""
        for key in ((plan, group), (plan, 0), (None, group), (None, 0)):
            if key in self.correction:
                return self.correction[key]
        return 1.0

    def rate(self, level: int, drafter: int, greedy: bool = True) -> float:
        key = (level, drafter, greedy)
        prior = PRIOR_RATE if self.tables[drafter] is not None else LOOKUP_PRIOR_RATE
        accepted = self.accepted.get(key, 0.0) + prior * PRIOR_WEIGHT
        rejected = self.rejected.get(key, 0.0) + (1 - prior) * PRIOR_WEIGHT
        return accepted / (accepted + rejected)

    # ------------------------------------------------------------- the model

    def draft_ms(self, tier: int, batch: int, k: int) -> float:
        table = self.tables[tier]
        if table is None:
            return self.lookup_ms[tier] * batch
        return table.estimate(batch, 2) + (k - 1) * table.estimate(batch, 1)

    def emitted(self, level: int, drafter: int, k: int) -> float:
        """Expected tokens of a round, over the batch's mix of greedy and sampling requests."""
        greedy = self.greedy_share
        return greedy * expected_tokens(self.rate(level, drafter, True), k) + (1 - greedy) * expected_tokens(self.rate(level, drafter, False), k)

    def step_ms(self, plan: Plan, batch: int) -> tuple[float, float]:
        """(predicted ms of one step, expected tokens per request) for `plan` at `batch` requests."""
        t0 = self.tables[0]
        if not plan.speculating:
            return t0.estimate(batch, 1), 1.0
        k = plan.lengths[0]
        if len(plan.active) == 2:
            drafter = plan.active[1]
            return t0.estimate(batch, k + 1) + self.draft_ms(drafter, batch, k), self.emitted(0, drafter, k)
        mid, bottom = plan.active[1], plan.active[2]
        j = plan.lengths[mid]
        per_round = self.emitted(mid, bottom, j)
        rounds = math.ceil(k / per_round)
        mid_ms = rounds * (self.tables[mid].estimate(batch, j + 1) + self.draft_ms(bottom, batch, j))
        # the mid tier emits ~k tokens; the target accepts them at its rate against the mid tier
        return t0.estimate(batch, k + 1) + mid_ms, self.emitted(0, mid, k)

    def fits(self, plan: Plan, batch: int) -> bool:
        """Does the plan's widest forward (the target's block) stay within max_batched_tokens?"""
        if self.max_batched_tokens is None or not plan.speculating:
            return True
        return batch * (plan.lengths[0] + 1) <= self.max_batched_tokens

    def goodput(self, plan: Plan, batch: int) -> float:
        """Expected total tokens/s of a step of `batch` requests under `plan`."""
        ms, tokens = self.step_ms(plan, batch)
        ms *= self.corrected(plan, bucket(batch))
        return batch * tokens / max(ms, 1e-6) * 1000.0

    def allowed(self, batch: int) -> list[Plan]:
        return [p for p in self.plans if self.fits(p, batch)] or self.plans[:1]

    def predicted_best(self, batch: int) -> Plan:
        """The plan the time model (with its online corrections) expects to give the most tokens/s."""
        return max(self.allowed(batch), key=lambda p: self.goodput(p, batch))

    def plan(self, batch: int, params: list[SamplingParams] | None = None) -> tuple[list[int], tuple[int, ...]]:
        """(lengths, active tiers) for the next step of `batch` requests."""
        group = bucket(batch)
        if params:
            self.greedy_share = sum(p.greedy for p in params) / len(params)
        allowed = self.allowed(batch)
        off = self.plans[0]
        spec_rate, off_rate = self.measured.get((group, True)), self.measured.get((group, False))
        if spec_rate is None:  # nothing measured speculating at this load yet: try only plans whose step is cheap
            cap = EXPLORE_COST * self.step_ms(off, batch)[0]
            allowed = [p for p in allowed if not p.speculating or self.step_ms(p, batch)[0] <= cap] or [off]
        best = max(allowed, key=lambda p: self.goodput(p, batch))
        if best.speculating and off_rate is None:
            best = off  # first measure "off" at this load: the bar speculation has to clear
        elif best.speculating and spec_rate is not None and spec_rate < off_rate:
            best = off  # measured: speculating at this load has been slower than not
        self.steps[group] = self.steps.get(group, 0) + 1
        if self.steps[group] >= EXPLORE_EVERY:  # measure the other side again now and then
            self.steps[group] = 0
            if best.speculating:
                best = off
            else:
                best = max((p for p in allowed if p.speculating), key=lambda p: self.goodput(p, batch), default=off)
        if self.chosen.get(group) != best:
            self.chosen[group] = best
            self.history.append({"batch": batch, "tiers": list(best.active), "lengths": list(best.lengths)})
            del self.history[:-64]
        self._pending = best
        self._predicted_ms = self.step_ms(best, batch)[0] * self.corrected(best, group)
        return list(best.lengths), best.active

    def describe(self) -> dict:
        return {
            "rates": {f"{self.tiers[a].name}<-{self.tiers[b].name}{'' if g else ' (sampling)'}": round(self.rate(a, b, g), 4)
                      for a, b, g in sorted(self.accepted)},
            "chosen": {str(b): {"tiers": [self.tiers[t].name for t in p.active], "lengths": list(p.lengths)} for b, p in sorted(self.chosen.items())},
        }


# ----------------------------------------------------------------- profiling


def profile_batched(tiers, vocab_size: int, max_batch: int, repeats: int = 2) -> tuple[list[ForwardTable | None], list[float]]:
    """Start-up tables: each model tier's forward on the (batch, width) grid, each lookup tier's ms per request."""
    generator = torch.Generator().manual_seed(0)
    tables: list[ForwardTable | None] = []
    lookup: list[float] = []
    batches = [b for b in BATCH_GRID if b <= max(max_batch, 1)] or [1]
    for index, tier in enumerate(tiers):
        context = torch.randint(1, vocab_size, (PROFILE_CONTEXT,), generator=generator).tolist()
        if not tier.has_weights:
            started = time.perf_counter()
            for _ in range(8):
                tier.draft_batch([("profile", index)], [context], [8], [SamplingParams()], [None])
            lookup.append((time.perf_counter() - started) / 8 * 1000.0)
            tier.release(("profile", index))
            tables.append(None)
            continue
        lookup.append(0.0)
        ms: dict[tuple[int, int], float] = {}
        ids = [("profile", index, r) for r in range(max(batches))]
        tier.prefill(ids, [context] * len(ids), PROFILE_CONTEXT * len(ids))
        warm = False
        for b in batches:
            for w in WIDTH_GRID:
                best = float("inf")
                for _ in range(repeats + (0 if warm else 1)):  # the very first run warms up
                    for seq_id in ids[:b]:
                        tier.truncate(seq_id, PROFILE_CONTEXT - 1)
                    started = time.perf_counter()  # a tail of 1 token and a block of w - 1: w new positions per row
                    tier.score_batch(ids[:b], [context] * b, _chains(context[1:w], b), [SamplingParams()] * b)
                    best = min(best, (time.perf_counter() - started) * 1000.0)
                ms[(b, w)] = best
                warm = True
        for seq_id in ids:
            tier.release(seq_id)
        tier.forward_log.clear()
        for b in BATCH_GRID:  # beyond the largest batch profiled: proportional to the rows
            if b not in batches:
                for w in WIDTH_GRID:
                    ms[(b, w)] = ms[(batches[-1], w)] * b / batches[-1]
        tables.append(ForwardTable(monotone(ms)))
    return tables, lookup


def monotone(ms: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """A forward never gets cheaper with more rows or more tokens: each cell becomes the smallest
    measurement at or beyond it, so one slow outlier (a busy machine) cannot dent the table."""
    out = dict(ms)
    for b in BATCH_GRID:
        for w in reversed(WIDTH_GRID[:-1]):
            nxt = WIDTH_GRID[WIDTH_GRID.index(w) + 1]
            out[(b, w)] = min(out[(b, w)], out[(b, nxt)])
    for w in WIDTH_GRID:
        for b in reversed(BATCH_GRID[:-1]):
            nxt = BATCH_GRID[BATCH_GRID.index(b) + 1]
            out[(b, w)] = min(out[(b, w)], out[(nxt, w)])
    return out


def _chains(tokens: list[int], count: int):
    from polyspec.workers.core.tree import DraftTree

    return [DraftTree.chain(tokens, None) for _ in range(count)]
