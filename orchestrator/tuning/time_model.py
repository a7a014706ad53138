"""The optimal-inference-time model, serial form (DESIGN §5): pure functions on numbers.

Units: every time is in milliseconds; acceptance rates are probabilities. No I/O.

Vocabulary
    t_i(m)         wall time of one forward of tier i over m new tokens (a `LatencyTable`)
    accept_rates   per-position acceptance of one stage: accept_rates[j-1] = P(position j of
                   a block is accepted | positions 1..j-1 were); positions past the end of
                   the list reuse its last entry
    E_i(k)         expected tokens tier i emits per verification of a k-token block
                   = 1 + sum_{j=1..k} prod_{l<=j} a_l   (accepted + the correction / bonus)
    C_i            expected wall time per token tier i emits, drafting below it included

Two forms of the cost are provided:

- `ideal_cost_per_token`: DESIGN §5 as written, C_i = (t_i(k_i+1) + k_i C_{i+1}) / E_i(k_i),
  with the bottom drafter's cost of k tokens read from its own table (`draft_ms`; for a
  model drafter that is about k * t(1), for the n-gram lookup it is about 0). Its optimum
  comes from one bottom-up pass (`ideal_bottom_up`).
- `round_models` / `cost_per_token` / `generation_ms`: what `polyspec.orchestrator.decode.scheduler` really does.
  A middle tier asked for `need` tokens runs whole rounds of its own length and hands up
  everything they emitted, so the block its verifier scores is a random length >= need
  (first passage of a sum of per-round emissions); the target's round length is clipped to
  `min(k_0, remaining - 1)` near `max_new_tokens` and its last round's surplus is dropped.
  Costs of the blocks below follow from Wald's identity (expected rounds x expected round
  cost). `generation_ms` gives the expected wall time of a whole request (before prefill).

Pipelined stages (`StageSpec.pipelined`, the distributed runtime with `pipeline: true`):
the drafter hands up exactly the block asked for and drafts the next one while this one is
verified, betting on whole blocks (`pipelined_round_model`, docs/time-model.md §5).

Trees: when the bottom stage proposes `tree_width` candidate chains of depth k, the verifier
scores width * k nodes and the accepted path is at most k long; its `accept_rates` are the
tree's (position 1 = acceptance of the best of `tree_width` candidates, deeper positions the
chain rates), see `tree_accept_rates`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Mapping, Sequence

LatencyTable = Mapping[int, float]  # m new tokens (or k drafted tokens) -> ms


# ----------------------------------------------------------------------- latencies


def latency(table: LatencyTable, m: int) -> float:
    """t(m) from a sparse table: exact where measured, linear between points, linear
    extrapolation past the largest m (never decreasing), the smallest entry below it."""
    if m in table:
        return float(table[m])
    if not table:
        raise ValueError("empty latency table")
    keys = sorted(table)
    if m < keys[0]:
        return float(table[keys[0]])
    if m > keys[-1]:
        if len(keys) == 1:
            return float(table[keys[-1]])
        lo, hi = keys[-2], keys[-1]
        slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
        return float(table[hi] + slope * (m - hi))
    hi_index = next(i for i, key in enumerate(keys) if key > m)
    lo, hi = keys[hi_index - 1], keys[hi_index]
    return float(table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo))


# ---------------------------------------------------------------------- acceptance


def rate_at(accept_rates: Sequence[float], position: int) -> float:
    """Acceptance of `position` (1-based) given the earlier ones; the last rate repeats."""
    if not accept_rates:
        return 0.0
    return float(accept_rates[min(position, len(accept_rates)) - 1])


def expected_emitted(accept_rates: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{j=1..k} prod_{l<=j} a_l: tokens emitted per round with a k-token block."""
    total, survive = 1.0, 1.0
    for position in range(1, k + 1):
        survive *= rate_at(accept_rates, position)
        total += survive
    return total


