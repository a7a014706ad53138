"""A whole batch's warp, draws and chain verification as tensor programs: no host sync, static shapes.

This is the verification half of a round that stays on the device (a CUDA graph replays it
beside the forward). Terminology as in the references (tests/reference_verification.py): accepted
tokens, the correction token (drawn from the residual at the first rejection), the bonus
token (drawn from the target row after a block accepted whole).

Layout (vLLM's rejection sampler's): B requests, request r proposes k_r draft tokens.
- draft tokens, draft rows: flattened, [N = sum k_r] and [N, V]; `cu_num_draft` [B + 1]
  holds the offsets (request r's drafts are rows cu[r] .. cu[r+1]);
- target rows: [N + B, V]: request r's k_r + 1 rows start at cu[r] + r.
Every shape depends only on (B, N, V), so one bucket of (batch, tokens) is one graph.

Randomness: counter-based streams (`stream_uniforms`). A draw is a hash of (the request's
seed, the request's own draw counter, a domain, an index), so a seeded request draws the same
numbers alone or in any batch, on any device, and no generator object (host state) is read.
The correction / bonus draw uses the exponential race (argmax(row / Exp(1) noise) is a
sample from row / sum(row)), so residual rows need no normalisation.

Each kernel is checked bit for bit against the slow, obvious reference
(`warp_logits` per row; tests/reference_verification.py's `verify_greedy` / `verify_chain_drawn` per request) in
tests/workers/test_device_verify.py, and for losslessness by a chi-square test.
"""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
HASH_MULTIPLIER = 0x45D9F3B  # < 2^27: a 32-bit value times it stays inside int64 (no overflow)
DOMAIN_ACCEPT = 1  # the acceptance uniforms of a round
DOMAIN_NEXT = 2  # the exponential noise of a round's correction / bonus draw
DOMAIN_DRAFT = 3  # a drafter's own draws
DOMAIN_TREE_MOVE = 0  # the importance chain's move draws of a tree round (0: the slot DOMAINS left free)
DOMAINS = 4  # fixed: changing it would change every request's streams


# ----------------------------------------------------------------------------- random streams


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Mueller's), on int64 tensors holding values in [0, 2^32); `x` is left as it was
    (the passes after the first work in place on the copy: a vocabulary-wide draw hashes 150k values a row)."""
    x = x ^ (x >> 16)
    x.mul_(HASH_MULTIPLIER).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 16).mul_(HASH_MULTIPLIER).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 16)


_INDEX_HASHES: dict[int, np.ndarray] = {}  # count -> _mix32(0 .. count - 1) as uint32: the same for every row and round


def _on_host(tensor: torch.Tensor) -> bool:
    """Draws for CPU tensors, outside tracing, are computed on the host (Python integers, numpy); elsewhere as tensors."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _none_on_host(flags: torch.Tensor) -> bool:
    """Are all of `flags` known false on the host, for free (CPU flags, outside tracing)? Then a draw or verdict skips
    its greedy rows (the argmax and the choice between them): what `torch.where` would choose when no row is greedy."""
    return _on_host(flags) and not bool(flags.any())


def _mix32_int(x: int) -> int:
    """`_mix32` of one Python integer in [0, 2^32): the same passes."""
    x = ((x ^ (x >> 16)) * HASH_MULTIPLIER) & MASK32
    x = ((x ^ (x >> 16)) * HASH_MULTIPLIER) & MASK32
    return x ^ (x >> 16)


def _host_keys(seeds: torch.Tensor, counters: torch.Tensor, domain: int) -> list[int]:
    return [_mix32_int((seed & MASK32) ^ _mix32_int(((seed >> 32) & MASK32) ^ _mix32_int((counter * DOMAINS + domain) & MASK32)))
            for seed, counter in zip(seeds.tolist(), counters.tolist())]


