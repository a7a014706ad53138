"""A feature head (EAGLE / FSPAD: polyspec.workers.tiers.feature_tier) as a device tier under a device target.

The target's device tier writes its last hidden states (after the final norm: what its LM head reads, the feature
a head reads) into a buffer indexed by (slot, position) in every chain forward (`StaticModelTier.record_features`).
The head's tier, `StaticFeatureTier`, keeps a KV pool of its own (the head's one decoder layer) and a buffer of its
own predicted features, and drafts with one static step per position (`feature_draft_step`). At position p the head
reads the feature at p - 1 — the target's where the target has computed p - 1 for this context, its own prediction
otherwise — and the embedding of token p, as `FeatureTier` does:

- the first step re-feeds each request's tail: the positions the head holds computed from its own predictions (the
  drafted tokens the target has since verified, the correction), each now from the target's feature; the longest
  tail of the batch, a power of two, is the step's width (a tail past MAX_TAIL is fed eagerly first);
- each further step feeds the token just drafted, from the feature the head predicted for the step before.

Which positions read the target's features is fixed on the host before any token is drawn (`real_limit`): the
drafts are a function of the context and of what the target has computed, so verification (the target's verify
step) stays exact. Positions computed from predictions are provisional: the next call computes them again
(`_real[slot]` counts the positions computed from the target's features). When the target has not computed a
context's features yet (a new prompt the scheduler did not prefill), the head has it prefill them: the target's
next verify step finds them cached.

`score_batch` (what the start-up profile times) feeds a block's tokens one a step after the first, as
`FeatureTier.score` does. Scope: the head is the chain's bottom tier and drafts chains (static_tier.misfit names
anything else): it verifies no tier's blocks.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from polyspec.workers.core.sampling import SamplingParams, warp_logits
from polyspec.workers.core.tree import DraftTree
from polyspec.workers.tiers.batched_llama import BatchedLlama, SlotCache, linear_function, rms_norm
from polyspec.workers.tiers.device_step import GREEDY, bucket, draw_next, sampling_mode
from polyspec.workers.tiers.feature_tier import head_trunk
from polyspec.workers.tiers.static_tier import StaticModelTier

MAX_TAIL = 32  # the widest first step: a longer tail (a long run of verified drafts) is fed eagerly before it


class StaticFeatureHead:
    """`FeatureHead`'s forward (polyspec.workers.tiers.drafters) for static-shape batches: its decoder layer a
    trunk stepped by the one forward (`BatchedLlama.step_hidden`) on a KV pool of its own; the target's embeddings and
    LM head."""

    def __init__(self, head, target: BatchedLlama) -> None:
        head.to(target.device)
        self.trunk = BatchedLlama(head_trunk(head))
        self.sampling, self.decoupled = head.sampling, head.decoupled
        self.fc = linear_function(head.fc)
        self.feature_norm = (head.feature_norm.weight.detach(), head.feature_norm.variance_epsilon)
        if head.decoupled:
            self.logit_norm = (head.logit_norm.weight.detach(), head.logit_norm.variance_epsilon)
            self.logit_adapter = linear_function(head.logit_adapter)
        self.embed, self.lm_head = target.embed, target.lm_head
        self.vocab_size, self.limit, self.device = target.vocab_size, target.limit, target.device
        self.dtype, self.hidden_size = self.trunk.dtype, self.trunk.hidden_size

    def new_pool(self, slots: int, max_tokens: int, context: int | None = None) -> SlotCache:
        return self.trunk.new_pool(slots, max_tokens, context)

    def bytes_per_slot(self, max_tokens: int, context: int | None = None) -> int:
        """The head's KV and its predicted features, and the target's features it reads, per slot."""
        capacity = min(context or self.limit, self.limit) + max_tokens
        return self.trunk.bytes_per_slot(max_tokens, context) + 2 * capacity * self.hidden_size * self.embed.element_size()

    def forward(self, pool: SlotCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, span: int,
                inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, V], predicted features [B, T, H]) of the tokens `ids` [B, T], each read with `inputs` [B, T, H],
        the feature of its previous position (`FeatureHead.forward` then the target's LM head, as the ragged head)."""
        embeds = F.embedding(ids, self.embed).to(self.dtype)  # [B, T, H]
        parts = [inputs, embeds] + ([inputs * embeds] if self.sampling else [])
        trunk = self.trunk.step_hidden(pool, self.fc(torch.cat(parts, dim=-1)), positions, slots, span)  # [B, T, H]
        feature = rms_norm(trunk, *self.feature_norm)
        if not self.decoupled:
            return self.lm_head(feature), feature
        logit_input = rms_norm(trunk, *self.logit_norm)
        return self.lm_head(logit_input + self.logit_adapter(logit_input)), feature


