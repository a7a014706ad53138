"""A model tier on the round that stays on the device: the one forward's static step over a KV pool allocated once.

`StaticModelTier` is a batched tier (polyspec.workers.tiers.batched) like `BatchedModelTier`, so the
one round (polyspec.orchestrator.decode.scheduler.ChainScheduler) runs it at any level of a chain:
the target, a middle tier, the bottom drafter. What differs is where its work happens:

- `verify_batch`: ONE static-shape step per call — the forward of [last committed token, block] of
  every request, the warp and the verification of every chain block (device_step.target_step),
  replayed as a CUDA graph on CUDA. Its one copy to the host: the emitted token ids and accepted
  counts. Logits never leave the device; the rows a middle tier passes up (at T > 0) stay on it.
  Draft trees take the same shape of step (device_step.target_tree_step: tree attention,
  device_tree_verify's walk); its one copy: each accepted path and next token.
- `draft_batch`: k one-token static steps (device_step.draft_step: forward, warp, one draw from the
  request's counter-based stream); tokens and rows stay on the device until one copy of the [B, k]
  token ids at the end (the round commits them on the host).
- `draft_tree_batch`: a tree of `width` chains per request, one static step per level
  (device_step.tree_root_step, tree_level_step: `width` nodes a level), one copy of the tokens.
- `prefill`: prompts in eager chunks (their shapes vary), one request at a time.
- `score_batch`: forward and warp, rows on the device: what a check other than the fused one reads
  (the profiler's timing).

Draft trees (`draft_tree_batch`, tree blocks in `verify_batch`, `accept_path`) are polyspec.workers.tiers.static_trees'
steps, mixed in.

The trained drafters: an early-exit drafter is a `StaticModelTier` of its own model (the target's first layers,
shared, and its adapter; its own pool; its exit threshold cuts blocks and trees on the host); a feature head is a
`StaticFeatureTier` (polyspec.workers.tiers.static_feature) reading the features its target's tier records
(`record_features`).

Every step's shapes depend only on its bucket: requests padded up to a power of two (padding rows
write the pool's scratch slot), the attended span rounded up to a power of two (at least MIN_SPAN),
the block width exact. A slot's contents are host bookkeeping (`SlotTable`: the tokens its KV holds), so a
rollback is free: every call first syncs a request's slot to the context it is given, keeping the
prefix they share, as `BatchedModelTier` does.

Randomness: a request's device draws come from counter-based streams keyed by its random stream at
this tier (polyspec.workers.core.sampling.RandomStream: `key`, and `take()` for fresh counters), so a
seeded request draws the same numbers alone or in any batch, and a retried step draws them again.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from polyspec.workers.core.sampling import RandomStream, SamplingParams, warp_logits
from polyspec.workers.core.tree import DraftTree
from polyspec.workers.tiers.batched import BatchedTier, Verdict
from polyspec.workers.tiers.device_step import (  # noqa: F401 (MAX_BLOCK_TOKENS, SLOT_MARGIN, MIN_SPAN, bucket: re-exported)
    DRAFT_TAIL,
    GREEDY,
    MAX_BLOCK_TOKENS,
    MIN_SPAN,
    PREFILL_CHUNK,
    PREFILL_WIDTH,
    SLOT_MARGIN,
    SlotTable,
    StepGraphs,
    bucket,
    draft_step,
    sampling_mode,
    target_step,
    target_tree_step,
    tree_level_step,
    tree_root_step,
)
from polyspec.workers.tiers.batched_llama import BatchedLlama, step_unsupported
from polyspec.workers.tiers.static_trees import PendingTree, TreeSteps
from polyspec.workers.tiers.tier import ModelTier, NGramTier

@dataclasses.dataclass
class DraftInputs:
    """A drafting call's requests with something to draft, ready for its first step: their indices in the call,
    contexts, slots (synced, the last DRAFT_TAIL tokens left to the first step) and params, and per padded row
    (`rows`) their streams, sampling parameters, slots and the first step's ids and positions on the device."""

    live: list[int]
    contexts: list[list[int]]
    slots: list[int]
    params: list[SamplingParams]
    rows: int
    mode: str
    seeds: torch.Tensor
    counters: torch.Tensor
    sampling: tuple[torch.Tensor, ...]
    slot_column: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor


def _stream_key(generator, rounds: int = 1) -> tuple[int, int]:
    """(key, first counter) of `rounds` rounds of device draws from `generator`; a profile's calls pass None."""
    if generator is None:
        return 0, 0
    if not isinstance(generator, RandomStream):
        raise TypeError("the device round draws from RandomStream generators (contract.seeded_generator)")
    return generator.key, generator.take(rounds)


def misfit(tiers, lengths, tree_width: int) -> str | None:
    """Why the device round cannot run a chain of these (loaded) tiers; None when it can. Every model
    tier must be a Llama / Qwen2 model the static step runs (float or fp8 weights; int8 on the CPU); every other
    tier the n-gram lookup, or a feature head drafting chains directly under the target (static_feature). An
    early-exit drafter is such a model (the target's first layers, shared, and its
    adapter: drafters.early_exit_model), its pool its own; its `exit_threshold` is `draft_batch`'s and
    `draft_tree_batch`'s. A draft tree (the bottom tier's block: tree_width x its length nodes) is one
    block, of at most MAX_BLOCK_TOKENS nodes."""
    from polyspec.workers.tiers.feature_tier import FeatureTier

    for level, tier in enumerate(tiers):
        if level and isinstance(tier, NGramTier):
            continue
        if level == 1 and isinstance(tier, FeatureTier):
            why = _feature_misfit(tiers, tree_width)
            if why:
                return why
            continue
        if not isinstance(tier, ModelTier) or step_unsupported(tier.model, torch.device(tier.device)) is not None:
            return (f"tier {tier.name!r} is not a Llama / Qwen2 model with float or fp8 weights on the CPU or CUDA (int8: the CPU), "
                    f"nor an n-gram drafter")
        if any(isinstance(head, FeatureTier) and head.source is tier for head in tiers[level + 2:]):
            return f"tier {tier.name!r} feeds a feature head that is not the tier below it, which the device round does not run"
    vocabularies = {tier.model.config.vocab_size for tier in tiers if isinstance(tier, ModelTier)}
    if len(vocabularies) > 1:
        return f"its tiers' logits must have one width, got {sorted(vocabularies)}"
    if lengths == "auto":  # the planner keeps its trees within a block (`longest_length`)
        if tree_width > MAX_BLOCK_TOKENS:
            return f"its draft trees hold at most {MAX_BLOCK_TOKENS} nodes, fewer than one level of {tree_width}"
        return None
    # a middle tier's last round may overshoot what it was asked for by the block below it: the target's
    # block can hold the sum of the lengths
    if sum(lengths) > MAX_BLOCK_TOKENS:
        return f"its blocks hold at most {MAX_BLOCK_TOKENS} tokens, and a chain's lengths add up in its top block: {sum(lengths)}"
    if tree_width > 1 and lengths and tree_width * lengths[-1] > MAX_BLOCK_TOKENS:
        return (f"its draft trees hold at most {MAX_BLOCK_TOKENS} nodes; tree_width {tree_width} x length {lengths[-1]} "
                f"makes {tree_width * lengths[-1]}")
    return None


def _feature_misfit(tiers, tree_width: int) -> str | None:
    """Why the device round cannot run the feature head tiers[1] (polyspec.workers.tiers.static_feature); None when it can."""
    from polyspec.workers.tiers.feature_tier import head_trunk

    head = tiers[1]
    if head.source is not tiers[0]:
        return f"tier {head.name!r} is a feature head over another tier than the target"
    if len(tiers) > 2 or tree_width > 1:
        return f"tier {head.name!r} is a feature head: on the device it drafts chains (tree_width 1) at the bottom of the chain"
    if step_unsupported(head_trunk(head.head), torch.device(getattr(tiers[0], "device", "cpu"))) is not None:
        return f"tier {head.name!r} is a feature head whose decoder layer the device round does not run"
    return None


def longest_length(tree_width: int) -> int:
    """The longest speculation length a planner may give device tiers: a bottom tree of `tree_width` x k nodes must
    fit one block (the goodput planner's plans then also keep a middle tier's overshoot inside it: their longest
    lengths, 12 and 10, add up to 22)."""
    return MAX_BLOCK_TOKENS // max(1, tree_width)