def stream_keys(seeds: torch.Tensor, counters: torch.Tensor, domain: int) -> torch.Tensor:
    """[B] int64: each request's key for round `counters[r]` in `domain`, which every draw of that round mixes in:
    `_mix32(lo ^ _mix32(hi ^ _mix32((counter * DOMAINS + domain) mod 2^32)))` of the seed's halves. On the host
    in Python integers (the tensor form is two dozen kernel calls over B elements: a tenth of a one-row round of the
    demo target at T = 1), as tensors on a device or while a step is traced."""
    if _on_host(seeds):
        return torch.tensor(_host_keys(seeds, counters, domain), dtype=torch.int64)
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    return _mix32(lo ^ _mix32(hi ^ _mix32((counters * DOMAINS + domain) & MASK32)))


def _host_uniforms(keys: list[int], count: int) -> torch.Tensor:
    """[B, count] `stream_uniforms` of draws 0 .. count - 1 on the host, in numpy's uint32 arithmetic (it wraps modulo
    2^32, where `_mix32` masks): the same numbers, in half the memory and without a tensor op's dispatch per pass.
    The draw numbers' hash is kept per count (a draw over the vocabulary hashes the same numbers every round)."""
    hashed = _INDEX_HASHES.get(count)
    if hashed is None:
        if len(_INDEX_HASHES) >= 64:  # block lengths, widths, vocabularies: a few counts in practice
            _INDEX_HASHES.clear()
        hashed = _INDEX_HASHES[count] = _mix32(torch.arange(count, dtype=torch.int64)[None, :]).numpy().astype(np.uint32)
    bits = np.array(keys, dtype=np.uint32)[:, None] ^ hashed  # [B, count]
    for _ in range(2):
        bits ^= bits >> 16
        bits *= np.uint32(HASH_MULTIPLIER)
    bits ^= bits >> 16
    uniforms = (bits >> 9).astype(np.float32)  # `unit_interval`'s steps, each exact in float32
    uniforms += np.float32(0.5)
    uniforms *= np.float32(1.0 / (1 << 23))
    return torch.from_numpy(uniforms)


def stream_uniforms(seeds: torch.Tensor, counters: torch.Tensor, domain: int, count: int,
                    first: torch.Tensor | None = None) -> torch.Tensor:
    """[B, count] float32 uniforms in (0, 1): request r's draws number first[r] .. first[r] + count - 1
    (`first` None: 0 ..) of round `counters[r]` in `domain`. seeds: [B] int64 (63-bit), counters: [B] int64."""
    if count == 0:  # a round with no drafts to accept: nothing to hash
        return torch.zeros(seeds.shape[0], 0, dtype=torch.float32, device=seeds.device)
    if first is None and _on_host(seeds):
        return _host_uniforms(_host_keys(seeds, counters, domain), count)
    numbers = torch.arange(count, device=seeds.device, dtype=torch.int64)[None, :]  # [1, count]
    hashed = _mix32(numbers if first is None else numbers + first[:, None])  # [1 or B, count]
    return unit_interval(_mix32(stream_keys(seeds, counters, domain)[:, None] ^ hashed))  # [B, count]


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in (0, 1): the top 23 bits, plus a half. (2^23 - 1) + 0.5 needs 24 significant
    bits, so every value is exact in float32 and the largest is 1 - 2^-24. With 24 bits the top one, 2^24 - 0.5,
    rounded to 2^24, i.e. u = 1: its Exp(1) noise was 0, and a token outside the top-k / top-p support won the
    exponential race as 0 / 0 = NaN (argmax takes NaN), about once per 2^24 draws (a real model's 49k-token rows)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def stream_exponentials(seeds: torch.Tensor, counters: torch.Tensor, domain: int, count: int,
                        first: torch.Tensor | None = None) -> torch.Tensor:
    """[B, count] float32 Exp(1) noise, from the same streams."""
    return -torch.log(stream_uniforms(seeds, counters, domain, count, first))


# ------------------------------------------------------------------------------------ warp


