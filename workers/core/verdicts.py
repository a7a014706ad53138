"""A batch's verdicts on its drafted blocks, on the device: every verification rule of a round in one call.

`verify_blocks` reads a call's drafted blocks (polyspec.workers.core.tree.Blocks) and the verifier's rows for them
(`ScoredRows`), both packed with offsets, sorts the blocks by rule and runs each group as one tensor program: greedy chains
from the argmax alone (`device_verify.verify_greedy_chains`), sampled chains by speculative sampling
(`device_verify.verify_chains`), trees by the multi-draft scheme (`device_tree_verify`). Its answer is
`Verdicts`: every request's accepted length and next token (and a tree's path) as tensors on the
verifier's device, read flattened with offsets, copied to the host once when first read. `Draws` holds a call's sampling parameters and random
streams as device columns, what every draw and verdict reads.

Randomness: a request's draws come from counter-based streams keyed by its random stream at a tier
(polyspec.workers.core.sampling.RandomStream: `key`, and `take()` for fresh counters; device_verify's
domains), never from the batch: a seeded request gets the same verdict alone or in any batch.
The slow, obvious references these kernels are checked against bit for bit live in
tests/reference_verification.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from polyspec.workers.core.device_tree_verify import pack_trees, tree_draws, verify_greedy_trees, verify_trees
from polyspec.workers.core.device_verify import (
    DOMAIN_ACCEPT,
    DOMAIN_NEXT,
    draw_tokens,
    root_candidates,
    sampling_mode,
    stream_exponentials,
    stream_uniforms,
    verify_chains,
    verify_greedy_chains,
)
from polyspec.workers.core.sampling import RandomStream, SamplingParams, warp_logits
from polyspec.workers.core.tree import Blocks, Ragged


def stream_key(generator, rounds: int = 1) -> tuple[int, int]:
    """(key, first counter) of `rounds` rounds of draws from a request's stream at a tier; a profile's calls pass None."""
    if generator is None:
        return 0, 0
    if isinstance(generator, RandomStream):
        return generator.key, generator.take(rounds)
    # another torch.Generator: a fresh key drawn from it (seeded, it gives the same draws again)
    return int(torch.randint(1 << 62, (1,), generator=generator)), 0


@dataclasses.dataclass
class Draws:
    """A call's requests' sampling parameters and random streams as columns on the device, one entry per request:
    what every draw (polyspec.workers.core.device_verify.draw_tokens) and verdict of the call reads. A request's
    draws are keyed by its stream and a counter, never by the batch, so a seeded request draws the same alone or
    in any batch, on any device."""

    mode: str
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], generators, rounds: list[int], device) -> "Draws":
        """`rounds[r]` rounds taken from request r's stream (a block's tokens, a tree's levels, one verdict)."""
        keys = [stream_key(g, n) for g, n in zip(generators, rounds)]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(sampling_mode(params), column([p.temperature for p in params], torch.float32),
                   column([p.top_k for p in params], torch.long), column([p.top_p for p in params], torch.float32),
                   column([p.greedy for p in params], torch.bool), column([k for k, _ in keys], torch.long),
                   column([c for _, c in keys], torch.long))

    def draw(self, logits: torch.Tensor, index: torch.Tensor, round: int | torch.Tensor = 0,
             first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`draw_tokens` for rows of `logits` [R, V] that belong to requests `index` [R], in round `round` of the
        rounds taken (draws first[r] .. of it)."""
        return draw_tokens(logits, self.mode, self.temperature[index], self.top_k[index], self.top_p[index], self.greedy[index],
                           self.seeds[index], self.counters[index] + round, first)

    def roots(self, logits: torch.Tensor, index: torch.Tensor, width: int, without_replacement: bool):
        """`root_candidates` for rows of `logits` [R, V] of requests `index` (their first round)."""
        return root_candidates(logits, self.mode, width, without_replacement, self.temperature[index], self.top_k[index],
                               self.top_p[index], self.greedy[index], self.seeds[index], self.counters[index])


class ScoredRows(Ragged):
    """A verifier's warped rows for a call's blocks, packed: request r's [len(block) + 1, V] (at its root, then at each
    node) are `rows[offsets[r]:offsets[r + 1]]` (offsets[r] = the block's offset + r), on the verifier's device. Read
    per request (`scored[r]`) as views of them."""

    def __init__(self, rows: torch.Tensor, offsets: list[int]) -> None:
        assert rows.shape[0] == offsets[-1]
        self.rows = rows  # [N + R, V] float32
        self.offsets = offsets

    @classmethod
    def of(cls, rows: list[torch.Tensor]) -> "ScoredRows":
        """Each request's rows, packed (one copy)."""
        offsets = list(itertools.accumulate((len(r) for r in rows), initial=0))
        return cls(torch.cat(rows) if len(rows) != 1 else rows[0], offsets)

    @classmethod
    def warped(cls, logits: list[torch.Tensor], params: list[SamplingParams]) -> "ScoredRows":
        """Each request's logits warped by its own sampling parameters (`warp_logits`), packed. When every request
        samples alike (the usual batch) the packed logits are warped at once: the warp is row by row either way."""
        offsets = list(itertools.accumulate((len(r) for r in logits), initial=0))
        if all(p == params[0] for p in params):
            return cls(warp_logits(torch.cat(logits) if len(logits) != 1 else logits[0], params[0]), offsets)
        return cls(torch.cat([warp_logits(rows, p) for rows, p in zip(logits, params)]), offsets)

    def __getitem__(self, r: int) -> torch.Tensor:
        return self.rows[self.offsets[r]: self.offsets[r + 1]]

    def __iter__(self):
        return (self[r] for r in range(len(self)))


@dataclasses.dataclass
class Verdict:
    """A verifier's decision on one request's block: the accepted path (node indices: a prefix of a chain, root to
    leaf in a tree), the next token (the correction at a rejection, else the bonus), and the verifier's rows at each
    emitted token ([len(path) + 1, V]; None unless asked for and sampling)."""

    path: list[int]
    next_token: int
    rows: torch.Tensor | None = None


@dataclasses.dataclass
class Verdicts:
    """A call's verdicts, one per request, as tensors on the verifier's device: request r accepted `lengths[r]` nodes,
    then `next_tokens[r]`; the nodes are 0 .. lengths[r] - 1 of a chain, `node_paths[r, :lengths[r]]` of a tree
    (`node_paths` None: every block a chain). `paths` / `offsets`: the accepted nodes flattened with offsets (vLLM's
    layout). `rows`: per request, the verifier's rows at its emitted tokens (None: not asked for). Read as a sequence
    of `Verdict`, it copies the tensors to the host once."""

    lengths: torch.Tensor  # [R] long
    next_tokens: torch.Tensor  # [R] long
    node_paths: torch.Tensor | None = None  # [R, D] long
    rows: list | None = None
    _host: list | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def offsets(self) -> torch.Tensor:
        return torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0))

    @property
    def paths(self) -> torch.Tensor:
        depth = int(self.lengths.max()) if len(self) else 0
        nodes = self.node_paths[:, :depth] if self.node_paths is not None else \
            torch.arange(depth, device=self.lengths.device).expand(len(self), depth)
        return nodes[torch.arange(depth, device=self.lengths.device)[None, :] < self.lengths[:, None]]

    def __len__(self) -> int:
        return self.next_tokens.shape[0]

    def __getitem__(self, r: int) -> Verdict:
        if self._host is None:
            lengths, tokens = self.lengths.tolist(), self.next_tokens.tolist()
            nodes = self.node_paths.tolist() if self.node_paths is not None else None
            self._host = [(list(range(n)) if nodes is None else nodes[i][:n], token)
                          for i, (n, token) in enumerate(zip(lengths, tokens))]
        path, token = self._host[r]
        return Verdict(list(path), token, None if self.rows is None else self.rows[r])

    def __iter__(self):
        return (self[r] for r in range(len(self)))


