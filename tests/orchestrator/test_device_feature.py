"""A feature head (EAGLE / FSPAD) under a target that decodes in static steps (`BatchedModelTier(steps=True)`), on the CPU.

- greedy: target <- feature head over a stepping target gives the target's own greedy `generate` for every request of a
  ragged batch (prompts joining at different steps);
- its drafts are those of a head over a ragged target for the same context (one that never saw the history, its
  target's features computed for the whole context): greedy tokens bit for bit on float32, round after round
  of accepted drafts, corrections and contexts the target has not seen; sampled rows within 1e-5;
- the stepping target records the features a head reads, as the ragged forward does;
- `batching.round: device` builds the chain in the engine (greedy tokens: the ragged round's).
Sampling's exactness is the target's verify step, the one every device chain shares (test_device_round.py).
"""

from __future__ import annotations

import pytest
import torch

from core_helpers import generate_alone, greedy_references
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks
from polyspec.workers.tiers.batched import BatchedModelTier, batched_tiers
from polyspec.workers.tiers.batched_feature import BatchedFeatureTier
from polyspec.workers.tiers.drafters import load_feature_head
from polyspec.workers.tiers.feature_tier import FeatureTier
from polyspec.workers.tiers.tier import ModelTier

from tests.orchestrator.test_device_round import MAX_NEW, PROMPTS, _run


@pytest.fixture(scope="module")
def target(tiny_drafters):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head(target, tiny_drafters):
    head, _ = load_feature_head(tiny_drafters["feature"], target, "test")
    return head


@pytest.fixture(scope="module")
def reference(target):
    return greedy_references(target, PROMPTS, MAX_NEW)


def _ragged(target, head) -> tuple[ModelTier, FeatureTier]:
    # its weights as the one forward reads them
    source = ModelTier("target", target, target.config.vocab_size, target.device)
    return source, FeatureTier("feature", head, source)


def _runtime(target, head):
    """(target, head): the ragged runtime tiers of a fresh target and head (polyspec.workers.tiers.batched)."""
    return tuple(batched_tiers(list(_ragged(target, head)), 4))


def _device(target, head, slots=8) -> tuple[BatchedModelTier, BatchedFeatureTier]:
    device_target, device_head = batched_tiers(list(_ragged(target, head)), slots, steps=True)
    assert device_target.steps
    return device_target, device_head


@pytest.mark.parametrize("length", [3, 6])
def test_greedy_target_feature_chain_equals_the_targets_generate(target, head, reference, length):
    scheduler = ChainScheduler(list(_device(target, head)), [length])
    results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], (length, i)
    stages = [results[i].stats["stages"][0] for i in range(len(PROMPTS))]
    assert all(s["blocks"] > 0 for s in stages)
    assert sum(s["accepted"] for s in stages) > 0, "some drafts were accepted: tails re-fed"
    assert not any(tier.cache.open_sequences for tier in scheduler.tiers), "every slot is released"


def test_a_head_over_a_stepping_target_drafts_as_over_a_ragged_one(target, head):
    """Three requests side by side (one a prompt longer than a step carries), eight rounds each, the same calls to a
    head over a stepping target and to one over a ragged target: every round's context keeps some of the drafted
    tokens (0 to 4) and a correction; every other round the target verifies the block first (its features then come
    from its verify step, else from its prefill on demand). Greedy blocks equal bit for bit; sampled rows (T 0.8,
    top-k 50) within 1e-5, and so do the rows `score_batch` gives for the blocks drafted."""
    from polyspec.workers.core.sampling import RandomStream

    pairs = [_device(target, head, slots=4), _runtime(target, head)]
    contexts = [list(PROMPTS[0]), list(PROMPTS[1]), PROMPTS[2] * 4]  # 44 tokens, none cached: longer than a step
    greedy = SamplingParams()
    for round_index in range(8):
        drafted = [pair[1].draft_batch([0, 1, 2], contexts, [5, 3, 4], [greedy] * 3, [None] * 3) for pair in pairs]
        assert drafted[0].host()[0] == drafted[1].host()[0], round_index
        if round_index % 2:
            blocks = Blocks.of_chains(drafted[0].host()[0], [None] * 3)
            verdicts = [pair[0].verify_batch([0, 1, 2], contexts, blocks, [greedy] * 3, [None] * 3) for pair in pairs]
            assert [v.path for v in verdicts[0]] == [v.path for v in verdicts[1]]
        for r, tokens in enumerate(drafted[0].host()[0]):
            kept = (round_index + r) % 5
            contexts[r] = contexts[r] + tokens[:kept] + [(17 * round_index + r) % 250]
    params = SamplingParams(temperature=0.8, top_k=50)
    sampled = [pair[1].draft_batch([0, 1, 2], contexts, [4, 4, 2], [params] * 3, [RandomStream(s) for s in (1, 2, 3)])
               for pair in pairs]
    for chain, other in zip(*sampled):
        assert chain.tokens == other.tokens and torch.allclose(chain.draft_rows, other.draft_rows, atol=1e-5)
    blocks = Blocks.of_chains(sampled[0].host()[0], [None] * 3)
    scored = [pair[1].score_batch([0, 1, 2], contexts, blocks, [params] * 3) for pair in pairs]
    for rows, other in zip(*scored):
        assert torch.allclose(rows, other, atol=1e-5)