def feature_forward(head: StaticFeatureHead, pool: SlotCache, ids, positions, slots, span: int, real_limit, source_slots, *,
                    real_features: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """The head's forward of `ids` [B, T] at `positions` [B, T], each token reading the feature of its previous position:
    the target's (`real_features` [S + 1, C, H] at [source_slots[b], p - 1]) where p - 1 < real_limit[b], else the head's
    own (`predicted` [S + 1, C, H] at [slots[b], p - 1]); zeros at position 0. Writes the predicted features
    at [slots[b], p]; returns the logits [B, T, V]."""
    previous = (positions - 1).clamp_min(0)  # [B, T]
    real = real_features[source_slots[:, None].expand(previous.shape), previous]  # [B, T, H]
    own = predicted[slots[:, None].expand(previous.shape), previous]
    inputs = torch.where((positions - 1 < real_limit[:, None])[..., None], real, own)
    inputs = torch.where((positions > 0)[..., None], inputs, torch.zeros_like(inputs))
    logits, feature = head.forward(pool, ids, positions, slots, span, inputs)
    predicted[slots[:, None].expand(positions.shape), positions] = feature
    return logits


def feature_logits_step(head: StaticFeatureHead, pool: SlotCache, ids, positions, slots, span: int, last, real_limit, source_slots,
                        *, real_features: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """`feature_forward`, then each row's logits [B, V] at its column `last[b]` (its last real token; columns past it pad
    a shorter tail)."""
    logits = feature_forward(head, pool, ids, positions, slots, span, real_limit, source_slots, real_features=real_features,
                             predicted=predicted)
    return logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]


def feature_draft_step(head: StaticFeatureHead, pool: SlotCache, ids, positions, slots, span: int, mode: str, temperature, top_k,
                       top_p, greedy, seeds, draw_counters, last, real_limit, source_slots, *, real_features: torch.Tensor,
                       predicted: torch.Tensor):
    """The head's drafting step: `feature_logits_step`, then `draft_step`'s warp and draw. Returns (tokens [B],
    probs [B, V]; the logits when greedy)."""
    rows = feature_logits_step(head, pool, ids, positions, slots, span, last, real_limit, source_slots,
                               real_features=real_features, predicted=predicted)  # [B, V]
    return draw_next(rows, mode, temperature, top_k, top_p, greedy, seeds, draw_counters)


@dataclasses.dataclass
class FirstStep:
    """A call's first step: its requests' slots and tails, the padded rows and width, the longest context, the step's
    [ids, positions, slots] and the columns every step reads: [last, real_limit, source_slots] (`feature_forward`)."""

    slots: list[int]
    tails: list[list[int]]
    rows: int
    width: int
    longest: int
    inputs: list[torch.Tensor]
    columns: list[torch.Tensor]


def _common_prefix(held: list[int], context: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(held, context)) if a != b), min(len(held), len(context)))


