"""Contexts cross the wire once (transport.SentContexts / KeptContexts): a tier-to-tier call carries
only the tokens its callee lacks, a callee that lost its copy refuses and the caller sends the whole
context again, and the greedy text is the target's own either way.

The chains are TierWorkers in this process over gRPC on loopback (tests/inprocess_chain.py). What
crossed the wire is read where the callee receives it: each request's `context` field, handed to
`KeptContexts.resolve` with the whole context it rebuilds.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from core_helpers import generate_alone
from family_chains import tier_specs
from inprocess_chain import in_process_chain
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.distributed.transport import KEPT_VERSIONS, KeptContexts, SentContexts
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.loading import load_tiers

EOS = (256,)  # the byte-level test tokenizer's end of text
# ~170 tokens of prompt under the tiny models' 256 positions, with room for MAX_NEW
LONG_PROMPT = "def add(a, b):\n    return a + b\n\n" * 4 + "import os\nimport sys\n" + "def mul(a, b):\n    return"
MAX_NEW = 40
GREEDY = SamplingParams(temperature=0.0)


def chain_config(family, names, **speculation):
    return parse_config({"tiers": tier_specs(family, names), "speculation": speculation})


@pytest.fixture(scope="module")
def expected(tiny_family):
    """The long prompt's ids and the target's own greedy tokens after it."""
    engine = Engine(chain_config(tiny_family, ["target"]))
    ids = encode_prompt(engine.tokenizer, LONG_PROMPT)
    assert 150 < len(ids) < 256 - MAX_NEW
    return ids, generate_alone(engine.scheduler, ids, MAX_NEW, GREEDY).token_ids


def _record_received(worker) -> list[tuple[int, list[int], list[int]]]:
    """(seq_id, the ints the request carried, the whole context rebuilt) per call this worker receives."""
    received = []
    resolve = worker.contexts.resolve

    def recording(seq_id, tail, delta):
        context = resolve(seq_id, tail, delta)
        received.append((seq_id, list(tail), context))
        return context

    worker.contexts.resolve = recording
    return received


def _new_tokens(previous: list[int] | None, context: list[int]) -> int:
    """Tokens of `context` past its common prefix with what the same callee was sent before."""
    if previous is None:
        return len(context)
    shared = 0
    while shared < min(len(previous), len(context)) and previous[shared] == context[shared]:
        shared += 1
    return len(context) - shared


def _wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


# ----------------------------------------------------------------- the two ends alone


def test_a_delta_carries_what_the_callee_lacks_and_rebuilds_the_context():
    sent, kept = SentContexts(), KeptContexts()
    prompt = list(range(100, 300))
    steps = [prompt, prompt + [1, 2, 3], prompt + [1, 2, 3, 4], prompt + [1, 9]]  # the last one rolled back past 2
    carried = []
    for context in steps:
        tail, delta = sent.delta(7, context)
        assert kept.resolve(7, tail, delta) == context
        sent.sent(7, delta, context)
        carried.append(len(tail))
    assert carried == [len(prompt), 3, 1, 1]


def test_a_base_the_callee_does_not_keep_is_refused():
    sent, kept = SentContexts(), KeptContexts()
    tail, delta = sent.delta(7, [1, 2, 3])
    kept.resolve(7, tail, delta)
    sent.sent(7, delta, [1, 2, 3])
    tail, delta = sent.delta(7, [1, 2, 3, 4])
    kept.drop(7)  # a restart, or a Release the caller did not see
    assert kept.resolve(7, tail, delta) is None and kept.stale == 1
    tail, delta = sent.delta(7, [1, 2, 3, 4], whole=True)
    assert tail == [1, 2, 3, 4] and delta.base_version == 0
    assert kept.resolve(7, tail, delta) == [1, 2, 3, 4]


def test_a_callee_keeps_its_last_versions_per_sequence_and_a_release_drops_them():
    kept, callers = KeptContexts(), [SentContexts() for _ in range(KEPT_VERSIONS + 1)]
    for n, caller in enumerate(callers):
        tail, delta = caller.delta(7, [n])
        kept.resolve(7, tail, delta)
        caller.sent(7, delta, [n])
    oldest, *rest = callers
    assert kept.resolve(7, *oldest.delta(7, [0, 5])) is None  # pushed out by the later versions
    for n, caller in enumerate(rest, start=1):
        assert kept.resolve(7, *caller.delta(7, [n, 5])) == [n, 5]
    kept.drop(7)
    assert len(kept) == 0


# ----------------------------------------------------------------------- over gRPC


@contextlib.contextmanager
def three_tier_chain(family, pipeline: bool):
    """target <- mid <- small as in-process gRPC workers, each recording what it receives: (chain, workers, received)."""
    config = chain_config(family, ["target", "mid", "small"], lengths=[4, 3])
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, [4, 3], pipeline=pipeline, eos_token_ids=EOS)
    received = [_record_received(worker) for worker in workers]
    try:
        yield chain, workers, received
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_after_the_first_call_only_new_tokens_cross_the_wire(tiny_family, expected, pipeline):
    """A ~170-token prompt through target <- mid <- small: each hop receives the prompt once, every later
    call only the tokens past what it was sent before, and the text is the target's own."""
    ids, target_tokens = expected
    with three_tier_chain(tiny_family, pipeline) as (chain, workers, received):
        assert generate_alone(chain, ids, MAX_NEW, GREEDY).token_ids == target_tokens
        stats = chain.runtime_stats()
        for tier, calls in enumerate(received):
            assert calls, f"tier {tier} was called"
            whole = [len(tail) for _, tail, _ in calls if len(tail) >= len(ids)]
            assert len(whole) == 1, f"tier {tier}: the prompt crossed {len(whole)} times"
            previous = None
            for _, tail, context in calls:
                assert len(tail) == _new_tokens(previous, context), f"tier {tier} was sent tokens it had"
                previous = context
            crossed, contexts = sum(len(t) for _, t, _ in calls), sum(len(c) for _, _, c in calls)
            # the whole contexts were ~170-210 ints a call; sent as deltas, the prompt once and a few ints a call after it
            assert crossed < len(ids) + 12 * len(calls) and crossed * 5 < contexts, (tier, crossed, contexts)
        assert stats["context_resends"] == 0
        assert all(t["contexts"] == {"refused": 0, "resent": 0} for t in stats["tiers"])
        # a finished request's records go on both sides (the releases below the target are fire and forget)
        assert len(chain._sent_target) == 0
        assert _wait_until(lambda: all(len(w.contexts) == 0 for w in workers))
        assert all(len(w.lower.sent) == 0 for w in workers[:-1])


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_a_callee_that_lost_its_contexts_is_sent_them_whole_and_says_the_same(tiny_family, expected, pipeline):
    """Every worker forgets what it was sent mid-request (as a restart would): the next calls name bases
    nobody keeps, are refused, and go again with whole contexts; the greedy text is the target's own."""
    ids, target_tokens = expected
    with three_tier_chain(tiny_family, pipeline) as (chain, workers, received):
        state = chain.start(ids, MAX_NEW, GREEDY)
        for _ in range(3):
            chain.step(state)
        assert not state.done
        calls_before = [len(calls) for calls in received]
        for worker in workers:
            worker.contexts.clear()
        while not state.done:
            chain.step(state)
        assert chain.finish(state).token_ids == target_tokens
        stats = chain.runtime_stats()
        assert stats["context_resends"] == 1  # the driver's next round, once
        target, mid, _ = stats["tiers"]
        assert target["contexts"]["refused"] >= 1 and mid["contexts"]["refused"] >= 1
        assert target["contexts"]["resent"] >= 1  # the target's next DraftBatch to mid
        for tier, (calls, before) in enumerate(zip(received, calls_before)):
            after = [len(tail) for _, tail, _ in calls[before:]]
            assert sum(n >= len(ids) for n in after) >= 1, f"tier {tier} was sent its context whole again"
