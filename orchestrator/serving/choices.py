"""One choice of an answer (OpenAI's `n`, gRPC's `n`): both APIs use it.

A choice is one request's work on the round thread, its stop strings given with it: the round
thread's batch cuts its text and tokens at the first stop string (`TextStream`) and ends it
there as "stop". A choice gathers what its events show: the deltas' tokens and text, then the
result's finish_reason.
"""

from __future__ import annotations

from polyspec.orchestrator.decode.contract import FINISH_STOP
from polyspec.orchestrator.serving.request_loop import Work


class Choice:
    """One choice's work, and what has been shown of it so far."""

    def __init__(self, work: Work, scheduler, index: int = 0) -> None:
        self.work, self.scheduler = work, scheduler  # scheduler: the RoundScheduler the work was submitted to
        self.index = index  # its place among the answer's choices
        self.token_ids: list[int] = []  # up to the token that completed a stop string
        self.text = ""  # shown so far
        self.finish_reason: str | None = None  # once done: "stop" when a stop string cut it, else the engine's reason
        self.finished = False  # done, or failed
        self.plans: list[dict] | None = None  # once done, with `lengths: auto`: the planner's plans (stats.plans)

    @property
    def stopped(self) -> bool:
        return self.finish_reason == FINISH_STOP

    def delta(self, token_ids: list[int], text: str) -> str:
        """A round's tokens and new text -> the text to show."""
        self.token_ids += token_ids
        self.text += text
        return text

    def done(self, result: dict) -> None:
        self.finish_reason = result["finish_reason"]
        self.plans = (result.get("stats") or {}).get("plans")
        self.finished = True

    def failed(self) -> None:
        self.finished = True

    def cancel(self) -> None:
        self.scheduler.cancel(self.work)  # a no-op for finished work
