"""The device round's tree verification kernels (polyspec.workers.core.device_tree_verify).

- bit for bit against the slow, obvious reference `verify_tree_drawn` (and `verify_tree` for
  greedy trees), request by request, on random batches: trees of 0..14 nodes with nodes of up
  to 4 children stored in any parents-first order, every multi-draft scheme, greedy and sampled
  requests side by side, truncated rows (draft tokens the target gives 0, disjoint supports,
  exhausted supports), padding in N, width and depth;
- a seeded request gets the same verdict alone or in any batch;
- lossless: per scheme, a chi-square test of the first two emitted tokens against the target's
  exact two-token joint;
- capturable: `torch.compile(fullgraph=True)` traces draws + verification without a graph break,
  once per shape bucket.
"""

from __future__ import annotations

import collections

import pytest
import torch

from core_helpers import CompiledGraphs
from lossless_stats import ALPHA, chi_square_p_value

from polyspec.workers.core.device_tree_verify import (
    PLACEHOLDER_NODE,
    children_table,
    pack_trees,
    tree_draws,
    verify_greedy_trees,
    verify_trees,
)
from polyspec.workers.core.device_verify import DOMAIN_DRAFT, DOMAIN_NEXT, stream_exponentials
from polyspec.workers.core.tree import Blocks, DraftTree
from reference_verification import (
    MULTI_DRAFT_SCHEMES,
    PLACEHOLDER_TOKEN_ID,
    draw_without_replacement,
    emitted_tree_tokens,
    verify_tree,
    verify_tree_drawn,
)

VOCAB = 12
MAX_NODES = 14
MAX_WIDTH = 4
LOSSLESS_SAMPLES = 40_000  # requests per scheme, all in one batch: about 1 s each on one core
LOSSLESS_VOCAB = 5  # 25 cells of the two-token joint


