"""The tuner's clocks: the time outside the model's forwards, and how a pipelined chain's
drafting ahead and rounds vary around the model (`Timing`, which the tuner keeps as `timing`
and feeds what it measured against what the time model charges for it).

Time outside the reported rounds (the scheduler's bookkeeping, a streaming callback) is
measured: wall time between two target rounds minus what the rounds reported, per round, as
an EMA (`round_overhead_ms`), added to every round the model predicts. A distributed chain's
time outside forwards is gRPC hops and the workers' Python: per target round
`step_overhead_ms` (the driver's call, the target's call to its drafter), per round of any
other stage on the critical path `round_overhead_ms` (a verifier's call to its drafter),
fitted to each round's residual (driver wall - model time) by a recency-weighted least
squares (`fit_overheads`).
"""

from __future__ import annotations

import collections
import math
import time

from polyspec.orchestrator.tuning.time_model import contended_block_ms, fit_slowdown

OVERHEAD_SMOOTHING = 0.1
OVERHEAD_DECAY = 0.98  # distributed chains: the overhead fit's memory (~50 target rounds)
OVERHEAD_PRIOR = 2.0  # ... and the weight, in target rounds, of its prior a = 2 b
JITTER_SMOOTHING = 0.05  # pipelined: memory of the spread of round and block times (~20 samples)
AHEAD_WINDOW = 64  # pipelined: blocks drafted ahead that the drafter's slow-down is fitted to ...
AHEAD_DECAY = 0.97  # ... each weighed this much less than the next (~33 blocks)


class Timing:
    """Overheads, jitter and drafting-ahead slow-downs of one chain (`distributed`: its tiers are workers)."""

    def __init__(self, distributed: bool = False) -> None:
        self.distributed = distributed
        self.step_overhead_ms = 0.0  # distributed: per target round
        self.round_overhead_ms = 0.0  # per round of a stage
        # pipelined: per drafting tier, how much longer its blocks take to draft ahead than the
        # model's own cost of them (cores shared with the verifier, calls below, waiting while
        # real calls go first): the slow-down that matches its recent blocks (`observe_ahead_block`)
        self._slowdown: dict[int, float] = {}  # (`ahead_slowdown`: fitted when read, not on every block)
        self._slowdown_stale: set[int] = set()  # drafters with blocks since their last fit
        self._ahead_blocks: dict[int, collections.deque] = {}  # per drafter: (measured, modelled, beside ms) of its last blocks
        # pipelined: how much the target's forwards and the blocks drafted ahead vary around the
        # model (EMA of squared relative deviations, pooled): StageSpec.jitter_cv
        self._jitter_sq = 0.0
        self._overhead_sums = [0.0] * 5  # decayed sums of 1, n, n^2, r, n*r (n: other rounds on the path, r: residual ms)
        self._round_started: float | None = None  # perf_counter when the current target round began
        self._reported_s = 0.0  # seconds the rounds since then reported
        self._reported_rounds = 0

    def stage_overhead_ms(self, verifier: int) -> float:
        """Time outside forwards per round of the stage verified by `verifier` (see __init__)."""
        if not self.distributed:
            return self.round_overhead_ms
        return self.step_overhead_ms if verifier == 0 else self.round_overhead_ms

    def observe_ahead_block(self, drafter: int, block_ms: float, modelled_ms: float, beside_ms: float) -> None:
        """A block drafted ahead by `drafter` in `block_ms`, which the model prices at `modelled_ms` on
        cores of its own, with its verifier's round of `beside_ms` beside it: the slow-down while the
        two share the cores (`time_model.fit_slowdown` over the last AHEAD_WINDOW blocks, each weighed
        AHEAD_DECAY less than the next)."""
        if drafter == 1:  # the target's drafter: its blocks are what the target's rounds wait for
            # (against the slow-down as last fitted: refitting it on every block, to read it
            # here, was two thirds of this hook's driver CPU on the Ray demo chain)
            self.observe_jitter(block_ms / contended_block_ms(modelled_ms, beside_ms, self.slowdown_of(drafter, refit=False)) - 1.0)
        blocks = self._ahead_blocks.setdefault(drafter, collections.deque(maxlen=AHEAD_WINDOW))
        blocks.append((block_ms, modelled_ms, beside_ms))
        self._slowdown_stale.add(drafter)

    @property
    def ahead_slowdown(self) -> dict[int, float]:
        """Per pipelined drafter, the slow-down of its blocks drafted ahead (`observe_ahead_block`),
        fitted when read: the searches read it a few times a second, blocks arrive every round."""
        for drafter in list(self._slowdown_stale):
            self.slowdown_of(drafter)
        return self._slowdown

    def slowdown_of(self, drafter: int, refit: bool = True) -> float:
        if refit and drafter in self._slowdown_stale:
            self._slowdown_stale.discard(drafter)
            samples = [(AHEAD_DECAY ** age, *sample) for age, sample in enumerate(reversed(self._ahead_blocks[drafter]))]
            self._slowdown[drafter] = fit_slowdown(samples, self._slowdown.get(drafter, 1.0))
        return self._slowdown.get(drafter, 1.0)

    def observe_jitter(self, deviation: float) -> None:
        deviation = min(max(deviation, -1.0), 1.0)  # one stall (a GC pause, a page fault) is not the spread
        self._jitter_sq += JITTER_SMOOTHING * (deviation * deviation - self._jitter_sq)

    @property
    def jitter_cv(self) -> float:
        """Coefficient of variation of the target's rounds and its drafter's blocks drafted ahead."""
        return math.sqrt(self._jitter_sq)

    def fit_overheads(self, other_rounds: int, residual_ms: float) -> None:
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

    def measure_overhead(self, continues_last: bool) -> None:
        """Wall time of the target round that just ended, less what its rounds and drafts reported
        (only when this round continues the same request: in between, a server may do other work)."""
        if continues_last and self._round_started is not None and self._reported_rounds:
            residual_ms = 1000.0 * (time.perf_counter() - self._round_started - self._reported_s) / self._reported_rounds
            self.round_overhead_ms += OVERHEAD_SMOOTHING * (max(0.0, residual_ms) - self.round_overhead_ms)
        self._reported_s, self._reported_rounds = 0.0, 0

    def round_begins(self) -> None:
        """A target round begins now (its wall time is measured from here: `measure_overhead`)."""
        self._round_started = time.perf_counter()

    def report_time(self, seconds: float, rounds: int) -> None:
        """`seconds` of the current target round were reported by `rounds` rounds (a draft: 0)."""
        self._reported_s += seconds
        self._reported_rounds += rounds