def warp_batch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               truncate: bool = True) -> torch.Tensor:
    """`polyspec.workers.core.sampling.warp_logits` for rows with their own parameters.

    logits: [R, V] any dtype; temperature, top_p: [R] float32; top_k: [R] int64 (0: none).
    `truncate`: False when no row has top-k or top-p (a static choice of the caller, which
    knows the requests' parameters): the two sorts over the vocabulary are skipped.
    Returns [R, V] float32 rows; a row with temperature 0 is one-hot at its argmax.
    """
    assert logits.dim() == 2 and temperature.shape == top_k.shape == top_p.shape == logits.shape[:1]
    logits = logits.float()
    vocab = logits.shape[-1]
    if not truncate and _none_on_host(temperature == 0):  # (a drafter's draw at T = 1): the softmax below alone
        return torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None], dim=-1)
    greedy = (temperature == 0)[:, None]  # [R, 1]
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).float()  # [R, V]
    safe_temperature = torch.where(greedy, torch.ones_like(temperature[:, None]), temperature[:, None])
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / safe_temperature  # [R, V]
    if not truncate:
        return torch.where(greedy, one_hot, torch.softmax(scaled, dim=-1))
    truncate = ((top_k > 0) & (top_k < vocab))[:, None]
    kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])  # [R, 1]
    scaled = torch.where(truncate & (scaled < kth), torch.full_like(scaled, float("-inf")), scaled)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [R, V]
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False  # the top token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    nucleus = probs.masked_fill(drop, 0.0)
    nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
    probs = torch.where((top_p < 1.0)[:, None], nucleus, probs)
    return torch.where(greedy, one_hot, probs)


# ---------------------------------------------------------------------------- verification


