"""Draft trees: the structure a drafter proposes and a verifier scores in one forward.

A tree hangs off the *root*, the last token of the committed context. Node j carries
`tokens[j]`, its parent `parents[j]` (-1 for a child of the root) and `draft_rows[j]`,
the drafter's probability row the token was drawn from (the drafter's distribution at
the parent). A chain of k tokens is the tree with parents [-1, 0, 1, ..., k-2].

Nodes are stored parents-first (a node's parent always has a smaller index), which is
what the attention mask and the walk below rely on. A call's blocks, one per request, travel
as one `Blocks`: every request's nodes flattened with offsets, on the drafter's device. (Also `common_prefix`, of two token lists: where a cache,
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


class Ragged:
    """Per-request runs of rows laid one after the other: request r's are rows `offsets[r]:offsets[r + 1]` of any
    tensor laid out as they are (vLLM's layout with offsets). `Blocks` (a call's drafted nodes) and
    polyspec.workers.core.verdicts.ScoredRows (a verifier's rows for them) are laid out so."""

    offsets: list[int]  # [R + 1], on the host

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    def nodes_of(self, values: torch.Tensor, requests: list[int]) -> torch.Tensor:
        """`values` ([N, ...], laid out as these runs) of `requests`' runs, concatenated in their order."""
        if list(requests) == list(range(len(self))):
            return values
        index = [i for r in requests for i in range(self.offsets[r], self.offsets[r + 1])]
        return values[torch.tensor(index, dtype=torch.long, device=values.device)]

    def padded(self, values: torch.Tensor, requests: list[int], width: int, fill=0) -> torch.Tensor:
        """`values` ([N, ...], laid out as these runs) of `requests`, a row each padded with `fill` to `width`:
        [len(requests), width, ...] (a view of `values` when every request is there and every run is that wide)."""
        requests = list(requests)
        sizes = [self.offsets[r + 1] - self.offsets[r] for r in requests]
        rest = tuple(values.shape[1:])
        if requests == list(range(len(self))) and all(size == width for size in sizes):
            return values.view((len(requests), width) + rest)
        out = values.new_full((len(requests) * width,) + rest, fill)
        source = [self.offsets[r] + j for r, size in zip(requests, sizes) for j in range(size)]
        if source:
            target = [i * width + j for i, size in enumerate(sizes) for j in range(size)]
            out[torch.tensor(target, device=values.device)] = values[torch.tensor(source, device=values.device)]
        return out.view((len(requests), width) + rest)


class Blocks(Ragged):
    """Every request's drafted block of one call, flattened with offsets (vLLM's layout for draft tokens): request
    r's nodes are `tokens[offsets[r]:offsets[r + 1]]`, each with its parent within its block in `parents` (-1: a
    child of the root; a chain's are -1, 0, 1, ...), and where its block carries them (`carries[r]`; a greedy
    draft and a lookup's proposal carry none) the drafter's rows `draft_rows[offsets[r]:offsets[r + 1]]`. The
    tensors stay on the drafter's device from its draws to the verdict; the offsets and which blocks are chains
    are on the host (the round's bookkeeping reads them without a copy). Read per request (`blocks[r]`: a
    `DraftTree`), the tokens and parents are copied to the host once for the whole batch."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor, offsets: list[int], chains: list[bool],
                 draft_rows: torch.Tensor | None = None, carries: list[bool] | None = None,
                 host: tuple[list[list[int]], list[list[int]]] | None = None) -> None:
        assert len(offsets) == len(chains) + 1 and tokens.shape[0] == parents.shape[0] == offsets[-1]
        assert draft_rows is None or (carries is not None and draft_rows.shape[0] == offsets[-1])
        self.tokens = tokens  # [N] long
        self.parents = parents  # [N] long
        self.offsets = offsets  # [R + 1]
        self.chains = chains  # [R]: request r's block is a chain
        self.draft_rows = draft_rows  # [N, V] float32 (zeros where a block carries none), or None: none does
        self.carries = carries if draft_rows is not None else [False] * len(chains)
        self._host = host  # (tokens, parents) per request, when the drafter had them on the host already

    @classmethod
    def of(cls, trees: list[DraftTree], device: torch.device | str | None = None) -> "Blocks":
        """The batch of `trees` on `device` (None: where their draft rows are, else the CPU)."""
        return cls._build([list(tree.tokens) for tree in trees], [list(tree.parents) for tree in trees],
                          [tree.is_chain() for tree in trees], [tree.draft_rows for tree in trees], device)

    @classmethod
    def of_chains(cls, tokens: list[list[int]], rows: list[torch.Tensor | None], device: torch.device | str | None = None) -> "Blocks":
        """The batch of chains `tokens[r]`, drawn from `rows[r]` ([len, V]; None: no rows)."""
        return cls._build(tokens, [list(range(-1, len(t) - 1)) for t in tokens], [True] * len(tokens), rows, device)

    @classmethod
    def _build(cls, tokens: list[list[int]], parents: list[list[int]], chains: list[bool], rows: list[torch.Tensor | None],
               device) -> "Blocks":
        offsets = [0]
        for block in tokens:
            offsets.append(offsets[-1] + len(block))
        carries = [r is not None and len(block) > 0 for block, r in zip(tokens, rows)]
        if device is None:
            device = next((r.device for r, carried in zip(rows, carries) if carried), "cpu")
        flat_rows = None
        if any(carries):
            vocab = next(r.shape[-1] for r, carried in zip(rows, carries) if carried)
            flat_rows = torch.cat([r.to(device, torch.float32) if carried else torch.zeros(len(block), vocab, device=device)
                                   for block, r, carried in zip(tokens, rows, carries)])
        flat = torch.tensor([t for block in tokens for t in block] + [p for block in parents for p in block], dtype=torch.long)
        flat = flat.to(device)  # (one copy for both)
        return cls(flat[: offsets[-1]], flat[offsets[-1]:], offsets, chains, flat_rows, carries, (tokens, parents))

    @classmethod
    def empty(cls, count: int, device: torch.device | str = "cpu") -> "Blocks":
        """`count` empty blocks (nothing drafted)."""
        return cls.of([DraftTree([], [], None) for _ in range(count)], device)

    @classmethod
    def gather(cls, count: int, parts: list[tuple[list[int], "Blocks"]]) -> "Blocks":
        """One batch of `count` requests from `parts` (request indices, their blocks); a request in no part gets an
        empty block. (A round whose requests are drafted by different tiers.)"""
        if len(parts) == 1 and parts[0][0] == list(range(count)):
            return parts[0][1]
        trees: list[DraftTree] = [DraftTree([], [], None) for _ in range(count)]
        for indices, blocks in parts:
            for j, tree in zip(indices, blocks):
                trees[j] = tree
        return cls.of(trees, next((b.tokens.device for _, b in parts), None))

    @property
    def all_chains(self) -> bool:
        return all(self.chains)

    def host(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every block's tokens and parents as host lists (one copy for the batch)."""
        if self._host is None:
            tokens, parents = self.tokens.tolist(), self.parents.tolist()
            self._host = ([tokens[a:b] for a, b in zip(self.offsets, self.offsets[1:])],
                          [parents[a:b] for a, b in zip(self.offsets, self.offsets[1:])])
        return self._host

    def __getitem__(self, r: int) -> DraftTree:
        tokens, parents = self.host()
        rows = self.draft_rows[self.offsets[r]: self.offsets[r + 1]] if self.carries[r] else None
        return DraftTree(list(tokens[r]), list(parents[r]), rows)

    def __iter__(self):
        return (self[r] for r in range(len(self)))


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


def path_rows(target_probs: torch.Tensor, chain: bool, path: list[int]) -> torch.Tensor:
    """The verifier's rows at the root and below each accepted node ([len(path) + 1, V]) of a block (`chain`: a
    chain's): the rows the emitted tokens (the accepted path, then the correction or bonus token) are distributed as."""
    return target_probs[: len(path) + 1] if chain else target_probs[[0] + [j + 1 for j in path]]
