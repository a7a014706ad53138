"""`Blocks`: a call's drafted blocks flattened with offsets, read back per request as the trees they were made of."""

from __future__ import annotations

import torch

from polyspec.workers.core.tree import Blocks, DraftTree

VOCAB = 7


def rows(count: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(count, VOCAB, generator=torch.Generator().manual_seed(seed)), -1)


def sample_trees() -> list[DraftTree]:
    """A sampled chain, a greedy tree, an empty block, a lookup's chain (no rows) and a sampled tree."""
    return [DraftTree.chain([3, 1, 4], rows(3, 0)),
            DraftTree([5, 2, 6, 0], [-1, -1, 0, 1], None),
            DraftTree([], [], None),
            DraftTree.chain([1, 1], None),
            DraftTree([2, 4, 6], [-1, 0, -1], rows(3, 1))]


def test_blocks_lay_trees_out_flat_with_offsets_and_read_back_as_them():
    trees = sample_trees()
    blocks = Blocks.of(trees)
    assert len(blocks) == 5 and blocks.offsets == [0, 3, 7, 7, 9, 12] and blocks.lengths == [3, 4, 0, 2, 3]
    assert blocks.tokens.tolist() == [3, 1, 4, 5, 2, 6, 0, 1, 1, 2, 4, 6]
    assert blocks.parents.tolist() == [-1, 0, 1, -1, -1, 0, 1, -1, 0, -1, 0, -1]
    assert blocks.chains == [True, False, True, True, False] and not blocks.all_chains
    assert blocks.carries == [True, False, False, False, True]
    # a block that carries no rows has zeros in the flattened rows; one that does, its own
    assert torch.equal(blocks.draft_rows[0:3], trees[0].draft_rows) and torch.equal(blocks.draft_rows[9:12], trees[4].draft_rows)
    assert not blocks.draft_rows[3:9].any()
    for tree, back in zip(trees, blocks):
        assert (back.tokens, back.parents) == (tree.tokens, tree.parents)
        assert (back.draft_rows is None) == (tree.draft_rows is None)
        assert back.draft_rows is None or torch.equal(back.draft_rows, tree.draft_rows)
    # read back from the tensors alone (a drafter that made them on its device): the same host lists
    bare = Blocks(blocks.tokens, blocks.parents, blocks.offsets, blocks.chains, blocks.draft_rows, blocks.carries)
    assert bare.host() == blocks.host() == ([t.tokens for t in trees], [t.parents for t in trees])


def test_padded_and_nodes_of_gather_requests_from_the_flat_layout():
    blocks = Blocks.of(sample_trees())
    assert blocks.padded(blocks.tokens, [4, 0, 2], 4, -1).tolist() == [[2, 4, 6, -1], [3, 1, 4, -1], [-1, -1, -1, -1]]
    assert blocks.padded(blocks.parents, [1], 5, -9).tolist() == [[-1, -1, 0, 1, -9]]
    assert blocks.nodes_of(blocks.tokens, [3, 0]).tolist() == [1, 1, 3, 1, 4]
    assert blocks.nodes_of(blocks.tokens, range(5)) is blocks.tokens
    padded_rows = blocks.padded(blocks.draft_rows, [0], 4, 0.0)
    assert padded_rows.shape == (1, 4, VOCAB) and torch.equal(padded_rows[0, :3], blocks.draft_rows[:3]) and not padded_rows[0, 3].any()
    empty = Blocks.empty(2)
    assert empty.lengths == [0, 0] and empty.padded(empty.tokens, [0, 1], 2, 5).tolist() == [[5, 5], [5, 5]]


def test_gather_places_each_drafters_blocks_at_their_requests():
    trees = sample_trees()
    lookups = Blocks.of([trees[3], trees[1]])
    model = Blocks.of([trees[0]])
    gathered = Blocks.gather(4, [([1, 3], lookups), ([0], model)])
    assert gathered.lengths == [3, 2, 0, 4]
    assert [(b.tokens, b.parents) for b in gathered] == [(trees[0].tokens, trees[0].parents), (trees[3].tokens, trees[3].parents),
                                                         ([], []), (trees[1].tokens, trees[1].parents)]
    assert gathered.carries == [True, False, False, False] and torch.equal(gathered[0].draft_rows, trees[0].draft_rows)
    whole = Blocks.of(trees)
    assert Blocks.gather(5, [(list(range(5)), whole)]) is whole  # one drafter for every request: its batch as it is
    assert Blocks.gather(2, []).lengths == [0, 0]  # nothing drafted (the target alone)


def test_of_chains_keeps_greedy_chains_without_rows():
    blocks = Blocks.of_chains([[4, 5], [6]], [None, None])
    assert blocks.draft_rows is None and blocks.carries == [False, False] and blocks.all_chains
    assert [b.draft_rows for b in blocks] == [None, None] and blocks.host()[0] == [[4, 5], [6]]


def test_scored_rows_pack_each_requests_warped_rows_and_read_back_as_them():
    """Alike requests are warped at once, mixed ones one by one: either way each request's rows are its own warp."""
    from polyspec.workers.core.sampling import SamplingParams, warp_logits
    from polyspec.workers.core.verdicts import ScoredRows

    logits = [torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(n)) for n in (4, 1, 3)]
    for params in ([SamplingParams(temperature=0.7)] * 3,
                   [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.5, top_p=0.6)]):
        scored = ScoredRows.warped(logits, params)
        assert len(scored) == 3 and scored.offsets == [0, 4, 5, 8] and scored.rows.shape == (8, VOCAB)
        for rows, one, p in zip(scored, logits, params):
            assert torch.allclose(rows, warp_logits(one, p), atol=1e-7)
    packed = ScoredRows.of(logits)
    assert torch.equal(packed[2], logits[2]) and packed.padded(packed.rows, [1], 2, 0.0)[0, 1].abs().sum() == 0
