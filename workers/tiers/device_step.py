"""A tier's step in the device round, as one tensor program per bucket, and its CUDA-graph replay.

- `target_step`: the verifier's forward over [last committed token, k drafts] per request,
  the warp, and the verification of every block (polyspec.workers.core.device_verify);
  returns the emitted token ids and accepted counts, the round's only output to the host;
- `draft_step`: a drafter's forward of one (or, to catch up, two) tokens per request, the warp
  of the last column, and one draw per request from its counter-based stream;
- `target_tree_step`: the verifier's forward over [last committed token, tree nodes] per request
  (tree attention), the warp, and the verification of every tree
  (polyspec.workers.core.device_tree_verify); returns the accepted paths and next tokens;
- `tree_root_step`, `tree_level_step`: a drafter's tree, one step per level: the root's `width`
  candidates (the top ones when greedy, else drawn with or without replacement), then one child
  for each of the `width` nodes of the frontier (static: a tree of w chains, w nodes a level);
- `sampling_mode`: the cheapest warp that serves every request of a step (greedy: no warp at
  all; plain: no top-k / top-p sorts; truncated) — a static choice, one graph each;
- `StepGraphs`: on CUDA, each step captured once per bucket key and replayed with its inputs
  copied into the graph's buffers; elsewhere, called directly.

Nothing here reads a tensor's value on the host: tests compile every step whole
(`fullgraph`) and check that a bucket compiles once.
"""

from __future__ import annotations

import torch

from polyspec.workers.core.device_tree_verify import tree_draws, verify_greedy_trees, verify_trees
from polyspec.workers.core.device_verify import (
    DOMAIN_ACCEPT,
    DOMAIN_DRAFT,
    DOMAIN_NEXT,
    emitted_tokens,
    stream_exponentials,
    stream_uniforms,
    verify_chains,
    verify_greedy_chains,
    warp_batch,
)
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched_llama import BatchedLlama, SlotCache

MAX_BLOCK_TOKENS = 32  # the longest block (the most tree nodes) a step verifies (each slot keeps room for it past the context)
SLOT_MARGIN = MAX_BLOCK_TOKENS + 2  # positions a slot holds past its context: a block, its root, a drafter's re-fed token
MIN_SPAN = 64  # the smallest attended span bucket
PREFILL_CHUNK = 256  # prompt tokens one eager prefill forward carries at most
PREFILL_WIDTH = 16  # a prefill chunk is padded to a multiple of this (fewer distinct shapes; stays inside SLOT_MARGIN)
DRAFT_TAIL = 2  # a drafter's first step feeds the last two context tokens (one it may not have seen after a whole block)


def bucket(value: int, smallest: int = 1) -> int:
    """The power of two at or above `value` (at least `smallest`)."""
    size = smallest
    while size < value:
        size *= 2
    return size


