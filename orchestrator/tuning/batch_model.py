"""Goodput under load: the time model with a batch dimension, and the plan that maximises total tokens/s.

A batched step runs one round of B requests. Its cost is built from each tier's forward time `t_i(B, W)`
for B rows padded to W new tokens:

    plan "off":            t_0(B, 1)                                              -> B tokens
    target <- d, k:        t_0(B, f k + 1) + draft_d(B, k)                        -> B * E(a_0, k)
    target <- m <- d, k, j: sum_L P(L) t_0(B, L + 1) + R * (t_m(B, f j + 1) + draft_d(B, j))  -> B * sum_L P(L) E(a_0, L)

plus the host's time around the forwards (`HostTime`: a + m R + d D for R middle rounds and D drafted forwards,
fitted from every step), with E(a, k) = (1 - a^(k+1)) / (1 - a) the expected tokens a round of block k emits at
per-token acceptance rate a (batch_acceptance.py; a round ended short of its block by a rejection or a short block
alike; a tree's per depth), f the share of a block the drafter fills (a lookup's misses and short continuations);
R the mid tier's expected rounds until it has k tokens and P(L) the law of the block L >= k it then hands up (it
hands up all it emitted: `middle_rounds`, an exact first passage of its rounds' tokens), and draft_d(B, k) = k
forwards t_d(B, 1) for a model drafter or B lookups for the n-gram tier; a tree of depth k and width w costs its
verifier t(B, w k + 1) and its drafter a root forward then k - 1 level forwards t_d(B, w). `t_i(B, W)` is a
start-up profile on a grid of (B, W) (`ForwardTable`), refined online by each shape's measured / profiled ratio
(forwards no wider than a plan's); each plan's predicted step time is also corrected by the ratio of measured to
predicted step times.

The model only proposes; per load (batch-size bucket, greedy / sampling / mixed requests) a measured A/B
against speculation off decides. docs/serving.md ("Speculation under load") gives the rules and the
measurements behind them; here each has its constant: MIN_STEPS per side, a plan not yet run gated by
EXPLORE_FLOOR / EXPLORE_BEST_SHARE / SEED_FLOOR of the model's prediction (`unexplored`, `spec_candidate`)
and by EXPLORE_TIME_SHARE of the running requests' remaining time (`affordable`), the lengths next to the
best measured (`neighbours`), hysteresis SWITCH_ON / SWITCH_OFF (`decide`), re-probes after REPROBE_FIRST
probes' times, doubling up to `tuning.explore_every`, a plan measured poor measured again once the model
carries its rate plus one standard error RETRY_MARGIN past the best's, at most once per RETRY_STEPS x 2^(its retries) steps
(`stale`), and per request drafting with a lookup tier once its own REQUEST_MIN_ROUNDS rounds say it pays
(`drafters`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import time


from polyspec.orchestrator.decode.contract import RoundObservation, ShadowObservation, StepObservation
from polyspec.orchestrator.tuning.batch_acceptance import (LOOKUP_PRIOR_RATE, MEMORY_ROUNDS, PRIOR_RATE,  # noqa: F401 (re-exported)
                                                            PRIOR_WEIGHT, Acceptance, expected_tokens, middle_rounds)
from polyspec.workers.core.sampling import SamplingParams

BATCH_GRID = (1, 4, 16, 64)
WIDTH_GRID = (1, 4, 8, 16)
PROFILE_CONTEXT = 128
SMOOTHING = 0.2
RATIO_MEMORY = 32  # a forward table's measured / profiled ratio of one shape fades over this many of its forwards ...
RATIO_MIN_SEEN = 2  # ... and speaks for that shape once it has seen this many
ESTIMATES_KEPT = 1024  # a forward table's estimates kept between two forwards observed (widths vary with the acceptance)
WINDOW = 8  # steps a measured rate sums before older steps start to fade
IN_FLIGHT_KEPT = 64  # planned steps kept per plan until heard (more in flight at once than any chain runs)
IN_FLIGHT_STALE_S = 120.0  # a planned step not heard for this long is taken for one whose round failed
MIN_STEPS = 3  # steps each side of an A/B runs before the A/B decides
PROBE_STEPS = 3  # steps the side not taken runs when it is looked at again
REPROBE_FIRST = 8  # time on the side taken before the first re-probe, in probes' times; doubles while the decision
# holds, up to `tuning.explore_every` (64 by default: a losing side re-probed costs under 2 % of the time)
SWITCH_ON = 1.05  # speculation turns on when it measures this many times off's tokens/s ...
SWITCH_OFF = 1.0  # ... and off when it measures under this many times off's
EXPLORE_FLOOR = 0.5  # a new load explores a further set of tiers only if predicted at least this share of off's tokens/s ...
EXPLORE_BEST_SHARE = 0.8  # ... and of the best speculating plan measured there
SEED_FLOOR = 0.25  # ... and the neighbouring load's winner only if predicted at least this share
EXPLORE_TIME_SHARE = 0.25  # a plan is measured only if its MIN_STEPS take at most this share of the running requests' remaining time
CANDIDATE_MARGIN = 1.5  # an unmeasured speculating plan must be predicted this much better than the measured best to be tried
RETRY_MARGIN = 1.1  # a plan measured poor is measured again when the model carries its rate this far past the best's
RETRY_STEPS = 16  # ... at most once per this many steps of the load, doubling with each retry
HOST_MEMORY = 64  # steps the host-time fit (`HostTime`) remembers, fading by 1 / this a step ...
HOST_MIN_STEPS = 3  # ... and the steps of a batch size it needs before it speaks for that size
REQUEST_MEMORY_ROUNDS = 16  # a request's own lookup counts fade by 1 / this per round of it
REQUEST_MIN_ROUNDS = 8  # ... and speak for the request once this many rounds are in
# the faded count of REQUEST_MIN_ROUNDS rounds (the least a request's own counts must hold; less a rounding's width)
REQUEST_MIN_WEIGHT = sum((1.0 - 1.0 / REQUEST_MEMORY_ROUNDS) ** i for i in range(REQUEST_MIN_ROUNDS)) - 1e-9
LENGTHS = (3, 6, 12)
INNER_LENGTHS = (4, 10)


def length_grid(grid: tuple[int, ...], longest: int) -> tuple[int, ...]:
    """The lengths of `grid` up to `longest`, and `longest` itself where the grid goes past it."""
    kept = tuple(k for k in grid if k <= longest)
    return kept if longest >= grid[-1] or longest in kept else kept + (longest,)


def _nearest_batch(batch: int) -> int:
    """The grid batch nearest `batch` (in ratio)."""
    return min(BATCH_GRID, key=lambda g: abs(math.log(g) - math.log(max(1, batch))))


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
    """ms of one batched forward on the (batch, width) grid, refined online.

    `ms` is the start-up profile (`profiled` reads it); what the tier's forwards then measure refines it as a ratio
    per (grid batch, width) measured: measured / profiled, faded over the last ~RATIO_MEMORY forwards of that shape,
    interpolated between the widths measured (`ratio`). Each shape that runs is priced from its own forwards: the
    profile's line between two grid widths is not the machine's (the demo target's 1- and 2-token forwards cost 2.1
    and 2.7 ms, not the line's 2.3), and moving the nearest grid cell toward each forward (as this table did) let the
    forwards on either side of a cell pull it apart, 15-35 % below the widths that ran.

    `ms` may hold more widths than WIDTH_GRID at a grid batch: a tier whose cost changes regime at some row count
    (a weight-only tier leaving its quantized kernel for the block path, workers/tiers/weight_only.py) is also
    measured on both sides of each such row count (`switch_widths`), and the estimate interpolates between the
    widths measured at that batch, so a kink or step between two grid widths is priced where it is; between two
    grid batches such a table reads both at this forward's rows, not its width (tests/orchestrator/test_switch_pricing.py)."""

    ms: dict[tuple[int, int], float]
    # ms per context token of a request's catch-up, timed for a tier that catches up inside its own calls (a feature
    # head: one forward over a context, while it verifies one token at a time); None: the widest block's per-token cost
    catch_up_ms: float | None = None
    _widths: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)  # widths() and switched(), kept
    # grid batch -> {width: [faded sum of measured / profiled, faded count, forwards]}; per grid batch the sorted (width,
    # ratio) points of the widths measured RATIO_MIN_SEEN times, and the mean ratio over every such shape (None: to rebuild)
    _seen: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _points: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _pooled: float | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _estimates: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)  # (batch, width) -> ms

    def catch_up(self) -> float:
        """ms per context token a request's catch-up costs this tier (one row)."""
        return self.catch_up_ms if self.catch_up_ms is not None else self.estimate(1, WIDTH_GRID[-1]) / WIDTH_GRID[-1]

    def switched(self) -> bool:
        """Whether the table holds switch widths (a tier whose cost changes regime at a row count)."""
        if "switched" not in self._widths:
            self._widths["switched"] = any(w not in WIDTH_GRID for _, w in self.ms)
        return self._widths["switched"]

    def widths(self, batch: int) -> tuple[int, ...]:
        """The widths measured at grid batch `batch`: WIDTH_GRID's and any switch widths."""
        if batch not in self._widths:
            self._widths[batch] = tuple(sorted(w for b, w in self.ms if b == batch and w <= WIDTH_GRID[-1]))
        return self._widths[batch]

    def estimate(self, batch: int, width: float) -> float:
        """ms of a forward of `batch` rows padded to `width` tokens: the profile x what the forwards measured (`ratio`).
        Kept until the next forward is observed: a planned step prices the same shapes for many plans."""
        key = (batch, width)
        value = self._estimates.get(key)
        if value is None:
            if len(self._estimates) >= ESTIMATES_KEPT:
                self._estimates.clear()
            value = self._estimates[key] = self.profiled(batch, width) * self.ratio(batch, width)
        return value

    def profiled(self, batch: int, width: float) -> float:
        """The start-up profile's ms, interpolated between its cells."""
        last, before = WIDTH_GRID[-1], WIDTH_GRID[-2]
        if width > last:  # past the widest block profiled (a deep tree's nodes): each token costs what the last step's did
            top = self.profiled(batch, last)
            return top + max(0.0, top - self.profiled(batch, before)) / (last - before) * (width - last)
        bl, bh, bw = _interpolate(BATCH_GRID, batch)
        rows = batch * width
        if 0.0 < bw < 1.0 and self.switched():
            # between two grid batches, each read at the same rows as this forward (not the same width): a switch sits
            # at a row count, so both neighbours are then on the same side of it as this forward. Where one of them
            # cannot hold that many rows (fewer than its requests, or past its widest block, where its line extrapolated
            # knows no switch beyond), the other alone.
            low, high = BATCH_GRID[bl], BATCH_GRID[bh]
            if rows < high:
                return self.profiled(low, rows / low)
            if rows / low > last:
                return self.profiled(high, rows / high)
            return self.profiled(low, rows / low) * (1 - bw) + self.profiled(high, rows / high) * bw

        def along(b: int) -> float:  # at grid batch b: linear between the two measured widths around `width`
            widths = self.widths(BATCH_GRID[b])
            wl, wh, ww = _interpolate(widths, width)
            return self.ms[(BATCH_GRID[b], widths[wl])] * (1 - ww) + self.ms[(BATCH_GRID[b], widths[wh])] * ww

        value = along(bl) * (1 - bw) + along(bh) * bw
        return value * max(1.0, batch / BATCH_GRID[-1])  # past the largest batch: proportional to the rows

    def ratio(self, batch: int, width: float) -> float:
        """Measured / profiled at this shape: at the nearest grid batch, linear between the widths measured around
        `width` (the nearest one's beyond them); where none was measured there, the mean over every shape measured;
        1 before any forward is heard."""
        b = _nearest_batch(batch)
        points = self._points.get(b, ())
        if points is None:
            entries = self._seen.get(b, {})
            points = self._points[b] = tuple(sorted((w, total / weight) for w, (total, weight, seen) in entries.items()
                                                    if seen >= RATIO_MIN_SEEN))
        if not points:
            if self._pooled is None:
                kept = [(total, weight) for entries in self._seen.values() for total, weight, seen in entries.values()
                        if seen >= RATIO_MIN_SEEN]
                self._pooled = sum(t for t, _ in kept) / sum(c for _, c in kept) if kept else 1.0
            return self._pooled
        widths = tuple(w for w, _ in points)
        low, high, weight = _interpolate(widths, width)
        return points[low][1] * (1 - weight) + points[high][1] * weight

    def observe(self, batch: int, width: int, ms: float) -> None:
        """A forward of `batch` rows padded to `width` tokens took `ms`: its shape's ratio to the profile moves."""
        profiled = self.profiled(batch, width)
        if profiled <= 0:
            return
        b = _nearest_batch(batch)
        entry = self._seen.setdefault(b, {}).setdefault(round(width), [0.0, 0.0, 0])
        keep = 1.0 - 1.0 / RATIO_MEMORY
        entry[0] = entry[0] * keep + min(3.0, max(1 / 3.0, ms / profiled))
        entry[1] = entry[1] * keep + 1.0
        entry[2] += 1
        self._points[b] = self._pooled = None
        self._estimates.clear()