class StaticFeatureTier(StaticModelTier):
    """A `FeatureTier` drafting on the device for the device tier `source` of its target (module docstring)."""

    def __init__(self, tier, source: StaticModelTier, slots: int, context: int | None = None,
                 model: StaticFeatureHead | None = None) -> None:
        super().__init__(tier, slots, context, model if model is not None else StaticFeatureHead(tier.head, source.model))
        self.source = source
        source.record_features()
        self.predicted = torch.zeros(self.pool.slots + 1, self.pool.capacity, self.model.hidden_size, dtype=self.model.dtype,
                                     device=self.device)  # [S + 1, C, H] the head's own feature at each position
        self._real: dict[int, int] = {}  # slot -> its first positions, computed from the target's features
        self._source_slots: dict[int, int] = {}  # slot -> the target's slot of the same request

    # ------------------------------------------------------------------ slots

    def cached(self, seq_id) -> int:
        slot = self.slot_table.slot_of.get(seq_id)
        return 0 if slot is None else min(len(self.slot_table.tokens[slot]), self._real.get(slot, 0))

    def release(self, seq_id) -> None:
        slot = self.slot_table.slot_of.get(seq_id)
        super().release(seq_id)
        self._real.pop(slot, None)
        self._source_slots.pop(slot, None)

    def truncate(self, seq_id, length: int) -> None:
        super().truncate(seq_id, length)
        slot = self.slot_table.slot_of.get(seq_id)
        if slot is not None:
            self._real[slot] = min(self._real.get(slot, 0), length)

    def _sync(self, slot: int, context: list[int], keep_at_most: int) -> list[int]:
        """Keep only positions computed from the target's features (the others are provisional)."""
        tail = super()._sync(slot, context, min(keep_at_most, self._real.get(slot, 0)))
        self._real[slot] = len(self.slot_table.tokens[slot])
        return tail

    def _target_has(self, seq_id, context: list[int]) -> int:
        """How many of the context's first positions the target holds (their features are in `source.features`)."""
        source_slot = self.source.slot_table.slot_of.get(seq_id)
        return 0 if source_slot is None else _common_prefix(self.source.slot_table.tokens[source_slot], context)

    def _head_slot(self, seq_id, context: list[int]) -> int:
        """The request's slot, with the target's features for every position of `context` but the last (computed now,
        by the target's prefill, where it lacks them: its next verify step finds them cached)."""
        if self._target_has(seq_id, context) < len(context) - 1:
            self.source.prefill([seq_id], [context], len(context))
        return self._bound_slot(seq_id)

    def _bound_slot(self, seq_id) -> int:
        """The request's slot, bound to the target's (a one-token context, which reads no feature: the target's scratch)."""
        slot = self._slot(seq_id)
        self._source_slots[slot] = self.source.slot_table.slot_of.get(seq_id, self.source.pool.scratch_slot)
        return slot

    def _eager_forward(self, slot: int, ids: torch.Tensor, positions: torch.Tensor, span: int) -> None:
        """A chunk whose positions all read the target's features (a prompt, a long tail)."""
        everything = torch.tensor([self.pool.capacity], device=self.device)
        source_slot = torch.tensor([self._source_slots[slot]], device=self.device)
        slots = torch.tensor([slot], device=self.device)
        feature_forward(self.model, self.pool, ids, positions, slots, span, everything, source_slot,
                        real_features=self.source.features, predicted=self.predicted)

    def _feed_real(self, slot: int, tokens: list[int]) -> None:
        self._feed_eagerly(slot, tokens)
        self._real[slot] = len(self.slot_table.tokens[slot])

    def prefill(self, seq_ids, contexts, budget: int) -> int:
        """Cache prompts (all but the last token) as far as the target has computed their features."""
        fed = 0
        for seq_id, context in zip(seq_ids, contexts):
            have = self._target_has(seq_id, context)
            if budget - fed <= 0 or not have:
                continue  # (the target has nothing of it yet: it is fed first, and a first draft asks it anyway)
            slot = self._bound_slot(seq_id)
            limit = min(len(context) - 1, have + 1)  # the positions whose inputs are the target's features
            tail = self._sync(slot, context, limit)
            chunk = tail[: limit - len(self.slot_table.tokens[slot])][: budget - fed]
            if chunk:
                self._feed_real(slot, chunk)
                fed += len(chunk)
        return fed

    # ------------------------------------------------------------------ steps

    def _first_step(self, seq_ids, contexts) -> FirstStep:
        """Each request's slot synced to its context and its tail laid out for the first step (module docstring)."""
        slots, tails = [], []
        for seq_id, context in zip(seq_ids, contexts):
            slot = self._head_slot(seq_id, context)
            tail = self._sync(slot, context, len(context) - 1)  # >= 1 token: the last is fed by the first step
            if len(tail) > MAX_TAIL:
                self._feed_real(slot, tail[: len(tail) - MAX_TAIL])
                tail = tail[len(tail) - MAX_TAIL:]
            slots.append(slot)
            tails.append(tail)
        rows, width = bucket(len(slots)), bucket(max(len(t) for t in tails))
        starts = self._column([len(c) - len(t) for c, t in zip(contexts, tails)], rows, torch.long, 0)
        return FirstStep(
            slots, tails, rows, width, max(len(c) for c in contexts),
            inputs=[self._column([t + [0] * (width - len(t)) for t in tails], rows, torch.long, [0] * width),  # [R, W] ids
                    starts[:, None] + torch.arange(width, device=self.device),  # positions
                    self._column(slots, rows, torch.long, self.pool.scratch_slot)],
            columns=[self._column([len(t) - 1 for t in tails], rows, torch.long, 0),  # last: each row's last real column
                     self._column([len(c) - 1 for c in contexts], rows, torch.long, 0),  # real_limit: the target has p < n - 1
                     self._column([self._source_slots[s] for s in slots], rows, torch.long, self.source.pool.scratch_slot)])

    @staticmethod
    def _next_step(step: list[torch.Tensor], last: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """[ids, positions, slots] of the step after `step`: one token per row (`tokens` [R]), after its column `last`."""
        return [tokens[:, None], step[1].gather(1, last[:, None]) + 1, step[2]]

    def _span_of(self, first: FirstStep, j: int) -> int:
        return self._span(first.longest + (first.width - 1 if j == 0 else j))

    def _settle(self, first: FirstStep, contexts, fed: list[list[int]]) -> None:
        """After the steps: each slot holds its context and the tokens `fed` after it, only its context from real features."""
        for slot, context, tokens in zip(first.slots, contexts, fed):
            self.slot_table.tokens[slot] = list(context) + tokens
            self._real[slot] = len(context)  # positions after it read predicted features: provisional
        self._forwarded += sum(len(t) for t in first.tails) + sum(len(t) for t in fed)

    @torch.inference_mode()
    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        """Each request's block of `counts[r]` tokens: the first step re-feeds its tail from the target's features, each
        further step one drafted token from the head's own (module docstring)."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seq_ids]
        live = [r for r, count in enumerate(counts) if count > 0]
        if not live:
            return out
        contexts, params = [contexts[r] for r in live], [params[r] for r in live]
        first = self._first_step([seq_ids[r] for r in live], contexts)
        rows, mode, steps = first.rows, sampling_mode(params), max(counts[r] for r in live)
        seeds, counters = self._streams([generators[r] for r in live], [counts[r] for r in live], rows)
        sampling = self._sampling(params, rows)
        last, real_limit, source_column = first.columns
        drafted = torch.zeros(rows, steps, dtype=torch.long, device=self.device)
        vocab = self.model.vocab_size
        drafted_probs = None if mode == GREEDY else torch.zeros(rows, steps, vocab, dtype=torch.float32, device=self.device)
        step, one_column = first.inputs, torch.zeros_like(last)  # after the first step, every row's one column
        self._set_threads()
        started = time.perf_counter()
        for j in range(steps):
            span = self._span_of(first, j)

            def drafting(*tensors, span=span):
                return feature_draft_step(self.model, self.pool, *tensors[:3], span, mode, *tensors[3:],
                                          real_features=self.source.features, predicted=self.predicted)

            column = last if j == 0 else one_column
            tokens, probs = self.graphs.run(("feature draft", rows, step[0].shape[1], span, mode), drafting,
                                            [*step, *sampling, seeds, counters + j, column, real_limit, source_column])
            drafted[:, j] = tokens
            if drafted_probs is not None:
                drafted_probs[:, j] = probs
            step = self._next_step(step, column, tokens)
        host = drafted[: len(live)].cpu().tolist()  # the drafter's one copy to the host
        self._timed(started, rows, steps)
        self._settle(first, contexts, [tokens[: steps - 1] for tokens in host])  # the last drafted token is not fed
        for index, r in enumerate(live):
            rows_of = None if params[index].greedy or drafted_probs is None else drafted_probs[index, : counts[r]]
            out[r] = (host[index][: counts[r]], rows_of)
        return out

    @torch.inference_mode()
    def score_batch(self, seq_ids, contexts, blocks: list[DraftTree], params: list[SamplingParams]) -> list[torch.Tensor]:
        """Each request's warped rows [len(block) + 1, V] after its context, as `FeatureTier.score`: the first step re-feeds
        the tail from the target's features, then one step per block token, each from the feature the head predicted at
        the step before (the start-up profile times these; the head verifies no tier's blocks: static_tier.misfit)."""
        if not all(block.is_chain() for block in blocks):
            raise NotImplementedError(f"tier {self.name!r} (a feature head) verifies chains only")
        first = self._first_step(seq_ids, contexts)
        rows, steps = first.rows, 1 + max(len(b) for b in blocks)
        last, real_limit, source_column = first.columns
        forced = self._column([b.tokens + [0] * (steps - 1 - len(b)) for b in blocks], rows, torch.long, [0] * (steps - 1))
        step, one_column, logits_rows = first.inputs, torch.zeros_like(last), []
        self._set_threads()
        started = time.perf_counter()
        for j in range(steps):
            span = self._span_of(first, j)

            def scoring(*tensors, span=span):
                return feature_logits_step(self.model, self.pool, *tensors[:3], span, *tensors[3:],
                                           real_features=self.source.features, predicted=self.predicted)

            column = last if j == 0 else one_column
            logits = self.graphs.run(("feature score", rows, step[0].shape[1], span), scoring,
                                     [*step, column, real_limit, source_column])
            logits_rows.append(logits.clone())  # (a graph's output buffer: its next replay overwrites it)
            if j + 1 < steps:
                step = self._next_step(step, column, forced[:, j])
        scored = torch.stack(logits_rows, dim=1)  # [R, k + 1, V]
        out = [warp_logits(scored[r, : len(b) + 1], p) for r, (b, p) in enumerate(zip(blocks, params))]
        self._timed(started, rows, steps)
        self._settle(first, contexts, [list(b.tokens) for b in blocks])
        return out

    def _refuse(self, *args, **options):
        raise NotImplementedError(f"tier {self.name!r} (a feature head on the device) drafts chains at the bottom of its chain")

    verify_batch = draft_tree_batch = _refuse
