"""A whole batch's draft-tree verification as tensor programs: no host sync, static shapes.

The tree half of a round that stays on the device, beside `device_verify` (chains). Each
kernel walks every request's tree at once, depth by depth, exactly as the slow reference
`verify_tree_drawn` (tests/reference_verification.py) walks one tree: at each node the greedy rule
(accept the child whose token is the target's argmax), or with one child single-draft
speculative sampling, or with several children the batch's multi-draft scheme
(`MULTI_DRAFT_SCHEMES`: specinfer, rsd, spectr, importance), with the same float32 / float64 arithmetic as the reference.

Layout (padded, every shape static): B requests, each a tree of at most N nodes stored
parents-first (`DraftTree`'s convention).
- node_tokens, parents: [B, N] int64 (parent -1: a child of the root); num_nodes: [B]: request
  r's nodes are its first num_nodes[r], the rest is padding and never read;
- draft_probs: [B, N, V] float32, the row node j's token was drawn from (its parent's drafter
  row); zeros for greedy requests;
- target_probs: [B, N + 1, V] float32: row 0 at the root, row j + 1 after node j.
Static bounds: max_depth >= every tree's depth (a chain of k nodes has depth k) and
max_width >= every node's number of children; one (B, N, V, depth, width) bucket is one graph.
Outputs: the accepted path [B, max_depth] of node indices (PLACEHOLDER_NODE past its length),
its length [B] and the next token [B] (the correction where the walk stopped, or the bonus
below an accepted leaf): what the reference's `verify_tree` returns.

Randomness (`tree_draws`): node j's acceptance test uses uniform j of the request's
DOMAIN_ACCEPT stream (a chain's position j uses the same one), the importance chain's step to
node j uses uniform j of DOMAIN_TREE_MOVE, and the one correction / bonus draw the
DOMAIN_NEXT exponentials (exponential race). Draws are keyed by (seed, counter, domain, node),
never by the batch or its padding: a seeded request gets the same tokens alone or in any batch.

Cost: rsd, specinfer and greedy are O(W V) per depth; spectr adds a sort and 50 bisection
steps over V; importance computes the exact law of its chain's choice, O(W V^2) per depth
(the reference's O(K S^2) over the drafts' support S; static shapes cannot shrink V to S).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polyspec.workers.core.device_verify import (
    DOMAIN_ACCEPT,
    DOMAIN_NEXT,
    DOMAIN_TREE_MOVE,
    stream_exponentials,
    stream_uniforms,
)
from polyspec.workers.core.tree import Blocks
MULTI_DRAFT_SCHEMES = ("specinfer", "rsd", "spectr", "importance")
SPECTR_BISECTION_STEPS = 50  # halves [1, K] to below 1e-14: rho* is exact to float64
INDUCED_CHUNK_ELEMENTS = 1 << 22  # cap on one [rows, S] block of the importance chain
BARKER_TIE_MOVE_PROB = 0.5  # move probability when both Barker weights are zero
PLACEHOLDER_NODE = -1  # fills a request's path past its accepted nodes; also "no child" in the children table
Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # node_tokens, parents, num_nodes, draft_probs
TreeDraws = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # uniforms [B, N], move_uniforms [B, N], exponentials [B, V]
Verdict = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # path [B, max_depth], path_len [B], next_tokens [B]


class _Candidates(NamedTuple):
    """The children of each request's current node, in index order, padded to max_width W."""

    tokens: torch.Tensor  # [B, W] int64
    valid: torch.Tensor  # [B, W] bool: a real child (valid ones come first)
    count: torch.Tensor  # [B] int64
    draft_rows: torch.Tensor  # [B, W, V] float32
    uniforms: torch.Tensor  # [B, W] acceptance draws
    move_uniforms: torch.Tensor  # [B, W] importance-chain draws


