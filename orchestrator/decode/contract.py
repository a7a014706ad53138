"""The decoder contract: what every decoder (embedded, distributed, batched) promises its callers.

A decoder turns requests into verified tokens, one target round at a time:

    state = decoder.start(prompt_ids, max_new_tokens, params, seed)
    while not state.done:
        tokens = decoder.step(state)      # the tokens this round committed (may be empty)
    output = decoder.finish(state)        # or decoder.cancel(state): frees the request's caches

The one request loop (polyspec.orchestrator.batch_runner) drives any decoder that way, so a
request means the same thing whichever decoder runs it. The rules every decoder shares live
here, once (docs/architecture.md, "The decoder contract"): the end of a request (`commit`,
`cancel`), seeds (`tier_seeds`: one per tier, so a seeded request samples the same tokens
whichever decoder runs it) and prefix reuse (`KeptSequences`: a chat's next turn runs under
the sequence id whose caches hold its prefix).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from polyspec.workers.core.sampling import RandomStream, SamplingParams
from polyspec.workers.core.tree import common_prefix

FINISH_LENGTH = "length"  # max_new_tokens reached, or the context is full
FINISH_EOS = "eos"  # the last committed token ends the sequence
FINISH_CANCELLED = "cancelled"  # the caller stopped the request
FINISH_STOP = "stop"  # a stop string appeared in its text (the request loop's TextStream)
NO_LIMIT = 1 << 62  # the context limit of a chain whose models state none
_NO_ROUNDS = {"rounds": 0, "tokens": 0, "seconds": 0.0, "predicted_tokens": 0.0, "predicted_seconds": 0.0}  # a plan's sums


@dataclasses.dataclass
class StageStats:
    """One verifying stage: tier `tier` verifies the blocks of tier `drafter`."""

    tier: str
    drafter: str
    blocks: int = 0
    proposed: int = 0
    accepted: int = 0
    time_s: float = 0.0
    lengths: list[int] = dataclasses.field(default_factory=list)  # speculation length each time it changed
    accepted_counts: list[int] = dataclasses.field(default_factory=list)  # [j] = blocks with exactly j accepted

    def record(self, proposed: int, accepted: int, length: int, seconds: float) -> None:
        self.blocks += 1
        self.proposed += proposed
        self.accepted += accepted
        self.time_s += seconds
        if not self.lengths or self.lengths[-1] != length:
            self.lengths.append(length)
        while len(self.accepted_counts) <= accepted:
            self.accepted_counts.append(0)
        self.accepted_counts[accepted] += 1

    def as_dict(self) -> dict:
        return {
            "tier": self.tier,
            "drafter": self.drafter,
            "blocks": self.blocks,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "mean_accepted_length": round(self.accepted / self.blocks, 4) if self.blocks else 0.0,
            "lengths": list(self.lengths),
            "accepted_counts": list(self.accepted_counts),
            "time_s": round(self.time_s, 6),
        }


def stage_of(stages: list[StageStats], bypass: dict[tuple[int, int], StageStats], tiers, level: int, drafter: int) -> StageStats:
    """The statistics of tier `level` verifying tier `drafter`: the chain's own stage when `drafter`
    is the next tier, else the bypass stage (created on first use) when the tiers between sit out."""
    if drafter == level + 1:
        return stages[level]
    key = (level, drafter)
    if key not in bypass:
        bypass[key] = StageStats(tiers[level].name, tiers[drafter].name)
    return bypass[key]


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # FINISH_LENGTH | FINISH_EOS | FINISH_CANCELLED
    stats: dict


@dataclasses.dataclass
class RequestState:
    """One request between a decoder's `start` and its `finish` / `cancel`."""

    seq_id: int  # the request's id in every tier's caches
    params: SamplingParams
    committed: list[int]  # prompt + accepted tokens
    max_new_tokens: int
    limit: int  # no position may reach this (the smallest model context of the chain)
    run: Any  # what only the decoder that started the request reads (ChainScheduler: its `Run`)
    tier_busy_s: list[float]  # model time spent on this request, per tier (where the decoder can tell)
    new_tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # set once done
    plans: list[dict] = dataclasses.field(default_factory=list)  # with a planner: lengths / tiers each time they changed
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_commit_at: float | None = None  # when its first tokens were committed (Engine: prefill vs decode time)
    request: object = None  # the caller's request object, carried along (Engine keeps its GenerationRequest here)
    text: Any = None  # its TextStream, where the request loop streams its text or matches stop strings

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@runtime_checkable
class Decoder(Protocol):
    """The four calls every decoder implements (see the module docstring)."""

    tiers: list  # target first; each has at least `name` and `busy_s`
    max_context: int | None  # the longest context any request may reach (None: no limit)
    eos_token_ids: frozenset[int]
    vocab_size: int  # the chain's shared vocabulary (what a request's logits rows span)
    lengths: list[int]  # the speculation length of each verifying level in use
    active: tuple[int, ...]  # the tiers in use, target first (a planner may bypass some)
    planner: "RoundPlanner | None"  # lengths: auto's planner (None: the lengths are fixed)
    concurrent_steps: bool  # may steps of different requests run at once (threads; a remote chain)?

    def close(self) -> None:
        """Release what the decoder holds outside this process (a remote chain's channels, actors)."""

    def start(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None) -> RequestState:
        """Open a request. Requests are independent: a caller may interleave their steps."""

    def step(self, state: RequestState) -> list[int]:
        """One target round; returns the newly committed tokens (nothing once the request is done)."""

    def finish(self, state: RequestState) -> GenerationOutput:
        """Release the request's caches and return its tokens and stats."""

    def cancel(self, state: RequestState) -> GenerationOutput:
        """Stop the request now: it finishes as "cancelled" (unless it was already done)."""


