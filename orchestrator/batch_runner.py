"""Continuous batching over an Engine: many requests in, results out as each finishes.

    while requests wait or run:
        admit waiting requests while fewer than `max_requests` run (they hold cache slots)
        prefill joining requests' prompts within the step's token budget (chunked prefill)
        one batched round of every running request whose prompt is cached (`Engine.step_all`)
        hand finished requests to `on_result`, freeing their slots for the next ones

`polyspec batch` and the load benchmark go through `run_requests`; the server's request
loop drives a `ContinuousBatch` itself (interactive requests and job items share it).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable


class ContinuousBatch:
    """The running set of one engine: admit, step, finish."""

    def __init__(self, engine, max_requests: int | None = None) -> None:
        self.engine = engine
        self.max_requests = max_requests or getattr(engine, "max_requests", 1) or 1
        self.running: list[Any] = []  # RequestState, admission order

    def admit(self, request) -> Any:
        state = self.engine.start(request)
        self.running.append(state)
        return state

    @property
    def room(self) -> int:
        return max(0, self.max_requests - len(self.running))

    def step(self) -> list[tuple[Any, list[int]]]:
        """Prefill joining requests, then one batched round; (state, new tokens) for each state that advanced or ended."""
        scheduler = self.engine.scheduler
        ready = self.running
        if hasattr(scheduler, "prefill"):
            scheduler.prefill(self.running)
            ready = [s for s in self.running if scheduler.ready(s) or s.done]
        emitted = self.engine.step_all(ready) if ready else []
        return list(zip(ready, emitted))

    def pop_finished(self) -> list[Any]:
        finished = [s for s in self.running if s.done]
        self.running = [s for s in self.running if not s.done]
        return finished

    def cancel_all(self) -> None:
        for state in self.running:
            self.engine.cancel(state)
        self.running = []


def run_requests(engine, requests: Iterable, on_result: Callable[[dict], None],
                 on_tokens: Callable[[Any, list[int]], None] | None = None, max_requests: int | None = None) -> None:
    """Generate every request (GenerationRequest) with continuous batching; `on_result(result)` as each finishes."""
    batch = ContinuousBatch(engine, max_requests)
    waiting = collections.deque(requests)
    try:
        while waiting or batch.running:
            while waiting and batch.room:
                batch.admit(waiting.popleft())
            for state, tokens in batch.step():
                if tokens and on_tokens is not None:
                    on_tokens(state, tokens)
            for state in batch.pop_finished():
                on_result(engine.finish(state))
    except BaseException:
        batch.cancel_all()
        raise
