"""One choice of an answer (OpenAI's `n`, gRPC's `n`), cut at the first stop string: both APIs use it.

A choice is one request's work on the round thread. Its text is matched against the stop
strings as it streams (`StopMatcher`): the text shown ends before the first stop string, the
request is cancelled there (the rest is not wanted), deltas of rounds committed before that
cancel was seen are dropped, and the choice finishes as "stop".
"""

from __future__ import annotations

from polyspec.orchestrator.serving.request_loop import Work
from polyspec.orchestrator.tokenization import StopMatcher

FINISH_STOP = "stop"


class Choice:
    """One choice's work and stop matcher, and what has been shown of it so far."""

    def __init__(self, work: Work, stops: tuple[str, ...], scheduler) -> None:
        self.work, self.scheduler = work, scheduler  # scheduler: the RoundScheduler the work was submitted to
        self.matcher = StopMatcher(stops)
        self.token_ids: list[int] = []  # up to the round that completed a stop string
        self.text = ""  # shown so far
        self.finish_reason: str | None = None  # once done: "stop" when a stop string cut it, else the engine's reason
        self.finished = False  # done, or failed

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def delta(self, token_ids: list[int], text: str) -> str | None:
        """A round's tokens and text -> the text to show; None for a round committed after the stop."""
        if self.matcher.stopped:
            return None
        self.token_ids += token_ids
        shown = self.matcher.push(text)
        self.text += shown
        if self.matcher.stopped:
            self.cancel()
        return shown

    def done(self, result: dict, tail: str) -> str:
        """The request's result and the text not yet sent -> the last text to show."""
        shown = self.matcher.push(tail) + self.matcher.finish()
        self.text += shown
        self.finish_reason = FINISH_STOP if self.matcher.stopped else result["finish_reason"]
        self.finished = True
        return shown

    def failed(self) -> None:
        self.finished = True

    def cancel(self) -> None:
        self.scheduler.cancel(self.work)  # a no-op for finished work