def expected_emitted_scalar(rate: float, k: int) -> float:
    """E(k) for one acceptance rate at every position: (1 - a^(k+1)) / (1 - a)."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


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
def _cached_accepted_pmf(accept_rates: tuple[float, ...], block_len: int) -> tuple[float, ...]:
    return tuple(accepted_pmf(accept_rates, block_len))


@functools.lru_cache(maxsize=4096)
def renewal_rates(text_rates: tuple[float, ...], length: int) -> tuple[float, ...]:
    """Per-position rates of the rounds of a chain asking for `length` tokens, from rates per
    position of the text (`text_rates[j-1]` = P(a drafter run from a context chosen evenly along
    the text reaches position j | it reached j - 1)).

    A chain does not sample contexts evenly: a round from a context where the drafter's run is
    a tokens long emits min(a, length) + 1 of them, so the next round starts that much later,
    and contexts where the drafter fails take more of the rounds. Renewal-reward: rounds visit
    contexts in proportion to 1 / (min(a, length) + 1). With Q(a) the text's distribution of
    run lengths, the rounds' is P(a) ~ Q(a) / (min(a, length) + 1), whose conditional rates
    are returned. Longer blocks jump through the drafter's good stretches faster, so the same
    drafter's rounds accept less per position at length 6 than at length 2 (the demo n-gram
    tier: 2.31 against 2.62 tokens a round at length 6 from one per-position table pooled
    over lengths 2, 3 and 6; docs/time-model.md §4)."""
    positions = len(text_rates)
    reach = [1.0]  # reach[m] = Q(a >= m)
    last = 1.0
    for rate in text_rates:
        last *= rate
        reach.append(last)
    tail = [0.0] * (positions + 1)  # tail[m] = sum over a >= m of Q(a) / (min(a, length) + 1)
    total = tail[positions] = reach[positions] / (min(positions, length) + 1)
    for m in range(positions - 1, -1, -1):
        total = tail[m] = total + (reach[m] - reach[m + 1]) / ((m if m < length else length) + 1)
    return tuple(tail[j] / tail[j - 1] if tail[j - 1] > 0 else 0.0 for j in range(1, positions + 1))


def tree_accept_rates(first_rate_with_width: float, chain_rates: Sequence[float]) -> list[float]:
    """Per-position rates of a tree of candidate chains: the first position is accepted if any
    of the candidates is (measured with that many candidates); deeper ones follow the chain."""
    deeper = list(chain_rates[1:]) if len(chain_rates) > 1 else list(chain_rates)
    return [first_rate_with_width] + deeper


# ------------------------------------------------------------------ the ideal form


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One verifying stage: its verifier's forward times and the stage's acceptance."""

    forward_ms: LatencyTable  # verifier t_i(m), m = new tokens in the forward
    accept_rates: tuple[float, ...]  # per position, for this (verifier, drafter) pair
    overhead_ms: float = 0.0  # per round, outside forwards / verification / drafting (scheduler bookkeeping)
    pipelined: bool = False  # the drafter drafts ahead while its block is verified (runtime pipeline: true)
    drafter_slowdown: float = 1.0  # pipelined: the drafter's slow-down while the verifier computes beside it (`contended_block_ms`)
    # expected share of an asked block the drafter really proposes: an n-gram lookup with no
    # match proposes nothing, and the verifier then scores fill * L + 1 tokens, not L + 1.
    # Acceptance already counts a missing proposal as a rejection, so only the forward changes.
    fill: float = 1.0
    # pipelined: coefficient of variation of the verifier's round (t + o) and of the block
    # drafted ahead (D). A round accepted whole waits for the later of the two, and the mean
    # of a maximum exceeds the maximum of the means, most when t + o and D are close.
    jitter_cv: float = 0.0
    # accept_rates are per position of the text (the tuner's estimates, `renewal_rates`): a
    # round asking for k tokens sees `at_length(k)`'s rates
    per_text_position: bool = False
    # pipelined, the target's stage only: a request's first round scores the prompt too, so its
    # forward lasts `head_start_ms` longer, and the drafter drafts the second block beside it
    # (RoundModel.head_start_saving_ms); with `request_tokens` (new tokens of a typical request)
    # the searches weigh a request's first rounds against its length (`request_ms_per_token`)
    head_start_ms: float = 0.0
    request_tokens: int = 0

    def at_length(self, length: int) -> "StageSpec":
        """The stage as its rounds of `length` asked tokens see it."""
        if not self.per_text_position:
            return self
        return dataclasses.replace(self, accept_rates=renewal_rates(tuple(self.accept_rates), max(1, length)), per_text_position=False)


def ideal_stage_cost(stage: StageSpec, length: int, below_ms: float) -> float:
    """C_i = (t_i(k+1) + cost of the k-token block) / E_i(k); `below_ms` is that block's cost."""
    rates = stage.at_length(length).accept_rates
    return (latency(stage.forward_ms, length + 1) + below_ms) / expected_emitted(rates, length)


