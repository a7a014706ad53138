"""The approximate modes wired into the engine (docs/approximate.md), on the tiny model family.

Each mode's output is checked against what its thresholds pin it to at their ends, where the
mode must reduce to a known decoder (greedy requests, so the comparisons are exact):
- BiLD with rollback_threshold 0 rolls back every token the target is not certain of: the
  target's own greedy text; with inf (and no fallback) it keeps every draft.
- Reflective Verification with weight 0 is plain verification: the exact chain's text.
- SpecReason with score_threshold 0 keeps every step: the small model's text alone; with 9
  (no random model scores 9) the large model rewrites each step: the target's text.
- Speculative Thinking without a reflection point is the small model alone; with one, the
  large model writes after it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import approximate_cases
import pytest
import yaml

from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import ConfigError, RequestError

PROMPT = "def f(x):"
NEW_TOKENS = 24


def chain_config(tiny_family, **extra) -> dict:
    return {"tiers": [{"name": "target", "model": tiny_family["target"]}, {"name": "small", "model": tiny_family["mid"]}],
            "speculation": {"lengths": [4]}, "sampling": {"max_new_tokens": NEW_TOKENS}, **extra}


@pytest.fixture(scope="module")
def engine(tiny_family):
    return Engine(parse_config(chain_config(tiny_family)))


@pytest.fixture(scope="module")
def device_engine(tiny_family):
    """Device tiers (`batching.round: device`): BiLD's fallback is the device drafter's early exit."""
    return Engine(parse_config(chain_config(tiny_family, batching={"round": "device", "max_context": 256})))


@pytest.fixture(scope="module")
def batched_engine(tiny_family):
    return Engine(parse_config(chain_config(tiny_family)), batched=True)


@pytest.fixture(scope="module")
def small_alone(tiny_family):
    """The small model's own greedy text (a one-tier chain of it)."""
    engine = Engine(parse_config({"tiers": [{"name": "small", "model": tiny_family["mid"]}]}))
    return engine.generate(engine.parse_request({"prompt": PROMPT, "max_new_tokens": NEW_TOKENS}))["token_ids"]


def run(engine, approximate=None, **fields):
    raw = {"prompt": PROMPT, "max_new_tokens": NEW_TOKENS, **fields}
    if approximate is not None:
        raw["approximate"] = approximate
    return engine.generate(engine.parse_request(raw))


def target_alone(engine):
    return run(engine, {"mode": "exact"})  # the exact chain's greedy text is the target's


def test_exact_is_the_default_and_unmarked(engine):
    plain = run(engine)
    assert "mode" not in plain and "approximate" not in plain["stats"]
    named = run(engine, {"mode": "exact"})
    assert named["token_ids"] == plain["token_ids"] and "mode" not in named


@pytest.mark.parametrize("tiers", ["engine", "device_engine"])
def test_bild_ends(request, tiers):
    engine = request.getfixturevalue(tiers)
    exact = target_alone(engine)["token_ids"]
    strict = run(engine, {"mode": "bild", "fallback_threshold": 0.0, "rollback_threshold": 0.0})
    assert strict["mode"] == "bild" and strict["stats"]["approximate"]["rollback_threshold"] == 0.0
    assert strict["token_ids"] == exact
    assert strict["stats"]["stages"][0]["accepted"] == 0  # every draft token rolled back
    keep_all = run(engine, {"mode": "bild", "fallback_threshold": 0.0, "rollback_threshold": float("inf")})
    stage = keep_all["stats"]["stages"][0]
    assert stage["accepted"] == stage["proposed"] > 0  # every draft kept
    assert keep_all["token_ids"] != exact  # the small model's tokens stand: not the target's text


@pytest.mark.parametrize("tiers", ["engine", "device_engine"])
def test_bild_fallback_shortens_blocks(request, tiers):
    """fallback_threshold 1: the drafter hands over after every token it is not certain of."""
    engine = request.getfixturevalue(tiers)
    never = run(engine, {"mode": "bild", "fallback_threshold": 0.0, "rollback_threshold": float("inf")})["stats"]["stages"][0]
    always = run(engine, {"mode": "bild", "fallback_threshold": 1.0, "rollback_threshold": float("inf")})["stats"]["stages"][0]
    assert never["proposed"] > never["blocks"]  # blocks of several tokens
    assert always["proposed"] == always["blocks"]  # one token a block


