"""The server's request loop in process (RoundScheduler over a tiny engine, no gRPC): it drives the
batch runner's ContinuousBatch, the loop `polyspec batch` runs.

- An engine that is not batched (`batching.enabled: false`) takes its requests' rounds in turn:
  several interactive requests hold caches at once, a short one admitted beside a long one ends
  first, and each one's streamed tokens are the target's greedy tokens.
- On such an engine a job item waits (caches kept) while interactive requests run: no round of it
  between an interactive request's first and last rounds; it then completes with its greedy tokens.
- A batched engine: a request cancelled mid-stream ends "cancelled" and frees its cache slot.
"""

from __future__ import annotations

import contextlib
import threading
import time

from family_chains import tier_specs
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.serving.jobs import JobStore
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.request_loop import MAX_ACTIVE, RoundScheduler, Work

WAIT_S = 120


def _engine(tiny_family, batched: bool) -> Engine:
    raw = {"tiers": tier_specs(tiny_family, ["target", "mid", "ngram"]), "speculation": {"lengths": [3, 2]},
           "batching": {"enabled": batched, "max_requests": 4}}
    engine = Engine(parse_config(raw), batched=True)
    engine.scheduler.eos_token_ids = frozenset()  # every request runs to its max_new_tokens
    return engine


def _record_rounds(engine: Engine, on_round=lambda request_id: None) -> list[str]:
    """The request id of every round an engine that takes turns runs (`Engine.step`), in order;
    `on_round(request_id)` before each (on the round thread)."""
    rounds: list[str] = []
    step = engine.step

    def recorded(state):
        on_round(state.request.id)
        rounds.append(state.request.id)
        return step(state)

    engine.step = recorded
    return rounds


class Stream:
    """One interactive request's events, as the round thread reports them."""

    def __init__(self, engine: Engine, raw: dict) -> None:
        self.work = Work(engine.parse_request(raw), on_event=self.on_event)
        self.token_ids: list[int] = []
        self.result: dict | None = None
        self.ended = threading.Event()
        self.on_delta = lambda: None  # called on the round thread after each delta

    def on_event(self, kind: str, payload) -> None:
        if kind == "delta":
            self.token_ids += payload[0]
            self.on_delta()
        else:
            self.result = payload[0] if kind == "done" else {"error": payload}
            self.ended.set()


@contextlib.contextmanager
def _serving(engine: Engine, store: JobStore | None = None):
    loop = RoundScheduler(engine, store, Metrics(), max_queue=64)
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()
        loop.join(30)


def test_an_engine_that_takes_turns_serves_its_requests_together(tiny_family):
    engine = _engine(tiny_family, batched=False)
    raws = [{"id": "long", "prompt_ids": [11, 12, 13, 14], "max_new_tokens": 30},
            {"id": "short", "prompt_ids": [21, 22, 23], "max_new_tokens": 4}]
    alone = {raw["id"]: engine.generate(engine.parse_request(raw))["token_ids"] for raw in raws}
    rounds = _record_rounds(engine)
    streams = [Stream(engine, raw) for raw in raws]
    with _serving(engine) as loop:
        assert not engine.batched and loop.batch.max_requests == MAX_ACTIVE
        loop.submit_all([stream.work for stream in streams])
        for stream in streams:
            assert stream.ended.wait(WAIT_S), "a request did not finish"
    long, short = streams
    # admitted together, the short request took its rounds between the long one's and ended first
    assert rounds[:2] == ["long", "short"] and rounds.count("short") <= len(alone["short"])
    assert rounds.index("long") < len(rounds) - 1 - rounds[::-1].index("short") < len(rounds) - 1 - rounds[::-1].index("long")
    for stream, raw in zip(streams, raws):
        assert stream.result["finish_reason"] == "length"
        assert stream.token_ids == stream.result["token_ids"] == alone[raw["id"]], raw["id"]
    assert not loop.batch.running


def test_a_job_item_waits_while_interactive_requests_run_on_an_engine_that_takes_turns(tiny_family, tmp_path):
    engine = _engine(tiny_family, batched=False)
    items = [{"id": f"job{i}", "prompt_ids": [31 + i, 32, 33], "max_new_tokens": 24} for i in range(2)]
    interactive = {"id": "chat", "prompt_ids": [41, 42, 43], "max_new_tokens": 8}
    alone = {raw["id"]: engine.generate(engine.parse_request(raw))["token_ids"] for raw in items + [interactive]}
    store = JobStore(tmp_path / "state")
    job = store.create([(raw["id"], raw, None) for raw in items])
    stream = Stream(engine, interactive)
    submitted = []

    def arrive(request_id: str) -> None:  # the interactive request arrives while the first job item is under way
        if request_id == "job0" and not submitted:
            submitted.append(request_id)
            loop.submit_all([stream.work])

    rounds = _record_rounds(engine, arrive)
    with _serving(engine, store) as loop:
        assert stream.ended.wait(WAIT_S), "the interactive request did not finish"
        deadline = time.monotonic() + WAIT_S
        while not store.get(job.job_id).finished:
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.05)
    first, last = rounds.index("chat"), len(rounds) - 1 - rounds[::-1].index("chat")
    assert rounds[first : last + 1] == ["chat"] * (last - first + 1), "a job item took a round beside an interactive request"
    assert last < len(rounds) - 1, "the job item went on after the interactive request"
    assert stream.token_ids == alone["chat"]
    results = {item.id: item for _, item in store.results_after(job.job_id, -1)}
    store.close()
    for raw in items:
        assert results[raw["id"]].error in ("", None) and results[raw["id"]].result["token_ids"] == alone[raw["id"]]


def test_a_cancelled_request_ends_cancelled_and_frees_its_slot(tiny_family):
    engine = _engine(tiny_family, batched=True)
    stream = Stream(engine, {"id": "c", "prompt_ids": [11, 12, 13], "max_new_tokens": 400})
    with _serving(engine) as loop:
        assert engine.batched and loop.batch.max_requests == engine.max_requests
        stream.on_delta = lambda: loop.cancel(stream.work)  # the client goes away at its first tokens
        loop.submit_all([stream.work])
        assert stream.ended.wait(WAIT_S), "the cancelled request never ended"
        assert stream.result["finish_reason"] == "cancelled" and stream.result["token_ids"] == stream.token_ids
        assert 0 < len(stream.token_ids) < 40
        deadline = time.monotonic() + WAIT_S
        while loop.queue_depth() != (0, 0):  # the loop retires it just after reporting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not loop.batch.running
        assert not any(t.cache.slot_of for t in engine.scheduler.tiers if hasattr(t, "cache")), "the slot is freed"
