"""Continuous batching over an Engine: the one request loop. Many requests in, results out as each finishes.

    while requests wait or run:
        admit waiting requests while fewer than `max_requests` run (they hold cache slots)
        prefill joining requests' prompts within the step's token budget (chunked prefill)
        one batched round of every running request whose prompt is cached (`Engine.step_all`)
        report each request's new tokens and text (`on_delta`), then its result once done
        (`on_result`), freeing its slot for the next ones

Every caller drives it: `Engine.generate` (a batch of one: `polyspec generate` and `chat`, the
harness), `polyspec batch` and the load benchmarks through `run_requests`; the server's request
loop (polyspec.orchestrator.serving.request_loop: `serve` and jobs) drives a `ContinuousBatch`
itself, choosing what to admit (interactive requests, job items) and what to cancel. Streaming
and stop strings are a request's `TextStream` (polyspec.orchestrator.tokenization): the text
each round adds, and the token that completes a stop string ends the request there. An engine
that is not batched takes its requests' rounds in turn (`Engine.step`, one request after the
other; a distributed chain's rounds in flight at once: `concurrent_steps`), so a long request
holds the others back by one round per step, never by the whole request.

Failure isolation (`step_isolated`): a step is one forward per tier for every running
request, so an exception raised for one request's row would fail all of them. When a
batched step raises, every request's random streams are put back where they were before
the step and each request retries the round alone: the one whose row raises fails by itself,
the others take the round they would have taken (the model tiers roll their caches back to
the committed context at their next call, so the failed forward leaves nothing behind). A
chain that is down (`is_unavailable`) fails the step for all of them, as before; so does a
fault that every request meets alone too (`shared_fault`: the chain's, not a request's).
Rounds taken in turn are isolated by construction: each request's round is its own call.
"""

from __future__ import annotations

import collections
import dataclasses
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from polyspec.orchestrator.decode.contract import FINISH_STOP
from polyspec.orchestrator.tokenization import TextStream
from polyspec.workers.core.sampling import RandomStream


def is_unavailable(exc: BaseException) -> bool:
    """A tier (or its actor) is gone and no valid chain is left: UNAVAILABLE, not INTERNAL."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"TierUnavailableError", "ChainUnavailableError", "RayActorError", "ActorDiedError"})


@dataclasses.dataclass
class StepOutcome:
    """What one step did: the states that took the round (with their new tokens), and those that failed alone."""

    advanced: list[tuple[Any, list[int]]]  # (state, tokens committed this round); includes states that ended
    failed: list[tuple[Any, Exception]]  # (state, the exception its own row raised); its caches are not freed yet
    # every request of a step of several failed alone too: the fault is the chain's (a tier's shared state),
    # not a request's; a caller keeps work it can redo (job items) for later instead of failing it
    shared_fault: bool = False
    step: dict = dataclasses.field(default_factory=dict)  # a batched step's `last_step` (batch, tokens, seconds, tiers), else {}


def _random_streams(states: list) -> list[list]:
    """Each state's random streams (a decoder that samples in this process keeps them on its run):
    the generators' states, and the device draws' counters where they have them (RandomStream)."""
    return [[g.snapshot() if isinstance(g, RandomStream) else g.get_state() for g in getattr(state.run, "generators", ())]
            for state in states]


def _restore_random_streams(states: list, saved: list[list]) -> None:
    for state, streams in zip(states, saved):
        for generator, stream in zip(getattr(state.run, "generators", ()), streams):
            if isinstance(generator, RandomStream):
                generator.restore(stream)
            else:
                generator.set_state(stream)


def _step(engine, states: list) -> list[tuple[Any, list[int]]]:
    """Prefill joining requests, then one batched round of every state whose prompt is cached."""
    scheduler = engine.scheduler  # a batched engine's decoder is a BatchDecoder
    scheduler.prefill(states)
    ready = [s for s in states if s.done or scheduler.ready(s)]
    emitted = engine.step_all(ready) if ready else []
    return list(zip(ready, emitted))


def _take_turns(engine, states: list, pool: Executor | None) -> StepOutcome:
    """One round of each state in turn (`Engine.step`; with `pool`, all in flight at once); each fails alone."""
    def one_round(state) -> tuple[Any, list[int] | None, Exception | None]:
        try:
            return state, engine.step(state) if not state.done else [], None
        except Exception as exc:  # noqa: BLE001 - this request's own round
            return state, None, exc

    rounds = list(pool.map(one_round, states)) if pool is not None else [one_round(state) for state in states]
    advanced = [(state, tokens) for state, tokens, exc in rounds if exc is None]
    failed = [(state, exc) for state, _, exc in rounds if exc is not None]
    return StepOutcome(advanced, failed, shared_fault=len(states) > 1 and not advanced)


def step_isolated(engine, states: list, pool: Executor | None = None) -> StepOutcome:
    """One step of `states` (see the module docstring): an error raised for one request fails that request alone.
    An engine that is not batched takes the states' rounds in turn (`pool`: threads to run them at once)."""
    if not states:
        return StepOutcome([], [])
    if not engine.batched:
        return _take_turns(engine, states, pool if len(states) > 1 else None)
    saved = _random_streams(states) if len(states) > 1 else []
    try:
        return StepOutcome(_step(engine, states), [], step=dict(engine.scheduler.last_step))
    except Exception as exc:  # noqa: BLE001 - sorted out below, request by request
        if len(states) == 1 or is_unavailable(exc):
            return StepOutcome([], [(state, exc) for state in states])
    _restore_random_streams(states, saved)
    advanced, failed = [], []
    for state in states:
        try:
            advanced += _step(engine, [state])
        except Exception as exc:  # noqa: BLE001 - this request's own fault
            failed.append((state, exc))
    return StepOutcome(advanced, failed, shared_fault=not advanced, step=dict(engine.scheduler.last_step) if advanced else {})


