"""The one tier family: what every chain runs, for one request or many, on every device.

`BatchedTier` is the protocol the round (polyspec.orchestrator.decode.scheduler) talks to; every
call takes a list of requests (a single request is a batch of one):

- `score_batch(seq_ids, contexts, blocks, params)`: ONE forward over every request's
  uncached context tail plus its block; returns each request's warped rows
  [len(block) + 1, V] (ragged blocks and contexts; per-request sampling parameters);
- `draft_batch(seq_ids, contexts, counts, params, generators)`: each request's block,
  sampled autoregressively with its own generator (one forward per drafted position, all
  requests in it);
- `draft_tree_batch(seq_ids, contexts, width, depths, params, scheme, generators)`: each
  request's draft tree (`width` chains sharing the root), one forward per tree level, all requests in it;
- `verify_batch(seq_ids, contexts, blocks, params, generators, want_rows, scheme, below)`: score
  every request's block (a chain or a tree) and verify it with its own generator; after a tree
  verdict this tier and `below` keep only the accepted path;
- `accept_path(seq_id, path)`: after a tree verdict keep only the accepted path's KV;
- `prefill(seq_ids, contexts, budget)`: cache up to `budget` prompt tokens (chunked
  prefill), so a long new prompt does not pad every row of the next round. Prompts of
  different lengths are cut where they end (`prefill_cuts`) rather than padded to the longest.

A call's blocks, drafted or scored, are one `Blocks` (polyspec.workers.core.tree: every request's nodes
flattened with offsets, on the drafter's device), and a verifier's rows for them one `ScoredRows`
(polyspec.workers.core.verdicts: packed the same way). `score_batch` takes chains and trees in the same
forward (a tree row carries its tree attention rows, `polyspec.workers.tiers.batched_llama.RowLayout`).

Per request the operations, and the draws from its generators, are the same in the same
order whatever else is in the batch, so seeding means the same thing batched or alone.

`batched_tiers` makes each loaded tier's (polyspec.workers.tiers.tier) runtime: `BatchedModelTier`
runs a model through the one forward (`BatchedLlama`) on its KV pool (`SlotCache`);
`BatchedNGramTier` answers the n-gram lookup from an index per request, kept up to date as the
context grows and rolled back with it; `BatchedFeatureTier` (polyspec.workers.tiers.batched_feature)
is a model tier over a feature head's layer, drafting with the model tier's code. A distributed
chain's remote tier implements the same protocol.

A model tier made with `steps` decodes in static-shape steps (`BatchedLlama.step`: requests padded to a
power of two, tokens to the widest row, the attended span to a power of two), each bucket captured once
as a CUDA graph on CUDA; its logits, draws (`Draws`) and verdicts (`verify_blocks`) stay on the device
until the tokens' one copy to the host. Prompts, and blocks wider than a step, go through the ragged
forward on the same pool.

Randomness: a request's draws come from counter-based streams keyed by its random stream at this tier
(polyspec.workers.core.sampling.RandomStream: `key`, and `take()` for fresh counters;
polyspec.workers.core.device_verify's domains), never from the batch: a seeded request draws the same
tokens alone or in any batch, with or without steps, on any device.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from polyspec.workers.core.context import Synced, extended, head
from polyspec.workers.core.device_verify import confidence
from polyspec.workers.core.grammar import cut_at_disallowed, grammar_of, node_context, restrict_blocks, restrict_each
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.verdicts import Draws, ScoredRows, Verdicts, verify_blocks
from polyspec.workers.core.tree import Blocks, DraftTree, path_rows, tree_allowed
from polyspec.workers.tiers.batched_llama import BatchedLlama, PendingTree, RowLayout, step_unsupported
from polyspec.workers.tiers.loading import return_freed_memory
from polyspec.workers.tiers.tier import ModelTier, NGramTier, Tier, copy_forward

# a forward's cost beyond its tokens' (reading every weight once), in prompt tokens of one row: on an EPYC core
# (one thread, Qwen2.5-Coder-1.5B) a 4-row one-token step costs what ~13 (int8 copy) / ~24 (bfloat16) prefill tokens do
FORWARD_COST_TOKENS = 24


MAX_STEP_TOKENS = 32  # the most tokens a row feeds in one static step (a block and its root, a tree's nodes)
STEP_MARGIN = MAX_STEP_TOKENS + 2  # positions a stepping tier's slot holds past its context: a step's padding columns
MIN_SPAN = 64  # the smallest attended span bucket of a step


def bucket(value: int, smallest: int = 1) -> int:
    """The power of two at or above `value` (at least `smallest`)."""
    size = smallest
    while size < value:
        size *= 2
    return size


class StepGraphs:
    """Each step captured once per bucket as a CUDA graph and replayed with new inputs (on CUDA); called directly
    elsewhere. The inputs are copied into the graph's own buffers before each replay; the outputs are the graph's
    buffers (read them before the next replay)."""

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


def _head_layout(layout: RowLayout, head: int) -> RowLayout:
    """A tree row's layout for its first `head` tokens (the linear tail before its nodes)."""
    start = layout.allowed.shape[1] - len(layout.positions)
    return RowLayout(layout.positions[:head], layout.allowed[:head, : start + head])