@runtime_checkable
class BatchDecoder(Decoder, Protocol):
    """A decoder that advances many requests per step (the batched, device and distributed batched
    rounds). The continuous-batching loop (polyspec.orchestrator.batch_runner) drives it:
    `prefill` the joining requests, then `step_all` the `ready` ones."""

    last_step: dict  # the latest step's batch size, tokens, seconds, lengths and tiers (for metrics)

    def prefill(self, states: list[RequestState], budget: int | None = None) -> int:
        """Cache joining requests' prompts (all but the last token) within `budget` tokens; returns the tokens fed."""

    def ready(self, state: RequestState) -> bool:
        """Is the request's prompt cached, so it can join the next step?"""

    def step_all(self, states: list[RequestState]) -> list[list[int]]:
        """One round of every request in `states`; the tokens each committed."""


# ------------------------------------------------------- planning and observing a round


@dataclasses.dataclass(frozen=True)
class StepInput:
    """What a planner sees before a step: the live requests' sampling parameters and context
    lengths (target first in every list), per drafting model tier how many context tokens it
    has yet to cache (what switching it on would cost), how many tokens each request may
    still commit (what a one-time cost such as that catch-up is spread over; empty: unknown), and
    each request's sequence id (what its observations carry; empty: unknown)."""

    params: tuple[SamplingParams, ...]
    context_lens: tuple[int, ...]
    behind: dict[int, int] = dataclasses.field(default_factory=dict)
    remaining: tuple[int, ...] = ()
    seq_ids: tuple = ()

    @property
    def batch(self) -> int:
        return len(self.params)


@dataclasses.dataclass(frozen=True)
class RoundObservation:
    """One verification round of one request: tier `level` scored a block of `proposed` nodes
    from tier `drafter` (asked for `length`) and accepted a path of `accepted` nodes, in
    `seconds` (the request's share of the shared forward, plus its verification rule), at a
    context of `context_len` tokens; `seq_id`: the request's id in the tiers' caches; `depth`:
    the depth a tree's walk reached (None: a chain); `ahead`: run while drafting ahead, off the
    step's critical path (a pipelined chain's lower stages)."""

    level: int
    drafter: int
    length: int
    proposed: int
    accepted: int
    seconds: float
    greedy: bool
    context_len: int
    seq_id: int
    depth: int | None = None
    ahead: bool = False