class ContinuousBatch:
    """The running set of one engine: admit, step, then finish or cancel each request.

    A step reports through the callbacks given here, request by request, on the caller's thread:
    `on_delta(state, tokens, text)` after each round that committed tokens (`text`: the new text,
    for a request admitted with `stream` or `stops`, else ""), then `on_result(state, result)` once
    it is done (its caches freed; a stop string ends it as "stop", cut there: `TextStream`), or
    `on_error(state, exc, shared)` when its own row raised (`shared`: every request of the step
    failed alone too, see `StepOutcome.shared_fault`). Without `on_error` the error is raised.

    `max_requests`: how many requests hold caches at once (default: the engine's). A batched engine
    steps them all in one round; one that is not batched takes their rounds in turn, so a caller may
    let more of them hold caches than one forward carries (the server does)."""

    def __init__(self, engine, max_requests: int | None = None, on_delta: Callable[[Any, list[int], str], None] | None = None,
                 on_result: Callable[[Any, dict], None] | None = None,
                 on_error: Callable[[Any, Exception, bool], None] | None = None) -> None:
        self.engine = engine
        self.max_requests = max_requests or engine.max_requests
        self.on_delta, self.on_result, self.on_error = on_delta, on_result, on_error
        self.running: list[Any] = []  # RequestState, admission order
        self._pool: Executor | None = None  # a distributed chain's rounds in flight at once (`concurrent_steps`)

    def admit(self, request, stops: tuple[str, ...] = (), stream: bool = False) -> Any:
        """Start `request` (its caches are taken at its first step); raises for a request the engine refuses.
        `stops`: stop strings that end it; `stream`: report its text as it is committed."""
        state = self.engine.start(request)
        state.text = TextStream(self.engine.decode, stops) if stops or stream else None
        self.running.append(state)
        return state

    @property
    def room(self) -> int:
        return max(0, self.max_requests - len(self.running))

    def step(self, states: list | None = None) -> StepOutcome:
        """Prefill joining requests, then one round (`step_isolated`) of `states` (default: every running
        request; the others wait, caches kept), reported through the callbacks. A request that failed or
        ended leaves the running set, its caches freed."""
        stepping = list(self.running if states is None else states)
        outcome = step_isolated(self.engine, stepping, self._concurrent_pool() if len(stepping) > 1 else None)
        for state, exc in outcome.failed:
            self.drop(state)
            self._fail(state, exc, outcome.shared_fault)
        for state, tokens in outcome.advanced:
            try:
                self._report(state, tokens)
            except Exception as exc:  # noqa: BLE001 - this request's own fault (its result, its callback)
                self.drop(state)
                self._fail(state, exc, False)
        return outcome

    def _report(self, state, tokens: list[int]) -> None:
        """`on_delta` for a round's tokens; `on_result` once the request is done, or a stop string ended it."""
        stream = state.text
        text = stream.push(tokens, final=state.done) if stream is not None and (tokens or state.done) else ""
        if stream is not None and stream.stopped:
            tokens = tokens[: len(tokens) - (len(state.new_tokens) - len(stream.token_ids))]
        if (tokens or text) and self.on_delta is not None:
            self.on_delta(state, tokens, text)
        if not state.done and not (stream is not None and stream.stopped):
            return
        self.running.remove(state)
        result = self.engine.finish(state) if state.done else self.engine.cancel(state)
        if stream is not None:
            result.update(text=stream.text, token_ids=list(stream.token_ids))
            if stream.stopped:
                result["finish_reason"] = FINISH_STOP
        if self.on_result is not None:
            self.on_result(state, result)

    def _fail(self, state, exc: Exception, shared: bool) -> None:
        if self.on_error is None:
            raise exc
        self.on_error(state, exc, shared)

    def _concurrent_pool(self) -> Executor | None:
        if self.engine.batched or not self.engine.scheduler.concurrent_steps:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_requests, thread_name_prefix="polyspec-round")
        return self._pool

    def cancel(self, state) -> dict:
        """Stop `state` now and free its caches; its result (finish_reason "cancelled" unless it was done)."""
        if state in self.running:
            self.running.remove(state)
        return self.engine.cancel(state)

    def drop(self, state) -> None:
        """Free the caches of a request that is failing (its own error is the one to report, not this one's)."""
        try:
            self.cancel(state)
        except Exception:  # noqa: BLE001 - already failing
            pass

    def cancel_all(self) -> None:
        for state in self.running:
            self.engine.cancel(state)
        self.running = []

    def close(self) -> None:
        """Stop the threads of concurrent rounds, if any were started."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def run_requests(engine, requests: Iterable, on_result: Callable[[dict], None], max_requests: int | None = None,
                 on_error: Callable[[Any, Exception], None] | None = None,
                 on_delta: Callable[[Any, list[int], str], None] | None = None,
                 stops: tuple[str, ...] = (), stream: bool = False) -> None:
    """Generate every request (GenerationRequest) with continuous batching; `on_result(result)` as each finishes,
    `on_delta(request, tokens, text)` after each of its rounds (`text`: with `stream` or `stops`, its new text).
    `stops`: stop strings that end each request (finish_reason "stop"; text and token_ids cut there).
    A request whose own row raises goes to `on_error(request, exc)` and the others carry on; without
    `on_error` its exception stops the run (every other request's caches freed)."""
    batch = ContinuousBatch(
        engine, max_requests,
        on_delta=None if on_delta is None else lambda state, tokens, text: on_delta(state.request, tokens, text),
        on_result=lambda state, result: on_result(result),
        on_error=None if on_error is None else lambda state, exc, shared: on_error(state.request, exc))
    waiting = collections.deque(requests)
    try:
        while waiting or batch.running:
            while waiting and batch.room:
                request = waiting.popleft()
                try:
                    batch.admit(request, stops, stream)
                except Exception as exc:  # noqa: BLE001 - this request's own fault
                    if on_error is None:
                        raise
                    on_error(request, exc)
            batch.step()
    except BaseException:
        batch.cancel_all()
        raise
    finally:
        batch.close()
