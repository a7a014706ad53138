"""Draft trees: the structure a drafter proposes and a verifier scores in one forward.

A tree hangs off the *root*, the last token of the committed context. Node j carries
`tokens[j]`, its parent `parents[j]` (-1 for a child of the root) and `draft_rows[j]`,
the drafter's probability row the token was drawn from (the drafter's distribution at
the parent). A chain of k tokens is the tree with parents [-1, 0, 1, ..., k-2].

Nodes are stored parents-first (a node's parent always has a smaller index), which is
what the attention mask and the walk below rely on. (Also `common_prefix`, of two token lists: where a cache,
a grammar matcher or a context sent before parts from the context now.)
"""

from __future__ import annotations

import dataclasses

import torch


def common_prefix(tokens: list[int], other: list[int]) -> int:
    """Length of the longest common prefix of two token lists. Usually one extends the other (a cache and the
    context after it, a context sent and the next one): that is one list comparison in C, the loop only finds
    where they part."""
    limit = min(len(tokens), len(other))
    if tokens[:limit] == other[:limit]:
        return limit
    length = 0
    for a, b in zip(tokens, other):
        if a != b:
            break
        length += 1
    return length


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
    """Which positions each query of a forward feeding `tail_len` linear tokens, then the tree nodes
    `fed_nodes`, may attend to: a boolean [tail_len + len(fed_nodes), total_len].

    The cache (plus this forward's inputs) holds `total_len` positions: linear tokens at
    [0, prefix_len + tail_len) and tree nodes at `node_positions[node]`. A linear token at
    position p attends to [0, p]; a tree node attends to every linear position and to its
    ancestors and itself."""
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


def chain_draft_rows(block: DraftTree, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A chain's draft rows [k, V] float32 on `device`: the drafter's, or point masses for a lookup's proposals,
    which carry none."""
    if block.draft_rows is not None:
        return block.draft_rows.to(device, torch.float32)
    return torch.nn.functional.one_hot(torch.tensor(block.tokens, dtype=torch.long, device=device), vocab).float()


def path_rows(target_probs: torch.Tensor, block: DraftTree, path: list[int]) -> torch.Tensor:
    """The verifier's rows at the root and below each accepted node ([len(path) + 1, V]): the rows the emitted
    tokens (the accepted path, then the correction or bonus token) are distributed as."""
    return target_probs[: len(path) + 1] if block.is_chain() else target_probs[[0] + [j + 1 for j in path]]
