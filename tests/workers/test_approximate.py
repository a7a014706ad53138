"""The approximate modes' rules (workers/core/approximate.py): BiLD's fallback and rollback,
SpecReason's steps and scores, Speculative Thinking's reflection points, Reflective
Verification's fused acceptance, and the config object that keeps them opt-in."""

from __future__ import annotations

import math

import pytest
import torch

from polyspec.workers.core.approximate import (
    DEFAULT_TRIGGER_WORDS,
    MODES,
    ApproximateMode,
    ApproximateModeError,
    accept_step,
    bild_first_rollback,
    bild_rollback_distances,
    bild_verdict,
    expected_utility_score,
    find_reflection_point,
    find_step_end,
    fuse_reflective,
    reflective_input,
    reflective_layout,
    utility_scoring_prompt,
    verify_reflective,
)
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree
from polyspec.workers.core.verdicts import ScoredRows, verify_blocks


def rows(*probabilities: list[float]) -> torch.Tensor:
    return torch.tensor(probabilities, dtype=torch.float32)


# ---------------------------------------------------------------------------- config


def test_exact_is_the_default_and_the_only_lossless_mode():
    assert ApproximateMode().mode == "exact" and ApproximateMode().lossless
    assert ApproximateMode.from_mapping(None).mode == "exact"
    assert ApproximateMode.from_mapping({}).mode == "exact"
    for mode in MODES[1:]:
        assert not ApproximateMode(mode=mode).lossless


def test_from_mapping_reads_a_modes_knobs():
    mode = ApproximateMode.from_mapping({"mode": "bild", "fallback_threshold": 0.3, "rollback_threshold": math.inf})
    assert (mode.mode, mode.fallback_threshold, mode.rollback_threshold) == ("bild", 0.3, math.inf)
    thinking = ApproximateMode.from_mapping({"mode": "speculative-thinking", "trigger_words": ["wait", "hmm"]})
    assert thinking.trigger_words == ("wait", "hmm")  # a YAML list becomes a tuple (hashable, frozen)


def test_describe_names_the_mode_and_only_its_knobs():
    assert ApproximateMode().describe() == {"mode": "exact"}
    bild = ApproximateMode.from_mapping({"mode": "bild", "fallback_threshold": 0.3})
    assert bild.describe() == {"mode": "bild", "fallback_threshold": 0.3, "rollback_threshold": 2.0}
    thinking = ApproximateMode(mode="speculative-thinking", trigger_words=("wait",))
    assert ApproximateMode.from_mapping(thinking.describe()) == thinking  # it round-trips through YAML / JSON


@pytest.mark.parametrize("key, low, high", [
    ("fallback_threshold", 0.0, 1.0), ("rollback_threshold", 0.0, math.inf),
    ("score_threshold", 0, 9), ("reflective_weight", 0.0, 1.0),
])
def test_thresholds_at_their_bounds_are_valid(key, low, high):
    assert getattr(ApproximateMode(**{key: low}), key) == low
    assert getattr(ApproximateMode(**{key: high}), key) == high


@pytest.mark.parametrize("raw, names", [
    ({"mode": "fast"}, "approximate.mode"),
    ({"mode": 3}, "approximate.mode"),
    ({"mode": "bild", "fallback_threshold": 1.5}, "approximate.fallback_threshold"),
    ({"mode": "bild", "fallback_threshold": -0.1}, "approximate.fallback_threshold"),
    ({"mode": "bild", "fallback_threshold": "high"}, "approximate.fallback_threshold"),
    ({"mode": "bild", "rollback_threshold": -1}, "approximate.rollback_threshold"),
    ({"mode": "bild", "rollback_threshold": math.nan}, "approximate.rollback_threshold"),
    ({"mode": "specreason", "score_threshold": 10}, "approximate.score_threshold"),
    ({"mode": "specreason", "score_threshold": True}, "approximate.score_threshold"),
    ({"mode": "specreason", "step_delimiter": ""}, "approximate.step_delimiter"),
    ({"mode": "speculative-thinking", "takeover_tokens": 0}, "approximate.takeover_tokens"),
    ({"mode": "speculative-thinking", "takeover_tokens": 2.5}, "approximate.takeover_tokens"),
    ({"mode": "speculative-thinking", "reflection_limit": -1}, "approximate.reflection_limit"),
    ({"mode": "speculative-thinking", "trigger_words": []}, "approximate.trigger_words"),
    ({"mode": "speculative-thinking", "trigger_words": "wait"}, "approximate.trigger_words"),
    ({"mode": "speculative-thinking", "trigger_words": ["wait", " "]}, "approximate.trigger_words"),
    ({"mode": "reflective", "reflective_weight": 1.01}, "approximate.reflective_weight"),
    ({"mode": "reflective", "probe_prompt": None}, "approximate.probe_prompt"),
    # a knob of another mode, or of no mode, would silently do nothing: refused
    ({"mode": "bild", "score_threshold": 5}, "approximate.score_threshold"),
    ({"fallback_threshold": 0.2}, "approximate.fallback_threshold"),
    ({"mode": "bild", "fallback": 0.2}, "approximate.fallback"),
])
def test_every_mistake_is_one_line_naming_the_key(raw, names):
    with pytest.raises(ApproximateModeError) as caught:
        ApproximateMode.from_mapping(raw)
    message = str(caught.value)
    assert message.startswith(names + " ") and "\n" not in message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ConfigError)


