"""The serial time model, one stage at a time: pure functions on numbers.

No planner reads it (the goodput planner has its own, polyspec.orchestrator.tuning.batch_model): realbench
prices its chains with it (real_report), and benchmarks/gpu/predict_chains beside the planner's.

Units: every time is in milliseconds; acceptance rates are probabilities. No I/O.

Vocabulary
    t_i(m)         wall time of one forward of tier i over m new tokens (a `LatencyTable`)
    accept_rates   per-position acceptance of one stage: accept_rates[j-1] = P(position j of
                   a block is accepted | positions 1..j-1 were); positions past the end of
                   the list reuse its last entry
    E_i(k)         expected tokens tier i emits per verification of a k-token block
                   = 1 + sum_{j=1..k} prod_{l<=j} a_l   (accepted + the correction / bonus)
    C_i            expected wall time per token tier i emits, drafting below it included

The textbook form C_i = (t_i(k_i+1) + k_i C_{i+1}) / E_i(k_i) assumes every block is exactly
k tokens. This module models what `polyspec.orchestrator.decode.scheduler` really does: a
middle tier asked for `need` tokens runs whole rounds of its own length and hands up
everything they emitted, so the block its verifier scores is a random length >= need
(`block_for`: the first passage of a sum of per-round emissions); the cost of the blocks
below follows from Wald's identity (expected rounds x expected round cost). One stage's
round is a `RoundModel`; chain_model.py composes the stages of a chain bottom-up, prices a
whole request, and searches the lengths. (The textbook form is kept in the tests as a
reference the model must reproduce where the two coincide.)

Pipelined stages (`StageSpec.pipelined`, the distributed runtime with `pipeline: true`):
the drafter hands up exactly the block asked for and drafts the next one while this one is
verified, betting on whole blocks (`pipelined_shape` / `pipelined_round`, docs/time-model.md).

Trees: when the bottom stage proposes `tree_width` candidate chains of depth k, the verifier
scores width * k nodes and the accepted path is at most k long; its `accept_rates` are the
tree's: position 1 = acceptance of the best of `tree_width` candidates, deeper positions the
chain rates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

from polyspec.orchestrator.distributed.worker import AHEAD_SMOOTHING, AHEAD_THRESHOLD  # the tier worker's bet
from polyspec.orchestrator.tuning.batch_acceptance import accepted_pmf, first_passage, rate_at  # (shared with the planner)

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


def expected_emitted(accept_rates: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{j=1..k} prod_{l<=j} a_l: tokens emitted per round with a k-token block."""
    total, survive = 1.0, 1.0
    for position in range(1, k + 1):
        survive *= rate_at(accept_rates, position)
        total += survive
    return total


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
    over lengths 2, 3 and 6; docs/time-model.md, acceptance)."""
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


# ------------------------------------------------------------------- one stage


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
    # accept_rates are per position of the text (`renewal_rates` converts them): a
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


def block_for(stage: StageSpec, below: RoundModel | None, draft_ms: LatencyTable, need: int) -> tuple[list[float], float]:
    """The block `stage` verifies when it asks for `need` tokens. A pipelined drafter hands up
    exactly `need` tokens and keeps any overshoot of its rounds for the next block (its
    draft-ahead stream), so a block costs `need` tokens at the drafter's cost per token (on
    cores of its own: the slow-down while it shares them is `pipelined_round`'s)."""
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
    T = 1 the model's error grew with k_0 to +21 % at [6, 1], docs/time-model.md, predicted vs measured.)"""
    if block_ms * slowdown <= forward_ms:
        return block_ms * slowdown
    return block_ms + forward_ms * (1.0 - 1.0 / slowdown)


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
    pipelined_forward_ms: float  # t_avg + o of `pipelined_shape`
    emitted: tuple[float, ...]  # the mix of the two by `share`


def round_shape(stage: StageSpec, block_pmf: Sequence[float], tree_width: int = 1) -> RoundShape:
    serial = pipelined = None
    serial_ms = pipelined_ms = whole = share = 0.0
    if stage.pipelined and tree_width == 1:
        whole = whole_probability(tuple(stage.accept_rates), block_pmf)
        share = ahead_share(whole)
        if share >= 1e-3:
            pipelined, pipelined_ms = pipelined_shape(stage, block_pmf, whole)
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
    pipelined = pipelined_round(stage, shape.whole, shape.pipelined_emitted, shape.pipelined_forward_ms, block_ms)
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




def whole_probability(rates: tuple[float, ...], block_pmf: Sequence[float]) -> float:
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


def pipelined_shape(stage: StageSpec, block_pmf: Sequence[float], whole: float) -> tuple[tuple[float, ...], float]:
    """A draft-ahead stage's round, part 1: its emitted pmf and t_avg + o (the block's cost plays
    no part in them; `whole` = P(the block is accepted whole), `whole_probability`).

    While the verifier scores block n the drafter drafts block n+1, betting that n is accepted
    whole. Accepted whole, the round emits L tokens (no bonus: the drafter's continuation is
    verified next); otherwise the draft-ahead work is lost and the round emits A + 1 tokens, so
    t_avg = P * t(L) + (1 - P) * t(L + 1) (the round's time: docs/time-model.md, renewal-reward).
    """
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


def pipelined_round(stage: StageSpec, whole: float, emitted: tuple[float, ...], forward_ms: float, block_ms: float) -> RoundModel:
    """A draft-ahead stage's round, part 2: the `RoundModel` for a block costing `block_ms`
    (see `pipelined_shape`)."""
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