class _Selection(NamedTuple):
    """One step of the walk: the accepted child, or the row the next token is drawn from."""

    slot: torch.Tensor  # [B] the accepted candidate's slot, -1 when none was accepted
    row: torch.Tensor  # [B, V] float32 residual (or the target row)
    wide_row: torch.Tensor | None  # [B, V] float64 residual, drawn from instead of `row` where `wide`
    wide: torch.Tensor | None  # [B] bool


# ------------------------------------------------------------------------------ layout


def pack_trees(blocks: Blocks, requests: list[int], max_nodes: int, vocab: int, device: torch.device | str = "cpu") -> Layout:
    """The padded layout of `requests`' trees of `blocks` on `device` (node_tokens [B, N], parents [B, N],
    num_nodes [B], draft_probs [B, N, V]; a tree that carries no rows (greedy) has zeros), gathered from the
    flattened batch where the drafter left it."""
    assert all(blocks.lengths[r] <= max_nodes for r in requests), (blocks.lengths, max_nodes)
    node_tokens = blocks.padded(blocks.tokens, requests, max_nodes).to(device)
    parents = blocks.padded(blocks.parents, requests, max_nodes, -1).to(device)
    if blocks.draft_rows is None:
        draft_probs = torch.zeros(len(requests), max_nodes, vocab, dtype=torch.float32, device=device)
    else:
        draft_probs = blocks.padded(blocks.draft_rows, requests, max_nodes, 0.0).to(device, torch.float32)
    num_nodes = torch.tensor([blocks.lengths[r] for r in requests], dtype=torch.int64, device=device)
    return node_tokens, parents, num_nodes, draft_probs


def children_table(parents: torch.Tensor, num_nodes: torch.Tensor, max_width: int) -> torch.Tensor:
    """[B, N + 1, W] int64: row p + 1 lists node p's children (row 0: the root's) in index order,
    then PLACEHOLDER_NODE. A node's slot is the number of earlier siblings it has."""
    batch, max_nodes = parents.shape
    nodes = torch.arange(max_nodes, device=parents.device)
    real = nodes[None, :] < num_nodes[:, None]  # [B, N]
    earlier = (nodes[None, :] < nodes[:, None])[None]  # [1, N, N]: [j, i] is i < j
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & real[:, None, :] & earlier  # [B, N, N]
    slot = earlier_sibling.sum(dim=-1)  # [B, N]
    discard = (max_nodes + 1) * max_width  # one extra cell takes padding nodes (and any child past max_width)
    cell = torch.where(real & (slot < max_width), (parents + 1) * max_width + slot, discard)  # [B, N]
    table = torch.full((batch, discard + 1), PLACEHOLDER_NODE, dtype=torch.int64, device=parents.device)
    table = table.scatter(1, cell, nodes.expand(batch, max_nodes))
    return table[:, :discard].view(batch, max_nodes + 1, max_width)


def tree_draws(seeds: torch.Tensor, counters: torch.Tensor, max_nodes: int, vocab: int) -> TreeDraws:
    """(uniforms [B, N], move_uniforms [B, N], exponentials [B, V]): a tree round's draws (see the module docstring)."""
    return (stream_uniforms(seeds, counters, DOMAIN_ACCEPT, max_nodes),
            stream_uniforms(seeds, counters, DOMAIN_TREE_MOVE, max_nodes),
            stream_exponentials(seeds, counters, DOMAIN_NEXT, vocab))


# ------------------------------------------------------------------------------ kernels