class SlotTable:
    """Which slot of a device tier's buffers (a KV pool, a token buffer) each open sequence holds, and the
    tokens each slot holds from position 0: host bookkeeping, so a rollback is free (only what a sequence
    no longer shares with its context is ever rewritten). The last slot, `scratch`, is padding rows'."""

    def __init__(self, slots: int, owner: str, what: str) -> None:
        self.slots = slots
        self.owner, self.what = owner, what  # for the one line a full table raises: "tier 'x': all 8 <what> are in use"
        self.slot_of: dict[object, int] = {}
        self.free = list(range(slots))
        self.tokens: dict[int, list[int]] = {}  # slot -> the tokens it holds

    @property
    def scratch(self) -> int:
        return self.slots

    @property
    def open_sequences(self) -> int:
        return len(self.slot_of)

    def slot(self, seq_id) -> int:
        """The sequence's slot, taken from the free ones on first use."""
        slot = self.slot_of.get(seq_id)
        if slot is None:
            if not self.free:
                raise RuntimeError(f"tier {self.owner!r}: all {self.slots} {self.what} are in use")
            slot = self.slot_of[seq_id] = self.free.pop(0)
            self.tokens[slot] = []
        return slot

    def release(self, seq_id) -> int | None:
        """Free the sequence's slot; the slot it held (None: it held none)."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            del self.tokens[slot]
            self.free.append(slot)
            self.free.sort()
        return slot

    def truncate(self, seq_id, length: int) -> int | None:
        slot = self.slot_of.get(seq_id)
        if slot is not None:
            del self.tokens[slot][length:]
        return slot

    def cached(self, seq_id) -> int:
        slot = self.slot_of.get(seq_id)
        return 0 if slot is None else len(self.tokens[slot])

    def sync(self, slot: int, context: list[int], keep_at_most: int | None = None) -> int:
        """Roll the slot back to the prefix it shares with `context` (at most `keep_at_most` tokens); how many it keeps."""
        held = self.tokens[slot]
        limit = min(len(held), len(context), len(context) if keep_at_most is None else keep_at_most)
        keep = limit if held[:limit] == context[:limit] else next(i for i in range(limit) if held[i] != context[i])
        del held[keep:]
        return keep


GREEDY, PLAIN, TRUNCATED = "greedy", "plain", "truncated"  # a step's sampling: every request greedy; no top-k / top-p; some


def sampling_mode(params: list[SamplingParams]) -> str:
    """The cheapest warp that serves every request of a step (a static choice: one graph each)."""
    if all(p.greedy for p in params):
        return GREEDY
    return TRUNCATED if any(p.top_k > 0 or p.top_p < 1.0 for p in params) else PLAIN


def target_step(model: BatchedLlama, pool: SlotCache, ids, positions, slots, span: int, mode: str, temperature, top_k, top_p, greedy,
                draft_tokens, draft_probs, num_draft, seeds, counters, features: torch.Tensor | None = None):
    """The target's step: forward of [B, k + 1] tokens, warp, verification. Returns
    (tokens [B, k + 1]: accepted drafts, then the correction / bonus token, then padding; num_accepted [B];
    rows [B, k + 1, V]: the warped float32 rows the emitted tokens are distributed as — the logits when
    every request is greedy, whose rows nobody reads). `features`: the buffer the forward writes its last
    hidden states into, for a feature head below (`BatchedLlama.step`)."""
    logits = model.step(pool, ids, positions, slots, span, features=features)  # [B, k + 1, V]
    rows, width, vocab = logits.shape
    block = width - 1
    cu_num_draft = torch.arange(rows + 1, device=ids.device) * block  # the padded layout: k slots per request
    flat_tokens = draft_tokens.reshape(-1)
    if mode == GREEDY:
        num_accepted, next_tokens = verify_greedy_chains(logits, draft_tokens, num_draft)
        return emitted_tokens(flat_tokens, cu_num_draft, num_accepted, next_tokens, block), num_accepted, logits

    target_probs = warp_batch(logits.reshape(rows * width, vocab), _per_row(temperature, width), _per_row(top_k, width),
                              _per_row(top_p, width), truncate=mode == TRUNCATED)
    uniforms = stream_uniforms(seeds, counters, DOMAIN_ACCEPT, block).reshape(-1)  # [B * k]
    exponentials = stream_exponentials(seeds, counters, DOMAIN_NEXT, vocab)  # [B, V]
    num_accepted, next_tokens = verify_chains(target_probs, draft_probs.reshape(rows * block, vocab), flat_tokens, cu_num_draft,
                                              greedy, uniforms, exponentials, num_draft)
    tokens = emitted_tokens(flat_tokens, cu_num_draft, num_accepted, next_tokens, block)
    return tokens, num_accepted, target_probs.view(rows, width, vocab)


def target_tree_step(model: BatchedLlama, pool: SlotCache, ids, positions, slots, span: int, mode: str, scheme: str, max_depth: int,
                     max_width: int, temperature, top_k, top_p, greedy, ancestors, node_tokens, parents, num_nodes, draft_probs,
                     seeds, counters):
    """The verifier's step over draft trees: forward of [B, N + 1] tokens (the root, then the nodes; `ancestors`
    [B, N + 1, N + 1]), warp, `verify_trees` (`scheme`; the tree layout of device_tree_verify). Returns
    (verdicts [B, max_depth + 2]: the accepted path's node indices (PLACEHOLDER_NODE past its length), its
    length, the next token; rows [B, N + 1, V] as `target_step`'s)."""
    logits = model.step(pool, ids, positions, slots, span, ancestors)  # [B, N + 1, V]
    rows, width, vocab = logits.shape
    if mode == GREEDY:
        path, path_len, next_tokens = verify_greedy_trees(logits, node_tokens, parents, num_nodes, max_depth, max_width)
        target_rows = logits
    else:
        target_rows = warp_batch(logits.reshape(rows * width, vocab), _per_row(temperature, width), _per_row(top_k, width),
                                 _per_row(top_p, width), truncate=mode == TRUNCATED).view(rows, width, vocab)
        path, path_len, next_tokens = verify_trees(target_rows, draft_probs, node_tokens, parents, num_nodes, greedy,
                                                   *tree_draws(seeds, counters, width - 1, vocab), scheme, max_depth, max_width)
    return torch.cat([path, path_len[:, None], next_tokens[:, None]], dim=1), target_rows


def tree_root_step(model: BatchedLlama, pool: SlotCache, ids, positions, slots, span: int, mode: str, width: int,
                   without_replacement: bool, temperature, top_k, top_p, greedy, seeds, counters, confidence: bool = False):
    """A tree drafter's first step: forward, warp of the last column, and the root's `width` candidates per request
    (`tier.first_candidates`' rules): the top `width` logits when greedy; else drawn from the request's stream
    (DOMAIN_DRAFT, round `counters`): without replacement (Gumbel-top-k over one draw's noise) for rsd, otherwise
    i.i.d. (candidate w: the exponential race over draws w * V ..). Returns (tokens [B, W]; valid [B, W]: False for
    a candidate without replacement past the row's support, these come last; probs [B, V], the logits when greedy).
    `confidence` (a static choice): a fourth output, the root row's top probability at temperature 1 [B] (an early
    exit's signal, as `draft_step`'s)."""
    logits = model.step(pool, ids, positions, slots, span)[:, -1]  # [B, V]
    top = logits.topk(width, dim=-1).indices  # [B, W]
    confident = (_confidence(logits),) if confidence else ()
    if mode == GREEDY:
        return top, torch.ones_like(top, dtype=torch.bool), logits.float(), *confident
    probs = warp_batch(logits, temperature, top_k, top_p, truncate=mode == TRUNCATED)
    rows, vocab = probs.shape
    if without_replacement:
        # log q + Gumbel over one draw's noise; log 0 = -inf: a token outside the support comes last
        gumbel = -torch.log(stream_exponentials(seeds, counters, DOMAIN_DRAFT, vocab))  # [B, V]
        sampled = (torch.log(probs) + gumbel).topk(width, dim=-1).indices
    else:
        noise = stream_exponentials(seeds, counters, DOMAIN_DRAFT, width * vocab).view(rows, width, vocab)
        sampled = torch.argmax(probs[:, None, :] / noise, dim=-1)  # [B, W]
    tokens = torch.where(greedy[:, None], top, sampled)
    return tokens, greedy[:, None] | (probs.gather(1, tokens) > 0), probs, *confident


def tree_level_step(model: BatchedLlama, pool: SlotCache, ids, positions, slots, span: int, mode: str, ancestors, tree_start,
                    temperature, top_k, top_p, greedy, seeds, counters, confidence: bool = False):
    """One more level of every request's tree: forward of its W frontier nodes (`ancestors` [B, W, C] over the
    tree's C columns so far, cached from `tree_start` [B]), warp of each, and one child per node drawn from the
    request's stream (DOMAIN_DRAFT, round `counters`, node w's draws w * V ..). Returns (tokens [B, W],
    probs [B, W, V]; the logits when greedy). `confidence` (a static choice): a third output, the most confident
    of each request's W rows [B] (an early exit grows the tree on while any branch is sure: `ModelTier.draft_tree`)."""
    logits = model.step(pool, ids, positions, slots, span, ancestors, tree_start)  # [B, W, V]
    confident = (_confidence(logits).amax(dim=-1),) if confidence else ()
    if mode == GREEDY:
        return logits.argmax(dim=-1), logits.float(), *confident
    rows, width, vocab = logits.shape
    probs = warp_batch(logits.reshape(rows * width, vocab), _per_row(temperature, width), _per_row(top_k, width),
                       _per_row(top_p, width), truncate=mode == TRUNCATED).view(rows, width, vocab)
    noise = stream_exponentials(seeds, counters, DOMAIN_DRAFT, width * vocab).view(rows, width, vocab)
    return torch.where(greedy[:, None], probs.argmax(dim=-1), torch.argmax(probs / noise, dim=-1)), probs, *confident


def _confidence(logits: torch.Tensor) -> torch.Tensor:
    """The top probability of each row at temperature 1 (`tier.confidence` on the device): an early exit's signal."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


def _per_row(values: torch.Tensor, width: int) -> torch.Tensor:
    """[B * width]: a request's value on each of its `width` rows."""
    return values[:, None].expand(values.shape[0], width).reshape(-1)


def draft_step(model: BatchedLlama, pool: SlotCache, ids, positions, slots, span: int, mode: str, temperature, top_k, top_p, greedy, seeds,
               draw_counters, confidence: bool = False):
    """A drafter's step: forward, warp of the last column, one draw per request. Returns (tokens [B], probs [B, V];
    all-greedy steps return the logits instead of probabilities: the target's greedy verification reads none).
    `confidence` (a static choice): a third output, each row's top probability at temperature 1 [B], the signal of
    an early exit (`tier.confidence`: BiLD's fallback)."""
    logits = model.step(pool, ids, positions, slots, span)[:, -1]  # [B, V]
    return draw_next(logits, mode, temperature, top_k, top_p, greedy, seeds, draw_counters, confidence)


def draw_next(logits, mode: str, temperature, top_k, top_p, greedy, seeds, draw_counters, confidence: bool = False):
    """A drafter's next token from its rows' logits [B, V]: warp, one draw per request (`draft_step`'s outputs)."""
    confident = (_confidence(logits),) if confidence else ()
    if mode == GREEDY:
        return (logits.argmax(dim=-1), logits.float(), *confident)
    probs = warp_batch(logits, temperature, top_k, top_p, truncate=mode == TRUNCATED)
    sampled = torch.argmax(probs / stream_exponentials(seeds, draw_counters, DOMAIN_DRAFT, probs.shape[-1]), dim=-1)
    return (torch.where(greedy, probs.argmax(dim=-1), sampled), probs, *confident)


class StepGraphs:
    """Each step captured once per bucket as a CUDA graph and replayed with new inputs (on CUDA);
    called directly elsewhere. The inputs are copied into the graph's own buffers before each
    replay; the outputs are the graph's buffers (read them before the next replay)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.graphs: dict[tuple, tuple] = {}
        self.memory_pool = None

    def run(self, key: tuple, step, tensors: list[torch.Tensor]):
        """`step(*tensors)`, replayed from the graph captured for `key` (the bucket: whatever fixes the shapes)."""
        if not self.enabled:
            return step(*tensors)
        entry = self.graphs.get(key)
        if entry is None:
            buffers = [t.clone() for t in tensors]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (the same inputs: its writes are the replay's)
                step(*buffers)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.memory_pool is None:
                self.memory_pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                outputs = step(*buffers)
            entry = self.graphs[key] = (graph, buffers, outputs)
        graph, buffers, outputs = entry
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=True)
        graph.replay()
        return outputs