@pytest.mark.parametrize("case", approximate_cases.CASES)
def test_every_mode_on_device_tiers_keeps_the_ragged_tiers_text(engine, device_engine, small_alone, case):
    """The same settings on device tiers (BiLD: the early exit on the device, the rollback rule on the device tier's
    rows; Reflective: the probe scored in the device tier's forward; the step modes: the sub-chain's and the target's
    device rounds, the utility score from the target's own model) give the ragged tiers' text and counts. The step
    modes' settings make both writers write."""
    settings = approximate_cases.settings(case, engine.decode(small_alone))
    on_device, ragged = run(device_engine, settings), run(engine, settings)
    assert on_device["token_ids"] == ragged["token_ids"] and on_device["mode"] == settings["mode"]
    assert on_device["stats"]["approximate"] == ragged["stats"]["approximate"]
    approximate_cases.check_both_writers(case, on_device["stats"]["approximate"])


def test_reflective_weight_zero_is_exact(engine):
    exact = target_alone(engine)["token_ids"]
    plain = run(engine, {"mode": "reflective", "reflective_weight": 0.0})
    assert plain["token_ids"] == exact and plain["mode"] == "reflective"
    fused = run(engine, {"mode": "reflective", "reflective_weight": 1.0})
    assert fused["mode"] == "reflective" and len(fused["token_ids"]) > 0


def test_specreason_ends(engine, small_alone):
    keep = run(engine, {"mode": "specreason", "score_threshold": 0})
    counts = keep["stats"]["approximate"]
    assert keep["token_ids"] == small_alone and counts["large_tokens"] == 0
    assert counts["steps_scored"] == counts["steps_accepted"] >= 1
    rewrite = run(engine, {"mode": "specreason", "score_threshold": 9})
    assert rewrite["token_ids"] == target_alone(engine)["token_ids"]
    assert rewrite["stats"]["approximate"]["steps_accepted"] == 0 and rewrite["stats"]["approximate"]["small_tokens"] == 0


def test_specreason_scores_reuse_the_requests_scored_prompt(engine):
    """A request's utility scores keep the target's KV of the scored prompt (a scratch sequence of the request):
    the next score forwards only what its prompt does not share with the last one, gives the fresh forward's
    distribution (float32: within 1e-5), and the scratch goes when the request does."""
    import torch

    from polyspec.workers.tiers.tier import scratch_sequence

    scheduler = engine.scheduler
    target = scheduler.tiers[0].tier
    first = engine.encode("Problem: add two numbers.\n\nReasoning so far:\nWe read a")
    second = first + engine.encode(" and b, then return a + b.\n\nScore:")
    fresh = scheduler.target_distribution(second)  # nothing kept
    state = engine.start(engine.parse_request({"prompt": PROMPT, "max_new_tokens": 2}))
    before = target.forwarded_tokens
    scheduler.target_distribution(first, state.seq_id)
    kept = scheduler.target_distribution(second, state.seq_id)
    assert target.forwarded_tokens - before == len(second)  # the first prompt once, then only the second's tail
    assert torch.allclose(kept, fresh, atol=1e-5)
    assert scratch_sequence(state.seq_id) in scheduler.scorer.cache.slot_of
    while not state.done:
        engine.step(state)
    engine.finish(state)
    assert scratch_sequence(state.seq_id) not in scheduler.scorer.cache.slot_of


