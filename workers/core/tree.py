"""Draft trees: the structure a drafter proposes and a verifier scores in one forward.

A tree hangs off the *root*, the last token of the committed context. Node j carries
`tokens[j]`, its parent `parents[j]` (-1 for a child of the root) and `draft_rows[j]`,
the drafter's probability row the token was drawn from (the drafter's distribution at
the parent). A chain of k tokens is the tree with parents [-1, 0, 1, ..., k-2].

Nodes are stored parents-first (a node's parent always has a smaller index), which is
what the attention mask and the walk below rely on.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    draft_rows: torch.Tensor | None  # [N, V] float32; None for greedy drafts

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents)
        for j, parent in enumerate(self.parents):
            assert -1 <= parent < j, "nodes must be stored parents-first"
        if self.draft_rows is not None:
            assert self.draft_rows.shape[0] == len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], draft_rows: torch.Tensor | None) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_rows)

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 0."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return depth

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = the root), in index order."""
        return [j for j, parent in enumerate(self.parents) if parent == node]

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))


def tree_allowed(
    parents: list[int],
    node_positions: list[int] | dict[int, int],
    fed_nodes: list[int],
    prefix_len: int,
    tail_len: int,
    total_len: int,
) -> torch.Tensor:
    """Which positions each query of a tree forward may attend to: a boolean
    [tail_len + len(fed_nodes), total_len] (see `tree_attention_mask` for the layout)."""
    linear_len = prefix_len + tail_len
    num_queries = tail_len + len(fed_nodes)
    allowed = torch.zeros(num_queries, total_len, dtype=torch.bool)
    for q in range(tail_len):
        allowed[q, : prefix_len + q + 1] = True
    for offset, node in enumerate(fed_nodes):
        row = tail_len + offset
        allowed[row, :linear_len] = True
        while node >= 0:
            allowed[row, node_positions[node]] = True
            node = parents[node]
    return allowed