@dataclasses.dataclass(frozen=True)
class DraftObservation:
    """The bottom tier proposed `tokens` (None: a tree, or tokens not at hand) for one request,
    asked for `length`, continuing `context_len` tokens, in `seconds` (its share of a shared
    forward); `proposed`: how many, where the tokens are not at hand (a remote tier's report).
    `ahead`: instead a block of `proposed` tokens that tier `tier` drafted ahead (a pipelined
    chain), `seconds` from handing up its previous block to drafting this one's last token."""

    tier: int
    length: int
    context_len: int
    tokens: tuple[int, ...] | None
    seconds: float
    proposed: int | None = None
    ahead: bool = False


@dataclasses.dataclass(frozen=True)
class StepObservation:
    """A step ended: each live request's committed tokens (in the order of its StepInput), the
    step's wall time, and the lengths / tiers it ran with; `catch_up_s`: the part of the wall time
    spent caching contexts a drafter of the plan was behind on (a price of switching it on, not of
    the plan's steps); `busy_s`: the part its tiers' forwards and lookups took, `forwards` per tier how many
    (None where a tier runs elsewhere: a remote tier's forwards are not timed here)."""

    committed: tuple[tuple[int, ...], ...]
    seconds: float
    lengths: tuple[int, ...]
    active: tuple[int, ...]
    catch_up_s: float = 0.0
    busy_s: float | None = None
    forwards: tuple[int, ...] | None = None

    @property
    def batch(self) -> int:
        return len(self.committed)

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.committed)


@dataclasses.dataclass(frozen=True)
class ShadowObservation:
    """A lookup tier `drafter` the step did not run under tier `level`, asked what it would have proposed at a
    request's context: the first `accepted` of its `proposed` tokens matched the tokens tier `level` produced there
    (level 0: what the step committed; a model drafter: the block it drafted), and `accepted < proposed` only where
    one of them differed (where those tokens ran out first, `proposed` is cut to the match). Each of those tokens
    is distributed as tier `level`'s own, so a match is an acceptance at the rate that tier verifying a block of
    these tokens (point masses) would have had, sampling or not. `proposed` 0: the lookup had nothing to propose
    there. `seq_id`: the request's."""

    drafter: int
    proposed: int
    accepted: int
    greedy: bool
    seq_id: object = None
    level: int = 0
    ended: bool | None = None  # the round would have ended within the tokens compared (None: accepted < proposed)


Observation = RoundObservation | DraftObservation | StepObservation | ShadowObservation


@runtime_checkable
class RoundPlanner(Protocol):
    """What sets a round's speculation lengths and tiers (the goodput planner): `plan` before each
    step, `observe` every round, draft and step as it happens."""

    shadows: bool  # is it told what the lookup tiers left out of a step would have proposed (ShadowObservation)?

    def plan(self, step: StepInput) -> tuple[list[int], tuple[int, ...]]:
        """The lengths (one per verifying level) and the tiers to run (target first) for this step."""

    def observe(self, observation: Observation) -> None:
        """What a round, a draft or a step just measured."""

    def drafters(self, step: StepInput) -> tuple[int, ...]:
        """Right after `plan(step)`: per request of the step, the tier that drafts its block for the target, where
        that differs from the plan's for some (a request whose own text makes a lookup pay); empty: the plan's for all."""

    # right after `plan(step)`: the tokens/s it expects of each request of the step under the plan (None: no prediction);
    # after `drafters(step)` named drafters apart, one per request; recorded per plan in the request's stats beside the
    # measured rate (`note_round`)
    predicted_tokens_per_s: float | tuple[float, ...] | None


# ----------------------------------------------------------------- end of a request


def at_length(state: RequestState) -> bool:
    """The request has all its tokens, or its context is full."""
    return len(state.new_tokens) >= state.max_new_tokens or len(state.committed) >= state.limit


