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

Drafting is the model tier's own (`BatchedModelTier.draft_batch` / `draft_tree_batch` over `Row`s): this class
gives it the head's rows (`_rows`), the features each fed token reads (`_previous`, `_level_previous`) and the
head's forward (`_logits`); only scoring, which feeds a block one token a forward, is its own.

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

import torch
import torch.nn.functional as F

from polyspec.workers.core.grammar import restrict_blocks
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree
from polyspec.workers.core.verdicts import ScoredRows
from polyspec.workers.tiers.batched import BatchedModelTier, Row
from polyspec.workers.tiers.batched_llama import BatchedLlama, PendingTree, RowLayout, linear_function
from polyspec.workers.tiers.feature_tier import FeatureTier, head_trunk


class BatchedFeatureTier(BatchedModelTier):
    """A `FeatureTier` whose open requests share one slot cache and one forward per step (module docstring): the
    model tier's drafting (`draft_batch`, `draft_tree_batch`) over the head's own rows, forward and inputs."""

    def __init__(self, tier: FeatureTier, source: BatchedModelTier, max_slots: int | None = None) -> None:
        super().__init__(tier, max_slots, model=BatchedLlama(head_trunk(tier.head)))
        self.caches_prompts = False  # the scheduler prefills the target; the head catches up in its own calls
        self.head = tier.head
        self.source = source  # the batched target: its slot cache records the features the head reads
        source.keep_features = True
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
        super().release(seq_id)
        self.real.pop(seq_id, None)

    def truncate(self, seq_id, length: int) -> None:
        super().truncate(seq_id, length)
        if seq_id in self.cache.slot_of:
            self.real[seq_id] = min(self.real.get(seq_id, 0), self.cache.length(self.cache.slot_of[seq_id]))

    def accept_path(self, seq_id, path: list[int]) -> None:
        """The accepted nodes were computed from predicted features: the tree goes, the next call computes them again."""
        slot = self.cache.slot_of.get(seq_id)
        if slot is not None:
            self.cache.drop_tree(slot)

    def bytes_per_request(self) -> int:
        return self.cache.bytes_per_slot(hidden_size=self.hidden_size)

    def prefill(self, seq_ids, contexts, budget: int) -> int:
        """Nothing: the head's positions read the target's features, so it catches up inside its own calls."""
        return 0

    # ---------------------------------------------------------------------- forwards

    def _logits(self, slots: list[int], tokens: list[list[int]], outputs: list[int], layouts: list[RowLayout | None] | None,
                previous: list[torch.Tensor]) -> list[torch.Tensor]:
        """The head's forward (`_forward` times and counts it): feed `tokens[r]` to slot `slots[r]`, token j read with
        `previous[r][j]` (the feature at its previous position, [len(tokens[r]), H]); each row's logits
        [len(tokens[r]) - outputs[r], V] float32 on the CPU, of its positions from `outputs[r]` on. The slot cache
        records the head's predicted feature at each."""
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
        return list(torch.split(logits, [row.shape[0] for row in trunk]))

    def _rows(self, seq_ids, contexts: list[list[int]]) -> list[Row]:
        """Each request's slot rolled back to what it shares with its context and computed from the target's
        features (feature_tier's docstring gives the rules), and what it feeds to reach the context's end."""
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
            keep = min(self.cache.agreed(slot, context), self.real.get(seq_id, 0), n - 1)
            self.cache.truncate(slot, keep)
            real_end = min(n, have.shape[0] + 1)  # positions with a target feature for their predecessor
            chunk = context[keep:real_end]
            previous = have.reshape(-1, self.hidden_size)[max(keep - 1, 0) : max(real_end - 1, 0)]  # [len(chunk) (- 1), H]
            if keep == 0:
                previous = torch.cat([torch.zeros(1, self.hidden_size), previous])  # position 0 reads no feature
            self.real[seq_id] = max(keep, real_end)
            rows.append(Row(slot, keep, n, chunk, context[max(keep, real_end) :], previous[: len(chunk)]))
        return rows

    def _previous(self, row: Row, chunk: bool) -> torch.Tensor:
        """The features the chunk reads (the target's), or the head's own prediction at the queued token's previous position."""
        return row.chunk_features if chunk else self.cache.features[row.slot][row.position - 1 : row.position]

    def _level_previous(self, rows: list[Row], pending: list[PendingTree], trees: list[DraftTree],
                        frontiers: list[list[int]]) -> list[torch.Tensor]:
        """Each node read with its parent's predicted feature (the context's last position's for a root child)."""
        previous = []
        for row, tree_pending, tree, frontier in zip(rows, pending, trees, frontiers):
            at = [row.context_len - 1 if tree.parents[node] < 0 else tree_pending.node_slots[tree.parents[node]] for node in frontier]
            previous.append(self.cache.features[row.slot][at])
        return previous

    # ------------------------------------------------------------------ verification

    def score_batch(self, seq_ids, contexts, blocks: Blocks, params: list[SamplingParams]) -> ScoredRows:
        """Every request's rows [len(block) + 1, V] after its context, the block's tokens
        fed one a forward after the first, each read with the head's prediction at the position before."""
        if not blocks.all_chains:
            raise NotImplementedError(f"tier {self.name!r} (a feature head) verifies chains only; "
                                      "a tree must be verified by the target")
        rows = self._rows(seq_ids, contexts)
        scored: list[list[torch.Tensor]] = [[] for _ in seq_ids]
        block_tokens, _ = blocks.host()

        def record(ready: dict[int, torch.Tensor]) -> None:
            for i, logits in ready.items():
                scored[i].append(logits)
                if len(scored[i]) <= len(block_tokens[i]):
                    rows[i].queue.append(block_tokens[i][len(scored[i]) - 1])

        if rows:
            self._steps(rows, record)
        restricted = restrict_blocks([torch.stack(rows_of) for rows_of in scored], params, contexts, blocks)
        return ScoredRows.warped(restricted, params)
