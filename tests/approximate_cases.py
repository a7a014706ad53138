"""The approximate modes' settings that make both writers write (shared by the tests that compare a mode's text
across tiers: ragged and device tiers, embedded and Ray)."""

from __future__ import annotations

CASES = ("bild", "reflective", "specreason-keep", "specreason-rewrite", "speculative-thinking")


def reflection_point(text: str) -> tuple[str, str]:
    """(a delimiter character, a word after it) inside `text`, the small model's own: a reflection point it will write."""
    point = next(i for i in range(1, len(text) - 2) if text[i].isalnum() and not text[i + 1].isalnum() and not text[i - 1].isalnum())
    return text[point - 1], text[point]


def settings(case: str, small_text: str) -> dict:
    """The request's `approximate` field for `case`: SpecReason keeping every step and rewriting every one (steps split
    at a character of the small model's text), Speculative Thinking taking over at a reflection point in it."""
    delimiter, word = reflection_point(small_text)
    return {
        "bild": {"mode": "bild", "fallback_threshold": 0.4, "rollback_threshold": 2.0},
        "reflective": {"mode": "reflective", "reflective_weight": 0.5},
        "specreason-keep": {"mode": "specreason", "score_threshold": 0, "step_delimiter": delimiter},
        "specreason-rewrite": {"mode": "specreason", "score_threshold": 9, "step_delimiter": delimiter},
        "speculative-thinking": {"mode": "speculative-thinking", "step_delimiter": delimiter, "trigger_words": [word],
                                 "takeover_tokens": 4},
    }[case]


def check_both_writers(case: str, counts: dict) -> None:
    """The step modes' counts show the case did what it is for (steps kept, steps rewritten, a takeover)."""
    if case == "specreason-keep":
        assert counts["steps_scored"] >= 2 and counts["small_tokens"] > 0
    if case == "specreason-rewrite":
        assert counts["steps_accepted"] == 0 and counts["large_tokens"] > 0
    if case == "speculative-thinking":
        assert counts["takeovers"] >= 1 and counts["small_tokens"] > 0 and counts["large_tokens"] >= 4