def ideal_cost_per_token(stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int]) -> float:
    """C_0 of DESIGN §5 (stages target first, one length per stage), bottom-up."""
    assert len(stages) == len(lengths) >= 1
    per_token = None  # C_{i+1}
    for stage, length in zip(reversed(stages), reversed(lengths)):
        below_ms = latency(draft_ms, length) if per_token is None else length * per_token
        per_token = ideal_stage_cost(stage, length, below_ms)
    return per_token


def ideal_bottom_up(stages: Sequence[StageSpec], draft_ms: LatencyTable, max_length: int) -> tuple[list[int], float]:
    """Optimal lengths of the ideal form: C_i grows with C_{i+1} for any k_i, so choosing
    k_{n-2}, then k_{n-3} given it, ... minimises C_0 exactly. Returns (lengths, C_0)."""
    lengths: list[int] = []
    per_token = None
    for stage in reversed(stages):
        costs = {
            k: ideal_stage_cost(stage, k, latency(draft_ms, k) if per_token is None else k * per_token)
            for k in range(1, max_length + 1)
        }
        best = min(costs, key=costs.get)
        lengths.insert(0, best)
        per_token = costs[best]
    return lengths, per_token


def best_stage_cost(stage: StageSpec, below_ms_per_token: float, max_length: int) -> tuple[int, float]:
    """min over k of (t_i(k+1) + k * C_below) / E(k): (k*, cost per token)."""
    costs = {k: ideal_stage_cost(stage, k, k * below_ms_per_token) for k in range(1, max_length + 1)}
    best = min(costs, key=costs.get)
    return best, costs[best]


def tier_pays_off(direct: StageSpec, via: StageSpec, direct_below_ms: float, via_below_ms: float, max_length: int) -> bool:
    """DESIGN §5 insertion / bypass condition for a tier m between i and i+1.

    `direct`: tier i verifying i+1 (acceptance a_{i,i+1}); `via`: tier i verifying m
    (acceptance a_{i,m}); `*_below_ms`: C_{i+1}* and C_m* per token. True iff inserting m
    (equivalently, not bypassing it) lowers tier i's best cost per token."""
    return best_stage_cost(via, via_below_ms, max_length)[1] < best_stage_cost(direct, direct_below_ms, max_length)[1]


# --------------------------------------------------------- what the scheduler does


@dataclasses.dataclass(frozen=True)
class RoundModel:
    """One verification round of a tier, as the scheduler runs it."""

    emitted_pmf: tuple[float, ...]  # [x] = P(the round emits x tokens), x >= 1 ([0] = 0)
    round_ms: float  # expected wall time of the round, the block's drafting included
    cold_extra_ms: float = 0.0  # a pipelined stage's first round: nothing was drafted ahead for it
    # ... and the second round's saving: its block was drafted beside the first round's long
    # forward (the prompt's), so it is ready sooner than a block drafted beside a round's forward
    head_start_saving_ms: float = 0.0

    @property
    def expected_emitted(self) -> float:
        return sum(x * p for x, p in enumerate(self.emitted_pmf))

    @property
    def ms_per_token(self) -> float:
        return self.round_ms / self.expected_emitted


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


def block_for(stage: StageSpec, below: RoundModel | None, draft_ms: LatencyTable, need: int) -> tuple[list[float], float]:
    """The block `stage` verifies when it asks for `need` tokens. A pipelined drafter hands up
    exactly `need` tokens and keeps any overshoot of its rounds for the next block (its
    draft-ahead stream), so a block costs `need` tokens at the drafter's cost per token (on
    cores of its own: the slow-down while it shares them is `pipelined_round_model`'s)."""
    if stage.pipelined and need > 0:
        ms = need * below.ms_per_token if below is not None else latency(draft_ms, need)
        return [0.0] * need + [1.0], ms
    return block_from_below(below, draft_ms, need)