def test_a_knob_of_another_mode_names_its_mode():
    with pytest.raises(ApproximateModeError, match="applies to mode specreason / speculative-thinking, not bild"):
        ApproximateMode.from_mapping({"mode": "bild", "step_delimiter": "\n"})
    with pytest.raises(ApproximateModeError, match="approximate must be a mapping"):
        ApproximateMode.from_mapping(["bild"])


def test_direct_construction_validates_too():
    with pytest.raises(ApproximateModeError, match=r"^fallback_threshold must be a number in \[0.0, 1.0\], got 2"):
        ApproximateMode(mode="bild", fallback_threshold=2)


# ---------------------------------------------------------------------------- BiLD


def test_rollback_distance_is_the_cross_entropy_of_the_small_token_under_the_large_model():
    target_probs = rows([0.5, 0.5, 0.0], [0.1, 0.9, 0.0], [0.0, 0.0, 1.0])
    draft_tokens = torch.tensor([0, 0, 2])
    distances = bild_rollback_distances(target_probs, draft_tokens)
    assert distances.tolist() == pytest.approx([math.log(2), -math.log(0.1), 0.0])
    assert bild_rollback_distances(rows([0.0, 1.0]), torch.tensor([0])).item() == math.inf  # excluded token


def test_first_rollback_position_and_its_bounds():
    target_probs = rows([0.5, 0.5, 0.0], [0.1, 0.9, 0.0], [0.0, 0.0, 1.0], [0.2, 0.3, 0.5])
    draft_tokens = torch.tensor([0, 0, 2])  # distances ln 2, ln 10, 0
    assert bild_first_rollback(target_probs, draft_tokens, 1.0) == 1
    assert bild_first_rollback(target_probs, draft_tokens, 0.5) == 0
    assert bild_first_rollback(target_probs, draft_tokens, 3.0) is None
    assert bild_first_rollback(target_probs, draft_tokens, math.log(10)) is None  # equal: kept
    assert bild_first_rollback(target_probs, draft_tokens, math.inf) is None  # inf never rolls back
    assert bild_first_rollback(target_probs, torch.tensor([], dtype=torch.long), 0.0) is None  # empty block
    # threshold 0 rolls back the first token the large model is not certain of
    certain = rows([0.0, 1.0], [1.0, 0.0], [0.5, 0.5])
    assert bild_first_rollback(certain, torch.tensor([1, 0]), 0.0) is None
    assert bild_first_rollback(certain, torch.tensor([1, 1]), 0.0) == 1
    # threshold inf keeps even a token the large model excludes (distance inf is not > inf)
    assert bild_first_rollback(certain, torch.tensor([0]), math.inf) is None


def test_bild_verdict_keeps_the_prefix_and_takes_the_large_models_token():
    target_probs = rows([0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.0, 0.0, 1.0], [0.2, 0.7, 0.1])
    assert bild_verdict(target_probs, torch.tensor([0, 0, 2]), 1.0, None, greedy=True) == (1, 2)
    assert bild_verdict(target_probs, torch.tensor([0, 2, 2]), 1.0, None, greedy=True) == (3, 1)  # bonus
    assert bild_verdict(target_probs[:1], torch.tensor([], dtype=torch.long), 1.0, None, greedy=True) == (0, 0)  # tie: first index
    # sampling draws the replacement from the large model's row at the rollback position
    generator = torch.Generator().manual_seed(0)
    drawn = {bild_verdict(target_probs, torch.tensor([0, 0, 2]), 1.0, generator, greedy=False)[1] for _ in range(200)}
    assert drawn == {0, 1, 2}
    with pytest.raises(ValueError, match="need k\\+1"):
        bild_verdict(target_probs, torch.tensor([0]), 1.0, None, greedy=True)


# ---------------------------------------------------------------------------- SpecReason