def _tail_layout(layout: RowLayout, head: int) -> RowLayout:
    """A tree row's layout for its tokens after the first `head` (fed by an earlier forward)."""
    return RowLayout(layout.positions[head:], layout.allowed[head:], layout.key_positions)


def prefill_cuts(lengths: list[int], forward_cost: int = FORWARD_COST_TOKENS) -> list[int]:
    """Where a prefill of chunks of `lengths` tokens is cut into forwards: increasing ends, the last
    max(lengths); forward i feeds each chunk's tokens [end_{i-1}, end_i), padded to the longest.

    One forward of all chunks pads every row to the longest (HumanEval prompts of 86-254 tokens:
    1016 positions computed for 624); cutting at every chunk's end pads nothing but costs a forward per
    cut. The cuts minimise positions computed plus `forward_cost` per forward (dynamic programming
    over the distinct chunk ends; a few dozen at most)."""
    ends = sorted(set(length for length in lengths if length > 0))
    if not ends:
        return []
    points = [0] + ends
    best = [0.0] + [float("inf")] * len(ends)  # best[j]: cost of feeding every chunk up to points[j]
    previous = [0] * len(points)
    for j in range(1, len(points)):
        for i in range(j):
            rows = sum(length > points[i] for length in lengths)
            cost = best[i] + forward_cost + rows * (points[j] - points[i])
            if cost < best[j]:
                best[j], previous[j] = cost, i
    cuts, j = [], len(points) - 1
    while j > 0:
        cuts.append(points[j])
        j = previous[j]
    return cuts[::-1]


@dataclasses.dataclass
class Row:
    """One request in a drafting call of a model tier: its slot, the next position it feeds, and what it feeds."""

    slot: int
    position: int  # the next position fed
    context_len: int
    chunk: list[int]  # fed by the first forward (a model: the context's uncached tail)
    queue: list[int]  # fed one a forward after the chunk (drafted tokens; a feature head's provisional context)
    chunk_features: torch.Tensor | None = None  # a feature head's features for the chunk (`BatchedFeatureTier`)

    @property
    def going(self) -> bool:
        return bool(self.chunk or self.queue)