def contended_block_ms(block_ms: float, forward_ms: float, slowdown: float) -> float:
    """A block drafted ahead while the verifier scores the previous one: the two share the
    cores for `forward_ms`, during which the drafter runs `slowdown` times slower; past that
    the verifier waits and the drafter has the cores. So a block that fits in the overlap
    costs block_ms * slowdown, a longer one block_ms + forward_ms * (1 - 1 / slowdown).
    (One factor for the whole block over-charged long blocks: on the Ray demo chain at
    T = 1 the model's error grew with k_0 to +21 % at [6, 1], docs/time-model.md §6.)"""
    if block_ms * slowdown <= forward_ms:
        return block_ms * slowdown
    return block_ms + forward_ms * (1.0 - 1.0 / slowdown)


def fitted_slowdown(measured_ms: float, block_ms: float, forward_ms: float) -> float:
    """The slow-down that makes `contended_block_ms(block_ms, forward_ms, s)` = `measured_ms`
    (the inverse, clamped to 1/3..3)."""
    if block_ms <= 0:
        return 1.0
    if measured_ms <= forward_ms:  # (the block fitted in the overlap iff it ended within it)
        return min(max(measured_ms / block_ms, 1.0 / 3), 3.0)
    shared = (measured_ms - block_ms) / forward_ms  # = 1 - 1 / s
    return min(max(1.0 / (1.0 - shared), 1.0 / 3), 3.0) if shared < 2.0 / 3 else 3.0


def fit_slowdown(samples: Sequence[tuple[float, float, float, float]], start: float = 1.0) -> float:
    """The slow-down s whose `contended_block_ms` matches blocks drafted ahead on (weighted)
    average: samples (weight, measured_ms, block_ms, forward_ms), sum w (contended(s) - measured)
    = 0 by Newton steps from `start` (the sum rises with s), clamped to 1/3..3. Averaging each
    block's own `fitted_slowdown` instead was biased and noisy (s = 1 / (1 - excess / forward)
    is convex in a block's excess time; on the Ray demo chain at T = 1 an EMA of it read 1.04 to
    1.81 within one run, the blocks' mean excess 1.2-1.3)."""
    s = min(max(start, 1.0 / 3), 3.0)
    for _ in range(6):
        gap = slope = 0.0
        shared, squared = 1.0 - 1.0 / s, s * s  # (contended_block_ms inlined: it runs ~400 times a fit)
        for weight, measured_ms, block_ms, forward_ms in samples:
            if block_ms * s <= forward_ms:
                gap += weight * (block_ms * s - measured_ms)
                slope += weight * block_ms
            else:
                gap += weight * (block_ms + forward_ms * shared - measured_ms)
                slope += weight * (forward_ms / squared)
        if slope <= 1e-12:
            break
        step = gap / slope
        s = min(max(s - step, 1.0 / 3), 3.0)
        if abs(step) < 1e-4:
            break
    return s


def block_from_below(below: RoundModel | None, draft_ms: LatencyTable, need: int) -> tuple[list[float], float]:
    """The block a tier receives when it asks the tier below for `need` tokens.

    `below` is the lower tier's round model, or None when the lower tier is the bottom
    drafter (which returns exactly `need` tokens for `draft_ms[need]`). Returns
    (pmf of the block length, expected ms to produce it)."""
    if need <= 0:
        return [1.0], 0.0
    if below is None:
        return [0.0] * need + [1.0], latency(draft_ms, need)
    totals, rounds = first_passage(below.emitted_pmf, need)
    return totals, rounds * below.round_ms


def round_model(stage: StageSpec, block_pmf: Sequence[float], block_ms: float, tree_width: int = 1) -> RoundModel:
    """A tier's round: score the block (tree_width * L nodes + the last token) and verify it."""
    return round_from_shape(stage, round_shape(stage, block_pmf, tree_width), block_ms)


@dataclasses.dataclass(frozen=True)
class RoundShape:
    """What a round's model takes from the block's length distribution alone, not from what the
    block costs: the emitted tokens, the verifier's forwards and (pipelined) how often the
    drafter drafts ahead. A pipelined stage's block is exactly k tokens whatever the stages
    below it do, so a search computes this once per k and only `round_from_shape` per
    combination of the lengths below (`round_models`' memo)."""

    serial_emitted: tuple[float, ...] | None  # the round as the serial form runs it (None: never)
    serial_forward_ms: float
    share: float  # of rounds in which the drafter drafts ahead (`ahead_share`)
    whole: float  # P(a block is accepted whole)
    pipelined_emitted: tuple[float, ...] | None  # the round as it runs when the drafter bets (None: never)
    pipelined_forward_ms: float  # t_avg + o of `pipelined_round_model`
    emitted: tuple[float, ...]  # the mix of the two by `share`