def test_the_target_writes_the_features_a_head_reads(target, head):
    """After a prefill and a verify step, the stepping target holds at each position of the context the hidden state
    the ragged target keeps there (`BatchedModelTier.features`), within 1e-5."""
    device_target, _ = _device(target, head, slots=2)
    context = list(PROMPTS[2])
    device_target.prefill([0], [context], 1 << 20)
    (verdict,) = device_target.verify_batch([0], [context], Blocks.of_chains([[1, 2, 3]], [None]), [SamplingParams()], [None])
    context = context + [[1, 2, 3][j] for j in verdict.path] + [verdict.next_token]
    source, _ = _runtime(target, head)
    expected = source.features("x", context, len(context) - 1, compute=True)
    assert torch.allclose(device_target.features(0, context, len(context) - 1), expected, atol=1e-5)


@pytest.mark.parametrize("lengths", [[4], "auto"])
def test_the_engine_runs_a_feature_head_on_the_device(tiny_drafters, lengths):
    """`batching.round: device` steps the target under its feature head; its greedy tokens are the ragged round's
    (with `lengths: auto` the goodput planner, its profile timing the head's steps, sets each step's plan)."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs

    def engine(round_kind):
        return Engine(parse_config({"tiers": tier_specs(tiny_drafters, ["target", "feature"]), "speculation": {"lengths": lengths},
                                    "batching": {"round": round_kind, "max_requests": 4, "max_context": 128}}), batched=True)

    raws = [{"id": str(i), "prompt_ids": p, "max_new_tokens": 16} for i, p in enumerate(PROMPTS)]
    results = {}
    for round_kind in ("device", "ragged"):
        chosen = engine(round_kind)
        if round_kind == "device":
            assert [type(t) for t in chosen.scheduler.tiers] == [BatchedModelTier, BatchedFeatureTier]
            assert chosen.scheduler.tiers[0].steps
            assert (chosen.scheduler.planner is not None) == (lengths == "auto")
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[round_kind] = out
    assert all(results["device"][r["id"]]["token_ids"] == results["ragged"][r["id"]]["token_ids"] for r in raws)
    if lengths != "auto":  # (the planner may keep speculation off for a head this cheap to beat)
        assert results["device"]["0"]["stats"]["stages"][0]["proposed"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_rounds_with_trained_drafters_give_the_targets_greedy_output(tiny_drafters):
    """On CUDA (float32) every step is captured once a bucket and replayed: target <- feature head and target <- early
    exit (exit threshold 0.3) give the target's own greedy `generate` on the device, ragged joins included."""
    from transformers import AutoModelForCausalLM

    from polyspec.workers.tiers.drafters import load_early_exit

    target = AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).to("cuda").eval()
    expected = greedy_references(target, PROMPTS, MAX_NEW)
    head, _ = load_feature_head(tiny_drafters["feature"], target, "test")
    early, _ = load_early_exit(tiny_drafters["early_exit_noisy"], target, 1, "test")
    early_tier = ModelTier("early", early, early.config.vocab_size, torch.device("cuda"))
    early_tier.exit_threshold = 0.3
    target_tier = ModelTier("target", target, target.config.vocab_size, torch.device("cuda"))
    for tiers in (list(_device(target, head)), [BatchedModelTier(target_tier, 8, steps=True), BatchedModelTier(early_tier, 8, steps=True)]):
        scheduler = ChainScheduler(tiers, [4])
        assert tiers[0].graphs.enabled
        results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
        for i, prompt in enumerate(PROMPTS):
            assert results[i].token_ids == expected[tuple(prompt)], (type(tiers[1]).__name__, i)
        assert tiers[0].graphs.graphs, "no step was captured"
    # the ragged feature tier on CUDA too (its inputs and kept features on the target's device)
    scheduler = ChainScheduler(list(_runtime(target, head)), [4])
    for prompt in PROMPTS:
        assert generate_alone(scheduler, prompt, MAX_NEW, SamplingParams()).token_ids == expected[tuple(prompt)]