def verify_greedy_trees(target_logits: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                        max_depth: int, max_width: int) -> Verdict:
    """`verify_trees` for a batch whose requests are all greedy, from the logits (no warp, no draws).

    target_logits: [B, N + 1, V]. Returns (path [B, max_depth], path_len [B], next_tokens [B])."""
    batch, max_nodes = node_tokens.shape
    assert target_logits.shape[:2] == (batch, max_nodes + 1) and parents.shape == node_tokens.shape
    assert num_nodes.shape == (batch,)
    target_argmax = target_logits.argmax(dim=-1)  # [B, N + 1]
    children = children_table(parents, num_nodes, max_width)
    requests = torch.arange(batch, device=node_tokens.device)
    current = torch.full((batch,), -1, dtype=torch.int64, device=node_tokens.device)
    walking = torch.ones(batch, dtype=torch.bool, device=node_tokens.device)
    path_columns = []
    for _ in range(max_depth):
        kids = children[requests, current + 1]  # [B, W]
        best = target_argmax.gather(1, (current + 1)[:, None])  # [B, 1]
        slot = _first_true((kids >= 0) & (node_tokens.gather(1, kids.clamp_min(0)) == best))
        current, walking, column = _descend(kids, slot, current, walking)
        path_columns.append(column)
    path = torch.stack(path_columns, dim=1) if path_columns else current.new_zeros(batch, 0)
    return path, (path >= 0).sum(dim=1), target_argmax.gather(1, (current + 1)[:, None])[:, 0]


