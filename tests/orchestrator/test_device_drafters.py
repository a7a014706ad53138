"""The trained drafters on tiers that decode in static steps (`BatchedModelTier(steps=True)`), run on the CPU.

Early exit (Kangaroo: the target's first layer, shared, and an adapter; tests/conftest.py `tiny_drafters`):
- greedy: target <- early exit on device tiers gives the target's own greedy `generate` for every request of a
  ragged batch (chains and trees, with and without an exit threshold);
- a stepping tier's draft is the ragged forward's (the same model) for the same contexts: greedy tokens
  bit for bit on float32, the blocks an exit threshold cuts included, and trees; sampled rows within 1e-5;
- `batching.round: device` builds it in the engine, whose greedy tokens are the ragged round's.
Sampling's exactness is the target's verify step, the one every device chain shares (test_device_round.py).
"""

from __future__ import annotations

import pytest
import torch

from core_helpers import greedy_references
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedModelTier
from polyspec.workers.tiers.drafters import load_early_exit
from polyspec.workers.tiers.tier import ModelTier

from tests.orchestrator.test_device_round import MAX_NEW, PROMPTS, _run

NOISY = "early_exit_noisy"  # an adapter that disagrees with the target now and then


@pytest.fixture(scope="module")
def target(tiny_drafters):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def early(target, tiny_drafters):
    """The early-exit model over `target` (its first layer shared)."""
    model, _ = load_early_exit(tiny_drafters[NOISY], target, 1, "test")
    return model


@pytest.fixture(scope="module")
def reference(target):
    return greedy_references(target, PROMPTS, MAX_NEW)


def _tier(name, model, threshold=None) -> ModelTier:
    tier = ModelTier(name, model, model.config.vocab_size, model.device)
    tier.exit_threshold = threshold
    return tier


@pytest.mark.parametrize("threshold,tree_width", [(None, 1), (0.3, 1), (0.6, 2), (None, 2)])
def test_greedy_target_early_exit_chain_equals_the_targets_generate(target, early, reference, threshold, tree_width):
    tiers = [_tier("target", target), _tier("early", early, threshold)]
    scheduler = ChainScheduler([BatchedModelTier(tier, 8, steps=True) for tier in tiers], [4], tree_width=tree_width)
    assert all(tier.steps for tier in scheduler.tiers)
    results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], (threshold, tree_width, i)
    stage = results[0].stats["stages"][0]
    assert stage["blocks"] > 0 and 0 < stage["accepted"] <= stage["proposed"]
    assert not any(tier.cache.open_sequences for tier in scheduler.tiers), "every slot is released"


def test_the_early_exit_pool_is_its_own_and_its_weights_the_targets(target, early):
    device_target = BatchedModelTier(_tier("target", target), 2, steps=True)
    device_early = BatchedModelTier(_tier("early", early), 2, steps=True)
    for tier in (device_target, device_early):
        tier.cache.allocate()
    assert len(device_early.cache.keys) == 2 and device_early.cache.keys[0] is not device_target.cache.keys[0]
    early_model, target_model = device_early.tier.model, device_target.tier.model
    shared = (model.model.layers[0].self_attn.q_proj.weight for model in (early_model, target_model))  # layer 0's q projection
    assert len({weight.data_ptr() for weight in shared}) == 1, "the first layer is the target's, not a copy"
    assert early_model.lm_head.weight.data_ptr() == target_model.lm_head.weight.data_ptr()
    assert device_early.model.embed.data_ptr() == device_target.model.embed.data_ptr()


@pytest.mark.parametrize("threshold", [None, 0.5, 1.0])
def test_a_device_early_exit_draft_is_the_ragged_tiers(early, threshold):
    """Greedy blocks bit for bit (float32), after an exit threshold too (1.0: every block stops after its first token);
    sampled (T 0.8, top-k 50): a seeded request's rows are the model's own, within 1e-5, whatever it drew."""
    from polyspec.workers.core.sampling import RandomStream
    from polyspec.workers.core.sampling import warp_logits

    contexts, counts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [6, 3, 5]
    device_tier = BatchedModelTier(_tier("early", early, threshold), 4, steps=True)
    ragged = BatchedModelTier(_tier("early", early, threshold))
    greedy = [SamplingParams()] * 3
    drafted = device_tier.draft_batch([0, 1, 2], contexts, counts, greedy, [None] * 3)
    expected = ragged.draft_batch([0, 1, 2], contexts, counts, greedy, [None] * 3)
    assert drafted.host()[0] == expected.host()[0]
    if threshold == 1.0:
        assert drafted.lengths == [1, 1, 1]
    elif threshold is None:
        assert drafted.lengths == counts
    params = SamplingParams(temperature=0.8, top_k=50)
    sampled = device_tier.draft_batch([0, 1, 2], contexts, counts, [params] * 3, [RandomStream(s) for s in (1, 2, 3)])
    for context, chain in zip(contexts, sampled):
        tokens, rows = chain.tokens, chain.draft_rows
        assert rows.shape == (len(tokens), early.config.vocab_size)
        with torch.inference_mode():
            logits = early(torch.tensor([context + tokens])).logits[0, len(context) - 1:]
        assert torch.allclose(rows, warp_logits(logits[: len(tokens)], params), atol=1e-5)


@pytest.mark.parametrize("threshold", [None, 0.6, 1.0])
def test_a_device_early_exit_tree_is_the_ragged_tiers(early, threshold):
    """The exit in steps: a tree ends below the first level none of whose rows was sure."""
    contexts, depths, width = [PROMPTS[0], PROMPTS[3], PROMPTS[4]], [4, 2, 5], 2
    device_tier = BatchedModelTier(_tier("early", early, threshold), 4, steps=True)
    ragged = BatchedModelTier(_tier("early", early, threshold))
    greedy = [SamplingParams()] * 3
    trees = device_tier.draft_tree_batch([0, 1, 2], contexts, width, depths, greedy, "specinfer", [None] * 3)
    expected = ragged.draft_tree_batch([0, 1, 2], contexts, width, depths, greedy, "specinfer", [None] * 3)
    for tree, other in zip(trees, expected):
        assert (tree.tokens, tree.parents) == (other.tokens, other.parents)
    if threshold == 1.0:
        assert all(len(tree) == width for tree in trees)


def test_the_engine_runs_an_early_exit_chain_on_the_device(tiny_drafters):
    """`batching.round: device` steps target <- early exit; its greedy tokens are the ragged round's."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs

    def engine(round_kind):
        return Engine(parse_config({"tiers": tier_specs(tiny_drafters, ["target", NOISY]), "speculation": {"lengths": [4]},
                                    "batching": {"round": round_kind, "max_requests": 4, "max_context": 128}}), batched=True)

    raws = [{"id": str(i), "prompt_ids": p, "max_new_tokens": 16} for i, p in enumerate(PROMPTS)]
    results = {}
    for round_kind in ("device", "ragged"):
        chosen = engine(round_kind)
        if round_kind == "device":
            assert all(t.steps for t in chosen.scheduler.tiers)
            assert chosen.scheduler.tiers[1].tier.exit_threshold == 0.3
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[round_kind] = out
    assert all(results["device"][r["id"]]["token_ids"] == results["ragged"][r["id"]]["token_ids"] for r in raws)
    assert results["device"]["0"]["stats"]["stages"][0]["proposed"] > 0