def _row(generator: torch.Generator, near: torch.Tensor | None = None) -> torch.Tensor:
    """A [V] probability row: random, or a perturbation of `near` (high acceptance), sometimes
    truncated to a few tokens (zeros: rejected drafts, disjoint supports, exhausted supports)."""
    logits = torch.randn(VOCAB, generator=generator) * 2
    if near is not None and torch.rand((), generator=generator) < 0.5:  # else a drafter far from the target: rejections
        logits = torch.log(near.clamp_min(1e-30)) + torch.randn(VOCAB, generator=generator) * 0.3
    kind = int(torch.randint(0, 6, (), generator=generator))
    if kind == 0:  # top-2
        logits[logits < logits.topk(2).values[-1]] = float("-inf")
    elif kind == 1:  # a random support of 3
        logits[torch.randperm(VOCAB, generator=generator)[3:]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if near is not None and kind == 2:
        probs = near.clone()  # the drafter agrees exactly: residual max(0, target - draft) is zero
    return probs


def _random_tree(generator: torch.Generator, scheme: str, greedy: bool) -> tuple[DraftTree, torch.Tensor]:
    """(tree, target rows [n + 1, V]) drawn the way `scheme` requires: rsd siblings without
    replacement from their parent's row, spectr siblings i.i.d. from it, specinfer / importance
    siblings each from its own row (the parent's or another drafter's). Nodes join random open
    parents, so siblings are interleaved in index order (still parents-first)."""
    num_nodes = int(torch.randint(0, MAX_NODES + 1, (), generator=generator))

    def target_row() -> torch.Tensor:
        row = _row(generator)
        return torch.nn.functional.one_hot(row.argmax(), VOCAB).float() if greedy else row  # greedy: warp_logits at temperature 0

    target_rows = [target_row()]
    tokens, parents, draft_rows = [], [], []
    parent_row = {-1: _row(generator, near=target_rows[0])}  # the drafter's row at each node
    without_replacement = {-1: draw_without_replacement(parent_row[-1], MAX_WIDTH, generator).tolist()}  # rsd's candidates
    open_nodes = [-1]
    while len(tokens) < num_nodes and open_nodes:
        wide_root = open_nodes[0] == -1 and torch.rand((), generator=generator) < 0.3  # more siblings where the walk starts
        parent = -1 if wide_root else open_nodes[int(torch.randint(0, len(open_nodes), (), generator=generator))]
        siblings = parents.count(parent)
        if siblings + 1 >= (len(without_replacement[parent]) if scheme == "rsd" and not greedy else MAX_WIDTH):
            open_nodes.remove(parent)  # this one is its last child
        row = parent_row[parent]
        if greedy:
            follows = torch.rand((), generator=generator) < 0.5
            token = int(target_rows[parent + 1].argmax()) if follows else int(torch.randint(0, VOCAB, (), generator=generator))
            row = torch.zeros(VOCAB)
        elif scheme == "rsd":
            token = without_replacement[parent][siblings]
        else:
            if scheme != "spectr" and torch.rand((), generator=generator) < 0.5:
                row = _row(generator, near=target_rows[parent + 1])  # another drafter's row for this candidate
            token = int(torch.multinomial(row, 1, generator=generator))
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        draft_rows.append(row)
        target_rows.append(target_row())
        parent_row[node] = _row(generator, near=target_rows[-1])
        without_replacement[node] = draw_without_replacement(parent_row[node], MAX_WIDTH, generator).tolist()
        open_nodes.append(node)
    rows = torch.stack(draft_rows) if draft_rows else torch.zeros(0, VOCAB)
    return DraftTree(tokens, parents, None if greedy else rows), torch.stack(target_rows)


def _random_batch(seed: int, scheme: str, batch: int = 24):
    generator = torch.Generator().manual_seed(seed)
    greedy = [r % 4 == 1 for r in range(batch)]
    trees, targets = zip(*[_random_tree(generator, scheme, g) for g in greedy])
    node_tokens, parents, num_nodes, draft_probs = pack_trees(Blocks.of(list(trees)), range(len(trees)), MAX_NODES, VOCAB)
    # padding rows stay random
    target_probs = torch.softmax(torch.randn(batch, MAX_NODES + 1, VOCAB, generator=generator), dim=-1)
    for r, rows in enumerate(targets):
        target_probs[r, : rows.shape[0]] = rows
    seeds = torch.randint(0, 2**62, (batch,), generator=generator)
    counters = torch.randint(0, 1000, (batch,), generator=generator)
    return list(trees), torch.tensor(greedy), target_probs, draft_probs, node_tokens, parents, num_nodes, seeds, counters


def _reference(trees, greedy, target_probs, scheme, uniforms, move_uniforms, exponentials, r):
    n = len(trees[r])
    return verify_tree_drawn(target_probs[r, : n + 1], trees[r], scheme, bool(greedy[r]),
                             uniforms[r, :n], move_uniforms[r, :n], exponentials[r])


def _depth(tree: DraftTree) -> int:
    return max(tree.depths(), default=-1) + 1


def test_children_table_lists_each_nodes_children_in_index_order():
    generator = torch.Generator().manual_seed(0)
    trees = [_random_tree(generator, "specinfer", False)[0] for _ in range(20)]
    node_tokens, parents, num_nodes, _ = pack_trees(Blocks.of(trees), range(len(trees)), MAX_NODES, VOCAB)
    table = children_table(parents, num_nodes, MAX_WIDTH)
    for r, tree in enumerate(trees):
        for node in range(-1, MAX_NODES):
            expected = tree.children(node) if node < len(tree) else []
            assert table[r, node + 1].tolist() == expected + [PLACEHOLDER_NODE] * (MAX_WIDTH - len(expected)), (r, node)


@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
@pytest.mark.parametrize("seed", range(6))
def test_verify_trees_equals_the_per_request_reference(scheme, seed):
    trees, greedy, target_probs, draft_probs, node_tokens, parents, num_nodes, seeds, counters = _random_batch(seed, scheme)
    uniforms, move_uniforms, exponentials = tree_draws(seeds, counters, MAX_NODES, VOCAB)
    max_depth = max(_depth(tree) for tree in trees) + seed % 2  # sometimes one spare level
    path, path_len, next_tokens = verify_trees(target_probs, draft_probs, node_tokens, parents, num_nodes, greedy, uniforms,
                                               move_uniforms, exponentials, scheme, max_depth, MAX_WIDTH)
    out = emitted_tree_tokens(node_tokens, path, path_len, next_tokens)
    for r, tree in enumerate(trees):
        expected_path, expected_next = _reference(trees, greedy, target_probs, scheme, uniforms, move_uniforms, exponentials, r)
        length = int(path_len[r])
        assert (path[r, :length].tolist(), int(next_tokens[r])) == (expected_path, expected_next), (scheme, seed, r)
        assert path[r, length:].eq(PLACEHOLDER_NODE).all()
        padding = [PLACEHOLDER_TOKEN_ID] * (max_depth - length)
        assert out[r].tolist() == [tree.tokens[j] for j in expected_path] + [expected_next] + padding


def _support_row(tokens: list[int], weights: list[float] | None = None) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[tokens] = torch.tensor(weights or [1.0] * len(tokens))
    return row / row.sum()


@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
def test_edge_cases_equal_the_reference(scheme):
    """Hand-made trees, each verified under 50 counters: a draft disjoint from the target (spectr's
    beta = 0), a draft support used up by its candidates (rsd), duplicate candidates (drawn with
    replacement), a drafter equal to the target (everything accepted), an empty tree."""
    target = _support_row([0, 1, 2], [0.5, 0.3, 0.2])
    disjoint, narrow = _support_row([5, 6, 7]), _support_row([1, 2], [0.6, 0.4])
    trees = [DraftTree([5, 7, 6], [-1, -1, -1], disjoint.expand(3, VOCAB)),
             DraftTree([2, 1, 0, 0], [-1, -1, 0, 1], torch.stack([narrow, narrow, target, target])),
             DraftTree([0, 1, 2], [-1, 0, 1], target.expand(3, VOCAB)),
             DraftTree([], [], torch.zeros(0, VOCAB))]
    if scheme != "rsd":
        trees.append(DraftTree([1, 1, 2], [-1, -1, 1], torch.stack([narrow, narrow, target])))
    counters = 50
    trees = trees * counters
    node_tokens, parents, num_nodes, draft_probs = pack_trees(Blocks.of(trees), range(len(trees)), 4, VOCAB)
    target_probs = target.expand(len(trees), 5, VOCAB).contiguous()
    seeds = torch.full((len(trees),), 3, dtype=torch.int64)
    draws = tree_draws(seeds, torch.arange(len(trees)), 4, VOCAB)
    greedy = torch.zeros(len(trees), dtype=torch.bool)
    path, path_len, next_tokens = verify_trees(target_probs, draft_probs, node_tokens, parents, num_nodes, greedy, *draws,
                                               scheme, 3, 3)
    for r, tree in enumerate(trees):
        expected = _reference(trees, greedy, target_probs, scheme, *draws, r)
        assert (path[r, : int(path_len[r])].tolist(), int(next_tokens[r])) == expected, (scheme, r)


def test_the_reference_walks_deep_and_stops_everywhere():
    """The random batches above reach every kind of verdict (guards the generator of trees)."""
    lengths, corrections, bonuses = collections.Counter(), 0, 0
    for scheme in MULTI_DRAFT_SCHEMES:
        for seed in range(4):
            trees, greedy, target_probs, _, _, _, _, seeds, counters = _random_batch(seed, scheme)
            draws = tree_draws(seeds, counters, MAX_NODES, VOCAB)
            for r, tree in enumerate(trees):
                path, _ = _reference(trees, greedy, target_probs, scheme, *draws, r)
                lengths[len(path)] += 1
                below = tree.children(path[-1] if path else -1)
                corrections += bool(below)
                bonuses += not below
    assert min(lengths) == 0 and max(lengths) >= 4 and corrections >= 40 and bonuses >= 40, (lengths, corrections, bonuses)


def test_greedy_trees_equal_verify_tree():
    generator = torch.Generator().manual_seed(5)
    trees = [_random_tree(generator, "specinfer", True)[0] for _ in range(16)]
    node_tokens, parents, num_nodes, _ = pack_trees(Blocks.of(trees), range(len(trees)), MAX_NODES, VOCAB)
    logits = torch.randn(len(trees), MAX_NODES + 1, VOCAB, generator=generator)
    for r, tree in enumerate(trees):  # drafts that follow the target's argmax, until they do not
        for j in range(len(tree)):
            if torch.rand((), generator=generator) < 0.7:
                node_tokens[r, j] = logits[r, tree.parents[j] + 1].argmax()
        tree.tokens = node_tokens[r, : len(tree)].tolist()
    max_depth = max(_depth(tree) for tree in trees)
    path, path_len, next_tokens = verify_greedy_trees(logits, node_tokens, parents, num_nodes, max_depth, MAX_WIDTH)
    assert int(path_len.max()) >= 3
    for r, tree in enumerate(trees):
        expected = verify_tree(logits[r, : len(tree) + 1], tree, "specinfer", True, None)
        assert (path[r, : int(path_len[r])].tolist(), int(next_tokens[r])) == expected, r


@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
def test_a_seeded_request_gets_the_same_verdict_alone_or_in_any_batch(scheme):
    trees, greedy, target_probs, draft_probs, node_tokens, parents, num_nodes, seeds, counters = _random_batch(7, scheme)
    max_depth = max(_depth(tree) for tree in trees)
    together = verify_trees(target_probs, draft_probs, node_tokens, parents, num_nodes, greedy,
                            *tree_draws(seeds, counters, MAX_NODES, VOCAB), scheme, max_depth, MAX_WIDTH)
    for r, tree in enumerate(trees):
        n = max(len(tree), 1)  # alone: a batch of one with the least padding
        alone = verify_trees(target_probs[r:r + 1, : n + 1], draft_probs[r:r + 1, :n], node_tokens[r:r + 1, :n],
                             parents[r:r + 1, :n],
                             num_nodes[r:r + 1], greedy[r:r + 1], *tree_draws(seeds[r:r + 1], counters[r:r + 1], n, VOCAB),
                             scheme, _depth(tree), MAX_WIDTH + 2)
        length = int(alone[1][0])
        assert length == int(together[1][r]) and alone[0][0, :length].tolist() == together[0][r, :length].tolist(), (scheme, r)
        assert int(alone[2][0]) == int(together[2][r]), (scheme, r)


@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
def test_device_tree_verification_is_lossless(scheme):
    """Chi-square (alpha ALPHA) over LOSSLESS_SAMPLES requests, one per seed, all in one batch. Each
    drafts a tree from its own stream: 3 root candidates drawn as `scheme` requires (rsd without
    replacement, spectr i.i.d. from one row, specinfer / importance from three different rows),
    each with one child drawn from a row that depends on its token. The first two emitted tokens
    (a second round, when only one token is emitted, is a direct target draw) must follow the
    target's exact joint t0(x1) t1[x1](x2)."""
    vocab, samples, width = LOSSLESS_VOCAB, LOSSLESS_SAMPLES, 3
    first_target = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    pattern = torch.arange(vocab * vocab, dtype=torch.float32).view(vocab, vocab)
    second_target = torch.softmax(pattern.remainder(7) * 0.6, dim=-1)  # [V, V] t1[x1]
    root_draft = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1])
    root_drafts = torch.stack([root_draft, torch.tensor([0.05, 0.05, 0.3, 0.3, 0.3]), torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])])
    if scheme in ("rsd", "spectr"):
        root_drafts = root_draft.expand(width, vocab)
    second_draft = torch.softmax(pattern.remainder(3) * 0.8, dim=-1)  # [V, V]
    seeds = torch.arange(samples, dtype=torch.int64)
    zero = torch.zeros(samples, dtype=torch.int64)
    noise = stream_exponentials(seeds, zero, DOMAIN_DRAFT, (width + width) * vocab).view(samples, width + width, vocab)
    if scheme == "rsd":  # Gumbel-top-k: the first `width` tokens of log q + Gumbel
        candidates = (torch.log(root_draft) - torch.log(noise[:, 0])).topk(width, dim=-1).indices  # [S, W]
    else:
        candidates = torch.argmax(root_drafts / noise[:, :width], dim=-1)  # [S, W] candidate j ~ root_drafts[j]
    grandchildren = torch.argmax(second_draft[candidates] / noise[:, width:], dim=-1)  # [S, W]
    node_tokens = torch.cat([candidates, grandchildren], dim=1)  # [S, 2W]: nodes 0..W-1 under the root, W + j under j
    parents = torch.tensor([-1] * width + list(range(width))).expand(samples, -1)
    draft_probs = torch.cat([root_drafts.expand(samples, width, vocab), second_draft[candidates]], dim=1)  # [S, 2W, V]
    target_probs = torch.cat([first_target.expand(samples, 1, vocab), second_target[candidates],
                              first_target.expand(samples, width, vocab)], dim=1)  # [S, 2W + 1, V]
    path, path_len, next_tokens = verify_trees(target_probs, draft_probs, node_tokens, parents, torch.full((samples,), 2 * width),
                                               torch.zeros(samples, dtype=torch.bool), *tree_draws(seeds, zero, 2 * width, vocab),
                                               scheme, 2, width)
    out = emitted_tree_tokens(node_tokens, path, path_len, next_tokens)  # [S, 3]
    next_round = torch.argmax(second_target[out[:, 0]] / stream_exponentials(seeds, zero + 1, DOMAIN_NEXT, vocab), dim=-1)
    seconds = torch.where(path_len >= 1, out[:, 1], next_round)
    counts = collections.Counter(zip(out[:, 0].tolist(), seconds.tolist()))
    assert int((path_len == 2).sum()) > samples / 10 and int((path_len == 0).sum()) > samples / 20  # both levels matter
    assert chi_square_p_value(counts, first_target[:, None] * second_target, samples) > ALPHA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
