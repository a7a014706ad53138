"""The slow, obvious references of the verification rules: greedy, chain speculative sampling, multi-draft
selection, and the walk of a draft tree, one request and one position at a time on the host.

The runtime verifies on the device (polyspec.workers.core.verdicts over device_verify and
device_tree_verify); the tests check those kernels against the rules here bit for bit, and check the
rules here for losslessness (chi-square).

Terminology:
- target: the tier doing the verifying; `target_probs` are its warped float32
  probabilities. draft: the tier (or tiers) that proposed; `draft_probs` are the
  probabilities each proposed token was actually sampled from.
- accepted tokens: the prefix of draft tokens the target keeps.
- correction token: sampled from the residual distribution at the first rejection.
- bonus token: sampled from the target row after the last draft token when every
  draft token was accepted. A verification always emits accepted + 1 tokens.
- residual: norm(max(0, target - draft)), the part of the target the draft under-covers.

Every rule here is lossless: each emitted token is distributed exactly as the target.

Multi-draft selection (`select_multi_draft`, one position, K candidate tokens) and how the
candidates must be drawn for the scheme to be lossless:
- "specinfer"  (recursive rejection sampling): candidate j drawn independently from
  draft_probs[j]; rows may differ (different drafters) or be equal (i.i.d., *with*
  replacement).
- "rsd"        (Recursive Speculative Decoding): candidates drawn *without* replacement
  from one draft row by Gumbel-top-k, see `draw_without_replacement`.
- "spectr"     (SpecTr k-sequential selection): K i.i.d. candidates (with replacement)
  from one draft row.
- "importance" (the two-step canonical scheme of the multi-draft paper): candidate j drawn independently
  from draft_probs[j]; rows may differ. Step 1 picks one candidate with an
  independence-sampler chain (Barker acceptance), step 2 speculatively samples it
  against the target using the exact distribution induced by step 1.

All functions are pure: no I/O, every random draw comes from the `generator` argument,
so the same generator state gives the same result. The `*_drawn` variants take their draws
as arguments instead (`GivenDraws`): they are the slow, obvious references of the device
kernels (polyspec.workers.core.device_verify, device_tree_verify), which draw from
counter-based streams and must match them bit for bit.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from polyspec.workers.core.device_tree_verify import (
    BARKER_TIE_MOVE_PROB,
    INDUCED_CHUNK_ELEMENTS,
    MULTI_DRAFT_SCHEMES,
    SPECTR_BISECTION_STEPS,
)
from polyspec.workers.core.sampling import sample
from polyspec.workers.core.tree import DraftTree, chain_draft_rows

NO_CANDIDATE_ACCEPTED = -1  # accepted_index when the token came from the final residual


# ---------------------------------------------------------------------------------
# Single-draft rules
# ---------------------------------------------------------------------------------


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Accept draft tokens while they equal the target's argmax.

    target_argmax: [k+1] long, the target's argmax at each draft position plus one.
    draft_tokens:  [k] long (k may be 0).
    Returns (num_accepted, next_token); next_token is the correction or bonus token.
    """
    _require(target_argmax.dim() == 1 and draft_tokens.dim() == 1, "expected 1-D tensors")
    num_drafts = draft_tokens.shape[0]
    _require(
        target_argmax.shape[0] == num_drafts + 1,
        f"target_argmax has {target_argmax.shape[0]} entries, need k+1 = {num_drafts + 1}",
    )
    matches = target_argmax[:num_drafts] == draft_tokens  # [k]
    num_accepted = int(torch.cumprod(matches.long(), dim=0).sum())
    return num_accepted, int(target_argmax[num_accepted])


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Standard speculative sampling of one chain of k draft tokens.

    target_probs: [k+1, V], draft_probs: [k, V], draft_tokens: [k] (k may be 0).
    Draft token j is accepted with probability min(1, target(x_j) / draft(x_j)); a token
    with draft probability 0 is rejected. Returns (num_accepted, next_token).
    """
    _require(target_probs.dim() == 2 and draft_probs.dim() == 2, "probs must be 2-D [rows, V]")
    _require(draft_tokens.dim() == 1, "draft_tokens must be 1-D [k]")
    num_drafts, vocab = draft_tokens.shape[0], target_probs.shape[1]
    _require(
        target_probs.shape[0] == num_drafts + 1,
        f"target_probs has {target_probs.shape[0]} rows, need k+1 = {num_drafts + 1}",
    )
    _require(
        tuple(draft_probs.shape) == (num_drafts, vocab),
        f"draft_probs shape {tuple(draft_probs.shape)} != (k, V) = {(num_drafts, vocab)}",
    )
    target_probs, draft_probs = target_probs.float(), draft_probs.float()

    positions = torch.arange(num_drafts)
    target_at_draft = target_probs[positions, draft_tokens]  # [k]
    draft_at_draft = draft_probs[positions, draft_tokens]  # [k]
    uniforms = torch.rand(num_drafts, generator=generator)  # [k]
    # u * draft < target  <=>  u < target / draft, and never true when draft == 0
    accepted = (draft_at_draft > 0) & (uniforms * draft_at_draft < target_at_draft)  # [k]
    num_accepted = int(torch.cumprod(accepted.long(), dim=0).sum())

    if num_accepted == num_drafts:
        return num_accepted, sample(target_probs[num_drafts], generator)  # bonus
    correction_probs = _residual(target_probs[num_accepted], draft_probs[num_accepted])  # [V]
    return num_accepted, sample(correction_probs, generator)


def verify_chain_drawn(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[int, int]:
    """`verify_chain` with its randomness given: the slow, obvious reference of the device kernel
    (polyspec.workers.core.device_verify), which must match it bit for bit.

    uniforms: [k] in (0, 1), one acceptance draw per draft token; exponentials: [V], Exp(1)
    noise for the correction or bonus draw, made by the exponential race: argmax(row / noise)
    samples a token with probability proportional to row (no normalisation needed).
    Returns (num_accepted, next_token).
    """
    num_drafts = draft_tokens.shape[0]
    _require(target_probs.shape[0] == num_drafts + 1 and uniforms.shape == (num_drafts,), "need k+1 target rows, k uniforms")
    num_accepted = num_drafts
    for j in range(num_drafts):
        token = int(draft_tokens[j])
        target_prob, draft_prob = target_probs[j, token].float(), draft_probs[j, token].float()  # float32, as on the device
        if not bool((draft_prob > 0) & (uniforms[j] * draft_prob < target_prob)):
            num_accepted = j
            break
    row = target_probs[num_accepted].float()
    if num_accepted < num_drafts:
        residual = (row - draft_probs[num_accepted].float()).clamp_min(0.0)
        if residual.sum() > 0:
            row = residual
    return num_accepted, int(torch.argmax(row / exponentials))


# ---------------------------------------------------------------------------------
# Multi-draft selection (one position, K candidates)
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GivenDraws:
    """The draws of one multi-draft selection, given up front (the device kernels' counter-based
    streams). Candidate j's acceptance test uses uniforms[j] (importance: the selected
    candidate's); the importance chain's step to candidate j uses move_uniforms[j] (j >= 1);
    the final token (from a residual, or the target row) is argmax(row / exponentials), the
    exponential race. uniforms, move_uniforms: [K] float32 in (0, 1); exponentials: [V] float32."""

    uniforms: torch.Tensor
    move_uniforms: torch.Tensor
    exponentials: torch.Tensor

    def accept_uniform(self, candidate: int) -> float:
        return float(self.uniforms[candidate])

    def move_uniform(self, candidate: int) -> float:
        return float(self.move_uniforms[candidate])

    def sample(self, row: torch.Tensor) -> int:
        return int(torch.argmax(row / self.exponentials))


@dataclasses.dataclass(frozen=True)
class GeneratorDraws:
    """Draws from a torch.Generator, in the order the rules ask for them."""

    generator: torch.Generator | None

    def accept_uniform(self, candidate: int) -> float:
        return _uniform(self.generator)

    def move_uniform(self, candidate: int) -> float:
        return _uniform(self.generator)

    def sample(self, row: torch.Tensor) -> int:
        return sample(row, self.generator)


Draws = GeneratorDraws | GivenDraws  # where a rule's randomness comes from


def select_multi_draft(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    scheme: str,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Pick the output token at one position from K candidate tokens, losslessly.

    target_probs: [V]; draft_probs: [K, V], row j is what candidate j was drawn from;
    draft_tokens: [K]. scheme: one of MULTI_DRAFT_SCHEMES (see the module docstring for
    how candidates must be drawn). Returns (token, accepted_index), accepted_index being
    the position in draft_tokens of the accepted candidate, or NO_CANDIDATE_ACCEPTED when
    the token was sampled from the final residual. token ~ target_probs exactly.
    """
    return select_multi_draft_drawn(target_probs, draft_probs, draft_tokens, scheme, GeneratorDraws(generator))


