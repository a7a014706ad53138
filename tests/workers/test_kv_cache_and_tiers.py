"""KV rollback, tree forwards and drafters, checked against recomputation from scratch."""

from __future__ import annotations

import pytest
import torch

from core_helpers import ancestors_and_self
from polyspec.orchestrator.config import TierConfig
from polyspec.workers.tiers.loading import load_model_tier
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedModelTier, BatchedNGramTier
from polyspec.workers.tiers.tier import NGramTier
from polyspec.workers.core.tree import Blocks, DraftTree

ATOL = 1e-4  # fp32 logits of a forward over other chunkings of the same tokens
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(tiny_family):
    return BatchedModelTier(load_model_tier(TierConfig(name="target", model=tiny_family["target"])), max_slots=4)


def score(tier, seq_id, context, block, params=GREEDY):
    return tier.score_batch([seq_id], [context], Blocks.of([block]), [params])[0]


def draft(tier, seq_id, context, count, params=GREEDY):
    chain = tier.draft_batch([seq_id], [context], [count], [params], [None])[0]
    return chain.tokens, chain.draft_rows


def draft_tree(tier, seq_id, context, width, depth, params=GREEDY, generator=None):
    return tier.draft_tree_batch([seq_id], [context], width, [depth], [params], "specinfer", [generator])[0]


def cached(tier, seq_id) -> int | None:
    """Positions the tier's pool holds for `seq_id` (None: it holds no slot for it)."""
    slot = tier.cache.slot_of.get(seq_id)
    return None if slot is None else tier.cache.length(slot)


def fresh_logits(tier, tokens: list[int]) -> torch.Tensor:
    """Logits over `tokens` from one forward with no cache: the reference. [T, V]"""
    with torch.inference_mode():
        return tier.tier.model(torch.tensor([tokens])).logits[0, :, : tier.vocab_size].float()


def test_truncate_is_exact_rollback(target):
    # transformers 5.x DynamicCache.crop takes a negative count; SequenceCache speaks lengths
    context = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10]
    score(target, "roll", context, DraftTree.chain([11, 12, 13], None), GREEDY)
    # reject the last two draft tokens and continue down another branch
    other = context + [11, 60, 61]
    rows = score(target, "roll", other, DraftTree.chain([62], None), GREEDY)
    reference = torch.softmax(fresh_logits(target, other + [62])[len(other) - 1 :], -1)
    assert cached(target, "roll") == len(other) + 1
    greedy_ref = torch.nn.functional.one_hot(reference.argmax(-1), target.vocab_size).float()
    assert torch.equal(rows, greedy_ref)
    probs = score(target, "roll", other, DraftTree.chain([62], None), SamplingParams(temperature=1.0))
    assert torch.allclose(probs, reference, atol=ATOL)
    target.release("roll")


def test_cache_is_reused_not_recomputed(target):
    context = list(range(20, 60))
    score(target, "reuse", context, DraftTree.chain([1, 2], None), GREEDY)
    assert cached(target, "reuse") == len(context) + 2
    score(target, "reuse", context + [1, 2, 3], DraftTree.chain([4], None), GREEDY)
    # only the new token and the draft were fed: the cache grew by exactly 2
    assert cached(target, "reuse") == len(context) + 4
    target.release("reuse")
    assert cached(target, "reuse") is None


def test_tree_forward_matches_each_path(target):
    params = SamplingParams(temperature=1.0)
    context = [40, 41, 42, 43, 44]
    #      root
    #     /  |  \
    #    0   1   2
    #    |       |
    #    3       4
    #    |
    #    5
    tree = DraftTree(tokens=[70, 71, 72, 73, 74, 75], parents=[-1, -1, -1, 0, 2, 3], draft_rows=None)
    rows = score(target, "tree", context, tree, params)  # [7, V]
    assert rows.shape == (len(tree) + 1, target.vocab_size)
    for node in range(len(tree)):
        path = ancestors_and_self(tree, node)
        tokens = context + [tree.tokens[j] for j in path]
        reference = torch.softmax(fresh_logits(target, tokens)[-1], -1)
        assert torch.allclose(rows[node + 1], reference, atol=ATOL), node
    # keep the path root->2->4, then continue linearly: the cache must equal a fresh prefill
    target.accept_path("tree", [2, 4])
    assert cached(target, "tree") == len(context) + 2
    accepted = context + [72, 74]
    probs = score(target, "tree", accepted + [9], DraftTree.chain([10], None), params)
    reference = torch.softmax(fresh_logits(target, accepted + [9, 10])[-2:], -1)
    assert cached(target, "tree") == len(accepted) + 2  # only [9, 10] were fed
    assert torch.allclose(probs, reference, atol=ATOL)
    target.release("tree")


def test_draft_tree_nodes_are_drafters_own_continuations(target):
    params = SamplingParams(temperature=1.0)
    context = [33, 34, 35, 36]
    generator = torch.Generator().manual_seed(0)
    tree = draft_tree(target, "dt", context, 3, 3, params, generator)
    assert len(tree) == 9 and tree.parents[:3] == [-1, -1, -1]
    for node in range(len(tree)):
        parent_path = ancestors_and_self(tree, node)[:-1]
        tokens = context + [tree.tokens[j] for j in parent_path]
        reference = torch.softmax(fresh_logits(target, tokens)[-1], -1)
        assert torch.allclose(tree.draft_rows[node], reference, atol=ATOL), node
    target.release("dt")


def test_greedy_draft_tree_takes_top_candidates(target):
    context = [50, 51, 52]
    tree = draft_tree(target, "gt", context, 2, 2)
    top2 = fresh_logits(target, context)[-1].topk(2).indices.tolist()
    assert tree.tokens[:2] == top2
    target.release("gt")


def test_ngram_proposes_continuation_of_latest_match():
    tier = BatchedNGramTier(NGramTier("ng", vocab_size=100, max_ngram=3))
    context = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    tokens, rows = draft(tier, "s", context, 3)
    assert tokens == [7, 8, 1]  # the latest earlier "1 2 3" was followed by 7 8 1
    assert rows is None
    tokens, rows = draft(tier, "s", context, 2, SamplingParams(temperature=1.0))
    assert rows.shape == (2, 100) and torch.equal(rows.argmax(-1), torch.tensor(tokens))
    tree = draft_tree(tier, "s", context, 2, 2)
    assert tree.tokens == [7, 8, 4, 5] and tree.parents == [-1, 0, -1, 2]
    assert draft(tier, "s", [1, 2, 3], 4)[0] == []  # nothing to look up
    # a loop shorter than the block is continued through the copy, not cut at the context's end
    assert draft(tier, "s", [9, 5, 6, 5, 6, 5, 6], 5)[0] == [5, 6, 5, 6, 5]