def verify_trees(target_probs: torch.Tensor, draft_probs: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                 num_nodes: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor, move_uniforms: torch.Tensor,
                 exponentials: torch.Tensor, scheme: str, max_depth: int, max_width: int) -> Verdict:
    """Verify every request's tree at once (layout in the module docstring).

    greedy: [B] bool (walk by the target's argmax, no draws); uniforms, move_uniforms: [B, N]
    float32 (`tree_draws`); exponentials: [B, V]; scheme: the batch's multi-draft rule, one of
    MULTI_DRAFT_SCHEMES (a static choice). rsd and spectr read the first child's draft row as
    every sibling's (the reference requires the rows equal; a kernel cannot raise).
    Returns (path [B, max_depth], path_len [B], next_tokens [B]) as int64 tensors on the device.
    """
    batch, max_nodes = node_tokens.shape
    vocab = target_probs.shape[-1]
    assert scheme in MULTI_DRAFT_SCHEMES, scheme
    assert target_probs.shape == (batch, max_nodes + 1, vocab) and draft_probs.shape == (batch, max_nodes, vocab)
    assert parents.shape == uniforms.shape == move_uniforms.shape == node_tokens.shape and exponentials.shape == (batch, vocab)
    device = target_probs.device
    children = children_table(parents, num_nodes, max_width)
    requests = torch.arange(batch, device=device)
    current = torch.full((batch,), -1, dtype=torch.int64, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    final_row = target_probs[:, 0]  # [B, V] the row the next token is drawn from, set where the walk stops
    final_wide_row = torch.zeros(batch, vocab, dtype=torch.float64, device=device) if scheme in ("spectr", "importance") else None
    final_wide = torch.zeros(batch, dtype=torch.bool, device=device)
    path_columns = []
    for _ in range(max_depth):
        target_row = target_probs[requests, current + 1]  # [B, V]
        kids = children[requests, current + 1]  # [B, W]
        safe_kids = kids.clamp_min(0)
        tokens = node_tokens.gather(1, safe_kids)
        valid = kids >= 0
        candidates = _Candidates(tokens, valid, valid.sum(dim=1), draft_probs[requests[:, None], safe_kids],
                                 uniforms.gather(1, safe_kids), move_uniforms.gather(1, safe_kids))
        selection = _select(scheme, target_row, candidates)
        greedy_slot = _first_true(valid & (tokens == target_row.argmax(dim=-1, keepdim=True)))
        slot = torch.where(greedy, greedy_slot, selection.slot)
        stops = (walking & (slot < 0))[:, None]  # [B, 1]
        final_row = torch.where(stops, torch.where(greedy[:, None], target_row, selection.row), final_row)
        if selection.wide is not None:
            final_wide_row = torch.where(stops, selection.wide_row, final_wide_row)
            final_wide = torch.where(stops[:, 0], selection.wide & ~greedy, final_wide)
        current, walking, column = _descend(kids, slot, current, walking)
        path_columns.append(column)
    # still walking: at a leaf of depth max_depth - 1 (or the root when max_depth is 0): the bonus row
    final_row = torch.where(walking[:, None], target_probs[requests, current + 1], final_row)
    path = torch.stack(path_columns, dim=1) if path_columns else current.new_zeros(batch, 0)
    next_tokens = torch.argmax(final_row / exponentials, dim=-1)
    if final_wide_row is not None:
        wide_next = torch.argmax(final_wide_row / exponentials, dim=-1)  # float64 / float32, as the reference divides
        next_tokens = torch.where(final_wide, wide_next, next_tokens)
    next_tokens = torch.where(greedy, final_row.argmax(dim=-1), next_tokens)
    return path, (path >= 0).sum(dim=1), next_tokens


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """[B]: the first True column of each row of `mask` [B, W], -1 when there is none."""
    first = torch.argmax(mask.to(torch.int8), dim=1)  # argmax returns the first maximum
    return torch.where(mask.any(dim=1), first, torch.full_like(first, -1))


def _descend(kids: torch.Tensor, slot: torch.Tensor, current: torch.Tensor, walking: torch.Tensor):
    """Move each walking request to its chosen child (slot -1 stops it). Returns (current, walking,
    this depth's path column [B])."""
    moves = walking & (slot >= 0)
    child = kids.gather(1, slot.clamp_min(0)[:, None])[:, 0]
    return torch.where(moves, child, current), moves, torch.where(moves, child, torch.full_like(child, PLACEHOLDER_NODE))


# ------------------------------------------------------------------ the rules, one depth


def _select(scheme: str, target_row: torch.Tensor, candidates: _Candidates) -> _Selection:
    """`select_multi_draft` at every request's current node: one child is single-draft
    speculative sampling (specinfer with K = 1), several use `scheme`; no child: the target row."""
    single = _select_specinfer(target_row, candidates)
    if scheme == "specinfer" or candidates.tokens.shape[1] == 1:
        return single
    several = candidates.count > 1
    multi = {"rsd": _select_rsd, "spectr": _select_spectr, "importance": _select_importance}[scheme](target_row, candidates)
    slot = torch.where(several, multi.slot, single.slot)
    row = torch.where(several[:, None], multi.row, single.row)
    if multi.wide is None:
        return _Selection(slot, row, None, None)
    return _Selection(slot, row, multi.wide_row, several & multi.wide)


def _accepts(target_at: torch.Tensor, draft_at: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """u * draft < target in float64 (exact for float32 inputs, as the reference's Python floats);
    never with draft 0."""
    draft_at = draft_at.double()
    return (draft_at > 0) & (uniforms.double() * draft_at < target_at.double())


def _normalized_or(rows: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = rows.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, rows / total, fallback / fallback.sum(dim=-1, keepdim=True))


def _residual(target_rows: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)); the target rows themselves, normalised, where that is all zero."""
    return _normalized_or((target_rows - draft_rows).clamp_min(0.0), target_rows)


def _at(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B]: rows[b, tokens[b]] for rows [B, V]."""
    return rows.gather(1, tokens[:, None])[:, 0]


def _select_specinfer(target_row: torch.Tensor, candidates: _Candidates) -> _Selection:
    """Recursive rejection sampling: candidate w tested against the residual left by 0 .. w-1."""
    residual = target_row  # [B, V]
    slot = torch.full_like(candidates.count, -1)
    decided = torch.zeros_like(candidates.valid[:, 0])
    for w in range(candidates.tokens.shape[1]):
        token, draft_row = candidates.tokens[:, w], candidates.draft_rows[:, w]
        testing = candidates.valid[:, w] & ~decided
        accepted = testing & _accepts(_at(residual, token), _at(draft_row, token), candidates.uniforms[:, w])
        slot = torch.where(accepted, w, slot)
        decided = decided | accepted
        residual = torch.where((testing & ~accepted)[:, None], _residual(residual, draft_row), residual)
    return _Selection(slot, residual, None, None)


def _select_rsd(target_row: torch.Tensor, candidates: _Candidates) -> _Selection:
    """Recursive rejection sampling for candidates drawn without replacement from one row: candidate
    w's law is the draft row with candidates 0 .. w-1 removed, renormalised."""
    residual = target_row  # [B, V]
    remaining_draft = candidates.draft_rows[:, 0]  # [B, V]
    slot = torch.full_like(candidates.count, -1)
    decided = torch.zeros_like(candidates.valid[:, 0])
    exhausted = torch.zeros_like(decided)  # the draft's support is used up: no later candidate is tested
    for w in range(candidates.tokens.shape[1]):
        token = candidates.tokens[:, w]
        step_draft = remaining_draft / remaining_draft.sum(dim=-1, keepdim=True)  # [B, V]
        testing = candidates.valid[:, w] & ~decided & ~exhausted
        accepted = testing & _accepts(_at(residual, token), _at(step_draft, token), candidates.uniforms[:, w])
        rejected = testing & ~accepted
        slot = torch.where(accepted, w, slot)
        decided = decided | accepted
        residual = torch.where(rejected[:, None], _residual(residual, step_draft), residual)
        remaining_draft = torch.where(rejected[:, None], remaining_draft.scatter(1, token[:, None], 0.0), remaining_draft)
        exhausted = exhausted | (rejected & (remaining_draft.sum(dim=-1) <= 0))
    return _Selection(slot, residual, None, None)


def _select_spectr(target_row: torch.Tensor, candidates: _Candidates) -> _Selection:
    """SpecTr k-sequential selection over the candidates (i.i.d. from the first child's row), in float64."""
    target64 = target_row.double()  # [B, V]
    draft64 = candidates.draft_rows[:, 0].double()  # [B, V]
    num_candidates = candidates.count
    degenerate = torch.minimum(draft64, target64).sum(dim=-1) <= 0  # beta == 0 for every rho: draw from the target
    rho = _spectr_rho(target64, draft64, num_candidates)  # [B]
    slot = torch.full_like(num_candidates, -1)
    decided = degenerate.clone()
    for w in range(candidates.tokens.shape[1]):
        token = candidates.tokens[:, w]
        testing = candidates.valid[:, w] & ~decided
        accepted = testing & _accepts(_at(target64, token), rho * _at(draft64, token), candidates.uniforms[:, w])
        slot = torch.where(accepted, w, slot)
        decided = decided | accepted
    accept_mass = torch.minimum(draft64, target64 / rho[:, None])  # [B, V]
    beta = accept_mass.sum(dim=-1)  # [B]
    # each candidate is accepted as x with prob accept_mass(x); summed over the K tries
    accepted_total = accept_mass * (1.0 - (1.0 - beta) ** num_candidates)[:, None] / beta[:, None]  # [B, V]
    residual = _normalized_or((target64 - accepted_total).clamp_min(0.0), target64)
    return _Selection(slot, target_row, residual, ~degenerate)


def _spectr_rho(target64: torch.Tensor, draft64: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """[B] float64: the reference's `_spectr_rho` for every row, the same sorted cumulative sums
    and bisection; tokens outside the draft's support sort last (ratio inf) and add nothing."""
    support = draft64 > 0
    infinity = torch.full_like(target64, float("inf"))
    ratios, order = torch.sort(torch.where(support, target64 / draft64, infinity), dim=-1)  # [B, V]
    target_sorted = torch.where(support, target64, 0.0).gather(1, order)
    draft_sorted = torch.where(support, draft64, 0.0).gather(1, order)
    target_below = torch.nn.functional.pad(torch.cumsum(target_sorted, dim=-1), (1, 0))  # [B, V + 1]
    draft_above = torch.nn.functional.pad(torch.cumsum(draft_sorted.flip(-1), dim=-1).flip(-1), (0, 1))  # [B, V + 1]

    def feasible(rho: torch.Tensor) -> torch.Tensor:
        split = torch.searchsorted(ratios, rho[:, None], right=True)  # [B, 1] tokens [0, split) have ratio <= rho
        beta = target_below.gather(1, split)[:, 0] / rho + draft_above.gather(1, split)[:, 0]
        return rho * beta >= 1.0 - (1.0 - beta) ** num_candidates

    low = torch.ones_like(target64[:, 0])
    high = num_candidates.to(torch.float64)
    low_feasible = feasible(low)
    for _ in range(SPECTR_BISECTION_STEPS):  # invariant: high feasible, low not
        middle = 0.5 * (low + high)
        middle_feasible = feasible(middle)
        high = torch.where(middle_feasible, middle, high)
        low = torch.where(middle_feasible, low, middle)
    return torch.where(low_feasible, torch.ones_like(high), high)


def _select_importance(target_row: torch.Tensor, candidates: _Candidates) -> _Selection:
    """Two-step canonical scheme: a Barker independence-sampler chain over the candidates picks
    one, then speculative sampling against the exact law of that pick."""
    tokens, num_candidates = candidates.tokens, candidates.count
    width = tokens.shape[1]
    target_at = target_row.gather(1, tokens).double()  # [B, W] t(x_i)
    proposal_at = candidates.draft_rows.gather(2, tokens[:, None, :].expand(-1, width, -1)).double()  # [B, W, W] q_j(x_i)
    state = torch.zeros_like(num_candidates)  # [B] the chain's current candidate
    for index in range(1, width):
        state_target = target_at.gather(1, state[:, None])[:, 0]
        state_proposal = proposal_at[:, index].gather(1, state[:, None])[:, 0]  # q_index(x_state)
        forward = target_at[:, index] * state_proposal
        total = forward + state_target * proposal_at[:, index, index]
        move_prob = torch.where(total > 0, forward / total, BARKER_TIE_MOVE_PROB)
        moves = candidates.valid[:, index] & (candidates.move_uniforms[:, index].double() < move_prob)
        state = torch.where(moves, index, state)
    selected = tokens.gather(1, state[:, None])[:, 0]
    induced = _importance_induced_distribution(target_row, candidates.draft_rows, num_candidates)  # [B, V] float64
    accepted = _accepts(_at(target_row, selected), _at(induced, selected), candidates.uniforms.gather(1, state[:, None])[:, 0])
    residual = _residual(target_row.double(), induced)
    return _Selection(torch.where(accepted, state, -1), target_row, residual, torch.ones_like(accepted))


def _importance_induced_distribution(target_row: torch.Tensor, draft_rows: torch.Tensor,
                                     num_candidates: torch.Tensor) -> torch.Tensor:
    """[B, V] float64: the reference's `_importance_induced_distribution` for every request (its first
    num_candidates rows), over the whole vocabulary in static row blocks of [B, R, V]."""
    batch, width, vocab = draft_rows.shape
    target64 = target_row.double()  # [B, V]
    drafts64 = draft_rows.double()  # [B, W, V]
    block_rows = max(1, INDUCED_CHUNK_ELEMENTS // (batch * vocab))
    induced = drafts64[:, 0]  # [B, V]
    for index in range(1, width):
        proposal = drafts64[:, index]  # [B, V]
        inflow = torch.zeros_like(induced)  # [B, V] sum_z r(z) A(z, y)
        stay_blocks = []  # sum_z q(z) (1 - A(y, z)), by row block of y
        for start in range(0, vocab, block_rows):
            rows = slice(start, start + block_rows)
            forward = proposal[:, rows, None] * target64[:, None, :]  # [B, R, V]  t(y) q(z)
            total = forward + target64[:, rows, None] * proposal[:, None, :]
            move = torch.where(total > 0, forward / total, BARKER_TIE_MOVE_PROB)  # [B, R, V]  A(z, y)
            inflow = inflow + torch.bmm(induced[:, None, rows], move)[:, 0]
            stay_blocks.append(torch.bmm(1.0 - move, proposal[:, :, None])[:, :, 0])  # [B, R]
        updated = proposal * inflow + induced * torch.cat(stay_blocks, dim=1)
        induced = torch.where((index < num_candidates)[:, None], updated, induced)
    return induced