def tree_attention_mask(
    parents: list[int],
    node_positions: list[int] | dict[int, int],
    fed_nodes: list[int],
    prefix_len: int,
    tail_len: int,
    total_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive attention mask for a forward that feeds `tail_len` linear tokens followed by
    the tree nodes `fed_nodes`.

    The cache (plus this forward's inputs) holds `total_len` positions: linear tokens at
    [0, prefix_len + tail_len) and tree nodes at `node_positions[node]`. A linear token at
    position p attends to [0, p]; a tree node attends to every linear position and to its
    ancestors and itself. Returns [1, 1, tail_len + len(fed_nodes), total_len].
    """
    allowed = tree_allowed(parents, node_positions, fed_nodes, prefix_len, tail_len, total_len)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def verify_block(
    target_probs: torch.Tensor, block: DraftTree, scheme: str, greedy: bool, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """(accepted path of node indices, next token) for a drafted block: a chain by the greedy
    or single-draft rule (the drafter's rows, none for a lookup's proposals), a tree by
    `verify_tree`. target_probs: [len(block) + 1, V]."""
    from polyspec.workers.core.verification import verify_chain, verify_greedy

    if not block.is_chain():
        return verify_tree(target_probs, block, scheme, greedy, generator)
    draft_tokens = torch.tensor(block.tokens, dtype=torch.long)
    if greedy:
        accepted, next_token = verify_greedy(target_probs.argmax(dim=-1), draft_tokens)
    else:
        draft_rows = chain_draft_rows(block, target_probs.shape[-1])
        accepted, next_token = verify_chain(target_probs, draft_rows, draft_tokens, generator)
    return list(range(accepted)), next_token


def chain_draft_rows(block: DraftTree, vocab: int) -> torch.Tensor:
    """A chain's draft rows [k, V]: the drafter's, or point masses for a lookup's proposals, which carry none."""
    if block.draft_rows is not None:
        return block.draft_rows
    return torch.nn.functional.one_hot(torch.tensor(block.tokens, dtype=torch.long), vocab).float()


def path_rows(target_probs: torch.Tensor, block: DraftTree, path: list[int]) -> torch.Tensor:
    """The verifier's rows at the root and below each accepted node ([len(path) + 1, V]): the rows the emitted
    tokens (the accepted path, then the correction or bonus token) are distributed as."""
    return target_probs[: len(path) + 1] if block.is_chain() else target_probs[[0] + [j + 1 for j in path]]


def verify_tree(
    target_probs: torch.Tensor, tree: DraftTree, scheme: str, greedy: bool, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Walk the tree from the root, one verification rule per node. Returns (accepted path of
    node indices, next token): the next token is the correction where the walk stopped, or
    the bonus token below an accepted leaf.

    target_probs: [len(tree) + 1, V] float32 — row 0 at the root, row 1 + j at node j.
    A node with one child is single-draft speculative sampling; a node with several
    children uses the multi-draft `scheme` (candidates as the drafter drew them).
    """
    from polyspec.workers.core.verification import GeneratorDraws

    draws = GeneratorDraws(generator)
    return _walk_tree(target_probs, tree, scheme, greedy, lambda children: draws)


def verify_tree_drawn(
    target_probs: torch.Tensor, tree: DraftTree, scheme: str, greedy: bool,
    uniforms: torch.Tensor, move_uniforms: torch.Tensor, exponentials: torch.Tensor,
) -> tuple[list[int], int]:
    """`verify_tree` with its randomness given: the slow, obvious reference of the device tree
    kernels (polyspec.workers.core.device_tree_verify), which must match it bit for bit.

    uniforms, move_uniforms: [len(tree)] float32 in (0, 1), node j's acceptance draw and its
    importance-chain move draw (see `GivenDraws`); exponentials: [V], the noise of the one
    correction or bonus draw (exponential race).
    """
    from polyspec.workers.core.verification import GivenDraws

    assert uniforms.shape == move_uniforms.shape == (len(tree),) and exponentials.shape == target_probs.shape[1:]
    return _walk_tree(target_probs, tree, scheme, greedy,
                      lambda children: GivenDraws(uniforms[children], move_uniforms[children], exponentials))


def _walk_tree(target_probs: torch.Tensor, tree: DraftTree, scheme: str, greedy: bool, draws_of) -> tuple[list[int], int]:
    """The walk of `verify_tree`; `draws_of(children)` gives the draws of one node's selection."""
    from polyspec.workers.core.verification import select_multi_draft_drawn

    assert target_probs.shape[0] == len(tree) + 1, (target_probs.shape, len(tree))
    children_of: dict[int, list[int]] = {}
    for j, parent in enumerate(tree.parents):
        children_of.setdefault(parent, []).append(j)
    path: list[int] = []
    node = -1
    while True:
        row = target_probs[node + 1]  # [V]
        children = children_of.get(node, [])
        if greedy:
            best = int(row.argmax())
            match = next((c for c in children if tree.tokens[c] == best), None)
            if match is None:
                return path, best
            path.append(match)
            node = match
            continue
        draws = draws_of(children)
        if not children:
            return path, draws.sample(row)
        candidates = torch.tensor([tree.tokens[c] for c in children], dtype=torch.long)
        rule = scheme if len(children) > 1 else "specinfer"
        token, index = select_multi_draft_drawn(row, tree.draft_rows[children], candidates, rule, draws)
        if index < 0:
            return path, token
        path.append(children[index])
        node = children[index]


def windowed_mask(mask: torch.Tensor, query_positions: list[int], slot_positions: list[int], window: int) -> torch.Tensor:
    """`mask` ([1, 1, Q, S], additive) with every slot at or past `window` positions behind
    its query hidden: a sliding-window layer's view of a tree forward. Positions are token
    positions (a tree node's is its prefix length + depth), not cache slots."""
    queries = torch.tensor(query_positions, dtype=torch.long)[:, None]  # [Q, 1]
    slots = torch.tensor(slot_positions, dtype=torch.long)[None, :]  # [1, S]
    outside = (queries - slots) >= window  # [Q, S]; transformers' overlay keeps kv > q - window
    return mask.masked_fill(outside[None, None], torch.finfo(mask.dtype).min)
