"""The feature head's runtime tier (polyspec.workers.tiers.feature_tier has the rules): one forward for all requests.

`BatchedFeatureTier` keeps every open request of the head in one `SlotCache` and runs the head's decoder layer through `BatchedLlama`, given the
layer's inputs (`inputs=`) and returning its raw output (`raw=True`), so a call costs about one forward per
position drafted, whatever the batch:

- the first forward brings every row's slot up to its context: the positions whose previous position the
  target has computed, each read with the target's feature there (the batched target's slot cache records
  them: `BatchedModelTier.features`), in one ragged forward over all rows;
- every further forward feeds one token of each row still going, read with the feature the head predicted at
  the position before: context positions the target has not computed (when the head verifies a cheaper
  tier's blocks), then the drafted tokens (`draft_batch`) or the block's (`score_batch`); rows ask for
  different counts and leave the steps when done;
- a tree (`draft_tree_batch`) grows one level per forward over every row's frontier (tree rows of the ragged
  forward, `RowLayout`), after the rows' slots are brought up to their contexts as above.

The rules are those of feature_tier's docstring: which positions read the target's features is fixed
before any token is drawn; positions computed from predicted features are provisional (`real` counts the
others, the next call computes the rest again); tree nodes go after the verdict (`accept_path`). The head's
predicted feature at every position it writes is the feature its slot cache records (`keep_features`: the
final norm of the head's layer is its feature norm). Per request, the warp and the draws with its own
generator are made in the same order alone or in any batch, so a seeded request draws the same tokens.

The head catches up on a context inside its own calls (`caches_prompts` is False: the
scheduler prefills only the target, whose features the head's first forward reads).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from polyspec.workers.core.grammar import grammar_of, node_context, restrict_each, restrict_rows, tree_prefixes
from polyspec.workers.core.sampling import SamplingParams, warp_logits
from polyspec.workers.core.tree import DraftTree, tree_allowed
from polyspec.workers.core.verdicts import Draws
from polyspec.workers.tiers.batched import BatchedModelTier, BatchedTier
from polyspec.workers.tiers.batched_llama import BatchedLlama, PendingTree, RowLayout, linear_function
from polyspec.workers.tiers.feature_tier import FeatureTier, head_trunk


@dataclasses.dataclass
class HeadRow:
    """One request in a call: its slot, the next position it feeds, and what it feeds."""

    slot: int
    position: int  # the next position fed
    context_len: int
    chunk: list[int]  # the first forward's tokens, each read with the target's feature at the position before
    chunk_features: torch.Tensor  # [len(chunk), H] those features (zeros at position 0)
    queue: list[int]  # tokens fed one a forward after the chunk, each read with the head's prediction before it

    @property
    def going(self) -> bool:
        return bool(self.chunk or self.queue)


class BatchedFeatureTier(BatchedTier):
    """A `FeatureTier` whose open requests share one slot cache and one forward per step (module docstring)."""

    def __init__(self, tier: FeatureTier, source: BatchedModelTier, max_slots: int | None = None) -> None:
        super().__init__(tier)
        self.head = tier.head
        self.source = source  # the batched target: its slot cache records the features the head reads
        source.keep_features = True
        self.model = BatchedLlama(head_trunk(tier.head))
        self.cache = self.model.new_cache(max_slots)
        self.cache.keep_features = True  # the head's predicted feature at every position (its feature norm)
        self.fc = linear_function(tier.head.fc)
        self.hidden_size = tier.head.config.hidden_size
        self.real: dict[object, int] = {}  # seq_id -> its first positions, computed from the target's features

    # ------------------------------------------------------------------ bookkeeping

    def cached(self, seq_id) -> int:
        """Positions of `seq_id` the head holds computed from the target's features (the others are recomputed)."""
        slot = self.cache.slot_of.get(seq_id)
        return 0 if slot is None else min(self.real.get(seq_id, 0), self.cache.length(slot))

    def release(self, seq_id) -> None:
        self.cache.release(seq_id)
        self.real.pop(seq_id, None)

    def truncate(self, seq_id, length: int) -> None:
        slot = self.cache.slot_of.get(seq_id)
        if slot is not None:
            self.cache.drop_tree(slot)
            self.cache.truncate(slot, min(length, self.cache.length(slot)))
            self.real[seq_id] = min(self.real.get(seq_id, 0), self.cache.length(slot))

    def accept_path(self, seq_id, path: list[int]) -> None:
        """The accepted nodes were computed from predicted features: the tree goes, the next call computes them again."""
        slot = self.cache.slot_of.get(seq_id)
        if slot is not None:
            self.cache.drop_tree(slot)

    def bytes_per_request(self) -> int:
        return self.cache.bytes_per_slot(hidden_size=self.hidden_size)

    def set_max_slots(self, slots: int) -> None:
        self.cache.max_slots = slots

    # ---------------------------------------------------------------------- forwards

    def _forward(self, slots: list[int], tokens: list[list[int]], previous: list[torch.Tensor], outputs: list[int],
                 layouts: list[RowLayout | None] | None = None) -> list[torch.Tensor]:
        """Feed `tokens[r]` to slot `slots[r]`, token j read with `previous[r][j]` (the feature at its previous
        position, [len(tokens[r]), H]); each row's logits [len(tokens[r]) - outputs[r], V] float32 on the CPU,
        of its positions from `outputs[r]` on. The slot cache records the head's predicted feature at each."""
        threads = self.tier.threads
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        counts = [len(t) for t in tokens]
        device, dtype = self.model.device, self.model.dtype
        with torch.inference_mode():
            ids = torch.tensor([token for row in tokens for token in row], dtype=torch.long, device=device)  # [N]
            embeds = F.embedding(ids, self.source.model.embed).to(dtype)  # [N, H] the target's embeddings
            features = torch.cat(previous).to(device, dtype)  # [N, H]
            parts = [features, embeds] + ([features * embeds] if self.head.sampling else [])
            layer_inputs = self.fc(torch.cat(parts, dim=-1))  # [N, H]
            row_inputs = list(torch.split(layer_inputs, counts))
            # per row its layer output [len(tokens[r]) - outputs[r], H]
            trunk = self.model.forward(self.cache, slots, tokens, outputs, layouts, inputs=row_inputs, raw=True)
            picked = torch.cat(trunk)  # [M, H]
            logits = torch.zeros(0, self.vocab_size)
            if picked.shape[0]:
                _, logit_input = self.head.outputs(picked)
                logits = self.source.model.lm_head(logit_input)[:, : self.vocab_size].float().cpu()  # [M, V]
        seconds = time.perf_counter() - started
        self.tier.busy_s += seconds
        self.tier.forwards += 1
        self.tier.forwarded_tokens += sum(len(t) for t in tokens)
        self.log_forward(len(slots), max(counts), seconds)
        return list(torch.split(logits, [row.shape[0] for row in trunk]))

    def _rows(self, seq_ids, contexts: list[list[int]]) -> list[HeadRow]:
        """Each request's slot rolled back to what it shares with its context and computed from the target's
        features (`FeatureTier._condition`'s rules), and what it feeds to reach the context's end."""
        wanted = [len(context) - 1 for context in contexts]
        real = [self.source.features(s, c, n) for s, c, n in zip(seq_ids, contexts, wanted)]
        new = [r for r, (have, n) in enumerate(zip(real, wanted)) if have.shape[0] == 0 and n > 0]
        if new:  # new prompts: the target computes their features now (its next score finds them cached)
            self.source.prefill([seq_ids[r] for r in new], [contexts[r] for r in new], sum(wanted[r] for r in new))
            for r in new:
                real[r] = self.source.features(seq_ids[r], contexts[r], wanted[r])
        rows = []
        for seq_id, context, have in zip(seq_ids, contexts, real):
            slot = self.cache.slot(seq_id)
            self.cache.drop_tree(slot)
            n = len(context)
            keep = min(self.cache.common_prefix(slot, context), self.real.get(seq_id, 0), n - 1)
            self.cache.truncate(slot, keep)
            real_end = min(n, have.shape[0] + 1)  # positions with a target feature for their predecessor
            chunk = context[keep:real_end]
            previous = have.reshape(-1, self.hidden_size)[max(keep - 1, 0) : max(real_end - 1, 0)]  # [len(chunk) (- 1), H]
            if keep == 0:
                previous = torch.cat([torch.zeros(1, self.hidden_size), previous])  # position 0 reads no feature
            self.real[seq_id] = max(keep, real_end)
            rows.append(HeadRow(slot, keep, n, chunk, previous[: len(chunk)], context[max(keep, real_end) :]))
        return rows

    def _advance(self, rows: list[HeadRow], going: list[int]) -> dict[int, torch.Tensor]:
        """One forward of `rows[i]` for i in `going`: its chunk, or its next queued token. The logits [V] at the
        last position fed, of the rows that reached (or passed) their context's end."""
        slots, tokens, previous, outputs = [], [], [], []
        for i in going:
            row = rows[i]
            if row.chunk:
                fed, features = row.chunk, row.chunk_features
                row.chunk = []
            else:
                fed, features = [row.queue.pop(0)], self.cache.features[row.slot][row.position - 1 : row.position]
            row.position += len(fed)
            slots.append(row.slot)
            tokens.append(fed)
            previous.append(features)
            outputs.append(len(fed) - 1 if row.position >= row.context_len else len(fed))
        logits = self._forward(slots, tokens, previous, outputs)
        return {i: row_logits[-1] for i, row_logits in zip(going, logits) if row_logits.shape[0]}

    def _steps(self, rows: list[HeadRow], after) -> None:
        """Forward every row until none has anything left to feed; `after(i, logits)` receives each row's logits
        once it has reached its context's end (and may queue the next token)."""
        going = list(range(len(rows)))
        while going:
            for i, logits in self._advance(rows, going).items():
                after(i, logits)
            going = [i for i in going if rows[i].going]

    # ---------------------------------------------------------------------- drafting

    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        """`FeatureTier.draft` for every request: the first forward brings its slot up to its context, then one
        forward per drafted token, the rows still drafting together."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seq_ids]
        live = [r for r, count in enumerate(counts) if count > 0]
        if not live:
            return out
        rows = self._rows([seq_ids[r] for r in live], [contexts[r] for r in live])
        draws = Draws.of([params[r] for r in live], [generators[r] for r in live], [counts[r] for r in live], "cpu")
        tokens: list[list[int]] = [[] for _ in live]
        drawn_rows: list[list[torch.Tensor]] = [[] for _ in live]

        def draw(i: int, logits: torch.Tensor) -> None:  # position j of request i draws from its round j
            r = live[i]
            row = restrict_rows(logits[None], grammar_of(params[r]), [contexts[r] + tokens[i]])
            token, probs = draws.draw(row, torch.tensor([i]), len(tokens[i]))
            tokens[i].append(int(token))
            drawn_rows[i].append(probs[0])
            if len(tokens[i]) < counts[r]:
                rows[i].queue.append(token)

        self._steps(rows, draw)
        for i, r in enumerate(live):
            out[r] = (tokens[i], None if params[r].greedy else torch.stack(drawn_rows[i]))
        return out

    def draft_tree_batch(self, seq_ids, contexts, width: int, depths: list[int], params, scheme: str,
                         generators) -> list[DraftTree]:
        """`FeatureTier.draft_tree` for every request: its slot brought up to its context, then one forward per
        level over every request's frontier, each node read with its parent's predicted feature (the root's for
        the first level); each request's draws in the one-request order."""
        trees = [DraftTree([], [], None) for _ in seq_ids]
        live = [r for r, depth in enumerate(depths) if depth > 0]
        if not live:
            return trees
        rows = self._rows([seq_ids[r] for r in live], [contexts[r] for r in live])
        roots: dict[int, torch.Tensor] = {}
        self._steps(rows, roots.__setitem__)
        draws = Draws.of([params[r] for r in live], [generators[r] for r in live], [depths[r] for r in live], "cpu")
        root_logits = restrict_each(torch.stack([roots[i] for i in range(len(live))]), [params[r] for r in live],
                                     [contexts[r] for r in live])
        candidates, valid, root_rows = draws.roots(root_logits, torch.arange(len(live)), width, scheme == "rsd")
        pending, frontier, node_depths, drawn_rows = [], [], [], []
        for i, (r, tokens, ok) in enumerate(zip(live, candidates.tolist(), valid.tolist())):
            pending.append(PendingTree(rows[i].context_len, {}))
            self.cache.pending[rows[i].slot] = pending[i]
            kept = [token for token, good in zip(tokens, ok) if good]
            trees[r].tokens.extend(kept)
            trees[r].parents.extend([-1] * len(kept))
            drawn_rows.append([root_rows[i]] * len(kept))
            frontier.append(list(range(len(kept))))
            node_depths.append([0] * len(kept))
        for level in range(1, max(depths)):
            growing = [i for i, r in enumerate(live) if level < depths[r] and frontier[i]]
            if not growing:
                break
            layouts, previous = [], []
            for i in growing:
                slot, prefix, tree = rows[i].slot, rows[i].context_len, trees[live[i]]
                first = self.cache.length(slot)
                for offset, node in enumerate(frontier[i]):
                    pending[i].node_slots[node] = first + offset
                parents = [tree.parents[node] for node in frontier[i]]
                at = [prefix - 1 if parent < 0 else pending[i].node_slots[parent] for parent in parents]  # the root: n - 1
                previous.append(self.cache.features[slot][at])
                allowed = tree_allowed(tree.parents, pending[i].node_slots, frontier[i], prefix, 0, first + len(frontier[i]))
                layouts.append(RowLayout([prefix + node_depths[i][node] for node in frontier[i]], allowed))
            fed = [[trees[live[i]].tokens[node] for node in frontier[i]] for i in growing]
            logits = self._forward([rows[i].slot for i in growing], fed, previous, [0] * len(growing), layouts)
            flat = torch.cat(logits)  # [nodes, V]: node w of a level draws from the level's round, draws w * V ..
            flat = restrict_each(flat, [params[live[i]] for i in growing for _ in frontier[i]],
                                  [node_context(contexts[live[i]], trees[live[i]].tokens, trees[live[i]].parents, n)
                                   for i in growing for n in frontier[i]])
            owner = torch.tensor([i for i in growing for _ in frontier[i]])
            first = torch.tensor([w * flat.shape[-1] for i in growing for w in range(len(frontier[i]))])
            drawn, probs = draws.draw(flat, owner, level, first)
            drawn, node = drawn.tolist(), 0
            for i in growing:
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
        return trees

    # ------------------------------------------------------------------ verification

    def score_batch(self, seq_ids, contexts, blocks: list[DraftTree], params: list[SamplingParams]) -> list[torch.Tensor]:
        """`FeatureTier.score` for every request: rows [len(block) + 1, V] after its context, the block's tokens
        fed one a forward after the first, each read with the head's prediction at the position before."""
        if not all(block.is_chain() for block in blocks):
            raise NotImplementedError(f"tier {self.name!r} (a feature head) verifies chains only; "
                                      "a tree must be verified by the target")
        rows = self._rows(seq_ids, contexts)
        scored: list[list[torch.Tensor]] = [[] for _ in seq_ids]

        def record(i: int, logits: torch.Tensor) -> None:
            scored[i].append(logits)
            if len(scored[i]) <= len(blocks[i]):
                rows[i].queue.append(blocks[i].tokens[len(scored[i]) - 1])

        if rows:
            self._steps(rows, record)
        scored = [restrict_rows(torch.stack(rows_of), grammar_of(p), tree_prefixes(context, block.tokens, block.parents))
                  for rows_of, p, context, block in zip(scored, params, contexts, blocks)]
        return [warp_logits(rows, p) for rows, p in zip(scored, params)]