def verify_greedy_chains(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_chains` for requests that are all greedy, from the target's argmax tokens (no warp, no draws).

    target_argmax: [B, k + 1] int64; draft_tokens: [B, k]; num_draft: [B] (the rest of a row is padding).
    Returns (num_accepted [B], next_tokens [B])."""
    block = draft_tokens.shape[1]
    columns = torch.arange(block, device=draft_tokens.device)[None, :]
    matches = (target_argmax[:, :block] == draft_tokens) & (columns < num_draft[:, None])  # [B, k]
    num_accepted = torch.cumprod(matches.long(), dim=1).sum(dim=1)  # [B]
    return num_accepted, target_argmax.gather(1, num_accepted[:, None])[:, 0]


def verify_chains(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor,
                  greedy: torch.Tensor, uniforms: torch.Tensor, exponentials: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's chain block at once.

    target_probs: [N + B, V] float32; draft_probs: [N, V]; draft_tokens: [N] int64;
    cu_num_draft: [B + 1] int64 offsets; greedy: [B] bool (accept while the draft is the
    target's argmax); uniforms: [N] acceptance draws; exponentials: [B, V] noise of the next draw.
    num_draft: [B], only for a padded layout (every request given the same room in the flat
    tensors, a static shape): request r's block is its first num_draft[r] tokens, the rest is
    padding and never read as a draft.
    Returns (num_accepted [B], next_tokens [B]) as int64 tensors on the device.
    """
    num_requests = cu_num_draft.shape[0] - 1
    num_drafts = draft_tokens.shape[0]
    assert target_probs.shape[0] == num_drafts + num_requests and exponentials.shape == (num_requests, target_probs.shape[1])
    device = target_probs.device
    sampled_only = _none_on_host(greedy)
    requests = torch.arange(num_requests, device=device)
    if num_draft is None:
        num_draft = cu_num_draft[1:] - cu_num_draft[:-1]  # [B]
    first_row = cu_num_draft[:-1] + requests  # [B] each request's first target row
    num_accepted = num_draft.clone()
    if num_drafts:
        positions = torch.arange(num_drafts, device=device)
        request_of = torch.searchsorted(cu_num_draft[1:], positions, right=True)  # [N]
        local = positions - cu_num_draft[request_of]  # [N] index inside its block
        checked = positions + request_of  # [N] the target row each draft token is checked against
        target_at = target_probs[checked, draft_tokens]  # [N]
        draft_at = draft_probs.gather(-1, draft_tokens[:, None])[:, 0]  # [N]
        sampled_ok = (draft_at > 0) & (uniforms * draft_at < target_at)  # u < target / draft, never with draft 0
        if sampled_only:
            accepted = sampled_ok
        else:
            greedy_ok = target_probs[checked].argmax(dim=-1) == draft_tokens
            accepted = torch.where(greedy[request_of], greedy_ok, sampled_ok)
        accepted = accepted | (local >= num_draft[request_of])  # [N] padding passes
        rejected_at = torch.where(accepted, torch.full_like(local, num_drafts + 1), local)
        num_accepted = num_accepted.scatter_reduce(0, request_of, rejected_at, reduce="amin", include_self=True)
    next_rows = target_probs[first_row + num_accepted]  # [B, V]
    rows = next_rows
    if num_drafts:
        draft_rows = draft_probs[(cu_num_draft[:-1] + num_accepted).clamp_max(num_drafts - 1)]  # [B, V] (unused past a block)
        residual = (next_rows - draft_rows).clamp_min(0.0)
        use_residual = ((num_accepted < num_draft) & (residual.sum(dim=-1) > 0))[:, None]
        rows = torch.where(use_residual, residual, next_rows)
    sampled = torch.argmax(rows / exponentials, dim=-1)
    if sampled_only:
        return num_accepted, sampled
    return num_accepted, torch.where(greedy, next_rows.argmax(dim=-1), sampled)


# ------------------------------------------------------------------------------- drafting


GREEDY, PLAIN, TRUNCATED = "greedy", "plain", "truncated"  # a call's sampling: every request greedy; no top-k / top-p; some


def sampling_mode(params) -> str:
    """The cheapest warp that serves every request of a call (a static choice: one graph each)."""
    if all(p.greedy for p in params):
        return GREEDY
    return TRUNCATED if any(p.top_k > 0 or p.top_p < 1.0 for p in params) else PLAIN


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """The top probability of each row at temperature 1: an early-exit drafter's stopping signal."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


def draw_tokens(logits: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                greedy: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's next token for each row of `logits` [R, V]: the warp (`warp_batch`), then one draw from the
    row's stream (DOMAIN_DRAFT, round `counters`, draws first[r] .. first[r] + V - 1: a tree level's node w reads
    w * V ..), by the exponential race; a greedy row takes its argmax. Returns (tokens [R], rows [R, V] float32:
    the warped rows, or the logits when `mode` is GREEDY, whose rows nobody reads)."""
    if mode == GREEDY:
        return logits.argmax(dim=-1), logits.float()
    probs = warp_batch(logits, temperature, top_k, top_p, truncate=mode == TRUNCATED)
    sampled = torch.argmax(probs / stream_exponentials(seeds, counters, DOMAIN_DRAFT, probs.shape[-1], first), dim=-1)
    if _none_on_host(greedy):
        return sampled, probs
    return torch.where(greedy, probs.argmax(dim=-1), sampled), probs


def root_candidates(logits: torch.Tensor, mode: str, width: int, without_replacement: bool, temperature: torch.Tensor,
                    top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                    counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree root's `width` children per row of `logits` [R, V]: the top `width` when greedy; else drawn from the
    row's stream (DOMAIN_DRAFT, round `counters`): without replacement (Gumbel-top-k over one draw's noise: RSD's
    rule), otherwise i.i.d. (candidate w: the exponential race over draws w * V ..). Returns (tokens [R, W];
    valid [R, W]: False for a candidate without replacement past the row's support, these come last;
    rows [R, V], as `draw_tokens`')."""
    top = logits.topk(width, dim=-1).indices  # [R, W]
    if mode == GREEDY:
        return top, torch.ones_like(top, dtype=torch.bool), logits.float()
    probs = warp_batch(logits, temperature, top_k, top_p, truncate=mode == TRUNCATED)
    rows, vocab = probs.shape
    if without_replacement:  # log q + Gumbel; log 0 = -inf: a token outside the support comes last
        gumbel = -torch.log(stream_exponentials(seeds, counters, DOMAIN_DRAFT, vocab))  # [R, V]
        sampled = (torch.log(probs) + gumbel).topk(width, dim=-1).indices
    else:
        noise = stream_exponentials(seeds, counters, DOMAIN_DRAFT, width * vocab).view(rows, width, vocab)
        sampled = torch.argmax(probs[:, None, :] / noise, dim=-1)  # [R, W]
    tokens = torch.where(greedy[:, None], top, sampled)
    return tokens, greedy[:, None] | (probs.gather(1, tokens) > 0), probs
