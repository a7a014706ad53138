"""The one request loop's core (batch_runner.ContinuousBatch) over a fake engine that is not batched:
no model, microseconds.

- Rounds are taken in turn (`Engine.step`, one request after the other, in admission order); a
  distributed chain's (`concurrent_steps`) are in flight at once, on the batch's own threads.
- A request whose round raises fails alone and leaves the running set with its caches freed; when
  every request of a step of several fails, the fault is the chain's (`shared_fault`).
- `step(states)` steps only those (the others keep their caches and wait); `cancel` frees one now;
  no more requests are admitted than a decoder with fixed cache slots (the device round) holds.
- A step reports through callbacks: deltas carry only the new text, and the token that completes a
  stop string ends the request there (finish_reason "stop", its text and tokens cut).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from polyspec.orchestrator.batch_runner import ContinuousBatch, run_requests


@dataclasses.dataclass(eq=False)
class State:
    request: str
    left: int  # rounds until done
    done: bool = False
    new_tokens: list = dataclasses.field(default_factory=list)
    text: object = None  # its TextStream (set by the batch)


class TurnsEngine:
    """An engine that is not batched: each round commits one token; a request named "bad*" raises."""

    batched = False
    max_requests = 1

    def __init__(self, concurrent: bool = False) -> None:
        self.scheduler = type("Chain", (), {"concurrent_steps": concurrent})()
        self.rounds: list[tuple[str, str]] = []  # (request, thread name)
        self.cancelled: list[str] = []
        self.in_flight, self.most_in_flight = 0, 0
        self._lock = threading.Lock()
        self._together = threading.Barrier(2, timeout=10)  # concurrent: two rounds must be in flight at once

    def start(self, request: str) -> State:
        return State(request, left=3)

    def step(self, state: State) -> list[int]:
        with self._lock:
            self.rounds.append((state.request, threading.current_thread().name))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.scheduler.concurrent_steps and len(self.rounds) <= 2:
            self._together.wait()
        with self._lock:
            self.in_flight -= 1
        if state.request.startswith("bad"):
            raise RuntimeError(f"{state.request}'s own fault")
        state.left -= 1
        state.done = state.left == 0
        state.new_tokens.append(len(self.rounds))
        return [len(self.rounds)]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def finish(self, state: State) -> dict:
        return {"id": state.request}

    def cancel(self, state: State) -> dict:
        self.cancelled.append(state.request)
        return {"id": state.request, "finish_reason": "cancelled"}


def test_rounds_are_taken_in_turn_and_a_bad_request_fails_alone():
    engine = TurnsEngine()
    finished, errors = [], []
    batch = ContinuousBatch(engine, 3, on_result=lambda state, result: finished.append(state),
                            on_error=lambda state, exc, shared: errors.append((state.request, shared)))
    a, bad, b = (batch.admit(name) for name in ("a", "bad", "b"))
    outcome = batch.step()
    assert [name for name, _ in engine.rounds] == ["a", "bad", "b"]
    assert {s.request for s, _ in outcome.advanced} == {"a", "b"} and [s.request for s, _ in outcome.failed] == ["bad"]
    assert not outcome.shared_fault and outcome.step == {} and errors == [("bad", False)]
    assert batch.running == [a, b] and engine.cancelled == ["bad"]  # its caches freed
    batch.step([b])  # only b: a waits, caches kept
    assert (a.left, b.left) == (2, 1)
    assert batch.cancel(a)["finish_reason"] == "cancelled" and batch.running == [b]
    while not b.done:
        batch.step()
    assert finished == [b] and batch.running == [] and batch.room == 3  # reported once done, out of the running set


def test_when_every_request_of_a_step_fails_the_fault_is_shared():
    engine = TurnsEngine()
    errors = []
    batch = ContinuousBatch(engine, 2, on_error=lambda state, exc, shared: errors.append(shared))
    batch.admit("bad1"), batch.admit("bad2")
    outcome = batch.step()
    assert len(outcome.failed) == 2 and outcome.shared_fault and not batch.running and errors == [True, True]


def test_a_distributed_chains_rounds_are_in_flight_at_once():
    engine = TurnsEngine(concurrent=True)
    results, errors = [], []
    run_requests(engine, ["a", "b", "bad"], results.append, max_requests=3, on_error=lambda request, exc: errors.append(request))
    assert sorted(r["id"] for r in results) == ["a", "b"] and errors == ["bad"]
    assert engine.most_in_flight >= 2 and all(name.startswith("polyspec-round") for _, name in engine.rounds)


def test_without_on_error_a_failed_round_stops_the_run_and_frees_every_request():
    engine = TurnsEngine()
    with pytest.raises(RuntimeError, match="bad's own fault"):
        run_requests(engine, ["a", "bad", "b"], lambda result: None, max_requests=3)
    assert sorted(engine.cancelled) == ["a", "b", "bad"]


def test_deltas_carry_only_the_new_text_and_a_stop_string_ends_the_request_there():
    engine = TurnsEngine()  # round n commits token n, shown as the n-th letter: b, c, d, ...
    deltas, results = [], []
    run_requests(engine, ["a", "b"], results.append, max_requests=2, stream=True,
                 on_delta=lambda request, tokens, text: deltas.append((request, tokens, text)))
    assert deltas[:2] == [("a", [1], "b"), ("b", [2], "c")]
    assert {r["id"]: r["text"] for r in results} == {"a": "bdf", "b": "ceg"}
    engine, results = TurnsEngine(), []
    run_requests(engine, ["a"], results.append, stops=("c",))  # the second round's token is "c"
    assert results == [{"id": "a", "text": "b", "token_ids": [1, 2], "finish_reason": "stop"}]
    assert engine.cancelled == ["a"] and len(engine.rounds) == 2  # no round past the stop
