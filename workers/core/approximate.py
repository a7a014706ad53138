"""The approximate decoding modes' rules: BiLD, SpecReason, Speculative Thinking, Reflective Verification.

None of these is lossless: each lets polyspec emit text the target would not have written, in
exchange for speed (BiLD, SpecReason, Reflective Verification) or for a better small model
(Speculative Thinking). So a mode is only ever chosen by naming it (`ApproximateMode.mode`,
default "exact"); this module holds the rules themselves, as pure functions (tensors, lists,
strings in; decisions out; no I/O), and the validated config object that selects them.

Terminology (as in polyspec.workers.core.verdicts):
- target / large: the verifying tier (the "large model" of BiLD, the "base model" of
  SpecReason); `target_probs` are its warped float32 rows.
- draft / small: the tier that proposed; `draft_probs` the rows its tokens came from.
- verdict: (num_accepted, next_token), the same shape the lossless rules return, so a round
  can call any of them in the same place.

Sources (the related-systems seed, 001): BiLD (Kim et al., "Speculative Decoding with Big
Little Decoder"), SpecReason (Pan et al.), Speculative Thinking (Yang et al.), Reflective
Verification (Wang et al., "Think Before You Accept"). docs/approximate.md maps each onto
chains of more than two tiers.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from polyspec.workers.core.approximate_mode import (  # noqa: F401 (re-exported: the rules and their config object in one place)
    ApproximateMode,
    ApproximateModeError,
    BILD,
    DEFAULT_PROBE_PROMPT,
    DEFAULT_TRIGGER_WORDS,
    EXACT,
    MAX_UTILITY_SCORE,
    MIN_UTILITY_SCORE,
    MODES,
    MODE_KEYS,
    PARAGRAPH_DELIMITER,
    REFLECTIVE,
    SPECREASON,
    SPECULATIVE_THINKING,
)
from polyspec.workers.core.sampling import SamplingParams, sample
from polyspec.workers.core.tree import Blocks
from polyspec.workers.core.verdicts import ScoredRows, verify_blocks

# ---------------------------------------------------------------------------------
# BiLD: fallback and rollback
# ---------------------------------------------------------------------------------


def bild_rollback_distances(target_probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """BiLD's distance between a drafted token and the large model's prediction at its position:
    the cross-entropy between the small model's hard label and the large model's soft label,
    d = -log p_large(y_small). target_probs: [k, V] (or [k+1, V]; the last row is then unused),
    draft_tokens: [k]. Returns [k] float32 nats; +inf where the large model gives the token 0."""
    _require(target_probs.dim() == 2 and draft_tokens.dim() == 1, "expected target_probs [k, V] and draft_tokens [k]")
    num_drafts = draft_tokens.shape[0]
    _require(target_probs.shape[0] >= num_drafts, f"target_probs has {target_probs.shape[0]} rows, need >= k = {num_drafts}")
    target_at_draft = target_probs[torch.arange(num_drafts), draft_tokens].float()  # [k]
    return -torch.log(target_at_draft)  # log(0) = -inf, so a token the target excludes is +inf


def bild_first_rollback(target_probs: torch.Tensor, draft_tokens: torch.Tensor, rollback_threshold: float) -> int | None:
    """BiLD's rollback policy: the first position m of the block whose distance
    (`bild_rollback_distances`) exceeds alpha_RB, or None when no token is rolled back. The
    tokens at m and after are discarded and the large model's prediction at m replaces them.
    A distance equal to the threshold is kept (strict test)."""
    distances = bild_rollback_distances(target_probs, draft_tokens)  # [k]
    over = distances > rollback_threshold
    return int(over.nonzero()[0, 0]) if bool(over.any()) else None


def bild_verdict(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, rollback_threshold: float, generator: torch.Generator | None,
    greedy: bool,
) -> tuple[int, int]:
    """The large model's verdict on a small model's block under BiLD: keep the tokens before
    the first rollback position, then the large model's own token there (or after the last
    drafted token when nothing is rolled back). target_probs: [k+1, V], draft_tokens: [k].
    greedy: take the large model's argmax; otherwise sample its row with `generator`.
    Returns (num_accepted, next_token) like the lossless rules."""
    _require(target_probs.dim() == 2, "target_probs must be 2-D [k+1, V]")
    _require(target_probs.shape[0] == draft_tokens.shape[0] + 1, f"target_probs has {target_probs.shape[0]} rows, need k+1 = {draft_tokens.shape[0] + 1}")
    rollback_at = bild_first_rollback(target_probs, draft_tokens, rollback_threshold)
    num_accepted = draft_tokens.shape[0] if rollback_at is None else rollback_at
    row = target_probs[num_accepted].float()  # [V]
    next_token = int(row.argmax()) if greedy else sample(row, generator)
    return num_accepted, next_token


# ---------------------------------------------------------------------------------
# SpecReason: steps and their utility scores
# ---------------------------------------------------------------------------------


def find_step_end(text: str, start: int = 0, step_delimiter: str = PARAGRAPH_DELIMITER) -> int | None:
    """The offset just past the first step delimiter at or after `start` (with repeated
    delimiter characters absorbed), or None while the step is unfinished. A delimiter at the
    very end of `text` might still grow ("\\n\\n" then "\\n"), which only lengthens the same step."""
    at = text.find(step_delimiter, start)
    while at == start and at >= 0:  # a leading delimiter belongs to the previous step
        start += len(step_delimiter)
        at = text.find(step_delimiter, start)
    if at < 0:
        return None
    end = at + len(step_delimiter)
    filler = step_delimiter[-1]
    while end < len(text) and text[end] == filler:
        end += 1
    return end


def utility_scoring_prompt(question: str, previous_steps: list[str] | tuple[str, ...], new_step: str) -> str:
    """The prompt that asks the base model for the utility of a speculated step, SpecReason's
    way: the problem, the reasoning so far, the new step, and a request for one integer score
    from 0 (useless or wrong) to 9 (correct and useful), ending where that integer is the next
    token so one forward (or a one-token reply) reads it."""
    so_far = "".join(previous_steps).strip() or "(none yet)"
    return (
        "You are checking a step of someone's reasoning.\n\n"
        f"Problem:\n{question.strip()}\n\n"
        f"Reasoning so far:\n{so_far}\n\n"
        f"New step:\n{new_step.strip()}\n\n"
        f"Rate how correct and useful the new step is for solving the problem, as one integer from "
        f"{MIN_UTILITY_SCORE} (wrong or useless) to {MAX_UTILITY_SCORE} (correct and useful). "
        "Reply with the integer only.\nScore:"
    )


def expected_utility_score(digit_probs: torch.Tensor) -> float | None:
    """SpecReason's score read from one forward instead of a reply: the expected score
    sum_s s * P(s) over the base model's probabilities of the ten digit tokens "0".."9",
    renormalised over those ten. digit_probs: [10]. None when the digits carry no mass
    (the model would not have answered with a score: a parse failure)."""
    _require(tuple(digit_probs.shape) == (MAX_UTILITY_SCORE + 1,), f"digit_probs must be [{MAX_UTILITY_SCORE + 1}]")
    digit_probs = digit_probs.double()
    total = float(digit_probs.sum())
    if not total > 0.0:
        return None
    scores = torch.arange(MAX_UTILITY_SCORE + 1, dtype=torch.float64)
    return float((digit_probs * scores).sum()) / total


def accept_step(score: float | None, score_threshold: float) -> bool:
    """SpecReason's acceptance: keep the small model's step when the base model's utility
    score is at least the threshold; a score that could not be read (None) rejects it."""
    return score is not None and score >= score_threshold


# ---------------------------------------------------------------------------------
# Speculative Thinking: reflection points
# ---------------------------------------------------------------------------------


def find_reflection_point(
    text: str, start: int = 0, trigger_words: tuple[str, ...] = DEFAULT_TRIGGER_WORDS,
    step_delimiter: str = PARAGRAPH_DELIMITER,
) -> int | None:
    """Speculative Thinking's handover point: the first step delimiter (a blank line by
    default) at or after `start` that is followed by a trigger word ("wait", "but", "hmm", ...)
    opening the next paragraph. Returns the offset just past the delimiter (and any spaces
    before the word): the small model's text before it stays, and the large model writes from
    there, the trigger word included. None when there is no complete trigger yet: a word must
    end (a non-letter follows) to count, so "\\n\\nbut" at the end of the text, or "\\n\\nbutter",
    is not one."""
    _require(bool(step_delimiter), "step_delimiter must be non-empty")
    pattern = _trigger_pattern(trigger_words, step_delimiter)
    match = pattern.search(text, start)
    return None if match is None else match.start("word")


def _trigger_pattern(trigger_words: tuple[str, ...], step_delimiter: str) -> re.Pattern[str]:
    _require(bool(trigger_words) and all(w.strip() for w in trigger_words), "trigger_words must be non-empty words")
    # longest first, so "let me verify" wins over a shorter word sharing its start
    words = sorted({w.strip().lower() for w in trigger_words}, key=len, reverse=True)
    alternatives = "|".join(r"\s+".join(map(re.escape, w.split())) for w in words)
    # the word must be followed by a non-letter to be complete (a comma, space, "?" ...)
    return re.compile(rf"{re.escape(step_delimiter)}[ \t]*(?P<word>(?:{alternatives}))(?=[^\w])", re.IGNORECASE)


# ---------------------------------------------------------------------------------
# Reflective Verification: the probe layout and the fused acceptance
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReflectiveLayout:
    """Where one verifier forward over [draft, probe, draft] puts its rows (absolute positions
    of the logits rows, context first). original_rows: k+1 rows, row i predicting draft token i
    (the last one: the bonus row after the draft). reflective_rows: k rows, row i predicting
    draft token i's copy after the probe."""

    original_rows: tuple[int, ...]
    reflective_rows: tuple[int, ...]
    input_length: int  # context + 2k + probe tokens