def test_verify_trees_on_cuda_equals_the_reference(scheme):
    """The same kernel on the GPU (its own reduction order: float sums may differ in the last bit,
    the verdicts may not) against the CPU reference; the streams are the same on every device."""
    trees, greedy, target_probs, draft_probs, node_tokens, parents, num_nodes, seeds, counters = _random_batch(11, scheme)
    draws = tree_draws(seeds, counters, MAX_NODES, VOCAB)
    cuda_draws = tree_draws(seeds.cuda(), counters.cuda(), MAX_NODES, VOCAB)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(draws, cuda_draws))
    args = [t.cuda() for t in (target_probs, draft_probs, node_tokens, parents, num_nodes, greedy)]
    max_depth = max(_depth(tree) for tree in trees)
    path, path_len, next_tokens = (t.cpu() for t in verify_trees(*args, *cuda_draws, scheme, max_depth, MAX_WIDTH))
    for r, tree in enumerate(trees):
        expected = _reference(trees, greedy, target_probs, scheme, *draws, r)
        assert (path[r, : int(path_len[r])].tolist(), int(next_tokens[r])) == expected, (scheme, r)


def _tree_step(target_probs, draft_probs, node_tokens, parents, num_nodes, greedy, seeds, counters, scheme):
    """A tier's tree verification after its forward: draws, verify, the output row."""
    draws = tree_draws(seeds, counters, node_tokens.shape[1], target_probs.shape[-1])
    path, path_len, next_tokens = verify_trees(target_probs, draft_probs, node_tokens, parents, num_nodes, greedy, *draws,
                                               scheme, 3, 3)
    return emitted_tree_tokens(node_tokens, path, path_len, next_tokens)