def round_shape(stage: StageSpec, block_pmf: Sequence[float], tree_width: int = 1) -> RoundShape:
    serial = pipelined = None
    serial_ms = pipelined_ms = whole = share = 0.0
    if stage.pipelined and tree_width == 1:
        whole = _whole_probability(tuple(stage.accept_rates), block_pmf)
        share = ahead_share(whole)
        if share >= 1e-3:
            pipelined, pipelined_ms = _pipelined_shape(stage, block_pmf, whole)
    if pipelined is None or share <= 1.0 - 1e-3:
        serial, serial_ms = _serial_shape(stage, block_pmf, tree_width)
    if pipelined is None:
        share, emitted = 0.0, serial
    elif serial is None:
        share, emitted = 1.0, pipelined
    else:
        size = max(len(serial), len(pipelined))
        pad = lambda pmf: list(pmf) + [0.0] * (size - len(pmf))  # noqa: E731
        emitted = tuple(share * a + (1.0 - share) * b for a, b in zip(pad(pipelined), pad(serial)))
    return RoundShape(serial, serial_ms, share, whole, pipelined, pipelined_ms, emitted)


def round_from_shape(stage: StageSpec, shape: RoundShape, block_ms: float) -> RoundModel:
    """The round model of `shape` (`round_shape` of the stage and its block) for a block costing `block_ms`."""
    serial_ms = block_ms + shape.serial_forward_ms + stage.overhead_ms
    if shape.pipelined_emitted is None:
        return RoundModel(shape.emitted, serial_ms)
    pipelined = _pipelined_round(stage, shape.whole, shape.pipelined_emitted, shape.pipelined_forward_ms, block_ms)
    if shape.serial_emitted is None:
        return pipelined
    share = shape.share
    return RoundModel(shape.emitted, share * pipelined.round_ms + (1.0 - share) * serial_ms, share * pipelined.cold_extra_ms,
                      share * pipelined.head_start_saving_ms)


def _serial_shape(stage: StageSpec, block_pmf: Sequence[float], tree_width: int) -> tuple[tuple[float, ...], float]:
    emitted = [0.0] * (len(block_pmf) + 1)
    forward_ms = 0.0
    for block_len, p in enumerate(block_pmf):
        if p == 0.0:
            continue
        forward_ms += p * latency(stage.forward_ms, tree_width * block_len * stage.fill + 1)
        for accepted, q in enumerate(_cached_accepted_pmf(tuple(stage.accept_rates), block_len)):
            emitted[accepted + 1] += p * q
    return tuple(emitted), forward_ms


def expected_max(mean_a: float, sd_a: float, mean_b: float, sd_b: float) -> float:
    """E[max(A, B)] of two independent normal variables (Clark, 1961):
    mean_a Phi(x) + mean_b Phi(-x) + theta phi(x), theta^2 = sd_a^2 + sd_b^2, x = (mean_a - mean_b) / theta."""
    theta = math.hypot(sd_a, sd_b)
    if theta <= 1e-12:
        return max(mean_a, mean_b)
    x = (mean_a - mean_b) / theta
    cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
    pdf = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return mean_a * cdf + mean_b * (1.0 - cdf) + theta * pdf


AHEAD_THRESHOLD = 0.5  # a drafter drafts past its block while at least this share of its blocks is accepted whole
AHEAD_SMOOTHING = 0.2  # ... measured as an EMA of whole / not whole with this smoothing (workers/tier_worker.py)


def _whole_probability(rates: tuple[float, ...], block_pmf: Sequence[float]) -> float:
    """P(a block, of length drawn from `block_pmf`, is accepted whole)."""
    return sum(p * _cached_accepted_pmf(rates, block_len)[block_len] for block_len, p in enumerate(block_pmf) if p and block_len)