class BatchedTier:
    """The protocol the round calls, with the common bookkeeping: the loaded tier's identity and the time its
    forwards took."""

    profile_kind = "batched"  # what its start-up profile times (a device tier's: its static steps, "device")
    timed_here = True  # its forwards run, and are timed and counted (`busy_s`, `forwards`), in this process

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.name = tier.name
        self.vocab_size = tier.vocab_size
        self.max_context = tier.max_context
        self.can_verify = tier.can_verify
        self.deterministic_drafts = tier.deterministic_drafts
        self.has_weights = tier.has_weights
        self.caches_prompts = False  # `prefill` caches prompt tokens (a slot cache), so `cached` counts them
        self.forward_log: list[tuple[int, int, float]] = []  # (rows, padded width, seconds) of recent forwards

    @property
    def busy_s(self) -> float:
        return self.tier.busy_s

    @property
    def forwards(self) -> int:
        """The wrapped tier's count of forwards."""
        return self.tier.forwards

    @property
    def forwarded_tokens(self) -> int:
        """The wrapped tier's count of tokens its forwards took (prefills and blocks: what a cached prefix saves)."""
        return self.tier.forwarded_tokens

    def log_forward(self, rows: int, width: int, seconds: float) -> None:
        self.forward_log.append((rows, width, seconds))
        if len(self.forward_log) > 256:
            del self.forward_log[:128]

    def cached(self, seq_id) -> int:
        """Tokens of `seq_id` this tier holds (0 for tiers without a cache)."""
        return 0

    def bytes_per_request(self) -> int:
        """A request's KV pool at the full context (0 for tiers without one)."""
        return 0

    def set_max_slots(self, slots: int) -> None:
        """Bound the KV pool to `slots` requests, before its first forward allocates it (no pool: nothing)."""

    def prefill(self, seq_ids: list, contexts: list[list[int]], budget: int) -> int:
        """Cache up to `budget` tokens of the contexts' prefixes (all but the last token); returns tokens fed."""
        return 0

    def draft_batch(self, seq_ids, contexts, counts: list[int], params, generators) -> Blocks:
        """Each request's chain of up to `counts[r]` tokens, with the rows they were drawn from ([k, V] float32;
        none when greedy). A chain is a draft tree of one candidate: by default, `draft_tree_batch` with width 1
        (a model tier drafts its chains with a loop of its own)."""
        return self.draft_tree_batch(seq_ids, contexts, 1, counts, params, "specinfer", generators)

    def draft_tree_batch(self, seq_ids, contexts, width: int, depths: list[int], params, scheme: str, generators) -> Blocks:
        """Each request's draft tree: `width` candidate chains of `depths[r]` tokens sharing the root."""
        raise NotImplementedError

    def score_batch(self, seq_ids, contexts, blocks: Blocks, params: list[SamplingParams]) -> ScoredRows:
        """ONE forward over every request's uncached context tail plus its block: each request's warped rows
        [len(block) + 1, V] (at the last context token, then at each block node), packed."""
        raise NotImplementedError(f"tier {self.name!r} cannot verify")

    def verify_batch(self, seq_ids, contexts, blocks: Blocks, params: list[SamplingParams], generators,
                     want_rows: bool = False, scheme: str = "specinfer", below: "BatchedTier | None" = None) -> Verdicts:
        """Score every request's block (`score_batch`) and verify it (`verify_blocks`: a chain by the greedy rule or
        speculative sampling against the block's draft rows; a tree by the multi-draft `scheme`), after which this
        tier and `below` (the tier that drafted a tree) keep only the accepted path (`accept_path`). `want_rows`:
        with the rows of the emitted tokens (a middle tier passes them up)."""
        scored = self.score_batch(seq_ids, contexts, blocks, params)
        verdicts = verify_blocks(scored, blocks, params, generators, scheme)
        if want_rows or not blocks.all_chains:
            paths = [verdict.path for verdict in verdicts]
            for seq_id, chain, path in zip(seq_ids, blocks.chains, paths):
                if not chain:
                    self.accept_path(seq_id, path)
                    if below is not None:
                        below.accept_path(seq_id, path)
            if want_rows:
                verdicts.rows = [None if p.greedy else path_rows(target_probs, chain, path)
                                 for target_probs, chain, p, path in zip(scored, blocks.chains, params, paths)]
        return verdicts

    def accept_path(self, seq_id, path: list[int]) -> None:
        """After a tree verdict keep only the accepted path's KV (node indices, root to leaf)."""

    def continues_past(self, seq_id) -> bool:
        """Is this tier drafting past the block it last handed up for `seq_id` (a pipelined remote tier)?
        Then a fully accepted block gets no bonus token: the continuation is verified instead."""
        return False

    def verdict(self, seq_id, base_len: int, proposed: int, accepted: int, correction: int | None) -> None:
        """A verifier's decision on this tier's block (continuing `base_len` tokens): a remote drafter drops
        its stale draft-ahead work; a local tier's cache syncs with the next context."""

    def release(self, seq_id) -> None:
        """Forget a sequence and free its cache."""

    def truncate(self, seq_id, length: int) -> None:
        """Cut a sequence's cached state back to its first `length` tokens."""