def finish_if_full(state: RequestState) -> bool:
    """Before a round: finish the request as "length" when no token fits. True when done."""
    if not state.done and at_length(state):
        state.finish_reason = FINISH_LENGTH
    return state.done


def remaining(state: RequestState) -> int:
    """How many more tokens the request may commit."""
    return state.max_new_tokens - len(state.new_tokens)


def first_eos(tokens: Iterable[int], eos_token_ids: frozenset[int]) -> int | None:
    """The index of the first end-of-sequence token in `tokens` (None: there is none)."""
    return next((j for j, t in enumerate(tokens) if t in eos_token_ids), None)


def commit(state: RequestState, emitted: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """Commit one round's tokens: cut at `max_new_tokens` and just after the first EOS, append
    them, and finish the request ("eos", or "length" when full). Returns the committed tokens."""
    emitted = emitted[: remaining(state)]
    eos_at = first_eos(emitted, eos_token_ids)
    if eos_at is not None:
        emitted = emitted[: eos_at + 1]
    state.committed += emitted
    state.new_tokens += emitted
    if eos_at is not None:
        state.finish_reason = FINISH_EOS
    elif at_length(state):
        state.finish_reason = FINISH_LENGTH
    return emitted


def note_plan(plans: list[dict], new_tokens: int, lengths, tiers: list[str]) -> None:
    """Append a request's plan (lengths, tiers) to `plans`, its result's record, when it differs from the last;
    `note_round` then adds each round run under it."""
    shown = {"lengths": list(lengths), "tiers": list(tiers)}
    if not plans or {k: plans[-1][k] for k in shown} != shown:
        plans.append({"new_tokens": new_tokens, **shown, **_NO_ROUNDS})


def note_round(plans: list[dict], tokens: int, seconds: float, predicted_tokens_per_s: float | None) -> None:
    """A round of the request under its latest plan: the tokens it committed, the step's wall `seconds`, and the
    planner's predicted tokens/s for this request under the plan (`RoundPlanner.predicted_tokens_per_s`; None: none)."""
    if not plans:
        return
    record = plans[-1]
    record["rounds"] += 1
    record["tokens"] += tokens
    record["seconds"] += seconds
    if predicted_tokens_per_s is not None and predicted_tokens_per_s > 0 and math.isfinite(predicted_tokens_per_s):
        record["predicted_tokens"] += predicted_tokens_per_s * seconds
        record["predicted_seconds"] += seconds


def plan_records(plans: list[dict]) -> list[dict]:
    """A request's plans as its stats show them: per plan it ran under (in order; a plan taken again is a new entry),
    the new tokens before it, its tiers and lengths, its rounds, the tokens they committed and their wall seconds,
    `measured_tokens_per_s` (tokens / seconds) and `predicted_tokens_per_s` (the planner's prediction for the
    request under the plan, averaged over those seconds; absent where the planner gave none)."""
    return [{**{key: record[key] for key in ("new_tokens", "tiers", "lengths")}, **(_rates(record) if "rounds" in record else {})}
            for record in plans]


def _rates(sums: dict) -> dict:
    """Rounds, tokens and seconds of `sums` (a plan's record, or a chain's total) with the measured tokens/s and,
    where some of its seconds had a prediction, the predicted."""
    seconds = sums["seconds"]
    out = {"rounds": sums["rounds"], "tokens": sums["tokens"], "seconds": round(seconds, 6),
           "measured_tokens_per_s": round(sums["tokens"] / seconds, 3) if seconds > 0 else 0.0}
    if sums["predicted_seconds"] > 0:
        out["predicted_tokens_per_s"] = round(sums["predicted_tokens"] / sums["predicted_seconds"], 3)
    return out


def chain_label(tiers: list[str]) -> str:
    """A plan's set of tiers as one label, target first ("target<-mid<-ngram"): a chain has at most 2^(tiers - 1)."""
    return "<-".join(tiers)


class PlanTally:
    """Finished requests' plans summed per chain (`chain_label`): rounds, tokens, seconds, and the predicted tokens
    over the seconds that had a prediction. What `polyspec batch --stats` and the server's metrics report."""

    def __init__(self) -> None:
        self.chains: dict[str, dict] = {}

    def add(self, records: list[dict]) -> None:
        """One request's `plan_records`."""
        for record in records:
            if "rounds" not in record:
                continue
            total = self.chains.setdefault(chain_label(record["tiers"]), dict(_NO_ROUNDS))
            total["rounds"] += record["rounds"]
            total["tokens"] += record["tokens"]
            total["seconds"] += record["seconds"]
            if "predicted_tokens_per_s" in record:
                total["predicted_tokens"] += record["predicted_tokens_per_s"] * record["seconds"]
                total["predicted_seconds"] += record["seconds"]

    def as_dict(self) -> dict:
        """Per chain: rounds, tokens, seconds, measured and predicted tokens/s (per request, over its rounds' seconds)."""
        return {label: _rates(total) for label, total in sorted(self.chains.items())}


def mark_cancelled(state: RequestState) -> None:
    """What `cancel` does before `finish`: a request that was not done ends as "cancelled"."""
    if not state.done:
        state.finish_reason = FINISH_CANCELLED


def output(state: RequestState, stages: Iterable[StageStats], **extra) -> GenerationOutput:
    """The request's result: its tokens, finish reason and the stats every decoder reports
    (throughput, time, the stages), plus the decoder's own `extra` stats."""
    elapsed = time.perf_counter() - state.started
    stats = {
        "tokens_per_s": round(len(state.new_tokens) / elapsed, 3) if elapsed > 0 else 0.0,
        "new_tokens": len(state.new_tokens),
        "time_s": round(elapsed, 6),
        "stages": [stage.as_dict() for stage in stages],
        **extra,
    }
    return GenerationOutput(list(state.new_tokens), state.finish_reason or FINISH_LENGTH, stats)


# ---------------------------------------------------------------------- prefix reuse


class KeptSequences:
    """Finished requests whose caches stay in the tiers, at most `keep` of them, oldest dropped first:
    a new request whose prompt shares a prefix with one's tokens (a conversation's next turn) runs
    under its sequence id, and every tier keeps the cached prefix and forwards only the rest.
    `release(seq_id)` frees a dropped one's caches; `new_id()` makes a fresh sequence id."""

    def __init__(self, keep: int, release: Callable[[int], None], new_id: Callable[[], int]) -> None:
        self.keep, self.release, self.new_id = keep, release, new_id
        self._kept: list[tuple[int, list[int]]] = []  # (seq_id, its tokens), oldest first

    def sequence_for(self, prompt_ids: list[int]) -> int:
        """The sequence id a new request runs under: that of the kept request whose tokens share the
        longest prefix with `prompt_ids` (no longer kept: its caches are the new request's), else a fresh one."""
        shared = [(common_prefix(tokens, prompt_ids), j) for j, (_, tokens) in enumerate(self._kept)]
        length, best = max(shared, default=(0, None))
        return self._kept.pop(best)[0] if length else self.new_id()

    def put(self, seq_id: int, tokens: list[int]) -> bool:
        """Keep a finished request's caches (dropping the oldest past `keep`); False: `keep` is 0, freed at once."""
        self._kept.append((seq_id, list(tokens)))
        while len(self._kept) > self.keep:
            self.release(self._kept.pop(0)[0])
        return self.keep > 0


# ----------------------------------------------------------------------------- seeds


def tier_seeds(seed: int | None, tiers: int) -> list[int]:
    """One seed per tier, drawn from the request's `seed`: every decoder derives them this way,
    so a seeded request samples the same tokens embedded and distributed."""
    base = RandomStream(seed)
    return [int(torch.randint(0, 2**62, (1,), generator=base)) for _ in range(tiers)]