def ahead_share(whole: float) -> float:
    """Share of a stage's rounds in which its drafter drafts ahead, when its blocks are
    accepted whole with probability `whole`: the runtime bets while its EMA (smoothing a) of
    the outcomes is >= AHEAD_THRESHOLD. The EMA has mean `whole` and variance
    a / (2 - a) * whole * (1 - whole) (sd 0.17 at whole = 0.5); taken as normal, the share is
    Phi((whole - threshold) / sd). A hard switch at the threshold would make the model jump
    where the runtime flips back and forth (an n-gram stage at k = 1 with ~50 % acceptance)."""
    variance = AHEAD_SMOOTHING / (2.0 - AHEAD_SMOOTHING) * whole * (1.0 - whole)
    if variance <= 1e-12:
        return 1.0 if whole >= AHEAD_THRESHOLD else 0.0
    return 0.5 * (1.0 + math.erf((whole - AHEAD_THRESHOLD) / math.sqrt(2.0 * variance)))


def pipelined_round_model(stage: StageSpec, block_pmf: Sequence[float], block_ms: float, bet: bool = False) -> RoundModel | None:
    """A round of a draft-ahead stage (docs/time-model.md §5), or None when its drafter would
    not bet on whole blocks (then the stage runs as in serial mode; `round_model` mixes the
    two by `ahead_share`).

    While the verifier scores block n the drafter drafts block n+1, betting that n is accepted
    whole (P = P[A = L]). Accepted whole: the next block is ready after max(t + o, D) and the
    round emits L tokens (no bonus: the drafter's continuation is verified next, and the
    next forward covers L new tokens, not L + 1). Otherwise the draft-ahead work is lost and
    the next block costs D after the verdict: t + o + D, and the round emits A + 1 tokens.
    By renewal-reward, with outcomes independent from block to block:

        round_ms = P * E[max(t_avg + o, D_ahead)] + (1 - P) * (t_avg + o + D)
        t_avg    = P * t(L) + (1 - P) * t(L + 1)      (the previous round's outcome)
        D_ahead  = contended_block_ms(D, t_avg + o, s)  (drafted beside the verifier)

    (with L the tokens really proposed: fill * L for a drafter that proposes less than asked;
    E[max] of two normal times with the stage's `jitter_cv`, `expected_max`)
    """
    whole = _whole_probability(tuple(stage.accept_rates), block_pmf)
    if whole < AHEAD_THRESHOLD and not bet:  # `bet`: the round as it runs when the drafter does bet
        return None
    emitted, forward_ms = _pipelined_shape(stage, block_pmf, whole)
    return _pipelined_round(stage, whole, emitted, forward_ms, block_ms)


def _pipelined_shape(stage: StageSpec, block_pmf: Sequence[float], whole: float) -> tuple[tuple[float, ...], float]:
    """`pipelined_round_model`'s emitted pmf and t_avg + o (the block's cost plays no part in them)."""
    rates = tuple(stage.accept_rates)
    emitted = [0.0] * (len(block_pmf) + 1)
    cold_ms = warm_ms = 0.0
    for block_len, p in enumerate(block_pmf):
        if p == 0.0:
            continue
        cold_ms += p * latency(stage.forward_ms, block_len * stage.fill + 1)
        warm_ms += p * latency(stage.forward_ms, max(1.0, block_len * stage.fill))
        for accepted, q in enumerate(_cached_accepted_pmf(rates, block_len)):
            bonus = 0 if (block_len and accepted == block_len) else 1
            emitted[accepted + bonus] += p * q
    return tuple(emitted), whole * warm_ms + (1.0 - whole) * cold_ms + stage.overhead_ms


def _pipelined_round(stage: StageSpec, whole: float, emitted: tuple[float, ...], forward_ms: float, block_ms: float) -> RoundModel:
    """`pipelined_round_model`'s round for a block costing `block_ms`."""
    ahead_ms = contended_block_ms(block_ms, forward_ms, stage.drafter_slowdown)
    overlap_ms = expected_max(forward_ms, stage.jitter_cv * forward_ms, ahead_ms, stage.jitter_cv * ahead_ms)
    round_ms = whole * overlap_ms + (1.0 - whole) * (forward_ms + block_ms)
    saving = 0.0
    if stage.head_start_ms > 0.0:
        # the request's second block, drafted beside the first round's forward (head_start_ms
        # longer): the next round waits only for what is left of it, counted like ahead_ms
        # from the start of that forward's last forward_ms
        first_ms = forward_ms + stage.head_start_ms
        left_ms = max(0.0, contended_block_ms(block_ms, first_ms, stage.drafter_slowdown) - stage.head_start_ms)
        second_ms = expected_max(forward_ms, stage.jitter_cv * forward_ms, left_ms, stage.jitter_cv * left_ms)
        saving = whole * max(0.0, overlap_ms - second_ms)
    return RoundModel(emitted, round_ms, whole * max(0.0, forward_ms + block_ms - overlap_ms), saving)