class StaticModelTier(TreeSteps, BatchedTier):
    """A Llama-architecture `ModelTier` whose requests share one KV pool and one static-shape step per call (module docstring)."""

    profile_kind = "device"  # its start-up profile times these steps, not the ragged forward's

    def __init__(self, tier: ModelTier, slots: int, context: int | None = None, model: BatchedLlama | None = None) -> None:
        """`slots`: requests the pool holds at once; `context`: positions each holds (default: the model's);
        `model`: the tier's forward when the caller has made it already."""
        super().__init__(tier)
        self.model = model if model is not None else BatchedLlama(tier.model)
        self.device = self.model.device
        self.pool = self.model.new_pool(slots, SLOT_MARGIN, context)
        self.max_context = min(x for x in (context, self.model.limit, tier.max_context) if x)
        self.caches_prompts = True
        self.graphs = StepGraphs(self.device.type == "cuda")
        self.threads = tier.threads
        self.slot_table = SlotTable(slots, self.name, "slots of its KV pool")  # each slot's tokens: what its KV holds
        self._trees: dict[int, PendingTree] = {}  # slot -> its unverified tree
        self._moves: list[tuple[int, int, int]] = []  # (slot, from, to): accepted nodes' KV still to move (`_compact`)
        self._forwarded = 0
        self.features: torch.Tensor | None = None  # [slots + 1, capacity, H] for a feature head below (`record_features`)

    def record_features(self) -> None:
        """From now on every chain forward also writes its last hidden states (what the LM head reads) at
        [slot, position] of `features`: a feature head drafting below reads them (polyspec.workers.tiers.static_feature)."""
        if self.features is None:
            self.features = torch.zeros(self.pool.slots + 1, self.pool.capacity, self.model.hidden_size, dtype=self.model.dtype,
                                        device=self.device)

    @staticmethod
    def bytes_per_request(model: BatchedLlama, context: int | None) -> int:
        return model.bytes_per_slot(SLOT_MARGIN, context)

    @property
    def forwarded_tokens(self) -> int:
        return self._forwarded

    # ------------------------------------------------------------------ slots

    @property
    def open_sequences(self) -> int:
        return self.slot_table.open_sequences

    def _slot(self, seq_id) -> int:
        return self.slot_table.slot(seq_id)

    def release(self, seq_id) -> None:
        slot = self.slot_table.release(seq_id)
        if slot is not None:
            self._trees.pop(slot, None)
            self._moves = [move for move in self._moves if move[0] != slot]

    def truncate(self, seq_id, length: int) -> None:
        slot = self.slot_table.truncate(seq_id, length)
        if slot is not None:
            self._trees.pop(slot, None)  # an unaccepted tree's nodes go with the cut

    def cached(self, seq_id) -> int:
        return self.slot_table.cached(seq_id)

    def _sync(self, slot: int, context: list[int], keep_at_most: int) -> list[int]:
        """Roll the slot back to what it shares with `context` (at most `keep_at_most` tokens); the uncached tail."""
        self._trees.pop(slot, None)  # an unaccepted tree's nodes are not context (they sit past the slot's tokens)
        return context[self.slot_table.sync(slot, context, keep_at_most):]

    # ------------------------------------------------------------------ steps

    def _set_threads(self) -> None:
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def _span(self, longest: int) -> int:
        return min(bucket(longest, MIN_SPAN), self.pool.capacity)

    def _column(self, values: list, rows: int, dtype: torch.dtype, pad) -> torch.Tensor:
        """One value (or row) per request, padded to `rows` with `pad`, on the device."""
        return torch.tensor(values + [pad] * (rows - len(values)), dtype=dtype).to(self.device, non_blocking=True)

    def _sampling(self, params: list[SamplingParams], rows: int) -> tuple[torch.Tensor, ...]:
        """temperature, top_k, top_p, greedy per request (padding rows: greedy)."""
        return (self._column([p.temperature for p in params], rows, torch.float32, 0.0),
                self._column([p.top_k for p in params], rows, torch.long, 0),
                self._column([p.top_p for p in params], rows, torch.float32, 1.0),
                self._column([p.greedy for p in params], rows, torch.bool, True))

    def _timed(self, started: float, rows: int, width: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self.tier.busy_s += seconds
        self.tier.forwards += 1
        self.log_forward(rows, width, seconds)

    def _feed_eagerly(self, slot: int, tokens: list[int]) -> None:
        """Append `tokens` to the slot in eager chunks (a prompt, or a tail too long for a step)."""
        start = len(self.slot_table.tokens[slot])
        for offset in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[offset:offset + PREFILL_CHUNK]
            width = -(-len(chunk) // PREFILL_WIDTH) * PREFILL_WIDTH  # padding writes past the chunk, inside the slot's margin
            ids = torch.zeros(1, width, dtype=torch.long)
            ids[0, : len(chunk)] = torch.tensor(chunk)
            positions = (start + offset + torch.arange(width))[None]
            self._set_threads()
            started = time.perf_counter()
            with torch.inference_mode():
                self._eager_forward(slot, ids.to(self.device), positions.to(self.device), self._span(start + offset + width))
            self._timed(started, 1, width)
            self._forwarded += len(chunk)
        self.slot_table.tokens[slot] += tokens

    def _eager_forward(self, slot: int, ids: torch.Tensor, positions: torch.Tensor, span: int) -> None:
        """One eager forward of a chunk [1, T] into `slot` (its KV, and its features where kept)."""
        self.model.step(self.pool, ids, positions, torch.tensor([slot], device=self.device), span, features=self.features)

    def prefill(self, seq_ids, contexts, budget: int) -> int:
        self._compact()
        fed = 0
        for seq_id, context in zip(seq_ids, contexts):
            if budget - fed <= 0:
                break
            slot = self._slot(seq_id)
            tail = self._sync(slot, context, len(context) - 1)[:-1]  # all but the last token
            chunk = tail[: budget - fed]
            if chunk:
                self._feed_eagerly(slot, chunk)
                fed += len(chunk)
        return fed

    def _prepare(self, seq_ids, contexts, keep_tail: int) -> list[int]:
        """Each request's slot, synced to its context, holding all but its last `keep_tail` tokens
        (a longer uncached tail is fed eagerly first)."""
        self._compact()
        slots = []
        for seq_id, context in zip(seq_ids, contexts):
            slot = self._slot(seq_id)
            tail = self._sync(slot, context, max(0, len(context) - keep_tail))
            if len(tail) > keep_tail:
                self._feed_eagerly(slot, tail[: len(tail) - keep_tail])
            slots.append(slot)
        return slots

    @torch.inference_mode()
    def verify_batch(self, seq_ids, contexts, blocks: list[DraftTree], params: list[SamplingParams], generators,
                     want_rows: bool = False, scheme: str = "specinfer", below: BatchedTier | None = None) -> list[Verdict]:
        """Verify every request's block (forward, warp, verification on the device; see BatchedTier): the chains in
        ONE step, the trees in ONE step, whose accepted paths are then all this tier and `below` keep (`accept_path`).
        A chain goes through the chain step whatever else is in the batch (so a seeded request draws the same alone);
        an empty block, which both steps draw alike, goes with the trees."""
        if all(block.is_chain() for block in blocks):
            return self._verify_chains(seq_ids, contexts, blocks, params, generators, want_rows)
        chains = [r for r, block in enumerate(blocks) if block.is_chain() and len(block)]
        if not chains:
            return self._verify_trees(seq_ids, contexts, blocks, params, generators, want_rows, scheme, below)
        trees = [r for r, block in enumerate(blocks) if not (block.is_chain() and len(block))]

        def picked(group: list[int]) -> list[list]:
            return [[values[r] for r in group] for values in (seq_ids, contexts, blocks, params, generators)]

        out: list[Verdict | None] = [None] * len(blocks)
        for r, verdict in zip(chains, self._verify_chains(*picked(chains), want_rows)):
            out[r] = verdict
        for r, verdict in zip(trees, self._verify_trees(*picked(trees), want_rows, scheme, below)):
            out[r] = verdict
        return out

    def _verify_chains(self, seq_ids, contexts, blocks: list[DraftTree], params: list[SamplingParams], generators,
                       want_rows: bool) -> list[Verdict]:
        """Every request's chain block in ONE step (device_step.target_step)."""
        slots = self._prepare(seq_ids, contexts, keep_tail=1)
        count = len(seq_ids)
        rows = bucket(count)
        block = max((len(b) for b in blocks), default=0)
        assert block <= MAX_BLOCK_TOKENS, f"a block of {block} tokens (at most {MAX_BLOCK_TOKENS})"
        mode = sampling_mode(params)
        vocab = self.model.vocab_size
        lengths = [len(c) for c in contexts]
        ids = self._column([[c[-1]] + b.tokens + [0] * (block - len(b)) for c, b in zip(contexts, blocks)], rows, torch.long,
                           [0] * (block + 1))  # [R, k + 1]
        positions = self._column([n - 1 for n in lengths], rows, torch.long, 0)[:, None] + torch.arange(block + 1, device=self.device)
        draft_tokens = ids[:, 1:]
        # greedy steps read no draft rows: a placeholder keeps the step's signature
        draft_probs = torch.zeros(rows, block, 1 if mode == GREEDY else vocab, dtype=torch.float32, device=self.device)
        if mode != GREEDY:
            for r, (b, p) in enumerate(zip(blocks, params)):
                if not p.greedy and len(b):
                    if b.draft_rows is None:  # a lookup's proposals are point masses
                        draft_probs[r, : len(b)].scatter_(1, draft_tokens[r, : len(b), None], 1.0)
                    else:
                        draft_probs[r, : len(b)] = b.draft_rows.to(self.device, non_blocking=True)
        seeds, counters = self._streams(generators, [1] * count, rows)
        span = self._span(max(lengths) + block)

        def verifying(*tensors):
            return target_step(self.model, self.pool, *tensors[:3], span, mode, *tensors[3:], features=self.features)

        self._set_threads()
        started = time.perf_counter()
        tokens, num_accepted, target_rows = self.graphs.run(
            ("verify", rows, block, span, mode), verifying,
            [ids, positions, self._column(slots, rows, torch.long, self.pool.scratch_slot), *self._sampling(params, rows), draft_tokens,
             draft_probs, self._column([len(b) for b in blocks], rows, torch.long, 0), seeds, counters])
        emitted, accepted = tokens[:count].cpu().tolist(), num_accepted[:count].cpu().tolist()  # the step's one copy to the host
        self._timed(started, rows, block + 1)
        self._forwarded += sum(len(b) + 1 for b in blocks)
        out = []
        for r, (slot, context, b, p) in enumerate(zip(slots, contexts, blocks, params)):
            self.slot_table.tokens[slot] += [context[-1]] + b.tokens  # what the step wrote; the next call keeps what stays context
            # the graph's output buffers are overwritten by its next replay: rows passed up are copies
            kept_rows = target_rows[r, : accepted[r] + 1].clone() if want_rows and not p.greedy else None
            out.append(Verdict(list(range(accepted[r])), emitted[r][accepted[r]], kept_rows))
        return out

    def _streams(self, generators, counts: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """seeds and first counters [R] of each request's device draws, `counts[r]` rounds taken from its stream."""
        keys = [_stream_key(g, n) for g, n in zip(generators, counts)]
        return self._column([k for k, _ in keys], rows, torch.long, 0), self._column([c for _, c in keys], rows, torch.long, 0)

    def _drafting(self, seq_ids, contexts, sizes: list[int], params, generators) -> DraftInputs | None:
        """The requests of a drafting call with something to draft (`sizes[r]` > 0: a block's tokens, a tree's
        levels, which are also the counters taken from each one's stream); None when none has. The first step
        feeds each context's last DRAFT_TAIL tokens: it re-feeds the token before the last, which a drafter whose
        block was accepted whole has not seen."""
        live = [r for r, size in enumerate(sizes) if size > 0]
        if not live:
            return None
        contexts = [contexts[r] for r in live]
        slots = self._prepare([seq_ids[r] for r in live], contexts, keep_tail=DRAFT_TAIL)
        params = [params[r] for r in live]
        rows = bucket(len(live))
        seeds, counters = self._streams([generators[r] for r in live], [sizes[r] for r in live], rows)
        ids = self._column([[c[-2] if len(c) > 1 else c[-1], c[-1]] for c in contexts], rows, torch.long, [0, 0])  # [R, 2]
        positions = self._column([[max(len(c) - 2, 0), len(c) - 1] for c in contexts], rows, torch.long, [0, 1])
        return DraftInputs(live, contexts, slots, params, rows, sampling_mode(params), seeds, counters, self._sampling(params, rows),
                           self._column(slots, rows, torch.long, self.pool.scratch_slot), ids, positions)

    @torch.inference_mode()
    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        """Each request's block of `counts[r]` tokens, one static step per position for every request at once."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seq_ids]
        inputs = self._drafting(seq_ids, contexts, counts, params, generators)
        if inputs is None:
            return out
        live, contexts, slots, params = inputs.live, inputs.contexts, inputs.slots, inputs.params
        rows, mode = inputs.rows, inputs.mode
        ids, positions = inputs.ids, inputs.positions
        count, steps = len(live), max(counts[r] for r in live)
        lengths = [len(c) for c in contexts]
        # an early exit (BiLD's fallback, `ModelTier.exit_by_seq`): a block ends after its first token drafted below
        # the request's threshold; the exit depends on the drafter's own rows only, so verification stays exact
        thresholds = [self.tier.exit_by_seq.get(seq_ids[r], self.tier.exit_threshold) for r in live]
        exits = any(t is not None for t in thresholds)
        drafted = torch.zeros(rows, steps * (2 if exits else 1), dtype=torch.long, device=self.device)  # [R, k] tokens, [R, k] unsure
        drafted_probs = torch.zeros(rows, steps, self.model.vocab_size, dtype=torch.float32, device=self.device) if mode != GREEDY else None
        floor = self._column([-1.0 if t is None else t for t in thresholds], rows, torch.float32, -1.0) if exits else None
        self._set_threads()
        started = time.perf_counter()
        for j in range(steps):
            span = self._span(max(lengths) + j + 1)

            def drafting(*tensors, span=span):
                return draft_step(self.model, self.pool, *tensors[:3], span, mode, *tensors[3:], confidence=exits)

            tokens, probs, *confident = self.graphs.run(
                ("draft", rows, ids.shape[1], span, mode, exits), drafting,
                [ids, positions, inputs.slot_column, *inputs.sampling, inputs.seeds, inputs.counters + j])
            drafted[:, j] = tokens
            if exits:
                drafted[:, steps + j] = (confident[0] < floor).long()
            if drafted_probs is not None:
                drafted_probs[:, j] = probs
            ids = tokens[:, None]
            positions = positions[:, -1:] + 1
        host = drafted[:count].cpu().tolist()  # the drafter's one copy to the host
        self._timed(started, rows, steps)
        self._forwarded += count * (DRAFT_TAIL + steps - 1)
        for index, (r, slot, context) in enumerate(zip(live, slots, contexts)):
            self.slot_table.tokens[slot] = list(context) + host[index][: steps - 1]  # the last drafted token is not fed
            kept = counts[r]
            if exits:
                kept = next((j + 1 for j in range(kept) if host[index][steps + j]), kept)
            rows_of = None if params[index].greedy or drafted_probs is None else drafted_probs[index, :kept]
            out[r] = (host[index][:kept], rows_of)
        return out

    @torch.inference_mode()
    def score_batch(self, seq_ids, contexts, blocks: list[DraftTree], params: list[SamplingParams]) -> list[torch.Tensor]:
        """Each request's warped rows [len(block) + 1, V] after its context (on the device). A tree's nodes stay
        cached, pending, for `accept_path` (a chain, in a batch with trees, is a tree whose rows are the chain's)."""
        slots = self._prepare(seq_ids, contexts, keep_tail=1)
        rows = bucket(len(seq_ids))
        width = 1 + max((len(b) for b in blocks), default=0)
        lengths = [len(c) for c in contexts]
        span = self._span(max(lengths) + width - 1)
        slot_column = self._column(slots, rows, torch.long, self.pool.scratch_slot)
        trees = not all(b.is_chain() for b in blocks)
        if trees:
            ids, positions, ancestors = self._tree_rows(contexts, blocks, rows, width - 1)
            inputs = [ids, positions, slot_column, ancestors]
        else:
            ids = self._column([[c[-1]] + b.tokens + [0] * (width - 1 - len(b)) for c, b in zip(contexts, blocks)], rows,
                               torch.long, [0] * width)
            starts = self._column([n - 1 for n in lengths], rows, torch.long, 0)
            positions = starts[:, None] + torch.arange(width, device=self.device)
            inputs = [ids, positions, slot_column]

        def forward(ids, positions, slots, ancestors=None):
            features = None if trees else self.features  # (a feature head below reads a chain's)
            return self.model.step(self.pool, ids, positions, slots, span, ancestors, features=features)

        self._set_threads()
        started = time.perf_counter()
        logits = self.graphs.run(("score", rows, width, span, trees), forward, inputs)
        out = [warp_logits(logits[r, : len(b) + 1], p) for r, (b, p) in enumerate(zip(blocks, params))]
        self._timed(started, rows, width)
        self._forwarded += sum(len(b) + 1 for b in blocks)
        for slot, context, b in zip(slots, contexts, blocks):
            if b.is_chain():
                self.slot_table.tokens[slot] += [context[-1]] + b.tokens
            else:
                self._hold_tree(slot, context, b)
        return out
