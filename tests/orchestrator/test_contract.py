"""The decoder contract's shared rules: end of a request, cancellation, seeds, the Protocol."""

from __future__ import annotations

import pytest
import torch

from polyspec.orchestrator.decode.contract import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    Decoder,
    KeptSequences,
    RequestState,
    StageStats,
    commit,
    finish_if_full,
    mark_cancelled,
    output,
    tier_seeds,
)
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.orchestrator.distributed.driver import DistributedChain
from polyspec.workers.core.sampling import RandomStream, SamplingParams
from core_helpers import generate_alone

EOS = frozenset({2})


def state(prompt=(7, 8), max_new_tokens=5, limit=1 << 62) -> RequestState:
    return RequestState(seq_id=1, params=SamplingParams(), committed=list(prompt), max_new_tokens=max_new_tokens,
                        limit=limit, run=None, tier_busy_s=[0.0])


def test_commit_cuts_at_max_new_tokens_and_finishes_as_length():
    s = state(max_new_tokens=5)
    assert commit(s, [10, 11, 12], EOS) == [10, 11, 12] and not s.done
    assert commit(s, [13, 14, 15, 16], EOS) == [13, 14]
    assert s.finish_reason == FINISH_LENGTH and s.new_tokens == [10, 11, 12, 13, 14] and s.committed[:2] == [7, 8]


def test_commit_keeps_the_eos_token_and_nothing_after_it():
    s = state(max_new_tokens=10)
    assert commit(s, [10, 2, 11, 2], EOS) == [10, 2]
    assert s.finish_reason == FINISH_EOS and s.committed == [7, 8, 10, 2]


def test_an_eos_past_max_new_tokens_does_not_count():
    s = state(max_new_tokens=2)
    assert commit(s, [10, 11, 2], EOS) == [10, 11]
    assert s.finish_reason == FINISH_LENGTH


def test_a_full_context_finishes_the_request_before_and_after_a_round():
    s = state(prompt=(1, 1, 1), limit=5)
    assert not finish_if_full(s)
    commit(s, [10, 11], EOS)
    assert s.finish_reason == FINISH_LENGTH
    full = state(prompt=(1, 1, 1, 1, 1), limit=5)
    assert finish_if_full(full) and full.finish_reason == FINISH_LENGTH


def test_cancel_marks_only_unfinished_requests():
    s = state()
    mark_cancelled(s)
    assert s.finish_reason == FINISH_CANCELLED
    done = state(max_new_tokens=1)
    commit(done, [2], EOS)
    mark_cancelled(done)
    assert done.finish_reason == FINISH_EOS


def test_output_reports_tokens_stages_and_the_decoders_own_stats():
    s = state()
    commit(s, [10, 11], EOS)
    stage = StageStats("t", "d")
    stage.record(proposed=4, accepted=3, length=4, seconds=0.01)
    out = output(s, [stage], rounds=1)
    assert out.token_ids == [10, 11] and out.finish_reason == FINISH_LENGTH  # never started: "length"
    assert list(out.stats) == ["tokens_per_s", "new_tokens", "time_s", "stages", "rounds"]
    assert out.stats["stages"][0]["accepted_counts"] == [0, 0, 0, 1] and out.stats["new_tokens"] == 2


def test_tier_seeds_are_a_function_of_the_request_seed():
    assert tier_seeds(5, 3) == tier_seeds(5, 3)
    assert tier_seeds(5, 2) == tier_seeds(5, 3)[:2]  # a shorter chain's tiers draw the same seeds
    assert tier_seeds(5, 3) != tier_seeds(6, 3)
    assert len(set(tier_seeds(None, 4))) == 4
    a, b = RandomStream(9), RandomStream(9)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


class _Counting:
    """A decoder that commits one token a round: the shared generate loop, and cancel on error."""

    tiers: list = []
    max_context = None
    eos_token_ids = EOS
    vocab_size = 32
    lengths: list = []
    active = (0,)
    planner = None
    concurrent_steps = False

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.cancelled = fail_at, 0

    def close(self) -> None:
        pass

    def start(self, prompt_ids, max_new_tokens, params, seed=None):
        return RequestState(0, params, list(prompt_ids), max_new_tokens, 1 << 62, None, [])

    def step(self, s):
        if finish_if_full(s):
            return []
        if len(s.new_tokens) == self.fail_at:
            raise RuntimeError("tier died")
        return commit(s, [len(s.new_tokens) + 10], self.eos_token_ids)

    def finish(self, s):
        return output(s, [])

    def cancel(self, s):
        self.cancelled += 1
        mark_cancelled(s)
        return self.finish(s)


def test_the_one_loop_streams_every_round_and_cancels_on_error():
    decoder = _Counting()
    seen = []
    out = generate_alone(decoder, [1], 3, SamplingParams(), on_commit=seen.extend)
    assert out.token_ids == [10, 11, 12] == seen and out.finish_reason == FINISH_LENGTH
    failing = _Counting(fail_at=1)
    with pytest.raises(RuntimeError):
        generate_alone(failing, [1], 3, SamplingParams())
    assert failing.cancelled == 1


def test_kept_sequences_hand_the_longest_shared_prefix_its_sequence_and_drop_the_oldest():
    released, fresh = [], iter(range(100, 200))
    kept = KeptSequences(2, released.append, lambda: next(fresh))
    assert kept.sequence_for([1, 2]) == 100  # nothing kept: a fresh id
    assert kept.put(1, [5, 6, 7]) and kept.put(2, [5, 6, 9, 9]) and released == []
    assert kept.put(3, [8]) and released == [1]  # past `keep`: the oldest is freed
    assert kept.sequence_for([5, 6, 9, 9, 4]) == 2 and kept.sequence_for([5, 6, 9]) == 101  # taken: no longer kept
    assert kept.sequence_for([8, 1]) == 3
    assert not KeptSequences(0, released.append, lambda: 0).put(4, [1]) and released == [1, 4]  # keep 0: freed at once


def test_both_decoders_implement_the_protocol():
    for cls in (ChainScheduler, DistributedChain, _Counting):
        assert all(callable(getattr(cls, name, None)) for name in ("start", "step", "finish", "cancel", "close")), cls
    assert isinstance(_Counting(), Decoder)


def test_every_batched_round_declares_the_batch_decoder_protocol():
    """The continuous-batching loop tells batched decoders by the declared protocol, not by probing."""
    from polyspec.orchestrator.decode.contract import BatchDecoder
    from polyspec.orchestrator.decode.scheduler import ChainScheduler
    from polyspec.orchestrator.distributed.driver import DistributedChain

    for batched in (ChainScheduler, DistributedChain):
        assert all(callable(getattr(batched, name, None)) for name in ("prefill", "ready", "step_all", "start", "finish", "cancel")), batched
    assert {"prefill", "ready", "step_all", "last_step"} <= set(BatchDecoder.__annotations__) | set(vars(BatchDecoder))