def reflective_layout(context_length: int, draft_length: int, probe_length: int) -> ReflectiveLayout:
    """Reflective Verification obtains the verifier's distribution and its reflective one in
    one forward: the draft block, then a probing prompt, then the draft block again. A causal
    model's rows over the first copy are unchanged by what follows, so they are the ordinary
    target rows; the rows over the copy are the reflective ones. Only the context and the
    accepted tokens' KV entries may be kept afterwards (the probe and the copy are scaffolding)."""
    _require(context_length >= 1, "the context must hold at least one token (the row before the draft)")
    _require(draft_length >= 0 and probe_length >= 1, "need draft_length >= 0 and probe_length >= 1")
    before_draft = context_length - 1  # the row that predicts draft token 0
    before_copy = context_length + draft_length + probe_length - 1
    return ReflectiveLayout(
        original_rows=tuple(before_draft + i for i in range(draft_length + 1)),
        reflective_rows=tuple(before_copy + i for i in range(draft_length)),
        input_length=context_length + 2 * draft_length + probe_length,
    )


def reflective_input(draft_tokens: list[int], probe_tokens: list[int]) -> list[int]:
    """The tokens appended to the context for the reflective forward: draft, probe, draft."""
    return [*draft_tokens, *probe_tokens, *draft_tokens]