def select_multi_draft_drawn(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    scheme: str,
    draws: Draws,
) -> tuple[int, int]:
    """`select_multi_draft` with its randomness from `draws`: a `GivenDraws` makes it the
    reference of the device tree kernels. Returns (token, accepted_index)."""
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unknown multi-draft scheme {scheme!r}; expected one of {MULTI_DRAFT_SCHEMES}"
        )
    _require(target_probs.dim() == 1, f"target_probs must be [V], got {tuple(target_probs.shape)}")
    _require(draft_probs.dim() == 2, f"draft_probs must be [K, V], got {tuple(draft_probs.shape)}")
    _require(draft_tokens.dim() == 1, f"draft_tokens must be [K], got {tuple(draft_tokens.shape)}")
    num_candidates = draft_tokens.shape[0]
    _require(num_candidates > 0, "need at least one candidate (K == 0)")
    _require(
        tuple(draft_probs.shape) == (num_candidates, target_probs.shape[0]),
        f"draft_probs shape {tuple(draft_probs.shape)} != (K, V) = "
        f"{(num_candidates, target_probs.shape[0])}",
    )
    return _SCHEMES[scheme](target_probs.float(), draft_probs.float(), draft_tokens, draws)


def draw_without_replacement(
    draft_probs: torch.Tensor, num: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Gumbel-top-k: `num` distinct tokens, in the order sequential sampling would draw them.

    draft_probs: [V]. Only tokens with positive probability are drawn, so fewer than
    `num` come back when fewer have positive probability. Returns [min(num, support)] long.
    """
    _require(draft_probs.dim() == 1, f"draft_probs must be [V], got {tuple(draft_probs.shape)}")
    support = torch.nonzero(draft_probs > 0).squeeze(1)  # [S]
    exponentials = torch.empty(support.shape[0]).exponential_(generator=generator)  # [S]
    # log q + Gumbel(0, 1) with Gumbel = -log(Exp(1))
    keys = torch.log(draft_probs[support].float()) - torch.log(exponentials)  # [S]
    top = torch.topk(keys, min(num, support.shape[0])).indices  # sorted by key, descending
    return support[top]


def _select_specinfer(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: Draws,
) -> tuple[int, int]:
    """Recursive rejection sampling; candidate j ~ draft_probs[j] independently."""
    candidates = torch.arange(draft_tokens.shape[0])
    draft_at_candidate = draft_probs[candidates, draft_tokens].tolist()  # [K], q_j(x_j)
    residual = target_probs  # [V]
    for index, token in enumerate(draft_tokens.tolist()):
        if _accepts(float(residual[token]), draft_at_candidate[index], draws, index):
            return token, index
        residual = _residual(residual, draft_probs[index])
    return draws.sample(residual), NO_CANDIDATE_ACCEPTED


def _select_rsd(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: Draws,
) -> tuple[int, int]:
    """Recursive rejection sampling for candidates drawn without replacement from one q."""
    _require_identical_rows(draft_probs, "rsd")
    tokens = draft_tokens.tolist()
    _require(len(set(tokens)) == len(tokens), "rsd candidates must be distinct (no replacement)")
    residual = target_probs  # [V]
    remaining_draft = draft_probs[0].clone()  # [V], q with earlier candidates removed
    for index, token in enumerate(tokens):
        step_draft = remaining_draft / remaining_draft.sum()  # [V], law of candidate j given earlier
        if _accepts(float(residual[token]), float(step_draft[token]), draws, index):
            return token, index
        residual = _residual(residual, step_draft)
        remaining_draft[token] = 0.0
        if remaining_draft.sum() <= 0:  # support exhausted: no further candidate can exist
            break
    return draws.sample(residual), NO_CANDIDATE_ACCEPTED


def _select_spectr(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: Draws,
) -> tuple[int, int]:
    """SpecTr k-sequential selection over K i.i.d. candidates from one q."""
    _require_identical_rows(draft_probs, "spectr")
    num_candidates = draft_tokens.shape[0]
    draft_row = draft_probs[0].double()  # [V]
    target_row = target_probs.double()  # [V]
    if float(torch.minimum(draft_row, target_row).sum()) <= 0:  # beta == 0 for every rho
        return draws.sample(target_probs), NO_CANDIDATE_ACCEPTED

    rho = _spectr_rho(target_row, draft_row, num_candidates)
    for index, token in enumerate(draft_tokens.tolist()):
        if _accepts(float(target_row[token]), rho * float(draft_row[token]), draws, index):
            return token, index

    accept_mass = torch.minimum(draft_row, target_row / rho)  # [V]
    beta = float(accept_mass.sum())
    # each candidate is accepted as x with prob accept_mass(x); summed over the K tries
    accepted_total = accept_mass * (1.0 - (1.0 - beta) ** num_candidates) / beta  # [V]
    residual = (target_row - accepted_total).clamp_min(0.0)  # [V]
    return draws.sample(_normalized_or(residual, target_row)), NO_CANDIDATE_ACCEPTED


def _spectr_rho(target_row: torch.Tensor, draft_row: torch.Tensor, num_candidates: int) -> float:
    """Smallest rho in [1, K] with rho * beta(rho) >= 1 - (1 - beta(rho))^K, by bisection.

    beta(rho) = sum_x min(q(x), target(x) / rho). Both rho * beta(rho) and
    (1 - beta(rho))^K are non-decreasing in rho, so the feasible set is an interval
    ending at K (rho = K is feasible: 1 - (1-beta)^K = beta * sum_{j<K} (1-beta)^j
    <= K * beta). To make each bisection step O(log V), tokens are sorted once by
    target/q: those with ratio <= rho contribute target/rho to beta, the others q.
    """
    support = draft_row > 0
    ratios, order = torch.sort(target_row[support] / draft_row[support])  # [S]
    target_sorted = target_row[support][order]  # [S]
    draft_sorted = draft_row[support][order]  # [S]
    target_below = torch.nn.functional.pad(torch.cumsum(target_sorted, 0), (1, 0))  # [S+1]
    draft_suffix = torch.cumsum(draft_sorted.flip(0), 0).flip(0)  # [S]
    draft_above = torch.nn.functional.pad(draft_suffix, (0, 1))  # [S+1]
    sorted_ratios = ratios.tolist()
    target_below, draft_above = target_below.tolist(), draft_above.tolist()

    def feasible(rho: float) -> bool:
        split = bisect.bisect_right(sorted_ratios, rho)  # tokens [0, split) have ratio <= rho
        beta = target_below[split] / rho + draft_above[split]
        return rho * beta >= 1.0 - (1.0 - beta) ** num_candidates

    low, high = 1.0, float(num_candidates)
    if feasible(low):
        return low
    for _ in range(SPECTR_BISECTION_STEPS):  # invariant: high feasible, low not
        middle = 0.5 * (low + high)
        if feasible(middle):
            high = middle
        else:
            low = middle
    return high


def _select_importance(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: Draws,
) -> tuple[int, int]:
    """Two-step canonical scheme: Barker independence-sampler chain, then speculative sampling."""
    tokens = draft_tokens.tolist()
    target_at = target_probs[draft_tokens].tolist()  # [K], t(x_i)
    proposal_at = draft_probs[:, draft_tokens].tolist()  # [K, K], proposal_at[j][i] = q_j(x_i)
    state = 0  # index into draft_tokens of the chain's current state
    for index in range(1, len(tokens)):
        move_prob = _barker_move_prob(
            target_at[state], proposal_at[index][state], target_at[index], proposal_at[index][index]
        )
        if draws.move_uniform(index) < move_prob:
            state = index

    selected = tokens[state]
    induced = _importance_induced_distribution(target_probs, draft_probs)  # [V] float64
    if _accepts(float(target_probs[selected]), float(induced[selected]), draws, state):
        return selected, state
    return draws.sample(_residual(target_probs.double(), induced)), NO_CANDIDATE_ACCEPTED


def _barker_move_prob(
    state_target: float, state_proposal: float, candidate_target: float, candidate_proposal: float
) -> float:
    """P(move state z -> candidate y) = t(y) q(z) / (t(y) q(z) + t(z) q(y)); leaves t invariant."""
    forward = candidate_target * state_proposal
    total = forward + state_target * candidate_proposal
    return forward / total if total > 0 else BARKER_TIE_MOVE_PROB


def _importance_induced_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor
) -> torch.Tensor:
    """Exact law of the token the Barker chain selects, over candidates x_j ~ draft_probs[j].

    r_1 = q_1;  r_j(y) = q_j(y) sum_z r_{j-1}(z) A_j(z, y) + r_{j-1}(y) sum_z q_j(z) (1 - A_j(y, z))
    with A_j(z, y) the Barker move probability. Computed on S = union of draft supports
    (no other token is ever a candidate or a state), in row blocks of [rows, S].
    Returns [V] float64, zero outside S.
    """
    support = torch.nonzero((draft_probs > 0).any(dim=0)).squeeze(1)  # [S]
    target_s = target_probs[support].double()  # [S]
    drafts_s = draft_probs[:, support].double()  # [K, S]
    size = support.shape[0]
    block_rows = max(1, INDUCED_CHUNK_ELEMENTS // size)

    induced_s = drafts_s[0]  # [S]
    for proposal_s in drafts_s[1:]:
        inflow = torch.zeros(size, dtype=torch.float64)  # [S], sum_z r(z) A(z, y)
        stay = torch.empty(size, dtype=torch.float64)  # [S], sum_z q(z) (1 - A(y, z))
        for start in range(0, size, block_rows):
            rows = slice(start, start + block_rows)
            forward = proposal_s[rows, None] * target_s[None, :]  # [R, S]  t(y) q(z)
            total = forward + target_s[rows, None] * proposal_s[None, :]  # [R, S]
            move = torch.where(total > 0, forward / total, BARKER_TIE_MOVE_PROB)  # [R, S]  A(z, y)
            inflow += induced_s[rows] @ move
            stay[rows] = (1.0 - move) @ proposal_s
        induced_s = proposal_s * inflow + induced_s * stay

    induced = torch.zeros(target_probs.shape[0], dtype=torch.float64)  # [V]
    induced[support] = induced_s
    return induced


_SCHEMES = {
    "specinfer": _select_specinfer,
    "rsd": _select_rsd,
    "spectr": _select_spectr,
    "importance": _select_importance,
}
assert tuple(_SCHEMES) == MULTI_DRAFT_SCHEMES


# ---------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------


def _residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)); the target itself if that is all zero (rows equal)."""
    return _normalized_or((target_row - draft_row).clamp_min(0.0), target_row)


def _normalized_or(row: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = row.sum()
    if total <= 0:
        return fallback / fallback.sum()
    return row / total


def _accepts(target_prob: float, draft_prob: float, draws: Draws, candidate: int) -> bool:
    """True with probability min(1, target_prob / draft_prob); False when draft_prob == 0 (no
    draw is spent then). The test runs in float64: u * draft_prob is exact for float32 inputs."""
    if draft_prob <= 0:
        return False
    return draws.accept_uniform(candidate) * draft_prob < target_prob


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def _require_identical_rows(draft_probs: torch.Tensor, scheme: str) -> None:
    if not torch.allclose(draft_probs[1:], draft_probs[:1]):  # [K-1, V] vs [1, V], broadcast
        raise ValueError(f"scheme {scheme!r} needs every draft_probs row to be the same distribution")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------------------
# Blocks and trees: one verdict per drafted block
# ---------------------------------------------------------------------------------


def verify_block(
    target_probs: torch.Tensor, block: DraftTree, scheme: str, greedy: bool, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """(accepted path of node indices, next token) for a drafted block: a chain by the greedy
    or single-draft rule (the drafter's rows, none for a lookup's proposals), a tree by
    `verify_tree`. target_probs: [len(block) + 1, V]."""
    if not block.is_chain():
        return verify_tree(target_probs, block, scheme, greedy, generator)
    draft_tokens = torch.tensor(block.tokens, dtype=torch.long)
    if greedy:
        accepted, next_token = verify_greedy(target_probs.argmax(dim=-1), draft_tokens)
    else:
        draft_rows = chain_draft_rows(block, target_probs.shape[-1])
        accepted, next_token = verify_chain(target_probs, draft_rows, draft_tokens, generator)
    return list(range(accepted)), next_token


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
    assert uniforms.shape == move_uniforms.shape == (len(tree),) and exponentials.shape == target_probs.shape[1:]
    return _walk_tree(target_probs, tree, scheme, greedy,
                      lambda children: GivenDraws(uniforms[children], move_uniforms[children], exponentials))


def _walk_tree(target_probs: torch.Tensor, tree: DraftTree, scheme: str, greedy: bool, draws_of) -> tuple[list[int], int]:
    """The walk of `verify_tree`; `draws_of(children)` gives the draws of one node's selection."""
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


# --------------------------------------------------- the device rules' verdicts as token rows (for comparing)

PLACEHOLDER_TOKEN_ID = -1  # fills a request's row past its emitted tokens


def emitted_tokens(draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
                   max_draft: int) -> torch.Tensor:
    """[B, max_draft + 1] int64: each request's accepted draft tokens then its next token, then
    PLACEHOLDER_TOKEN_ID: the one tensor a round sends to the host."""
    num_requests = num_accepted.shape[0]
    device = num_accepted.device
    columns = torch.arange(max_draft + 1, device=device)[None, :]  # [1, K + 1]
    flat = (cu_num_draft[:-1, None] + columns).clamp_max(max(draft_tokens.shape[0] - 1, 0))  # [B, K + 1]
    drafted = draft_tokens[flat] if draft_tokens.shape[0] else torch.zeros(num_requests, max_draft + 1, dtype=torch.int64, device=device)
    out = torch.where(columns < num_accepted[:, None], drafted, torch.full_like(drafted, PLACEHOLDER_TOKEN_ID))
    return torch.where(columns == num_accepted[:, None], next_tokens[:, None].expand_as(out), out)


def emitted_tree_tokens(node_tokens: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor,
                        next_tokens: torch.Tensor) -> torch.Tensor:
    """[B, max_depth + 1] int64: the accepted path's tokens, the next token, then PLACEHOLDER_TOKEN_ID."""
    path_tokens = node_tokens.gather(1, path.clamp_min(0))  # [B, D]
    path_tokens = torch.where(path >= 0, path_tokens, torch.full_like(path_tokens, PLACEHOLDER_TOKEN_ID))
    out = torch.cat([path_tokens, torch.full_like(path_tokens[:, :1], PLACEHOLDER_TOKEN_ID)], dim=1)  # [B, D + 1]
    columns = torch.arange(out.shape[1], device=out.device)[None, :]
    return torch.where(columns == path_len[:, None], next_tokens[:, None].expand_as(out), out)
