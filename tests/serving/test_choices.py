"""One choice of an answer (serving/request_loop.py's Choice), both APIs': it gathers its request's deltas (the round
thread's batch has cut them at the first stop string already) and the result's finish_reason;
"stop" marks a choice a stop string ended."""

from __future__ import annotations

from polyspec.orchestrator.serving.request_loop import Choice, Work


class Scheduler:
    def __init__(self) -> None:
        self.cancelled: list[Work] = []

    def cancel(self, work: Work) -> None:
        self.cancelled.append(work)


def test_a_choice_gathers_its_deltas_and_its_finish_reason():
    scheduler, work = Scheduler(), Work(None, stops=("\n\n",))
    choice = Choice(work, scheduler)
    assert choice.delta([1, 2], "def f") == "def f" and choice.delta([3, 4], "():") == "():"
    choice.done({"finish_reason": "stop"})
    assert (choice.text, choice.token_ids, choice.finish_reason, choice.finished, choice.stopped) == ("def f():", [1, 2, 3, 4], "stop", True, True)
    assert scheduler.cancelled == []  # the batch ended it: nothing to cancel
    other = Choice(Work(None), scheduler)
    other.done({"finish_reason": "length"})
    assert not other.stopped and other.finish_reason == "length"


def test_a_failed_or_abandoned_choice():
    scheduler = Scheduler()
    failing = Choice(Work(None), scheduler)
    failing.failed()
    assert failing.finished and failing.finish_reason is None
    left = Choice(Work(None), scheduler)
    left.cancel()  # the client went away
    assert scheduler.cancelled == [left.work]