def round_models(
    stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int], tree_width: int = 1, memo: dict | None = None
) -> list[RoundModel]:
    """Each stage's round model (target first) for fixed lengths, built bottom-up.

    `memo` (optional, for searches over one set of stages): reuses the round models of
    lower stages whose lengths repeat."""
    assert len(stages) == len(lengths) >= 1
    models: list[RoundModel] = []
    below = None
    for index in reversed(range(len(stages))):
        key = (index, tuple(lengths[index:]))
        if memo is not None and key in memo:
            below = memo[key]
        else:
            if memo is None:
                stage = stages[index].at_length(lengths[index])
            else:  # (at_length builds a new StageSpec: once per stage and length in a search)
                at_key = ("at", index, lengths[index])
                stage = memo.get(at_key) or memo.setdefault(at_key, stages[index].at_length(lengths[index]))
            block_pmf, block_ms = block_for(stage, below, draft_ms, lengths[index])
            width = tree_width if index == len(stages) - 1 else 1
            if memo is not None and stage.pipelined and lengths[index] > 0:
                # a pipelined stage's block is k tokens whatever the lengths below: one shape per k
                shape_key = ("shape", index, lengths[index])
                shape = memo.get(shape_key) or memo.setdefault(shape_key, round_shape(stage, block_pmf, width))
            else:
                shape = round_shape(stage, block_pmf, width)
            below = round_from_shape(stage, shape, block_ms)
            if memo is not None:
                memo[key] = below
        models.insert(0, below)
    return models


def cost_per_token(stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int], tree_width: int = 1) -> float:
    """C_0 as the scheduler runs the chain, far from max_new_tokens (ms per target token)."""
    return round_models(stages, draft_ms, lengths, tree_width)[0].ms_per_token


def request_ms_per_token(target: RoundModel, request_tokens: int) -> float:
    """ms per token of a request of `request_tokens` new tokens, from the target's round model:
    C_0, plus a pipelined chain's first rounds spread over the request (the first block drafted
    with nothing ahead, `cold_extra_ms`; the second drafted beside the prompt's forward,
    `head_start_saving_ms`). Their difference grows with k_0: on the Ray demo chain at T = 1,
    48-token requests, the second round ran 15-20 ms against a steady 40 at k_0 = 6 (C_0 was
    flat from k_0 = 3 to 6, requests 9 % faster at 6). 0 tokens: C_0."""
    if request_tokens <= 0:
        return target.ms_per_token
    return target.ms_per_token + (target.cold_extra_ms - target.head_start_saving_ms) / request_tokens


def chain_cost(stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int], tree_width: int = 1, memo: dict | None = None) -> float:
    """What the searches minimise: C_0, or with the target stage's `request_tokens` set,
    `request_ms_per_token`."""
    return request_ms_per_token(round_models(stages, draft_ms, lengths, tree_width, memo)[0], stages[0].request_tokens)


def generation_ms(
    stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int], new_tokens: int, tree_width: int = 1
) -> float:
    """Expected ms to generate `new_tokens` (decoding only; add the prefills for a request).

    The target's round length is min(k_0, remaining - 1) and a round emitting more than
    remain is cut, exactly as ChainScheduler.generate does."""
    if new_tokens <= 0:
        return 0.0
    below = round_models(stages[1:], draft_ms, lengths[1:], tree_width)[0] if len(stages) > 1 else None
    target_width = tree_width if len(stages) == 1 else 1
    target = stages[0].at_length(lengths[0])  # a request's short last rounds are too few to move where rounds start
    rounds: dict[int, RoundModel] = {}
    for need in range(0, min(lengths[0], new_tokens - 1) + 1):
        block_pmf, block_ms = block_for(target, below, draft_ms, need)
        rounds[need] = round_model(target, block_pmf, block_ms, target_width)
    remaining_ms = [0.0] * (new_tokens + 1)  # [r] = expected ms to emit r more tokens
    for remaining in range(1, new_tokens + 1):
        model = rounds[min(lengths[0], remaining - 1)]
        future = sum(p * remaining_ms[max(0, remaining - x)] for x, p in enumerate(model.emitted_pmf) if p)
        remaining_ms[remaining] = model.round_ms + future
    first = rounds[min(lengths[0], new_tokens - 1)]
    return remaining_ms[new_tokens] + first.cold_extra_ms - first.head_start_saving_ms