def split_reasoning_steps(text: str, step_delimiter: str = "\n\n") -> list[str]:
    """The text cut at every `find_step_end`, as SpecReason's driver walks its steps: each step keeps its trailing
    delimiter, so "".join(steps) == text; the last step may be unfinished."""
    steps, start = [], 0
    while (end := find_step_end(text, start, step_delimiter)) is not None:
        steps.append(text[start:end])
        start = end
    return steps + ([text[start:]] if start < len(text) else [])


def test_steps_split_at_blank_lines_and_join_back():
    text = "First, read the input.\n\nThen sort it.\n\n\nFinally return"
    steps = split_reasoning_steps(text)
    assert steps == ["First, read the input.\n\n", "Then sort it.\n\n\n", "Finally return"]
    assert "".join(steps) == text
    assert split_reasoning_steps("") == []
    assert split_reasoning_steps("no delimiter yet") == ["no delimiter yet"]
    assert split_reasoning_steps("one step\n\n") == ["one step\n\n"]
    assert split_reasoning_steps("\n\nlead\n\n") == ["\n\nlead\n\n"]  # a leading blank line opens the first step
    assert split_reasoning_steps("a. b. c", step_delimiter=". ") == ["a. ", "b. ", "c"]


def test_find_step_end_waits_for_the_delimiter():
    assert find_step_end("thinking about it") is None
    assert find_step_end("thinking\n") is None
    assert find_step_end("thinking\n\n") == len("thinking\n\n")
    assert find_step_end("one\n\ntwo\n\n", start=5) == len("one\n\ntwo\n\n")


def test_scoring_prompt_holds_the_problem_the_steps_and_ends_at_the_score():
    prompt = utility_scoring_prompt("Sum a list.", ["Loop over it.\n\n"], "Add each item.\n\n")
    assert "Sum a list." in prompt and "Loop over it." in prompt and "Add each item." in prompt
    assert "0" in prompt and "9" in prompt and prompt.endswith("Score:")
    assert "(none yet)" in utility_scoring_prompt("Q", [], "step")


def test_an_unread_score_rejects_the_step_and_the_threshold_is_inclusive():
    assert not accept_step(None, 0)  # even the most lenient threshold rewrites an unscored step
    assert accept_step(0, 0)
    assert accept_step(7, 7) and not accept_step(6, 7)
    assert accept_step(9, 9) and not accept_step(8.99, 9)


def test_expected_score_from_the_digit_probabilities():
    digit_probs = torch.zeros(10)
    digit_probs[[6, 8]] = torch.tensor([0.1, 0.1])  # the rest of the row's mass is on other tokens
    assert expected_utility_score(digit_probs) == pytest.approx(7.0)
    assert expected_utility_score(torch.zeros(10)) is None
    with pytest.raises(ValueError):
        expected_utility_score(torch.ones(9))


# ---------------------------------------------------------------------------- Speculative Thinking


def test_reflection_point_after_a_blank_line_and_a_trigger_word():
    text = "x = 2\n\nWait, that is wrong."
    at = find_reflection_point(text)
    assert at == len("x = 2\n\n") and text[at:].startswith("Wait")
    assert find_reflection_point("x = 2\n\n  hmm... let me see") == len("x = 2\n\n  ")
    assert find_reflection_point("first\n\nSo it is 4.\n\nBut then\n") == len("first\n\nSo it is 4.\n\n")
    assert find_reflection_point("one\n\nLet me verify this.") == len("one\n\n")  # several words


@pytest.mark.parametrize("text", [
    "",
    "wait, no blank line before",
    "x\nwait, only one newline",
    "x\n\nbutter is not a trigger",
    "x\n\nbut",  # the word may still grow: not yet a trigger
    "x\n\nThe answer, but wait",  # the trigger must open the paragraph
])
def test_no_reflection_point(text):
    assert find_reflection_point(text) is None


def test_reflection_points_are_configurable_and_counted():
    text = "a\n\nwait, b\n\nokay so\n\nWAIT again\n\nhmm."
    points, start = [], 0
    while (point := find_reflection_point(text, start)) is not None:
        points.append(point)
        start = point + 1
    assert points == [text.index("wait"), text.index("WAIT"), text.index("hmm")]  # "okay" is not a default trigger
    assert find_reflection_point(text, trigger_words=("okay",)) == text.index("okay")
    assert find_reflection_point(text, start=4) == text.index("\n\nWAIT") + 2
    assert find_reflection_point("a\n---\nwait!", step_delimiter="\n---\n") == len("a\n---\n")
    assert "wait" in DEFAULT_TRIGGER_WORDS and "but" in DEFAULT_TRIGGER_WORDS and "hmm" in DEFAULT_TRIGGER_WORDS
    with pytest.raises(ValueError):
        find_reflection_point(text, trigger_words=())


