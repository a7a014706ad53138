"""The per-choice stop handler both APIs share (serving/choices.py): text cut before the first stop
string (one split across rounds included), the request cancelled there once, rounds committed after
it dropped, and the finish reason "stop"; without a stop, the engine's reason and all the text."""

from __future__ import annotations

from polyspec.orchestrator.serving.choices import Choice
from polyspec.orchestrator.serving.request_loop import Work


class Scheduler:
    def __init__(self) -> None:
        self.cancelled: list[Work] = []

    def cancel(self, work: Work) -> None:
        self.cancelled.append(work)


def test_a_stop_string_split_across_rounds_cuts_the_text_and_cancels_once():
    scheduler, work = Scheduler(), Work(None)
    choice = Choice(work, ("\n\n",), scheduler)
    assert choice.delta([1, 2], "def f") == "def f"
    assert choice.delta([3], "():\n") == "():"  # the "\n" could start the stop string: held back
    assert not choice.stopped and not scheduler.cancelled
    assert choice.delta([4, 5], "\n    x") == "" and choice.stopped
    assert scheduler.cancelled == [work]
    assert choice.delta([6], "more") is None  # a round committed before the cancel was seen
    assert choice.done({"finish_reason": "cancelled"}, "tail") == ""
    assert (choice.text, choice.token_ids, choice.finish_reason, choice.finished) == ("def f():", [1, 2, 3, 4, 5], "stop", True)
    assert scheduler.cancelled == [work]


def test_without_a_stop_the_choice_keeps_all_its_text_and_the_engines_reason():
    scheduler = Scheduler()
    choice = Choice(Work(None), ("END",), scheduler)
    assert choice.delta([1], "abcE") == "abc"
    assert choice.done({"finish_reason": "length"}, "N") == "EN"  # what was held back, now that no more comes
    assert (choice.text, choice.finish_reason, scheduler.cancelled) == ("abcEN", "length", [])
    failing = Choice(Work(None), (), scheduler)
    failing.failed()
    assert failing.finished and failing.finish_reason is None