@pytest.mark.parametrize("scheme", MULTI_DRAFT_SCHEMES)
def test_the_tree_step_compiles_whole_and_once_per_bucket(scheme):
    step = CompiledGraphs(lambda *args: _tree_step(*args, scheme))
    generator = torch.Generator().manual_seed(1)
    trees = [DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, -1, 0, 1, 3], None), DraftTree([], [], None),
             DraftTree([7, 8, 9], [-1, 0, 1], None), DraftTree([3, 4], [-1, -1], None)]
    node_tokens, parents, num_nodes, _ = pack_trees(Blocks.of(trees), range(len(trees)), 6, 16)
    for step_index in range(2):  # new values every step, the same shapes
        target_probs = torch.softmax(torch.randn(4, 7, 16, generator=generator), dim=-1)
        draft_probs = torch.softmax(torch.randn(4, 6, 16, generator=generator), dim=-1)
        args = (target_probs, draft_probs, node_tokens, parents, num_nodes, torch.tensor([False, False, True, False]),
                torch.tensor([1, 2, 3, 4]), torch.full((4,), step_index))
        assert torch.equal(step(*args), _tree_step(*args, scheme))  # the traced step computes what the eager one does
    assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
    step.close()


def test_the_greedy_tree_step_compiles_whole():
    step = CompiledGraphs(lambda *args: verify_greedy_trees(*args, 3, 2))
    node_tokens, parents, num_nodes, _ = pack_trees(Blocks.of([DraftTree([1, 2, 3], [-1, -1, 0], None), DraftTree([], [], None)]), [0, 1], 3, 8)
    logits = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    eager = verify_greedy_trees(logits, node_tokens, parents, num_nodes, 3, 2)
    for got, expected in zip(step(logits, node_tokens, parents, num_nodes), eager):
        assert torch.equal(got, expected)
    assert len(step.graphs) == 1
    step.close()
