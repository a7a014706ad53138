"""The approximate decoding modes' config object (`approximate:` in a chain config, or a request's
`approximate` field): which mode, and its knobs, validated. Torch-free, so a config is checked
before torch loads; the rules themselves are polyspec.workers.core.approximate."""

from __future__ import annotations

import dataclasses
import math

from polyspec.workers.core.errors import ConfigError

EXACT = "exact"
BILD = "bild"
SPECREASON = "specreason"
SPECULATIVE_THINKING = "speculative-thinking"
REFLECTIVE = "reflective"
MODES = (EXACT, BILD, SPECREASON, SPECULATIVE_THINKING, REFLECTIVE)

# SpecReason asks the base model for a utility score on a fixed 0..9 scale (one token)
MIN_UTILITY_SCORE, MAX_UTILITY_SCORE = 0, 9
# Speculative Thinking's triggers: reflection ("wait", "hmm", "but", "alternatively"),
# affirmation ("yes", "yeah") and verification ("let me verify", "double-check") words that
# open a paragraph. Matched case-insensitively as whole words right after the delimiter.
DEFAULT_TRIGGER_WORDS = ("wait", "but", "hmm", "alternatively", "yes", "yeah", "let me verify",
                         "let me double-check", "double-check")
PARAGRAPH_DELIMITER = "\n\n"
# Reflective Verification's probing prompt: placed after the draft block, followed by the
# draft block again, so the verifier re-reads the draft "after reflecting". polyspec's
# wording; the paper's exact prompt is not in the seed.
DEFAULT_PROBE_PROMPT = "\n\nCheck the text above for mistakes and write it again, corrected:\n"


class ApproximateModeError(ConfigError, ValueError):
    """A mistake in an approximate mode's config: one line naming the key."""


# ---------------------------------------------------------------------------------
# The config object
# ---------------------------------------------------------------------------------

# mode -> the knobs it reads; a knob given for another mode is a mistake, not ignored
MODE_KEYS = {
    EXACT: (),
    BILD: ("fallback_threshold", "rollback_threshold"),
    SPECREASON: ("score_threshold", "step_delimiter", "max_step_tokens"),
    SPECULATIVE_THINKING: ("trigger_words", "step_delimiter", "takeover_tokens", "reflection_limit"),
    REFLECTIVE: ("reflective_weight", "probe_prompt"),
}


@dataclasses.dataclass(frozen=True)
class ApproximateMode:
    """Which decoding mode a request runs and its knobs. `exact` (the default) is the lossless
    chain; every other mode must be named. docs/approximate.md tables each mode's knobs: range,
    default and what moving it does; `__post_init__` checks the ranges."""

    mode: str = EXACT
    fallback_threshold: float = 0.5
    rollback_threshold: float = 2.0
    score_threshold: float = 7.0
    step_delimiter: str = PARAGRAPH_DELIMITER
    max_step_tokens: int = 64
    trigger_words: tuple[str, ...] = DEFAULT_TRIGGER_WORDS
    takeover_tokens: int = 32
    reflection_limit: int = 0
    reflective_weight: float = 0.5
    probe_prompt: str = DEFAULT_PROBE_PROMPT

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in MODES:
            _fail("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        _check_number("fallback_threshold", self.fallback_threshold, 0.0, 1.0)
        _check_number("rollback_threshold", self.rollback_threshold, 0.0, math.inf)
        _check_number("score_threshold", self.score_threshold, MIN_UTILITY_SCORE, MAX_UTILITY_SCORE)
        _check_text("step_delimiter", self.step_delimiter)
        _check_integer("max_step_tokens", self.max_step_tokens, 0)
        if isinstance(self.trigger_words, str) or not isinstance(self.trigger_words, (tuple, list)) or not self.trigger_words:
            _fail("trigger_words", f"must be a non-empty list of words, got {self.trigger_words!r}")
        for word in self.trigger_words:
            if not isinstance(word, str) or not word.strip():
                _fail("trigger_words", f"must hold non-empty strings, got {word!r}")
        object.__setattr__(self, "trigger_words", tuple(self.trigger_words))
        _check_integer("takeover_tokens", self.takeover_tokens, 1)
        _check_integer("reflection_limit", self.reflection_limit, 0)
        _check_number("reflective_weight", self.reflective_weight, 0.0, 1.0)
        _check_text("probe_prompt", self.probe_prompt)

    @property
    def lossless(self) -> bool:
        return self.mode == EXACT

    def describe(self) -> dict:
        """The mode and the knobs it reads, nothing else: what a result, its stats and the
        metrics carry to say a request was approximate and how ({"mode": "exact"} otherwise)."""
        knobs = {key: getattr(self, key) for key in MODE_KEYS[self.mode]}
        if "trigger_words" in knobs:
            knobs["trigger_words"] = list(knobs["trigger_words"])
        return {"mode": self.mode, **knobs}

    @classmethod
    def from_mapping(cls, raw: object, section: str = "approximate") -> ApproximateMode:
        """Build from a YAML / JSON mapping such as {mode: bild, fallback_threshold: 0.4}.
        Missing or empty -> exact. Keys of another mode than the one named are mistakes (a
        threshold that would silently do nothing)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ApproximateModeError(f"{section} must be a mapping, got {type(raw).__name__}")
        mode = raw.get("mode", EXACT)
        if not isinstance(mode, str) or mode not in MODES:
            raise ApproximateModeError(f"{section}.mode must be one of {', '.join(MODES)}, got {mode!r}")
        allowed = {"mode", *MODE_KEYS[mode]}
        for key in raw:
            if key not in allowed:
                owners = [name for name, keys in MODE_KEYS.items() if key in keys]
                why = f"applies to mode {' / '.join(owners)}, not {mode}" if owners else "is not a known key"
                raise ApproximateModeError(f"{section}.{key} {why} (keys of mode {mode}: {', '.join(sorted(allowed))})")
        try:
            return cls(**raw)
        except ApproximateModeError as error:
            raise ApproximateModeError(f"{section}.{error}") from None


def _fail(key: str, why: str) -> None:
    raise ApproximateModeError(f"{key} {why}")


def _check_number(key: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:  # also NaN
        _fail(key, f"must be a number in [{low}, {high}], got {value!r}")


def _check_integer(key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(key, f"must be an integer >= {low}, got {value!r}")


def _check_text(key: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        _fail(key, f"must be a non-empty string, got {value!r}")