def verify_blocks(scored: ScoredRows, blocks: Blocks, params: list[SamplingParams], generators, scheme: str) -> Verdicts:
    """Each request's verdict on its block (accepted path, next token) from the verifier's warped rows `scored[r]`
    [len(block) + 1, V]: the chains by the tensor verifier of chains (greedy ones from the argmax alone), the trees by
    the tree verifier (`scheme`), each request drawing from one round of its stream (device_verify's domains: a
    seeded request's verdict is the same alone or in any batch). A block that carries no draft rows (a lookup's
    proposals) is a point mass. The drafts are read from the flattened batch; every group's verdicts stay on the
    device, gathered into one `Verdicts`."""
    device = scored.rows.device
    vocab = scored.rows.shape[-1]
    count = len(blocks)
    sizes = blocks.lengths
    lengths = torch.zeros(count, dtype=torch.long, device=device)
    next_tokens = torch.zeros(count, dtype=torch.long, device=device)
    node_paths = None
    greedy = [r for r in range(count) if blocks.chains[r] and params[r].greedy]
    sampled = [r for r in range(count) if blocks.chains[r] and not params[r].greedy]
    trees = [r for r in range(count) if not blocks.chains[r]]
    # every request's stream gives one round to its verdict, drawn on or not (a seeded request's later draws do
    # not depend on its neighbours' rules); the columns are built only where something draws
    draws = Draws.of(params, generators, [1] * count, device) if sampled or trees else None
    if draws is None:
        for generator in generators:
            stream_key(generator, 1)
    tokens = blocks.tokens.to(device)
    if greedy:
        width = max(sizes[r] for r in greedy)
        argmax = scored.padded(scored.rows.argmax(dim=-1), greedy, width + 1)
        accepted, following = verify_greedy_chains(argmax, blocks.padded(tokens, greedy, width),
                                                   torch.tensor([sizes[r] for r in greedy], device=device))
        if len(greedy) == count:  # (the common call: every block a greedy chain)
            lengths, next_tokens = accepted.long(), following.long()
        else:
            index = torch.tensor(greedy, device=device)
            lengths[index], next_tokens[index] = accepted.long(), following.long()
    if sampled:
        index = torch.tensor(sampled, device=device)
        chain_lengths = [sizes[r] for r in sampled]
        cu_num_draft = torch.tensor([0] + chain_lengths, device=device).cumsum(0)
        accepted, following = verify_chains(
            scored.nodes_of(scored.rows, sampled), _chain_rows(blocks, sampled, tokens, vocab, device),
            blocks.nodes_of(tokens, sampled), cu_num_draft, draws.greedy[index],
            stream_uniforms(draws.seeds[index], draws.counters[index], DOMAIN_ACCEPT,
                            max(chain_lengths)).reshape(-1)[_flat_index(chain_lengths, max(chain_lengths))],
            stream_exponentials(draws.seeds[index], draws.counters[index], DOMAIN_NEXT, vocab))
        if len(sampled) == count:
            lengths, next_tokens = accepted.long(), following.long()
        else:
            lengths[index], next_tokens[index] = accepted.long(), following.long()
    if trees:
        index = torch.tensor(trees, device=device)
        nodes = max(sizes[r] for r in trees)
        node_tokens, parents, num_nodes, draft_probs = pack_trees(blocks, trees, nodes, vocab, device)
        target = scored.padded(scored.rows, trees, nodes + 1, 0.0)
        shapes = [blocks[r] for r in trees]  # (host lists: a tree's depth and width bound the walk)
        tree_depth = max(max(tree.depths(), default=-1) + 1 for tree in shapes)
        width = max(max([tree.parents.count(p) for p in set(tree.parents)], default=0) for tree in shapes)
        if all(params[r].greedy for r in trees):
            path, path_len, following = verify_greedy_trees(target, node_tokens, parents, num_nodes, tree_depth, max(width, 1))
        else:
            path, path_len, following = verify_trees(target, draft_probs, node_tokens, parents, num_nodes, draws.greedy[index],
                                                     *tree_draws(draws.seeds[index], draws.counters[index], nodes, vocab), scheme,
                                                     tree_depth, max(width, 1))
        depth = max(max(sizes), 1)
        node_paths = torch.arange(depth, device=device).repeat(count, 1)  # [R, D]: a chain accepts nodes 0 .. n - 1
        columns = min(path.shape[1], depth)
        node_paths[index, :columns] = path[:, :columns].long()
        lengths[index], next_tokens[index] = path_len.long(), following.long()
    return Verdicts(lengths, next_tokens, node_paths)


def _chain_rows(blocks: Blocks, requests: list[int], tokens: torch.Tensor, vocab: int, device) -> torch.Tensor:
    """The draft rows of `requests`' chains ([nodes, V] float32 on `device`): the drafter's, or point masses at the
    tokens of a block that carries none (a lookup's proposals)."""
    point = [r for r in requests if not blocks.carries[r]]
    if not point:
        return blocks.nodes_of(blocks.draft_rows, requests).to(device, torch.float32)
    masses = torch.nn.functional.one_hot(blocks.nodes_of(tokens, requests), vocab).float()
    if len(point) == len(requests):
        return masses
    carried = torch.tensor([blocks.carries[r] for r in requests for _ in range(blocks.lengths[r])], device=device)
    return torch.where(carried[:, None], blocks.nodes_of(blocks.draft_rows, requests).to(device, torch.float32), masses)


def _flat_index(lengths: list[int], width: int) -> torch.Tensor:
    """The positions of ragged rows of `lengths` in their padded [len(lengths), width] layout, flattened."""
    return torch.tensor([r * width + j for r, n in enumerate(lengths) for j in range(n)], dtype=torch.long)