def fuse_reflective(target_probs: torch.Tensor, reflective_probs: torch.Tensor, reflective_weight: float) -> torch.Tensor:
    """The fused distribution Reflective Verification accepts against: the verifier's own
    distribution and its reflective one, mixed with weight lambda on the reflective side,
    fused = (1 - lambda) * target_probs + lambda * reflective_probs, row by row. Both [k, V]
    float rows summing to 1 (so the mixture does too). lambda = 0 is plain verification."""
    _require(target_probs.shape == reflective_probs.shape, f"shapes differ: {tuple(target_probs.shape)} vs {tuple(reflective_probs.shape)}")
    _require(0.0 <= reflective_weight <= 1.0, f"reflective_weight must be in [0, 1], got {reflective_weight}")
    return (1.0 - reflective_weight) * target_probs.float() + reflective_weight * reflective_probs.float()


def verify_reflective(
    target_probs: torch.Tensor, reflective_probs: torch.Tensor, draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None, reflective_weight: float, generator: torch.Generator | None,
) -> tuple[int, int]:
    """Reflective Verification's acceptance test: the usual rule run against the fused rows.

    target_probs: [k+1, V] (the bonus row last), reflective_probs: [k, V], draft_tokens: [k].
    draft_probs None: greedy, accept while the draft token is the fused row's argmax.
    draft_probs [k, V]: speculative sampling, accept with min(1, fused(x) / draft(x)), the
    correction from norm(max(0, fused - draft)). The bonus token (all accepted) comes from the
    target's own row: there is no reflective row past the draft. Returns (num_accepted, next_token).
    The verdict is the runtime's (`verify_blocks` over the fused rows, already warped: temperature 1)."""
    num_drafts = draft_tokens.shape[0]
    _require(target_probs.dim() == 2 and target_probs.shape[0] == num_drafts + 1, f"target_probs must be [k+1, V] with k = {num_drafts}")
    fused = fuse_reflective(target_probs[:num_drafts], reflective_probs, reflective_weight)  # [k, V]
    rows = torch.cat([fused, target_probs[num_drafts:].float()], dim=0)  # [k+1, V]
    block = Blocks.of_chains([draft_tokens.tolist()], [draft_probs], rows.device)
    params = SamplingParams(temperature=0.0 if draft_probs is None else 1.0)
    verdict = verify_blocks(ScoredRows.of([rows]), block, [params], [generator], "specinfer")[0]
    path, next_token = verdict.path, verdict.next_token
    return len(path), next_token


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
