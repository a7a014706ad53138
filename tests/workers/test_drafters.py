"""Trained-drafter tiers: shared weights, feature bookkeeping, exact rollback, checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyspec.workers.core.errors import ModelLoadError
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree
from polyspec.workers.tiers.drafters import DrafterError, load_early_exit, load_feature_head, new_drafter, save_drafter
from polyspec.workers.tiers.batched import BatchedModelTier, batched_tiers
from polyspec.workers.tiers.feature_tier import FeatureTier
from polyspec.workers.tiers.tier import ModelTier

GREEDY = SamplingParams()


def draft(tier, seq_id, context, count):
    chain = tier.draft_batch([seq_id], [context], [count], [GREEDY], [None])[0]
    return chain.tokens, chain.draft_rows


def draft_tree(tier, seq_id, context, width, depth):
    return tier.draft_tree_batch([seq_id], [context], width, [depth], [GREEDY], "specinfer", [None])[0]


def score(tier, seq_id, context, block):
    return tier.score_batch([seq_id], [context], Blocks.of([block]), [GREEDY])[0]


@pytest.fixture(scope="module")
def target(tiny_family):
    return AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()


def model_tier(model, name="target"):
    return BatchedModelTier(ModelTier(name, model, model.config.vocab_size, torch.device("cpu")), max_slots=4)


def feature_tier(target_model, path):
    loaded = ModelTier("target", target_model, target_model.config.vocab_size, torch.device("cpu"))
    head, _ = load_feature_head(path, target_model, "test")
    source, tier = batched_tiers([loaded, FeatureTier("feature", head, loaded)], 4)
    return tier, source


def test_early_exit_shares_the_targets_layers(target, tiny_drafters):
    model, meta = load_early_exit(tiny_drafters["early_exit"], target, 1, "test")
    assert meta["layers"] == 1 and model.config.num_hidden_layers == 2
    assert model.model.layers[0] is target.model.layers[0]  # shared, not copied
    assert model.lm_head is target.lm_head and model.model.embed_tokens is target.model.embed_tokens
    ids = torch.tensor([[5, 17, 99, 3, 250, 42]])
    with torch.no_grad():
        # the adapter of this checkpoint is a copy of the target's second layer and norm
        assert torch.equal(model(ids).logits, target(ids).logits)


def test_target_features_follow_rollback_and_tree_paths(target):
    tier = model_tier(target)
    tier.keep_features = True
    context = [7, 8, 9, 10, 11, 12]
    tree = DraftTree([20, 21, 22, 23], [-1, -1, 0, 1], None)
    score(tier, 1, context, tree)
    tier.accept_path(1, [1, 3])  # keep nodes 1 and 3: tokens 21, 23
    kept = tier.features(1, context + [21, 23, 0], 8)
    fresh = model_tier(target)
    fresh.keep_features = True
    expected = fresh.features(2, context + [21, 23, 0], 8, compute=True)
    assert kept.shape == (8, target.config.hidden_size)
    assert torch.allclose(kept, expected, atol=1e-5)
    with torch.no_grad():  # the features are the hidden states the LM head reads
        hidden = target.model(torch.tensor([context + [21, 23]])).last_hidden_state[0]
    assert torch.allclose(expected, hidden, atol=1e-5)
    tier.truncate(1, 3)
    assert tier.features(1, context, 6).shape[0] == 3  # only what is still cached


def test_feature_tier_rollback_matches_a_fresh_tier(target, tiny_drafters):
    """After drafts, rejections, trees and verifications the head's cache must give exactly
    what a tier that never saw the history gives for the same context."""
    tier, source = feature_tier(target, tiny_drafters["feature"])
    context = [40, 41, 42, 43, 44]
    drafted, _ = draft(tier, 1, context, 4)
    score(source, 1, context, DraftTree.chain(drafted, None))  # the target verifies the block
    context = context + drafted[:2] + [99]  # two accepted, a correction
    draft_tree(tier, 1, context, 2, 3)
    tier.accept_path(1, [0])
    score(source, 1, context, DraftTree.chain([5, 6], None))
    context = context + [5, 77]
    again, _ = draft(tier, 1, context, 5)
    rows = score(tier, 1, context, DraftTree.chain(again[:3], None))

    fresh, fresh_source = feature_tier(target, tiny_drafters["feature"])
    score(fresh_source, 2, context, DraftTree([], [], None))  # the target has the same prefix
    assert draft(fresh, 2, context, 5)[0] == again
    assert torch.equal(score(fresh, 2, context, DraftTree.chain(again[:3], None)), rows)


def test_feature_tier_asks_the_target_for_a_new_prompts_features(target, tiny_drafters):
    tier, source = feature_tier(target, tiny_drafters["feature"])
    context = [3, 4, 5, 6, 7, 8, 9]
    draft(tier, 1, context, 2)
    assert source.features(1, context, 6).shape[0] == 6  # computed for the head, kept for the target's score
    assert tier.cached(1) == 7 and tier.cached(2) == 0  # the drafted position is provisional: not counted
    with pytest.raises(NotImplementedError, match="chains only"):
        score(tier, 1, context, DraftTree([1, 2], [-1, -1], None))


def test_exit_threshold_makes_the_block_length_dynamic(target, tiny_drafters):
    model, _ = load_early_exit(tiny_drafters["early_exit_noisy"], target, None, "test")
    tier = model_tier(model, "early")
    context = [11, 12, 13, 14]
    assert len(draft(tier, 1, context, 6)[0]) == 6  # no threshold: the asked length
    tier.tier.exit_threshold = 1.0  # nothing is that sure: stop after the first token
    assert len(draft(tier, 1, context, 6)[0]) == 1
    tree = draft_tree(tier, 1, context, 2, 4)
    assert len(tree) == 2  # the root's children only
    tier.tier.exit_threshold = 0.0
    assert len(draft(tier, 1, context, 6)[0]) == 6


def test_checkpoint_errors_are_one_line(target, tiny_family, tiny_drafters, tmp_path):
    other = AutoModelForCausalLM.from_pretrained(tiny_family["small"]).eval()
    with pytest.raises(DrafterError, match="trained for another target") as info:
        load_feature_head(tiny_drafters["feature"], other, "tier 'f'")
    assert "\n" not in str(info.value) and isinstance(info.value, ModelLoadError)
    with pytest.raises(DrafterError, match="trained over the target's first 1 layers"):
        load_early_exit(tiny_drafters["early_exit"], target, 3, "tier 'e'")
    with pytest.raises(DrafterError, match="not a drafter checkpoint"):
        load_feature_head(str(tmp_path), target, "tier 'f'")
    with pytest.raises(DrafterError, match="not a feature head"):
        load_feature_head(tiny_drafters["early_exit"], target, "tier 'f'")
    head, meta = new_drafter("feature", target, sampling=False)
    save_drafter(tmp_path / "nosampling", "feature", head, {**meta, "sampling": True})  # weights of another shape
    with pytest.raises(DrafterError, match="do not match"):
        load_feature_head(tmp_path / "nosampling", target, "tier 'f'")
    with pytest.raises(ValueError, match="reads 1 to 1"):
        new_drafter("early_exit", target, layers=2)