def switch_widths(batch: int, switch_rows: tuple[int, ...]) -> tuple[int, ...]:
    """The widths to measure at `batch` besides WIDTH_GRID for a tier whose cost changes regime at each of
    `switch_rows` rows (a batch x width forward runs batch * width rows): the last width below each switch and
    the first at or past it, where they fall strictly inside the grid's widths and are not grid widths."""
    out = set()
    for rows in switch_rows:
        first = -(-rows // batch)  # ceil: the first width whose forward takes the other path
        out.update(w for w in (first - 1, first) if WIDTH_GRID[0] < w < WIDTH_GRID[-1] and w not in WIDTH_GRID)
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class Plan:
    active: tuple[int, ...]  # tiers in use, target first
    lengths: tuple[int, ...]  # per tier: k of the stage it verifies (0 unused)

    @property
    def speculating(self) -> bool:
        return len(self.active) > 1


@dataclasses.dataclass
class Rate:
    """Measured tokens/s of one plan at one load, per request (`Arm.measured` scales it to a batch): recent tokens
    over recent seconds (sums that decay by SMOOTHING per step once WINDOW steps are in, so one noisy step cannot
    flip a decision)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # steps in the sums, counting the faded ones in part
    steps: int = 0
    predicted: float = 0.0  # the model's tokens/s for the plan at each step, summed as the steps are
    last: int = 0  # the load's step count at the last step measured
    squares: tuple[float, float, float] = (0.0, 0.0, 0.0)  # faded sums of tokens^2, tokens x seconds, seconds^2 (`spread`)

    def add(self, tokens: int, seconds: float, predicted: float = 0.0, at: int = 0) -> None:
        keep = 1.0 - SMOOTHING if self.steps >= WINDOW else 1.0
        self.tokens = self.tokens * keep + tokens
        self.seconds = self.seconds * keep + seconds
        self.predicted = self.predicted * keep + predicted
        self.weight = self.weight * keep + 1.0
        tt, ts, ss = self.squares
        self.squares = (tt * keep + tokens * tokens, ts * keep + tokens * seconds, ss * keep + seconds * seconds)
        self.steps += 1
        self.last = at

    @property
    def spread(self) -> float:
        """The standard error of `value`, a ratio of sums: the steps' residuals about it (tokens - value x seconds),
        n / (n - 1) for the value estimated from them, over the seconds summed. inf under two steps. (Three steps
        of one request on a CPU committed 1 to 5 tokens each: their tokens/s is known to about a third.)"""
        if self.steps < 2 or self.seconds <= 0:
            return math.inf
        value = self.tokens / self.seconds
        tt, ts, ss = self.squares
        residual = max(0.0, tt - 2.0 * value * ts + value * value * ss)
        return math.sqrt(residual * self.weight / max(self.weight - 1.0, 1e-9)) / self.seconds

    @property
    def predicted_value(self) -> float:
        """What the model said of the plan while it was measured (0: nothing)."""
        return self.predicted / self.weight if self.weight else 0.0

    @property
    def value(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


@dataclasses.dataclass
class HostTime:
    """ms a step spends outside the tiers' forwards and lookups (the scheduler's bookkeeping, sampling, verification,
    the planner itself), as a + m x its middle tiers' rounds + d x its bottom drafter's forwards: least squares over
    the steps heard, fading by 1 / HOST_MEMORY a step, no coefficient below 0 (a feature no step has varied gets 0).
    The forwards' own time is the tables'; this is what they leave out. On the demo chain, whose forwards take a few
    milliseconds, a target round's host time was 0.3 ms, a middle tier's round 1.2 ms (its verification and the
    round's bookkeeping), a drafted token 0.55 ms: `polyspec tune` predicted 3-tier plans a quarter too fast without."""

    sums: list = dataclasses.field(default_factory=lambda: [[0.0] * 3 for _ in range(3)] + [[0.0] * 3])  # X'X rows, then X'y
    steps: int = 0
    _fit: tuple | None = dataclasses.field(default=None, repr=False, compare=False)  # coefficients(), until the next add

    def add(self, middle_rounds: float, draft_forwards: float, ms: float) -> None:
        keep = 1.0 - 1.0 / HOST_MEMORY
        x = (1.0, middle_rounds, draft_forwards)
        for i in range(3):
            for j in range(3):
                self.sums[i][j] = self.sums[i][j] * keep + x[i] * x[j]
            self.sums[3][i] = self.sums[3][i] * keep + x[i] * ms
        self.steps += 1
        self._fit = None

    def coefficients(self) -> tuple[float, float, float]:
        """(a, m, d), each at least 0: the least-squares fit over the features kept, dropping the most negative
        coefficient's feature until none is (solved once per step heard: every plan priced reads it)."""
        if self._fit is None:
            self._fit = self._solved()
        return self._fit

    def _solved(self) -> tuple[float, float, float]:
        kept = [i for i in range(3) if self.sums[i][i] > 1e-9]
        while kept:
            solved = _solve([[self.sums[i][j] for j in kept] for i in kept], [self.sums[3][i] for i in kept])
            if solved is None or min(solved) >= 0.0:
                break
            kept.pop(solved.index(min(solved)))
        out = [0.0, 0.0, 0.0]
        for i, value in zip(kept, solved or ()):
            out[i] = value
        return out[0], out[1], out[2]

    def estimate(self, middle_rounds: float, draft_forwards: float) -> float:
        a, m, d = self.coefficients()
        return a + m * middle_rounds + d * draft_forwards


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """x with matrix x = rhs (Gauss-Jordan, partial pivoting; a ridge of 1e-9 x the diagonal); None if singular."""
    n = len(rhs)
    rows = [[matrix[i][j] + (1e-9 * matrix[i][i] if i == j else 0.0) for j in range(n)] + [rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return [rows[i][n] / rows[i][i] for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Pending:
    """A planned step not yet heard: its plan, its load's A/B, the corrected step time and the model's tokens/s."""

    plan: Plan
    arm: "Arm"
    predicted_ms: float
    predicted_value: float
    planned_at: float  # time.monotonic()
    catch_up_ms: float = 0.0  # what its drafters' catch-up was priced at (`BatchPlanner.catch_up_ms`, uncorrected)


@dataclasses.dataclass
class Arm:
    """The A/B of one load (batch-size bucket and sampling mix): speculation off against the best speculating plan."""

    rates: dict = dataclasses.field(default_factory=dict)  # Plan -> Rate
    speculate: bool | None = None  # None: not decided yet
    period: float = REPROBE_FIRST  # time between two re-probes, in multiples of a probe's expected time
    since: float = 0.0  # seconds run on the side taken since the last re-probe
    # where off is taken: `since` at which the next re-probe is due. Until then a step plans off without pricing the
    # speculating plans (their candidate is chosen when the probe starts): a tenth of a step of one demo request
    quiet_until: float = 0.0
    probe: list = dataclasses.field(default_factory=list)  # plans queued to run next (a re-probe)
    seed: Plan | None = None  # the best speculating plan of the nearest decided load: the one a new load tries
    steps: int = 0  # steps run at this load
    retries: dict = dataclasses.field(default_factory=dict)  # Plan -> times it was measured again (`BatchPlanner.stale`)
    retrying: set = dataclasses.field(default_factory=set)  # plans `stale` asked for: their next step starts a fresh rate

    def best_measured(self) -> Plan | None:
        measured = {p: self.measured(p, 1) for p in self.rates if p.speculating and self.measured(p, 1) is not None}
        return max(measured, key=measured.get) if measured else None

    def rate(self, plan: Plan) -> Rate:
        if plan not in self.rates:
            self.rates[plan] = Rate()
        return self.rates[plan]

    def measured(self, plan: Plan, batch: int) -> float | None:
        """The plan's measured tokens/s at `batch` requests (None: under MIN_STEPS steps measured): its tokens per
        request per second, times `batch`. A load is a range of batch sizes (`bucket`), and its first steps are
        off's at whatever batch the requests joining have reached: summed as tokens/s, off's 3 steps at 39, 53
        and 64 of 64 demo requests (one held up by a garbage collection) read 515 tokens/s, where off runs 1,300 at
        64, against speculation measured at 64 alone."""
        rate = self.rates.get(plan)
        return rate.value * batch if rate is not None and rate.steps >= MIN_STEPS else None


def decide(speculating_now: bool | None, off_rate: float, spec_rate: float, switch_on: float = SWITCH_ON) -> bool:
    """The A/B's rule with hysteresis: speculation turns on only when it measured `switch_on` times
    off's tokens/s, and once on stays on while it measures at least SWITCH_OFF times off's."""
    if speculating_now:
        return spec_rate >= SWITCH_OFF * off_rate
    return spec_rate > switch_on * off_rate


class BatchPlanner:
    """Chooses the plan of each batched step: the time model proposes a speculating plan, a measured
    A/B against speculation off decides whether to run it. `max_length`: the longest block a plan
    asks for (the grids' lengths up to it: `length_grid`); `allow_bypass`: speculating plans may
    leave tiers out (False: they run every tier, as a distributed round must; off is always the bar);
    `explore_every`: the longest time between re-probes of the side not taken, in probes' times (0: never);
    `shadows`: hear what the lookup tiers a step leaves out would have proposed (`tuning.shadow`);
    `decay`: what a pair's acceptance counts keep per round (`tuning.decay`; None: 1 - 1 / MEMORY_ROUNDS);
    `prior_rate`, `prior_weight`: every drafter's prior acceptance and its weight in tokens (`tuning.prior_mean`,
    `prior_strength`; None: PRIOR_RATE for a model drafter, LOOKUP_PRIOR_RATE for a lookup, PRIOR_WEIGHT);
    `switch_on`: the measured multiple of off's tokens/s speculation needs to be switched on (1 + `tuning.switch_hysteresis`).
    (options.goodput_options maps the config's `tuning:` section to these.)"""

    def __init__(self, tiers, tables: list[ForwardTable | None], lookup_ms: list[float], max_length: int = max(LENGTHS),
                 max_batched_tokens: int | None = None, tree_width: int = 1, allow_bypass: bool = True,
                 explore_every: int = 64, shadows: bool = True, decay: float | None = None, prior_rate: float | None = None,
                 prior_weight: float | None = None, switch_on: float = SWITCH_ON) -> None:
        self.tiers = tiers
        self.switch_on = switch_on
        self.allow_bypass = allow_bypass
        self.explore_every = explore_every
        self.shadows = shadows  # (contract.RoundPlanner) `tuning.shadow`: hear what the lookups left out would have proposed
        self.tree_width = tree_width  # the bottom drafter of a plan proposes trees of this many candidates (1: chains)
        self.max_batched_tokens = max_batched_tokens  # a plan whose widest forward would exceed it is not taken
        self.tables = tables  # per tier; None for the n-gram lookup
        self.lookup_ms = lookup_ms  # per tier: ms per request of a model-free draft
        self.lengths_grid = length_grid(LENGTHS, max_length)  # the target's blocks
        self.inner_grid = length_grid(INNER_LENGTHS, max_length)  # a middle tier's
        priors = [prior_rate if prior_rate is not None else PRIOR_RATE if t is not None else LOOKUP_PRIOR_RATE for t in tables]
        self.acceptance = Acceptance(priors, PRIOR_WEIGHT if prior_weight is None else prior_weight,
                                     1.0 - 1.0 / MEMORY_ROUNDS if decay is None else decay)
        self.host: dict[int, HostTime] = {}  # bucket (0: every batch size) -> the host's time around a step's forwards
        self.correction: dict[tuple, float] = {}  # (plan | side | None, bucket or 0) -> measured / predicted step time
        self.arms: dict[tuple[int, int], Arm] = {}  # (bucket, sampling mix) -> its A/B
        self.plans = self._candidates()
        # the widest forward a plan runs: a verifier's block and its root (a tree's nodes), at least WIDTH_GRID's last
        self.widest = max([WIDTH_GRID[-1]] + [width * k + 1 for plan in self.plans if plan.speculating
                                              for _, _, k, width in self.stages(plan)])
        self.chosen: dict[int, Plan] = {}
        self.history: list[dict] = []  # (batch, plan) each time a bucket's choice changed
        self.greedy_share = 1.0  # of the requests in the step being planned
        self._pending: Plan | None = None  # the plan just made (`drafters` reads it)
        self._predicted_ms = 0.0  # its corrected step time
        # steps planned and not yet heard, per (lengths, tiers): a chain whose steps overlap (a distributed chain
        # stepping requests one at a time, concurrently) hears each step against the plan it ran, oldest first
        self._in_flight: dict[tuple, collections.deque[Pending]] = {}
        self.requests: dict[tuple, list[float]] = {}  # (seq_id, lookup tier) -> faded [accepted, rejected, rounds, misses]
        self.behind: dict[int, int] = {}  # per drafting tier: tokens of the current requests it has not cached
        self.horizon = 0.0  # the current requests' mean remaining tokens (0: unknown)
        self._ran: tuple[int, ...] = ()  # the tiers of the last step heard (`observe_step`: a switch, or the same plan's)
        self._catch_ups = (0.0, 0.0)  # faded sums of the catch-ups heard: ms taken, ms priced (`catch_up_ms`)
        # while a step is planned (nothing it reads changes meanwhile): step_ms by (plan, batch). Its rules ask for the
        # same plans' times many times over: under cProfile, 2.4 ms of planning a 10 ms step of one demo request
        self._step_ms: dict | None = None

    def _candidates(self) -> list[Plan]:
        n = len(self.tiers)
        zero = (0,) * max(0, n - 1)
        plans = []
        for drafter in range(1, n):
            for k in self.lengths_grid:
                plans.append(Plan((0, drafter), tuple(k if i == 0 else 0 for i in range(n - 1))))
        for mid, bottom in itertools.combinations(range(1, n), 2):
            if not self.tiers[mid].can_verify:
                continue
            for k, j in itertools.product(self.lengths_grid, self.inner_grid):
                plans.append(Plan((0, mid, bottom), tuple(k if i == 0 else j if i == mid else 0 for i in range(n - 1))))
        if not self.allow_bypass:
            plans = [plan for plan in plans if plan.active == tuple(range(n))]
        return [Plan((0,), zero)] + plans

    # ------------------------------------------------------------- observing

    def observe_round(self, level: int, drafter: int, proposed: int, accepted: int, greedy: bool = True,
                      depth: int | None = None, length: int | None = None) -> None:
        """A verification round: `proposed` drafted nodes, an accepted path of `accepted`; `depth`: a tree's (None: a
        chain); `length`: the block asked for (a chain's round ends short of it by a rejection or a short block alike:
        `Acceptance.observe`)."""
        ended = None if length is None or depth is not None else accepted < max(proposed, length)
        self.acceptance.observe(level, drafter, proposed, accepted, greedy, depth, ended, length)

    def observe_forwards(self) -> None:
        """Fold the tiers' logged forwards into the tables: those no wider than the widest forward a plan prices
        (`widest`). A prompt's prefill is priced apart (catch-up, the tuner's prefills): folded in, a forward of
        100 tokens moved the cell of 16 toward its own cost per token, and the demo chain's predicted steps fell
        by a sixth over two passes of `polyspec tune`."""
        for tier, table in zip(self.tiers, self.tables):
            log = tier.forward_log
            if table is None or not log:
                continue
            for rows, width, seconds in log:
                if width <= self.widest:
                    table.observe(rows, width, seconds * 1000.0)
            log.clear()

    def observe_step(self, batch: int, tokens: int, seconds: float, lengths, active, catch_up_s: float = 0.0,
                     busy_s: float | None = None, forwards: tuple[int, ...] | None = None) -> None:
        """The step just planned took `seconds` and committed `tokens`: refine the model, feed the A/B.
        `catch_up_s` of the step went to drafters catching up on contexts. In a plan's first step (its tiers did not
        run the step before) that is the price of switching it on, weighed before it is tried (`entry_goodput`,
        `affordable`), so neither the A/B's rate nor the model's correction counts it. (Counted, the int8 copy's
        3-step probe at 4 HumanEval prompts, its ~5 s prefill included, measured 4.8 tokens/s against off's 11.5 and
        was never run again.) Once the plan runs, it is the prompts of the requests that join it: a cost of the plan
        under that load, which its rate counts (left out, a drafter that prefills each joining request's prompt is
        measured as if it never had to, and wins the A/B at loads of short requests where it loses).
        `busy_s`: of the rest, the seconds its tiers' forwards (`forwards`: per tier, how many) and lookups took (the
        host's time is the remainder: `HostTime`, learned from every step, planned here or not; None: not timed apart)."""
        self.observe_forwards()
        seconds = max(seconds - catch_up_s, 0.0)
        joined_s, self._ran = (catch_up_s if active == self._ran else 0.0), tuple(active)
        if busy_s is not None and forwards is not None and seconds > 0 and len(active) > 0:
            host_ms = max(seconds - busy_s, 0.0) * 1000.0
            middle = sum(forwards[t] for t in active[1:-1])
            drafted = forwards[active[-1]] if len(active) > 1 else 0
            for key in (bucket(batch), 0):
                self.host.setdefault(key, HostTime()).add(middle, drafted, host_ms)
        pending = self._heard(lengths, active)
        if pending is None:
            return
        plan, arm = pending.plan, pending.arm
        if pending.catch_up_ms > 0 and catch_up_s > 0:
            measured, priced = self._catch_ups
            keep = 1.0 - SMOOTHING
            self._catch_ups = (measured * keep + catch_up_s * 1000.0, priced * keep + pending.catch_up_ms)
        if pending.predicted_ms > 0 and seconds > 0:
            group = bucket(batch)
            ratio = min(4.0, max(0.25, seconds * 1000.0 / pending.predicted_ms))
            side = "spec" if plan.speculating else "off"
            for key in ((plan, group), (plan, 0), (side, group), (side, 0), (None, group), (None, 0)):
                current = self.correction.get(key, 1.0)
                self.correction[key] = current + SMOOTHING * (ratio - current)
        arm.steps += 1
        if seconds > 0:
            if plan in arm.retrying:  # its first step since `stale` asked for it: the old rate goes now, when it runs
                arm.retrying.discard(plan)
                arm.retries[plan] = arm.retries.get(plan, 0) + 1
                arm.rates[plan] = Rate()
            # (per request: `Arm.measured`)
            arm.rate(plan).add(tokens / batch, seconds + joined_s, pending.predicted_value / batch, arm.steps)
            if arm.speculate is not None and not arm.probe and plan.speculating == arm.speculate:
                arm.since += seconds + joined_s
        if not arm.probe:  # between probes only: a probe's steps are all in before the A/B looks again
            self._decide(arm, batch)

    def _heard(self, lengths, active) -> Pending | None:
        """The oldest step planned with `lengths` and `active` and not yet heard."""
        queue = self._in_flight.get((tuple(lengths), tuple(active)))
        while queue and len(queue) > 1 and time.monotonic() - queue[0].planned_at > IN_FLIGHT_STALE_S:
            queue.popleft()  # a step whose round failed is never heard: its entry must not shift the next ones
        return queue.popleft() if queue else None

    def _decide(self, arm: Arm, batch: int) -> None:
        off = arm.measured(self.plans[0], batch)
        spec_rate = max((r for r in (arm.measured(p, batch) for p in arm.rates if p.speculating) if r is not None), default=None)
        if off is None or spec_rate is None:  # the best speculating plan measured so far against off
            return
        if arm.speculate is None and self.unexplored(arm, batch):
            return  # a new load decides once each set of tiers has been measured
        verdict = decide(arm.speculate, off, spec_rate, self.switch_on)
        if verdict != arm.speculate:
            arm.period = REPROBE_FIRST  # the load changed its mind: look again soon
            arm.quiet_until = 0.0
        arm.speculate = verdict

    def corrected(self, plan, group: int) -> float:
        """Measured / predicted step time: this plan at this batch size, else this plan, else the plans
        on its side (speculating or not) at this size, else on its side, else all plans."""
        side = None if plan is None else "spec" if plan.speculating else "off"
        for key in ((plan, group), (plan, 0), (side, group), (side, 0), (None, group), (None, 0)):
            if key in self.correction:
                return self.correction[key]
        return 1.0

    def rate(self, level: int, drafter: int, greedy: bool = True) -> float:
        return self.acceptance.rate(level, drafter, greedy)

    # ------------------------------------------------------------- the model

    def draft_ms(self, tier: int, batch: int, k: int, width: int = 1) -> float:
        """A block of k (a tree of depth k with `width` candidates): a chain's k forwards of one token
        per row, a tree's root forward then k - 1 level forwards of `width` nodes per row."""
        table = self.tables[tier]
        if table is None:
            return self.lookup_ms[tier] * batch
        return table.estimate(batch, 2) + (k - 1) * table.estimate(batch, width)

    def emitted(self, level: int, drafter: int, k: int, width: int = 1) -> float:
        """Expected tokens of a round, over the batch's mix of greedy and sampling requests."""
        greedy = self.greedy_share
        expected = self.acceptance.expected
        return greedy * expected(level, drafter, True, k, width) + (1 - greedy) * expected(level, drafter, False, k, width)

    def stages(self, plan: Plan) -> list[tuple[int, int, int, int]]:
        """(verifier, drafter, length, width) of each stage of a speculating plan, target first: the
        bottom drafter's blocks are trees of `tree_width` candidates, the others' chains."""
        active = plan.active
        return [(active[i], active[i + 1], plan.lengths[active[i]], self.tree_width if i + 2 == len(active) else 1)
                for i in range(len(active) - 1)]

    def step_ms(self, plan: Plan, batch: int) -> tuple[float, float]:
        """(predicted ms of one step, expected tokens per request) for `plan` at `batch` requests: its forwards and
        lookups, and the host's time around them (`HostTime`, from the middle rounds and drafted forwards it runs)."""
        if self._step_ms is not None and (plan, batch) in self._step_ms:
            return self._step_ms[(plan, batch)]
        forward_ms, middle, drafted, tokens = self._forwards(plan, batch)
        out = forward_ms + self.host_ms(middle, drafted, batch), tokens
        if self._step_ms is not None:
            self._step_ms[(plan, batch)] = out
        return out

    def _forwards(self, plan: Plan, batch: int) -> tuple[float, float, float, float]:
        """(ms of the step's forwards and lookups, its middle tier's rounds, its bottom drafter's forwards, expected
        tokens per request)."""
        t0 = self.tables[0]
        if not plan.speculating:
            return t0.estimate(batch, 1), 0.0, 0.0, 1.0
        (_, top, k, width), *inner = self.stages(plan)
        if not inner:
            return (t0.estimate(batch, self.block_width(0, top, k, width)) + self.draft_ms(top, batch, k, width),
                    0.0, self.draft_forwards(top, k), self.emitted(0, top, k, width))
        _, bottom, j, inner_width = inner[0]
        # the mid tier runs rounds of j until it has k tokens and hands up all it emitted: the target verifies that
        # block (its length's pmf), at its rate against the mid tier
        rounds, blocks = middle_rounds(k, j, round(self.emitted(top, bottom, j, inner_width), 3))
        mid_ms = rounds * (self.tables[top].estimate(batch, self.block_width(top, bottom, j, inner_width))
                           + self.draft_ms(bottom, batch, j, inner_width))
        verify_ms = sum(p * t0.estimate(batch, length + 1) for length, p in blocks)
        return (verify_ms + mid_ms, rounds, rounds * self.draft_forwards(bottom, j),
                sum(p * self.emitted(0, top, length) for length, p in blocks))

    def block_width(self, level: int, drafter: int, k: int, width: int = 1) -> float:
        """Tokens a verifier's forward takes for a block of k from `drafter`: a chain as long as the drafter fills it
        (`Acceptance.fill`: a lookup's misses and short continuations), a tree's nodes, and the root."""
        if width > 1:
            return width * k + 1
        return self.acceptance.fill(level, drafter, self.greedy_share >= 0.5) * k + 1

    def draft_forwards(self, tier: int, k: int) -> float:
        """Forwards a block of k drafted by `tier` runs (a tree's depth k alike: its root, then k - 1 levels); a lookup none."""
        return 0.0 if self.tables[tier] is None else float(k)

    def host_ms(self, middle_rounds: float, draft_forwards: float, batch: int) -> float:
        """The host's ms in a step of `middle_rounds` rounds of middle tiers and `draft_forwards` forwards of its bottom
        drafter at `batch` requests (`HostTime`): this batch size's fit once it has HOST_MIN_STEPS steps, else every
        size's, else 0 (none heard yet: the forwards alone)."""
        for key in (bucket(batch), 0):
            fit = self.host.get(key)
            if fit is not None and fit.steps >= HOST_MIN_STEPS:
                return fit.estimate(middle_rounds, draft_forwards)
        return 0.0

    def fits(self, plan: Plan, batch: int) -> bool:
        """Does the plan's widest forward (a verifier's block: a tree's nodes) stay within max_batched_tokens?"""
        if self.max_batched_tokens is None or not plan.speculating:
            return True
        return batch * max(width * k + 1 for _, _, k, width in self.stages(plan)) <= self.max_batched_tokens

    def model_goodput(self, plan: Plan, batch: int) -> float:
        """The time model's tokens/s for `plan` at `batch` requests, without the online corrections of step times."""
        ms, tokens = self.step_ms(plan, batch)
        return batch * tokens / max(ms, 1e-6) * 1000.0

    def goodput(self, plan: Plan, batch: int, extra_ms: float = 0.0) -> float:
        """Expected total tokens/s of a step of `batch` requests under `plan` (`extra_ms` added to the step)."""
        ms, tokens = self.step_ms(plan, batch)
        ms = ms * self.corrected(plan, bucket(batch)) + extra_ms
        return batch * tokens / max(ms, 1e-6) * 1000.0

    def entry_goodput(self, plan: Plan, batch: int) -> float:
        """`goodput` with the one-time price of switching the plan on: its drafters catching up on the
        contexts they have not cached (a prefill, at the tier's per-token catch-up cost,
        `ForwardTable.catch_up`), spread over the steps the requests have left under the plan (their
        mean remaining tokens, `horizon`, over the plan's tokens per step), at least over a probe of
        MIN_STEPS steps. A drafter that has caught up serves each request for the rest of its tokens:
        charging the whole catch-up to one probe kept a good model drafter of long prompts from ever
        being measured (the Qwen 1.5B <- 0.5B pair on HumanEval prompts lost to the n-gram lookup that way)."""
        catch = self.catch_up_ms(plan)
        steps = MIN_STEPS
        if catch and self.horizon:
            steps = max(MIN_STEPS, self.horizon / max(self.step_ms(plan, batch)[1], 1.0))
        return self.goodput(plan, batch, catch / steps)

    def catch_up_ms(self, plan: Plan, corrected: bool = True) -> float:
        """ms `plan`'s drafting tiers would spend catching up on the contexts of the current requests they have
        not cached (`behind`) before its first step could draft: per token, each table's `catch_up`, times what the
        catch-ups heard took over what they were priced at (`corrected`; faded sums, so long catch-ups weigh most).
        Priced per token of the profile's 16-token forward, the Qwen2.5-Coder 0.5B's catch-up on 4 HumanEval prompts
        read 5.4 s and took 1.4-1.7 s (one forward over 600 tokens costs less per token), and at a job's tail its
        ~100 tokens read 0.9 s, more than 2 requests with 46 tokens left could pay for measuring the 3-tier plan."""
        ms = sum(self.behind[tier] * self.tables[tier].catch_up() for tier in plan.active[1:]
                 if self.tables[tier] is not None and self.behind.get(tier))
        measured, priced = self._catch_ups
        return ms * (measured / priced) if corrected and priced > 0 else ms

    def allowed(self, batch: int) -> list[Plan]:
        return [p for p in self.plans if self.fits(p, batch)] or self.plans[:1]

    def predicted_best(self, batch: int) -> Plan:
        """The plan the time model (with its online corrections) expects to give the most tokens/s."""
        return max(self.allowed(batch), key=lambda p: self.goodput(p, batch))

    def unexplored(self, arm: Arm, batch: int) -> list[Plan]:
        """Speculating plans whose set of tiers has no plan measured at this load yet and that, with the
        model corrected by what was measured here (`scale`: on a measured plan sharing a drafter, else
        on off), are predicted at least EXPLORE_FLOOR of off's measured tokens/s and EXPLORE_BEST_SHARE of the
        best speculating plan's."""
        allowed = [p for p in self.allowed(batch) if p.speculating]
        measured = {p: arm.measured(p, batch) for p in allowed if arm.measured(p, batch) is not None}
        if arm.seed is not None and arm.seed in allowed:  # a load next to a decided one tries only that one's best plan
            return [arm.seed] if not measured and self.first_payable(arm, arm.seed, batch) else []
        off = arm.measured(self.plans[0], batch)
        tried = {p.active for p in measured}
        if off is None:
            return [p for p in allowed if p.active not in tried]

        def scale(plan: Plan) -> float:
            """The model's error where it bears on `plan`: on the best measured plan sharing a drafter with it and
            running no tier it lacks (that drafter's table and acceptance), else on off (the target's table). A
            drafter that measured far below its prediction (an int8 copy as slow as the bf16 target) says nothing
            of the others, nor does a plan whose error may be a tier this one leaves out (a 3-tier plan slowed by
            its middle tier says nothing of its lookup alone)."""
            shared = [q for q in measured if set(q.active[1:]) & set(plan.active[1:]) and set(q.active) <= set(plan.active)]
            reference = max(shared, key=measured.get) if shared else self.plans[0]
            rate = measured[reference] if shared else off
            return rate / max(self.goodput(reference, batch), 1e-9)

        # once a speculating plan is measured, a set that either correction (its own, or off's) puts well below it is not worth
        # its MIN_STEPS and its drafters' catch-up: at 4 requests of 128 tokens a run has about 30 steps, and the six sets of a
        # 4-tier chain at MIN_STEPS each are 18. The more hopeful correction: a plan's error need not be its drafter's (a 3-tier
        # plan predicted high says little of the 2-tier plan on its mid tier)
        off_scale = off / max(self.goodput(self.plans[0], batch), 1e-9)
        best = max(measured.values(), default=0.0)

        def worth(plan: Plan) -> bool:
            predicted, own = self.entry_goodput(plan, batch), scale(plan)
            return own * predicted >= EXPLORE_FLOOR * off and max(own, off_scale) * predicted >= EXPLORE_BEST_SHARE * best

        return [p for p in allowed if p.active not in tried and worth(p) and self.affordable(arm, p, batch)]

    def affordable(self, arm: Arm, plan: Plan, batch: int, probe: bool = True) -> bool:
        """Can the running requests pay for measuring `plan` (MIN_STEPS of its predicted step time, unless not
        `probe`, and its drafters catching up on their contexts first: `catch_up_ms`) with at most
        EXPLORE_TIME_SHARE of the time they still need (their remaining tokens at the best rate measured here)? A
        block of 12 costs 10 of off's steps at 4 requests on a CPU: its three steps were half the time left to a job
        of 4 x 128 tokens, to learn what the model had predicted; and the demo chain's int8 copy spent 0.4-0.8 s
        catching up on 64 prompts of 160 tokens to measure 3 steps of 0.19 s, where those 64 requests' 32 new tokens
        took 1.5 s under speculation off. A plan not affordable now is measured when longer requests run at this
        load (unknown remaining tokens: always)."""
        if not self.horizon:
            return True
        rates = [rate for rate in (arm.measured(p, batch) for p in self.plans) if rate]
        if not rates:
            return True
        remaining_s = self.horizon * batch / max(rates)
        cost_s = (MIN_STEPS * self.step_seconds(arm, plan, batch) if probe else 0.0) + self.catch_up_ms(plan) / 1000.0
        return cost_s <= EXPLORE_TIME_SHARE * remaining_s

    def first_payable(self, arm: Arm, plan: Plan, batch: int) -> bool:
        """May `plan` be the first speculating plan measured at this load? The A/B needs one, so its steps are not
        weighed (`affordable` weighs them for the others); its drafters' catch-up is (`affordable` without the
        probe): seeded with the demo chain's int8 copy by the load of 16, 64 requests of 32 new tokens at T = 1
        caught it up on their 160-token prompts to measure it, and ran at 0.64x speculation off's tokens/s
        (benchmarks/load.py --quick)."""
        return self.affordable(arm, plan, batch, probe=False)

    def spec_candidate(self, arm: Arm, batch: int, explore: bool = False) -> Plan | None:
        """The speculating side of the A/B (None: none worth running). Once off is measured here, a plan
        not yet run is a candidate only if the model, scaled by its error on off, predicts it (its
        drafters' catch-up included, `entry_goodput`) at least EXPLORE_FLOOR of off's tokens/s (SEED_FLOOR for the neighbouring load's winner, which
        measured better than the model there): one step of a hopeless plan at a large batch (a drafter
        served row by row) can cost many steps of off. A plan whose measurement has begun runs until it has
        MIN_STEPS; exploring (a new load), each set of tiers gets its predicted best plan measured;
        where speculating won the A/B, the lengths next to the best measured plan's (`neighbours`)
        are measured, one at a time, so a profile that misjudged how a block's cost grows cannot
        pin the lengths; then the
        plan with the most measured tokens/s, unless an unmeasured plan is predicted
        CANDIDATE_MARGIN times better (tried next), so the candidate does not churn."""
        allowed = [p for p in self.allowed(batch) if p.speculating]
        off = arm.measured(self.plans[0], batch)
        if off is not None:  # an unmeasured plan the model (scaled by its error on off here) calls hopeless is not run
            scale = off / max(self.goodput(self.plans[0], batch), 1e-9)
            allowed = [p for p in allowed if arm.rates.get(p) is not None and arm.rates[p].steps
                       or scale * self.entry_goodput(p, batch) >= (SEED_FLOOR if p == arm.seed else EXPLORE_FLOOR) * off]
        if not allowed:
            return None
        for plan in allowed:
            rate = arm.rates.get(plan)
            if rate is not None and 0 < rate.steps < MIN_STEPS:
                return plan
        predicted = {p: self.goodput(p, batch) for p in allowed}
        if explore:
            fresh = [p for p in self.unexplored(arm, batch) if p in predicted]
            if fresh:
                return max(fresh, key=predicted.get)
        measured = {p: arm.measured(p, batch) for p in allowed if arm.measured(p, batch) is not None}
        if not measured:  # the seed, else the model's best, of those the requests can pay for (none: off, until longer ones run)
            payable = [p for p in allowed if self.first_payable(arm, p, batch)]
            return arm.seed if arm.seed in payable else max(payable, key=predicted.get, default=None)
        best = max(measured, key=measured.get)
        stale = self.stale(arm, measured, best, batch)
        if stale is not None:
            return stale
        around = [p for p in self.neighbours(best) if p in allowed and p not in measured and self.affordable(arm, p, batch)] \
            if arm.speculate else []
        if around:  # speculating pays here: the model picked the lengths, the machine checks the ones next to them
            return max(around, key=predicted.get)
        challenger = max((p for p in allowed if p not in measured), key=predicted.get, default=None)
        if challenger is not None and predicted[challenger] > CANDIDATE_MARGIN * measured[best] \
                and (arm.speculate or off is None or predicted[challenger] / max(predicted[best], 1e-9) * measured[best] > off) \
                and self.affordable(arm, challenger, batch):
            return challenger  # (where off wins: only one that, scaled by the model's error on the best, would beat off)
        return best

    def stale(self, arm: Arm, measured: dict, best: Plan, batch: int) -> Plan | None:
        """A plan measured below `best` whose measured rate, carried forward by the model (x its model value now /
        its model value while measured: its drafters' acceptance moved) and given the benefit of one standard error
        (`Rate.spread`, carried alike: a plan that lost on a few noisy steps is not written off for good), reaches
        RETRY_MARGIN times best's: it is measured again, its old rate dropped when it next runs (`observe_step`: where
        off is taken, that is the next re-probe; dropped sooner, the plan would lose its measurement without a new
        one). None: no such plan. Each plan at most once per RETRY_STEPS x 2^(its retries) steps of this load, and only
        where the running requests can pay for it."""
        carried = {}
        for plan, rate in measured.items():
            record = arm.rates[plan]
            if plan == best or not record.predicted_value:
                continue
            if arm.steps - record.last < RETRY_STEPS * 2 ** arm.retries.get(plan, 0):
                continue
            drift = self.model_goodput(plan, batch) / batch / record.predicted_value
            value = (rate + min(record.spread * batch, rate)) * drift
            if value >= RETRY_MARGIN * measured[best] and self.affordable(arm, plan, batch):
                carried[plan] = value
        if not carried:
            return None
        plan = max(carried, key=carried.get)
        arm.retrying.add(plan)
        return plan

    def neighbours(self, plan: Plan) -> list[Plan]:
        """The plans on the same tiers with one length a step longer or shorter on its grid."""
        out = []
        for tier, grid in ((0, self.lengths_grid), *(((plan.active[1], self.inner_grid),) if len(plan.active) == 3 else ())):
            if tier >= len(plan.lengths) or plan.lengths[tier] not in grid:
                continue
            at = grid.index(plan.lengths[tier])
            for step in (-1, 1):
                if 0 <= at + step < len(grid):
                    lengths = list(plan.lengths)
                    lengths[tier] = grid[at + step]
                    candidate = Plan(plan.active, tuple(lengths))
                    if candidate in self.plans:
                        out.append(candidate)
        return out

    def step_seconds(self, arm: Arm, plan: Plan, batch: int) -> float:
        """Seconds one step of `plan` takes at this load: measured, else predicted."""
        rate = arm.rates.get(plan)
        if rate is not None and rate.steps:
            return rate.seconds / rate.weight
        return self.step_ms(plan, batch)[0] * self.corrected(plan, bucket(batch)) / 1000.0

    def arm(self, batch: int) -> Arm:
        """The A/B of this load. A new load starts from the nearest decided load's decision where that
        decision carries over safely: "off" from a smaller batch, "speculate" from a larger one (a
        block's cost grows with the batch); otherwise it measures both sides, off first."""
        mix = 0 if self.greedy_share >= 1.0 else 1 if self.greedy_share <= 0.0 else 2
        key = (bucket(batch), mix)
        arm = self.arms.get(key)
        if arm is None:
            arm = self.arms[key] = Arm()
            decided = [(abs(math.log2(b) - math.log2(key[0])), b, a) for (b, m), a in self.arms.items() if m == mix and a.speculate is not None]
            if decided:
                _, size, nearest = min(decided, key=lambda t: (t[0], t[1]))
                if (size < key[0] and not nearest.speculate) or (size > key[0] and nearest.speculate):
                    arm.speculate = nearest.speculate
                arm.seed = nearest.best_measured()
        return arm

    # (contract.RoundPlanner) set by `plan_batch`: the step's goodput over its requests; by `drafters` where requests
    # draft apart: per request, its drafter's expected tokens over the step's time
    predicted_tokens_per_s: float | tuple[float, ...] | None = None

    def plan(self, step) -> tuple[list[int], tuple[int, ...]]:
        """`contract.RoundPlanner.plan`: the step's (lengths, active tiers)."""
        return self.plan_batch(step.batch, list(step.params), step.behind, step.remaining)

    def observe(self, observation) -> None:
        """`contract.RoundPlanner.observe`: rounds feed the acceptance, steps the tables and the A/B
        (a draft's cost is in the tiers' forward logs already)."""
        if isinstance(observation, RoundObservation):
            self.observe_round(observation.level, observation.drafter, observation.proposed, observation.accepted,
                               observation.greedy, observation.depth, observation.length)
            if observation.level == 0 and observation.depth is None and self.tables[observation.drafter] is None:
                self.observe_request(observation.seq_id, observation.drafter, observation.proposed, observation.accepted)
        elif isinstance(observation, ShadowObservation):
            self.acceptance.observe(observation.level, observation.drafter, observation.proposed, observation.accepted,
                                    observation.greedy, ended=observation.ended)
            if observation.level == 0:  # (a request's own counts choose its drafter for the target)
                self.observe_request(observation.seq_id, observation.drafter, observation.proposed, observation.accepted)
        elif isinstance(observation, StepObservation):
            self.observe_step(observation.batch, observation.tokens, observation.seconds, list(observation.lengths),
                              observation.active, observation.catch_up_s, observation.busy_s, observation.forwards)

    def observe_request(self, seq_id, drafter: int, proposed: int, accepted: int) -> None:
        """A round (or shadow) of lookup tier `drafter` for one request: its own faded counts (nothing proposed: a miss)."""
        if seq_id is None:
            return
        counts = self.requests.setdefault((seq_id, drafter), [0.0, 0.0, 0.0, 0.0])
        keep = 1.0 - 1.0 / REQUEST_MEMORY_ROUNDS
        counts[:] = [c * keep for c in counts]
        counts[0] += accepted
        counts[1] += 1.0 if 0 < proposed and accepted < proposed else 0.0
        counts[2] += 1.0
        counts[3] += 1.0 if proposed <= 0 else 0.0

    def request_tokens(self, seq_id, drafter: int, k: int) -> float | None:
        """Tokens a round of block k drafted by lookup `drafter` is expected to give this request, from its own
        rounds (a miss gives the one token of the verifier); None: too few of them."""
        counts = self.requests.get((seq_id, drafter))
        if counts is None or counts[2] < REQUEST_MIN_WEIGHT:
            return None
        accepted, rejected, rounds, misses = counts
        rate = accepted / (accepted + rejected) if accepted + rejected > 0 else 0.0
        hit = 1.0 - misses / rounds
        return hit * expected_tokens(rate, k) + (1.0 - hit)

    def drafters(self, step) -> tuple[int, ...]:
        """`contract.RoundPlanner.drafters`: under the target <- model drafter plan just made, the requests whose
        own rounds expect more tokens from a lookup tier at the same block length draft with it."""
        seq_ids = set(step.seq_ids)
        for key in [key for key in self.requests if key[0] not in seq_ids]:
            del self.requests[key]  # finished requests
        plan = self._pending
        if plan is None or len(plan.active) != 2 or self.tables[plan.active[1]] is None or not step.seq_ids:
            return ()
        model, k = plan.active[1], plan.lengths[0]
        lookups = [t for t in range(1, len(self.tiers)) if self.tables[t] is None]
        out, expected = [], []
        for seq_id, params in zip(step.seq_ids, step.params):
            best, most = model, self.acceptance.expected(0, model, params.greedy, k)
            for lookup in lookups:
                tokens = self.request_tokens(seq_id, lookup, k)
                if tokens is not None and tokens > most:
                    best, most = lookup, tokens
            out.append(best)
            expected.append(most)
        if all(d == model for d in out):
            return ()
        # each request's own prediction: the tokens its drafter is expected to give it, over the step's corrected time
        self.predicted_tokens_per_s = tuple(tokens / max(self._predicted_ms, 1e-6) * 1000.0 for tokens in expected)
        return tuple(out)

    def plan_batch(self, batch: int, params: list[SamplingParams] | None = None, behind: dict[int, int] | None = None,
                   remaining: tuple[int, ...] = ()) -> tuple[list[int], tuple[int, ...]]:
        """(lengths, active tiers) for the next step of `batch` requests; `behind`: per drafting model
        tier, the context tokens of these requests it has not cached (what using it first costs);
        `remaining`: the tokens each may still commit (what that cost is spread over)."""
        self._step_ms = {}
        try:
            return self._plan_batch(batch, params, behind, remaining)
        finally:
            self._step_ms = None

    def _plan_batch(self, batch: int, params, behind, remaining) -> tuple[list[int], tuple[int, ...]]:
        group = bucket(batch)
        self.behind = behind or {}
        self.horizon = sum(remaining) / len(remaining) if remaining else 0.0
        if params:
            self.greedy_share = sum(p.greedy for p in params) / len(params)
        arm = self.arm(batch)
        quiet = arm.speculate is False and not arm.probe and arm.since < arm.quiet_until
        best = self.plans[0] if quiet else self._choose(arm, batch)  # (quiet: off is taken and no re-probe is due)
        if self.chosen.get(group) != best:
            self.chosen[group] = best
            self.history.append({"batch": batch, "tiers": list(best.active), "lengths": list(best.lengths)})
            del self.history[:-64]
        self._pending = best
        ms, tokens = self.step_ms(best, batch)
        self._predicted_ms = ms * self.corrected(best, group)
        queue = self._in_flight.setdefault((best.lengths, best.active), collections.deque(maxlen=IN_FLIGHT_KEPT))
        queue.append(Pending(best, arm, self._predicted_ms, self.model_goodput(best, batch), time.monotonic(),
                             self.catch_up_ms(best, corrected=False)))
        # (contract.RoundPlanner) each request's share of the step's goodput: its tokens over the corrected step time
        self.predicted_tokens_per_s = tokens / max(self._predicted_ms, 1e-6) * 1000.0
        return list(best.lengths), best.active

    def _choose(self, arm: Arm, batch: int) -> Plan:
        """The plan of the step: off or the speculating candidate (`spec_candidate`), by the A/B's state: measuring,
        decided, or re-probing the side not taken."""
        off = self.plans[0]
        spec = self.spec_candidate(arm, batch, explore=arm.speculate is None)
        if spec is None:
            if arm.speculate is False:  # (nothing worth a probe now: look again after a probe period's steps of off)
                arm.quiet_until = arm.since + self._probe_due(arm, off, batch)
            return off
        if arm.probe:
            best = arm.probe.pop(0)
            return spec if best.speculating else best  # the plan queued, unless a better one was measured meanwhile
        if arm.speculate is None:  # measuring: off's MIN_STEPS first (the bar, and the model's check), then the candidates
            return off if arm.rate(off).steps < MIN_STEPS else spec
        best, other = (spec, off) if arm.speculate else (off, spec)
        # a decision carried over from a neighbouring load (speculating from a larger one, off from a smaller
        # one: a block only costs more at a larger batch) is checked by the re-probes alone: measuring off at
        # once at each smaller load a batch job's tail passes through cost each load three steps of one token
        due = self._probe_due(arm, other, batch)
        if arm.since >= due:
            arm.since = arm.quiet_until = 0.0  # look at the other side (again): the load may have changed
            arm.period = min(2 * arm.period, self.explore_every)
            arm.probe = [other] * PROBE_STEPS
        elif not arm.speculate:
            arm.quiet_until = due
        return best

    def _probe_due(self, arm: Arm, other: Plan, batch: int) -> float:
        """Seconds on the side taken before the side not taken (`other`) is looked at again: the re-probe period
        (at most `explore_every`) in probes' times of `other` (inf: never, `explore_every` 0)."""
        period = min(arm.period, self.explore_every)
        return period * PROBE_STEPS * self.step_seconds(arm, other, batch) if period else math.inf

    def describe(self) -> dict:
        def pair(a: int, b: int, g: bool) -> str:
            return f"{self.tiers[a].name}<-{self.tiers[b].name}{'' if g else ' (sampling)'}"

        return {
            "rates": {pair(a, b, g): round(self.rate(a, b, g), 4) for a, b, g in self.acceptance.pairs()},
            "rate_spreads": {pair(a, b, g): round(self.acceptance.spread(a, b, g), 4) for a, b, g in self.acceptance.pairs()},
            **({"tree_width": self.tree_width, "tree_depth_rates": {
                pair(a, b, g):
                    [round(q, 4) for q in
                     self.acceptance.depth_rates(a, b, g, self.tree_width, len(self.acceptance.reached[(a, b, g)]))]
                for a, b, g in self.acceptance.pairs() if (a, b, g) in self.acceptance.reached}} if self.tree_width > 1 else {}),
            "chosen": {str(b): {"tiers": [self.tiers[t].name for t in p.active], "lengths": list(p.lengths)} for b, p in sorted(self.chosen.items())},
            "ab": {f"batch<={b} {('greedy', 'sampling', 'mixed')[m]}": {
                "speculate": a.speculate,
                "tokens_per_s": {"+".join(self.tiers[t].name for t in p.active) + f" {list(p.lengths)}": round(r.value * b, 1)
                                 for p, r in a.rates.items() if r.value is not None}} for (b, m), a in sorted(self.arms.items())},
        }
