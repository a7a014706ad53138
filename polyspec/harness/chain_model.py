"""The time model of a whole chain: its stages' rounds composed bottom-up (`round_models`), a
request's expected time (`generation_ms`, `first_round_ms`), the cost a search minimises
(`chain_cost`: ms per target token, with a pipelined chain's first rounds weighed by the
request's length), and the search over lengths (`search_lengths`: every combination). One
stage's round: time_model.py. (No planner reads it: realbench and benchmarks/gpu price chains with it.)

The target's round length is clipped to `min(k_0, remaining - 1)` near `max_new_tokens`
and its last round's surplus is dropped (`generation_ms`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from polyspec.harness.time_model import LatencyTable, RoundModel, StageSpec, block_for, round_from_shape, round_model, round_shape


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