# ---------------------------------------------------------------------------- Reflective Verification


def test_layout_of_the_single_reflective_forward():
    # context of 5 tokens, draft of 3, probe of 4: [c0..c4, d0 d1 d2, p0..p3, d0 d1 d2]
    layout = reflective_layout(context_length=5, draft_length=3, probe_length=4)
    assert layout.original_rows == (4, 5, 6, 7)  # row 4 (after c4) predicts d0; row 7 is the bonus row
    assert layout.reflective_rows == (11, 12, 13)  # row 11 (after p3) predicts the copy of d0
    assert layout.input_length == 5 + 3 + 4 + 3
    assert reflective_input([10, 11, 12], [7, 8]) == [10, 11, 12, 7, 8, 10, 11, 12]
    empty = reflective_layout(context_length=2, draft_length=0, probe_length=1)
    assert (empty.original_rows, empty.reflective_rows) == ((1,), ())


def test_fused_distribution_is_the_weighted_mixture():
    target_probs = rows([0.6, 0.4, 0.0])
    reflective_probs = rows([0.0, 0.2, 0.8])
    fused = fuse_reflective(target_probs, reflective_probs, 0.25)
    assert fused.tolist()[0] == pytest.approx([0.45, 0.35, 0.2])
    assert fused.sum().item() == pytest.approx(1.0)
    assert torch.equal(fuse_reflective(target_probs, reflective_probs, 0.0), target_probs)
    assert torch.equal(fuse_reflective(target_probs, reflective_probs, 1.0), reflective_probs)
    with pytest.raises(ValueError):
        fuse_reflective(target_probs, reflective_probs, 1.5)


def test_greedy_reflective_acceptance_follows_the_fused_argmax():
    target_probs = rows([0.6, 0.4, 0.0], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4])
    reflective_probs = rows([0.1, 0.9, 0.0], [0.1, 0.2, 0.7])
    draft_tokens = torch.tensor([1, 2])  # the target prefers token 0 at position 0; reflection prefers 1
    assert verify_reflective(target_probs, reflective_probs, draft_tokens, None, 0.0, None) == (0, 0)  # plain greedy
    assert verify_reflective(target_probs, reflective_probs, draft_tokens, None, 0.5, None) == (2, 2)  # bonus from the target
    # a tie in the fused row (0.5 * 0.6 + 0.5 * 0.4 = 0.5 * 0.4 + 0.5 * 0.6) goes to the first index
    tied = verify_reflective(rows([0.6, 0.4], [1.0, 0.0]), rows([0.4, 0.6]), torch.tensor([1]), None, 0.5, None)
    assert tied == (0, 0)
    empty_block = torch.tensor([], dtype=torch.long)  # k = 0: only the bonus row, from the target
    assert verify_reflective(target_probs[:1], torch.zeros(0, 3), empty_block, None, 0.5, None) == (0, 0)


def test_sampled_reflective_acceptance_is_speculative_sampling_against_the_fused_rows():
    target_probs = rows([0.6, 0.4, 0.0], [0.1, 0.2, 0.7])
    reflective_probs = rows([0.0, 1.0, 0.0])
    draft_probs = rows([0.0, 1.0, 0.0])
    draft_tokens = torch.tensor([1])
    fused = fuse_reflective(target_probs[:1], reflective_probs, 0.5)
    verdict = verify_blocks(ScoredRows.of([torch.cat([fused, target_probs[1:]])]), Blocks.of([DraftTree.chain([1], draft_probs)]),
                            [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(3)], "specinfer")[0]
    path, token = verdict.path, verdict.next_token
    got = verify_reflective(target_probs, reflective_probs, draft_tokens, draft_probs, 0.5, torch.Generator().manual_seed(3))
    assert got == (len(path), token)
    # acceptance probability min(1, fused / draft) = 0.7 here, against 0.4 for plain verification
    generator = torch.Generator().manual_seed(0)
    trials = 4000
    accepted = sum(verify_reflective(target_probs, reflective_probs, draft_tokens, draft_probs, 0.5, generator)[0]
                   for _ in range(trials))
    assert abs(accepted / trials - 0.7) < 0.03  # binomial sd ~0.007: more than 4 sd of slack
    # with weight 1 and a reflective row equal to the draft, every token is accepted
    assert verify_reflective(target_probs, reflective_probs, draft_tokens, draft_probs, 1.0, generator)[0] == 1