def test_specreason_steps_end_at_max_step_tokens(engine, small_alone):
    """Text without the delimiter is still judged step by step: a step ends after max_step_tokens tokens, and so
    does the base model's rewrite of a rejected one (0: at the delimiter only, one step for the whole text)."""
    kept = run(engine, {"mode": "specreason", "score_threshold": 0, "step_delimiter": "@@", "max_step_tokens": 5})
    counts = kept["stats"]["approximate"]
    assert kept["token_ids"] == small_alone and counts["steps_scored"] == -(-NEW_TOKENS // 5)  # ceil(24 / 5) = 5 steps
    whole = run(engine, {"mode": "specreason", "score_threshold": 0, "step_delimiter": "@@", "max_step_tokens": 0})
    assert whole["token_ids"] == small_alone and whole["stats"]["approximate"]["steps_scored"] == 1
    rewritten = run(engine, {"mode": "specreason", "score_threshold": 9, "step_delimiter": "@@", "max_step_tokens": 5})
    counts = rewritten["stats"]["approximate"]
    assert rewritten["token_ids"] == target_alone(engine)["token_ids"] and counts["steps_accepted"] == 0
    assert counts["steps_scored"] >= 2  # the small model wrote again after each capped rewrite
    with pytest.raises(RequestError, match="max_step_tokens"):
        run(engine, {"mode": "specreason", "max_step_tokens": -1})


def test_specreason_steps_end_at_the_delimiter(engine, small_alone):
    """A delimiter the small model writes early splits its text into several scored steps."""
    text = engine.decode(small_alone)
    delimiter = text[3]  # a character inside its text, so at least two steps
    keep = run(engine, {"mode": "specreason", "score_threshold": 0, "step_delimiter": delimiter})
    assert keep["token_ids"] == small_alone and keep["stats"]["approximate"]["steps_scored"] >= 2


def test_speculative_thinking(engine, small_alone):
    quiet = run(engine, {"mode": "speculative-thinking", "trigger_words": ["zzzz"]})
    assert quiet["token_ids"] == small_alone and quiet["stats"]["approximate"]["takeovers"] == 0
    # a reflection point inside the small model's text: a delimiter character, then a word
    text = engine.decode(small_alone)
    delimiter, word = approximate_cases.reflection_point(text)
    point = next(i for i in range(1, len(text)) if text[i - 1] == delimiter and text[i:].startswith(word))
    taken = run(engine, {"mode": "speculative-thinking", "step_delimiter": delimiter, "trigger_words": [word], "takeover_tokens": 4})
    counts = taken["stats"]["approximate"]
    assert counts["takeovers"] >= 1 and counts["large_tokens"] >= 4
    assert engine.decode(taken["token_ids"]).startswith(text[:point])  # the small model's text up to the point stays


@pytest.mark.parametrize("mode", [{"mode": "bild", "rollback_threshold": 3.0}, {"mode": "reflective"},
                                  {"mode": "specreason", "score_threshold": 4}, {"mode": "speculative-thinking", "trigger_words": ["a"]}])
def test_batched_engine_matches_one_request_at_a_time(engine, batched_engine, mode):
    alone = run(engine, mode)
    batched = run(batched_engine, mode)
    assert batched["token_ids"] == alone["token_ids"] and batched["mode"] == mode["mode"]
    # and in a batched step beside an exact request, which stays exact
    states = [batched_engine.start(batched_engine.parse_request({"prompt": PROMPT, "max_new_tokens": NEW_TOKENS, **extra}))
              for extra in ({"approximate": mode}, {})]
    from polyspec.orchestrator.batch_runner import step_isolated

    while not all(s.done for s in states):
        outcome = step_isolated(batched_engine, [s for s in states if not s.done])
        assert not outcome.failed
    results = [batched_engine.finish(s) for s in states]
    assert results[0]["token_ids"] == alone["token_ids"] and results[0]["mode"] == mode["mode"]
    assert results[1]["token_ids"] == target_alone(engine)["token_ids"] and "mode" not in results[1]


@pytest.mark.parametrize("approximate, message", [
    ({"mode": "bilt"}, "approximate.mode must be one of exact, bild, specreason, speculative-thinking, reflective, got 'bilt'"),
    ({"mode": "bild", "score_threshold": 3}, "approximate.score_threshold applies to mode specreason, not bild"),
    ({"rollback_threshold": 3}, "approximate.rollback_threshold applies to mode bild, not exact"),
    ({"mode": "bild", "rollback_threshold": -1}, "approximate.rollback_threshold must be a number in [0.0, inf], got -1"),
    ("bild", "approximate must be a mapping, got str"),
])
def test_request_mistakes_are_one_line(engine, approximate, message):
    with pytest.raises(RequestError) as error:
        engine.parse_request({"prompt": PROMPT, "approximate": approximate})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_exact_only_refuses_approximate_requests(tiny_family):
    engine = Engine(parse_config(chain_config(tiny_family)))
    engine.exact_only = True
    assert "mode" not in run(engine)
    with pytest.raises(RequestError, match=r"approximate mode bild refused: this server runs exact decoding only \(serve --exact-only\)"):
        engine.parse_request({"prompt": PROMPT, "approximate": {"mode": "bild"}})


def test_where_a_mode_cannot_run(tiny_family):
    target_only = Engine(parse_config(chain_config(tiny_family)), speculative=False)
    with pytest.raises(RequestError, match="needs a chain of at least two tiers"):
        target_only.parse_request({"prompt": PROMPT, "approximate": {"mode": "bild"}})
    trees = Engine(parse_config(chain_config(tiny_family, speculation={"lengths": [3], "tree_width": 2})))
    with pytest.raises(RequestError, match=r"speculation.tree_width: 1"):
        trees.parse_request({"prompt": PROMPT, "approximate": {"mode": "reflective"}})
    lookup = Engine(parse_config({"tiers": [{"name": "target", "model": tiny_family["target"]}, {"name": "ng", "model": "ngram"}]}))
    with pytest.raises(RequestError, match="n-gram lookup, not a model"):
        lookup.parse_request({"prompt": PROMPT, "approximate": {"mode": "specreason"}})


def test_config_key(tiny_family):
    config = parse_config(chain_config(tiny_family, approximate={"mode": "bild", "rollback_threshold": 1.5}))
    assert config.approximate.mode == "bild" and config.target_only().approximate.lossless
    assert parse_config(chain_config(tiny_family)).approximate.lossless  # absent: exact
    with pytest.raises(ConfigError, match="approximate.mode must be one of"):
        parse_config(chain_config(tiny_family, approximate={"mode": "fast"}))
    on_ray = parse_config(chain_config(tiny_family, approximate={"mode": "bild"}, runtime={"backend": "ray"}))
    assert on_ray.approximate.mode == "bild"  # a Ray chain runs the modes too (tests/distributed/test_ray_runtime.py)


# ------------------------------------------------------------------ the installed command


def polyspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyspec", *args], capture_output=True, text=True, timeout=300)


# one mode through the command by default (every mode runs in process above, and `batch` names several);
# the other three through the command with -m extended
@pytest.mark.parametrize("mode", [
    {"mode": "bild", "rollback_threshold": 3.0},
    pytest.param({"mode": "reflective", "reflective_weight": 0.7}, marks=pytest.mark.extended),
    pytest.param({"mode": "specreason", "score_threshold": 0}, marks=pytest.mark.extended),
    pytest.param({"mode": "speculative-thinking", "trigger_words": ["a"]}, marks=pytest.mark.extended),
])
def test_generate_runs_each_mode_from_the_config(tiny_family, tmp_path, mode):
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(chain_config(tiny_family, approximate=mode)))
    proc = polyspec("generate", "-c", str(path), "-p", PROMPT, "-n", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["mode"] == mode["mode"] and result["stats"]["approximate"]["mode"] == mode["mode"]
    assert len(result["token_ids"]) > 0


def test_batch_lines_name_their_mode(tiny_family, tmp_path):
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(chain_config(tiny_family)))
    lines = [{"id": "exact", "prompt": PROMPT, "max_new_tokens": 8},
             {"id": "bild", "prompt": PROMPT, "max_new_tokens": 8, "approximate": {"mode": "bild"}},
             {"id": "sr", "prompt": PROMPT, "max_new_tokens": 8, "approximate": {"mode": "specreason", "score_threshold": 0}},
             {"id": "bad", "prompt": PROMPT, "approximate": {"mode": "bild", "takeover_tokens": 3}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = polyspec("batch", "-c", str(path), "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert "mode" not in results["exact"] and results["bild"]["mode"] == "bild" and results["sr"]["mode"] == "specreason"
    assert "takeover_tokens applies to mode speculative-thinking, not bild" in results["bad"]["error"], (results["bad"], proc.stderr)


@pytest.mark.parametrize("mode", [{"mode": "bild"}, {"mode": "reflective"}, {"mode": "specreason", "score_threshold": 4},
                                  {"mode": "speculative-thinking", "trigger_words": ["a"]}])
def test_sampled_requests_run_and_a_seed_repeats_them(engine, mode):
    first = run(engine, mode, temperature=1.0, seed=7)
    again = run(engine, mode, temperature=1.0, seed=7)
    assert first["mode"] == mode["mode"] and len(first["token_ids"]) > 0
    assert again["token_ids"] == first["token_ids"]