class BatchedModelTier(BatchedTier):
    """A Llama-architecture `ModelTier` whose open requests share one slot cache and one forward per call."""

    def __init__(self, tier: ModelTier, max_slots: int | None = None, model: BatchedLlama | None = None, steps: bool = False,
                 context: int | None = None) -> None:
        """`model`: the tier's forward when another runtime tier of the same model made it already (a pool of its own).
        `steps`: its decoding forwards (blocks, drafted tokens, tree levels: at most MAX_STEP_TOKENS a row) run as
        static-shape steps (`BatchedLlama.step`), replayed as CUDA graphs on CUDA, with its logits, draws and
        verdicts on the device; prompts still go through the ragged forward. A model the step does not cover
        (`step_unsupported`) runs the ragged forward throughout. `context`: positions each request's KV holds
        (default: the model's)."""
        super().__init__(tier)
        if model is None:
            model = BatchedLlama(tier.model)
            return_freed_memory()  # moving weights to oneDNN (block_linear) freed the dense copies in pieces
        self.model = model
        self.steps = steps and step_unsupported(tier.model, model.device) is None
        if self.steps:
            self.cache = model.new_cache(max_slots, context, margin=STEP_MARGIN, scratch=True)
            self.graphs = StepGraphs(model.device.type == "cuda")
        else:
            self.cache = model.new_cache(max_slots, context)
        if context:
            self.max_context = min(x for x in (context, tier.max_context) if x)
        self.caches_prompts = True
        self.threads = tier.threads
        # where its forwards' logits come back, and its draws and verdicts are made
        self.logits_device = model.device if self.steps else torch.device("cpu")

    @property
    def profile_kind(self) -> str:  # what its start-up profile times (steps, or the ragged forward)
        return "device" if self.steps else "batched"

    def release(self, seq_id) -> None:
        self.cache.release(seq_id)

    def truncate(self, seq_id, length: int) -> None:
        slot = self.cache.slot_of.get(seq_id)
        if slot is not None:
            self.cache.drop_tree(slot)
            self.cache.truncate(slot, min(length, self.cache.length(slot)))

    def accept_path(self, seq_id, path: list[int]) -> None:
        self.cache.accept_path(seq_id, path)

    def cached(self, seq_id) -> int:
        slot = self.cache.slot_of.get(seq_id)
        if slot is None:
            return 0
        pending = self.cache.pending.get(slot)  # an unverified tree's nodes are not context
        return self.cache.length(slot) if pending is None else min(self.cache.length(slot), pending.prefix_len)

    def bytes_per_request(self) -> int:
        return self.cache.bytes_per_slot(hidden_size=self.model.embed.shape[-1])

    def set_max_slots(self, slots: int) -> None:
        self.cache.max_slots = slots

    @property
    def keep_features(self) -> bool:
        return self.cache.keep_features

    @keep_features.setter
    def keep_features(self, keep: bool) -> None:
        self.cache.keep_features = keep

    def features(self, seq_id, context: list[int], length: int, compute: bool = False) -> torch.Tensor:
        """`ModelTier.features` from the slot cache: the last hidden states of the longest prefix of
        `context[:length]` this tier's forwards have computed ([m, H] float32, a fresh tensor). With
        `compute`, the missing positions are cached now (`prefill`: the next `score_batch` finds them).
        Needs `keep_features`."""
        if not self.keep_features:
            raise RuntimeError(f"tier {self.name!r} does not keep its hidden states (keep_features)")
        slot = self.cache.slot_of.get(seq_id)  # (`cached`: an unverified tree's nodes are not context)
        have = 0 if slot is None else min(self.cached(seq_id), self.cache.agreed(slot, head(context, length), sync=False))
        if compute and have < length:
            self.prefill([seq_id], [extended(head(context, length), [0])], length)  # [0]: prefill caches all but the last token
            slot, have = self.cache.slot_of[seq_id], length
        if have <= 0:
            return torch.zeros(0, 0)
        return self.cache.features[slot][:have].clone()

    def _sync(self, slot: int, context: list[int]) -> list[int]:
        """Roll the slot back to what `context` shares with it; the uncached tail (>= 1 token)."""
        self.cache.drop_tree(slot)
        keep = min(self.cache.agreed(slot, context), len(context) - 1)
        self.cache.truncate(slot, keep)
        return context[keep:]

    def _tree_layout(self, slot: int, pending: PendingTree, tail: list[int], tree: DraftTree, nodes: list[int], depths: list[int]) -> RowLayout:
        """The linear `tail` then tree `nodes` (whose ancestors are cached or fed here), in one
        forward: nodes at prefix length + depth, seeing the linear
        context and their ancestors."""
        cached = self.cache.length(slot)
        first = cached + len(tail)
        for offset, node in enumerate(nodes):
            pending.node_slots[node] = first + offset
        positions = list(range(cached, first)) + [pending.prefix_len + depths[n] for n in nodes]
        allowed = tree_allowed(tree.parents, pending.node_slots, nodes, pending.prefix_len - len(tail), len(tail), first + len(nodes))
        return RowLayout(positions, allowed)

    def _forward(self, slots: list[int], feeds: list[list[int]], outputs: list[int], layouts=None,
                 previous: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Append `feeds[r]` to slot `slots[r]`; each row's logits [len(feeds[r]) - outputs[r], V] float32 on
        `logits_device`, of its positions from `outputs[r]` on. (`previous`: a feature head's inputs; a model
        reads tokens only.) Timed and counted as the tier's forward; `_logits` runs it."""
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        started = time.perf_counter()
        logits = self._logits(slots, feeds, outputs, layouts, previous)
        seconds = time.perf_counter() - started
        self.tier.busy_s += seconds
        self.tier.forwards += 1
        self.tier.forwarded_tokens += sum(len(f) for f in feeds)
        self.log_forward(len(slots), max(len(f) for f in feeds), seconds)
        return logits

    def _logits(self, slots: list[int], feeds: list[list[int]], outputs: list[int], layouts, previous) -> list[torch.Tensor]:
        """`_forward`'s forward: a static step where the rows fit one, else the ragged forward."""
        wanted = [len(feed) - output for feed, output in zip(feeds, outputs)]
        if self.steps and any(wanted) and max(wanted) <= MAX_STEP_TOKENS:
            logits = self._step(slots, feeds, outputs, layouts)
        else:
            logits = self.model.forward(self.cache, slots, feeds, outputs, layouts)  # on the CPU
            logits = [row[:, : self.vocab_size].to(self.logits_device, torch.float32) for row in logits]
        if self.model.device.type == "cuda":  # a forward with no logits (a prefill) returns before its kernels end
            torch.cuda.synchronize(self.model.device)
        return logits

    @torch.inference_mode()
    def _step(self, slots: list[int], feeds: list[list[int]], outputs: list[int], layouts=None) -> list[torch.Tensor]:
        """`_forward` as one static step (`BatchedLlama.step`) over the rows' last tokens: requests padded to a
        power of two (the scratch slot's rows), tokens to the widest row's, the attended span to a power of two
        (at least MIN_SPAN); a row's tokens before its first wanted logit, beyond what a step carries, are fed by
        the ragged forward first. One graph per bucket (requests, tokens, span, trees) on CUDA."""
        heads = [max(0, len(feed) - MAX_STEP_TOKENS) for feed in feeds]  # (before every wanted logit: the caller's bound)
        early = [r for r, head in enumerate(heads) if head > 0]
        if early:  # long tails (a prompt's last chunk): their heads through the ragged forward, no logits
            self.model.forward(self.cache, [slots[r] for r in early], [feeds[r][: heads[r]] for r in early],
                               [heads[r] for r in early], [None if not layouts or layouts[r] is None else _head_layout(layouts[r], heads[r])
                                                          for r in early] if layouts and any(layouts) else None)
        feeds = [feed[head:] for feed, head in zip(feeds, heads)]
        outputs = [output - head for output, head in zip(outputs, heads)]
        layouts = [None if not layouts or layouts[r] is None else _tail_layout(layouts[r], heads[r]) for r in range(len(feeds))]
        count, width = len(slots), max(len(feed) for feed in feeds)
        rows = bucket(count)
        starts = [self.cache.length(slot) for slot in slots]
        end = max(start + len(feed) for start, feed in zip(starts, feeds))
        self.cache.reserve(max(slots) + 1, end)
        span = min(bucket(end, MIN_SPAN), self.cache.capacity)
        ids = torch.zeros(rows, width, dtype=torch.long)
        write_at = torch.zeros(rows, width, dtype=torch.long)
        for r, (start, feed) in enumerate(zip(starts, feeds)):
            ids[r, : len(feed)] = torch.tensor(feed)
            write_at[r] = start + torch.arange(width)
        rotary = write_at.clone()
        trees = [r for r, layout in enumerate(layouts) if layout is not None]
        mask = None
        if trees:  # chain rows see their slot up to their own position; a tree row as its layout says
            mask = (torch.arange(span)[None, None, :] <= write_at[:, :, None])[:, None].clone()  # [R, 1, W, span]
            for r in trees:
                n = len(feeds[r])
                rotary[r, :n] = torch.tensor(layouts[r].positions)
                mask[r, 0, :n] = False
                mask[r, 0, :n, : starts[r] + n] = layouts[r].allowed
        device = self.model.device
        slot_column = torch.tensor(slots + [self.cache.scratch_slot] * (rows - count), dtype=torch.long)
        inputs = [t.to(device, non_blocking=True) for t in (ids, rotary, write_at, slot_column)]
        if mask is not None:
            inputs.append(mask.to(device, non_blocking=True))

        def step(ids, rotary, write_at, slots, mask=None):
            return self.model.step(self.cache, ids, rotary, write_at, slots, span, mask)

        logits, normed = self.graphs.run((rows, width, span, mask is not None), step, inputs)
        for slot, feed in zip(slots, feeds):
            self.cache.tokens[slot].extend(feed)
        if self.cache.keep_features:  # what the LM head read, for a feature head below
            hidden = normed[:count].float().cpu()
            for r, (slot, start, feed) in enumerate(zip(slots, starts, feeds)):
                self.cache.store_features(slot, start, hidden[r, : len(feed)])
        # copies: the graph's output buffers are overwritten by its next replay
        return [logits[r, output: len(feed), : self.vocab_size].to(torch.float32, copy=True)
                for r, (feed, output) in enumerate(zip(feeds, outputs))]

    def prefill(self, seq_ids, contexts, budget: int) -> int:
        slots, feeds = [], []
        for seq_id, context in zip(seq_ids, contexts):
            if budget <= 0:
                break
            slot = self.cache.slot(seq_id)
            tail = self._sync(slot, context)
            chunk = tail[: min(len(tail) - 1, budget)]  # all but the last token
            if chunk:
                slots.append(slot)
                feeds.append(chunk)
                budget -= len(chunk)
        if not slots:
            return 0
        start = 0
        for end in prefill_cuts([len(f) for f in feeds]):
            rows = [r for r, feed in enumerate(feeds) if len(feed) > start]
            pieces = [feeds[r][start:end] for r in rows]
            self._forward([slots[r] for r in rows], pieces, [len(piece) for piece in pieces])  # no logits wanted
            start = end
        return sum(len(f) for f in feeds)

    def score_batch(self, seq_ids, contexts, blocks: Blocks, params: list[SamplingParams]) -> ScoredRows:
        slots, feeds, outputs, layouts = [], [], [], []
        block_tokens, _ = blocks.host()
        for r, (seq_id, context) in enumerate(zip(seq_ids, contexts)):
            slot = self.cache.slot(seq_id)
            tail = self._sync(slot, context)
            layout = None
            if not blocks.chains[r]:
                block = blocks[r]
                pending = self.cache.pending[slot] = PendingTree(len(context), {})
                layout = self._tree_layout(slot, pending, tail, block, list(range(len(block))), block.depths())
            slots.append(slot)
            feeds.append(tail + block_tokens[r])
            outputs.append(len(tail) - 1)
            layouts.append(layout)
        logits = self._forward(slots, feeds, outputs, layouts if any(layouts) else None)  # each [len(block) + 1, V]
        return ScoredRows.warped(restrict_blocks(logits, params, contexts, blocks), params)

    # ---------------------------------------------------------------------- drafting

    def _rows(self, seq_ids, contexts: list[list[int]]) -> list[Row]:
        """Each request's slot rolled back to what it shares with its context; the uncached tail is its chunk."""
        rows = []
        for seq_id, context in zip(seq_ids, contexts):
            slot = self.cache.slot(seq_id)
            tail = self._sync(slot, context)
            rows.append(Row(slot, len(context) - len(tail), len(context), tail, []))
        return rows

    def _previous(self, row: Row, chunk: bool) -> torch.Tensor | None:
        """A feature head's inputs for what `row` feeds next: its chunk's, or its next queued token's (a model: none)."""
        return None

    def _level_previous(self, rows: list[Row], pending: list[PendingTree], trees: list[DraftTree],
                        frontiers: list[list[int]]) -> list[torch.Tensor] | None:
        """A feature head's inputs for a tree level's nodes, read at each node's parent (a model: none)."""
        return None

    def _advance(self, rows: list[Row], going: list[int]) -> dict[int, torch.Tensor]:
        """One forward of `rows[i]` for i in `going`: its chunk, or its next queued token. The logits [V] at the
        last position fed, of the rows that reached (or passed) their context's end."""
        slots, tokens, previous, outputs = [], [], [], []
        for i in going:
            row = rows[i]
            features = self._previous(row, bool(row.chunk))
            if row.chunk:
                fed, row.chunk = row.chunk, []
            else:
                fed = [row.queue.pop(0)]
            row.position += len(fed)
            slots.append(row.slot)
            tokens.append(fed)
            previous.append(features)
            outputs.append(len(fed) - 1 if row.position >= row.context_len else len(fed))
        logits = self._forward(slots, tokens, outputs, previous=None if previous[0] is None else previous)
        return {i: row_logits[-1] for i, row_logits in zip(going, logits) if row_logits.shape[0]}

    def _steps(self, rows: list[Row], after) -> None:
        """Forward every row until none has anything left to feed; `after(ready)` receives the rows that reached
        their context's end in a forward ({i: logits [V]}) and may queue each one's next token."""
        going = list(range(len(rows)))
        while going:
            ready = self._advance(rows, going)
            if ready:
                after(ready)
            going = [i for i in going if rows[i].going]

    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        """Each request's block of `counts[r]` tokens: the first forward brings every row up to its context, then
        one forward per position over the requests still drafting, with their draws (`Draws`: request r's
        position j draws from round j of the `counts[r]` rounds it takes). An early exit
        (`Tier.exit_threshold`, or a request's own: BiLD's fallback) ends a request's block after its first
        token drafted below the threshold: the exit reads the drafter's own rows only, so verification stays exact."""
        live = [r for r, count in enumerate(counts) if count > 0]
        if not live:
            return Blocks.empty(len(seq_ids), self.logits_device)
        rows = self._rows([seq_ids[r] for r in live], [contexts[r] for r in live])
        draws = Draws.of([params[r] for r in live], [generators[r] for r in live], [counts[r] for r in live], self.logits_device)
        thresholds = [self.tier.exit_by_seq.get(seq_ids[r], self.tier.exit_threshold) for r in live]
        tokens: list[list[int]] = [[] for _ in live]
        drawn_rows: list[list[torch.Tensor]] = [[] for _ in live]

        def draw(ready: dict[int, torch.Tensor]) -> None:
            at = list(ready)
            last = torch.stack([ready[i] for i in at])  # [R, V]
            last = restrict_each(last, [params[live[i]] for i in at], lambda j: contexts[live[at[j]]] + tokens[at[j]])
            rounds = [len(tokens[i]) for i in at]  # (a feature head's rows reach their context's end apart)
            drawn, probs = draws.draw(last, torch.tensor(at, device=last.device),
                                      rounds[0] if len(set(rounds)) == 1 else torch.tensor(rounds, device=last.device))
            sure = [True] * len(at)
            if any(thresholds[i] is not None for i in at):
                sure = (confidence(last) >= torch.tensor([-1.0 if thresholds[i] is None else thresholds[i] for i in at])).tolist()
            for j, (i, token, ok) in enumerate(zip(at, drawn.tolist(), sure)):
                tokens[i].append(token)
                drawn_rows[i].append(probs[j])
                if ok and len(tokens[i]) < counts[live[i]]:
                    rows[i].queue.append(token)

        self._steps(rows, draw)
        chains: list[list[int]] = [[] for _ in seq_ids]
        chain_rows: list[torch.Tensor | None] = [None] * len(seq_ids)
        for i, r in enumerate(live):
            chains[r] = tokens[i]
            chain_rows[r] = None if params[r].greedy else torch.stack(drawn_rows[i])
        return Blocks.of_chains(chains, chain_rows, self.logits_device)

    def draft_tree_batch(self, seq_ids, contexts, width, depths, params, scheme, generators):
        """Each request's tree of `width` chains: its row brought up to its context and its `width` root candidates
        (`Draws.roots`: the top ones when greedy, without replacement for rsd, else i.i.d.), then one forward per
        level over every request's frontier, one child per frontier node (node w of level l draws from round l,
        draws w * V ..). An early exit grows a tree on while any of its branches is sure."""
        trees = [DraftTree([], [], None) for _ in seq_ids]
        live = [r for r, depth in enumerate(depths) if depth > 0]
        if not live:
            return Blocks.of(trees, self.logits_device)
        rows = self._rows([seq_ids[r] for r in live], [contexts[r] for r in live])
        reached: dict[int, torch.Tensor] = {}
        self._steps(rows, reached.update)
        roots = torch.stack([reached[i] for i in range(len(live))])  # [R, V]
        draws = Draws.of([params[r] for r in live], [generators[r] for r in live], [depths[r] for r in live], self.logits_device)
        threshold = self.tier.exit_threshold
        roots = restrict_each(roots, [params[r] for r in live], lambda j: contexts[live[j]])
        candidates, valid, root_rows = draws.roots(roots, torch.arange(len(live), device=roots.device), width, scheme == "rsd")
        sure = [True] * len(live) if threshold is None else (confidence(roots) >= threshold).tolist()
        pending, frontier, node_depths, drawn_rows = [], [], [], []
        for i, (r, tokens, ok) in enumerate(zip(live, candidates.tolist(), valid.tolist())):
            pending.append(PendingTree(len(contexts[r]), {}))
            self.cache.pending[rows[i].slot] = pending[i]
            kept = [token for token, good in zip(tokens, ok) if good]
            trees[r].tokens.extend(kept)
            trees[r].parents.extend([-1] * len(kept))
            drawn_rows.append([root_rows[i]] * len(kept))
            frontier.append(list(range(len(kept))))
            node_depths.append([0] * len(kept))
        for level in range(1, max(depths)):
            growing = [i for i, r in enumerate(live) if level < depths[r] and sure[i] and frontier[i]]
            if not growing:
                break
            layouts = [self._tree_layout(rows[i].slot, pending[i], [], trees[live[i]], frontier[i], node_depths[i]) for i in growing]
            previous = self._level_previous([rows[i] for i in growing], [pending[i] for i in growing],
                                            [trees[live[i]] for i in growing], [frontier[i] for i in growing])
            logits = self._forward([rows[i].slot for i in growing], [[trees[live[i]].tokens[n] for n in frontier[i]] for i in growing],
                                   [0] * len(growing), layouts, previous=previous)
            flat = torch.cat(logits)  # [nodes, V]
            nodes = [(live[i], n) for i in growing for n in frontier[i]]  # (request, node) of each row
            flat = restrict_each(flat, [params[r] for r, _ in nodes],
                                 lambda j: node_context(contexts[nodes[j][0]], trees[nodes[j][0]].tokens, trees[nodes[j][0]].parents, nodes[j][1]))
            owner = torch.tensor([i for i in growing for _ in frontier[i]], device=flat.device)
            first = torch.tensor([w * flat.shape[-1] for i in growing for w in range(len(frontier[i]))], device=flat.device)
            drawn, probs = draws.draw(flat, owner, level, first)
            drawn = drawn.tolist()
            node = 0
            for i, level_logits in zip(growing, logits):
                if threshold is not None:
                    sure[i] = bool((confidence(level_logits) >= threshold).any())
                tree, grown = trees[live[i]], []
                for parent in frontier[i]:
                    tree.tokens.append(drawn[node])
                    tree.parents.append(parent)
                    drawn_rows[i].append(probs[node])
                    node_depths[i].append(level)
                    grown.append(len(tree.tokens) - 1)
                    node += 1
                frontier[i] = grown
        for i, r in enumerate(live):
            trees[r].draft_rows = None if params[r].greedy or not drawn_rows[i] else torch.stack(drawn_rows[i])
        return Blocks.of(trees, self.logits_device)


class NGramIndex:
    """Where each n-gram of one context starts (in increasing order), updated as the context changes."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(min_ngram, max_ngram + 1)
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}
        self.synced = Synced()

    def sync(self, context: list[int]) -> None:
        cached = self.tokens
        keep = self.synced.agreed(cached, context)
        for end in range(len(cached) - 1, keep - 1, -1):  # drop the n-grams ending past `keep`, newest first
            for n in self.sizes:
                if end - n + 1 >= 0:
                    self.starts[tuple(cached[end - n + 1 : end + 1])].pop()
        del cached[keep:]
        for token in context[keep:]:
            cached.append(token)
            end = len(cached) - 1
            for n in self.sizes:
                if end - n + 1 >= 0:
                    self.starts.setdefault(tuple(cached[end - n + 1 :]), []).append(end - n + 1)

    def lookup(self, num_tokens: int) -> list[int]:
        """The continuation of the latest earlier occurrence of the longest matching suffix."""
        found = self.continuations(num_tokens, 1)
        return found[0] if found else []

    def continuations(self, num_tokens: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations with distinct first tokens: longest matching suffix first, latest match first."""
        found: list[list[int]] = []
        first_tokens: set[int] = set()
        length = len(self.tokens)
        for n in reversed(self.sizes):
            if n > length - 1:
                continue
            starts = self.starts.get(tuple(self.tokens[length - n :]), ())
            for start in reversed(starts[:-1]):  # the last one is the suffix itself
                continuation = copy_forward(self.tokens, start + n, num_tokens)
                if continuation and continuation[0] not in first_tokens:
                    first_tokens.add(continuation[0])
                    found.append(continuation)
                    if len(found) == limit:
                        return found
        return found


class BatchedNGramTier(BatchedTier):
    """`NGramTier`'s proposals from a per-request index instead of a scan of the whole context."""

    def __init__(self, tier: NGramTier) -> None:
        super().__init__(tier)
        self.indexes: dict[object, NGramIndex] = {}

    def release(self, seq_id) -> None:
        self.indexes.pop(seq_id, None)

    def _index(self, seq_id, context: list[int]) -> NGramIndex:
        index = self.indexes.get(seq_id)
        if index is None:
            index = self.indexes[seq_id] = NGramIndex(self.tier.min_ngram, self.tier.max_ngram)
        index.sync(context)
        return index

    def draft_tree_batch(self, seq_ids, contexts, width, depths, params, scheme, generators):
        """Each request's `width` continuations with distinct first tokens, as chains under the root (nodes parents-first)."""
        started = time.perf_counter()
        trees = []
        for seq_id, context, depth, p in zip(seq_ids, contexts, depths, params):
            tree = DraftTree([], [], None)
            for continuation in self._index(seq_id, context).continuations(depth, width) if depth > 0 else []:
                continuation = cut_at_disallowed(grammar_of(p), context, continuation)
                parent = -1
                for token in continuation:
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                    parent = len(tree.tokens) - 1
            if not p.greedy and tree.tokens:  # point masses
                tree.draft_rows = torch.nn.functional.one_hot(torch.tensor(tree.tokens, dtype=torch.long), self.vocab_size).float()
            trees.append(tree)
        self.tier.busy_s += time.perf_counter() - started
        return Blocks.of(trees)


def batched_tiers(tiers: list[Tier], max_slots: int | None = None, steps: bool = False, context: int | None = None) -> list[BatchedTier]:
    """Each loaded tier's runtime: a model tier's KV pool and forward (`steps`: decoding in static steps;
    `context`: positions a request's KV holds), the n-gram tier's index, a feature head's pool. A feature
    drafter reads its target's features from the target's slot cache, which its forwards fill anyway: no
    forward of the target runs for the drafter alone."""
    from polyspec.workers.tiers.batched_feature import BatchedFeatureTier  # (it builds on this module)
    from polyspec.workers.tiers.feature_tier import FeatureTier

    out: list[BatchedTier] = []
    for tier in tiers:
        if isinstance(tier, NGramTier):
            out.append(BatchedNGramTier(tier))
        elif isinstance(tier, FeatureTier):
            source = next((t for t in out if isinstance(t, BatchedModelTier) and t.tier is tier.source), None)
            if source is None:
                raise ValueError(f"tier {tier.name!r}: a feature head needs its target's tier before it in the chain")
            out.append(BatchedFeatureTier(tier, source, max_slots))
        else:
            out.append(BatchedModelTier(tier, max_slots, steps=steps, context=context))
    return out