def first_round_ms(
    stages: Sequence[StageSpec], draft_ms: LatencyTable, lengths: Sequence[int], new_tokens: int, tree_width: int = 1
) -> float:
    """Expected ms of a request's first target round, prefills excluded: its block
    (min(k_0, new_tokens - 1) tokens) is drafted after the prompt is in, with nothing drafted
    ahead, so in the pipelined form the forward and the block add up (`generation_ms` charges
    that as the first round's `cold_extra_ms`)."""
    below = round_models(stages[1:], draft_ms, lengths[1:], tree_width)[0] if len(stages) > 1 else None
    target = stages[0].at_length(lengths[0])
    block_pmf, block_ms = block_for(target, below, draft_ms, min(lengths[0], max(0, new_tokens - 1)))
    first = round_model(target, block_pmf, block_ms, tree_width if len(stages) == 1 else 1)
    return first.round_ms + first.cold_extra_ms


def search_lengths(
    stages: Sequence[StageSpec], draft_ms: LatencyTable, max_length: int, tree_width: int = 1, exhaustive_limit: int = 512
) -> tuple[list[int], float]:
    """Lengths minimising `chain_cost` (C_0). Every combination when there are at most
    `exhaustive_limit`; else bottom-up (each stage's k minimising its own ms per token given
    the stages below, the ideal form's argument), then coordinate descent on C_0, because a
    middle tier's overshoot couples a stage's best k to the k above it. Returns (lengths, cost)."""
    options = range(1, max_length + 1)
    memo: dict = {}

    def total(lengths: Sequence[int]) -> float:
        return chain_cost(stages, draft_ms, lengths, tree_width, memo)

    if max_length ** len(stages) <= exhaustive_limit:
        best = list(min(itertools.product(options, repeat=len(stages)), key=total))
        return best, total(best)
    lengths = [1] * len(stages)
    for index in reversed(range(len(stages))):
        def stage_cost(k: int) -> float:
            return round_models(stages, draft_ms, lengths[:index] + [k] + lengths[index + 1 :], tree_width, memo)[index].ms_per_token

        lengths[index] = min(options, key=stage_cost)
    best_cost = total(lengths)
    improved = True
    while improved:
        improved = False
        for index in range(len(stages)):
            for k in options:
                trial = lengths[:index] + [k] + lengths[index + 1 :]
                cost = total(trial)
                if cost < best_cost * (1 - 1e-9):
                    lengths, best_cost, improved = trial, cost, True
    return lengths, best_cost


def local_search(
    stages: Sequence[StageSpec], draft_ms: LatencyTable, start: Sequence[int], max_length: int, tree_width: int = 1, max_steps: int | None = None
) -> tuple[list[int], float]:
    """Lengths minimising `chain_cost` near `start`: hill-climbing to the best neighbour
    (every k moved by -1, 0 or +1, at least one moved) while it improves. A routine re-tune
    between full searches: the estimates move a little between two of them, so the optimum
    does too, and 3 ** len(stages) - 1 evaluations a step cost a fraction of `search_lengths`'
    max_length ** len(stages). Moving one k at a time is not enough: the stages' ks are
    coupled (at rates 0.99 / 0.95, from [1, 1] it stopped at [2, 8], 8 % above [8, 6]).
    Returns (lengths, cost)."""
    memo: dict = {}

    def total(lengths: Sequence[int]) -> float:
        return chain_cost(stages, draft_ms, lengths, tree_width, memo)

    moves = [move for move in itertools.product((-1, 0, 1), repeat=len(stages)) if any(move)]
    lengths = [min(max(1, k), max_length) for k in start]
    best_cost = total(lengths)
    for _ in range(max_length if max_steps is None else max_steps):
        neighbours = [trial for trial in ([k + step for k, step in zip(lengths, move)] for move in moves) if all(1 <= k <= max_length for k in trial)]
        if not neighbours:
            break
        trial = min(neighbours, key=total)
        cost = total(trial)
        if not cost < best_cost * (1 - 1e-9):
            break
        lengths, best_cost = trial, cost
    return lengths, best_cost


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured (inf when nothing was measured)."""
    return abs(predicted - measured) / measured if measured > 0 else math.inf
