"""The n-gram / prompt-lookup drafter on the device: one static-shape tensor program per call.

`BatchedNGramTier` (polyspec.workers.tiers.batched) answers the lookup from a Python index per
request, one request after another on the host; at large batches on a GPU that host time exceeds
the target's whole graph-replayed step. Here the lookup is a tensor program over a token buffer on
the device, so a batch costs one (graph-replayed) call:

- `ngram_lookup(tokens, rows, lengths, counts, span, min_ngram, max_ngram, block)`: for each row, the
  longest n-gram size first (max_ngram down to min_ngram), the latest earlier occurrence of the row's
  last n tokens (the suffix itself excluded), and the `count` tokens after it, continuing into the
  copy itself where the context runs out (`copy_forward`): exactly `NGramIndex.lookup`'s proposals.
  Matching runs by END position: an occurrence of size g ends at e when the one of size g - 1 does
  and the token g - 1 before e equals the suffix's; so the sizes share their comparisons, and the
  latest start of a size is its latest end. No host sync, no data-dependent Python control flow:
  shapes depend only on (rows, span, max_ngram, block), so a bucket compiles and captures once.
- `DeviceNGramTier`: the batched tier over a buffer `[slots + 1, capacity]` of token ids allocated
  once, a row per request slot (the last row is scratch, read by padding rows). What a row holds is
  host bookkeeping, as for `StaticModelTier`'s KV slots: each call keeps the prefix a row shares with
  the request's context and writes only what follows, so a rollback is free. The call's one copy to
  the host: the [B, block] proposals and their lengths. Proposals are point masses: the tier returns
  no draft rows, and a verifier reads a block without them as one-hot rows.
"""

from __future__ import annotations

import time

import torch

from polyspec.workers.tiers.batched import BatchedTier
from polyspec.workers.tiers.device_step import MIN_SPAN, SLOT_MARGIN, SlotTable, StepGraphs, bucket
from polyspec.workers.tiers.tier import NGramTier

NO_TOKEN = -1  # what the window holds before a row's first token: equal to no token id


def ngram_lookup(tokens: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor, span: int,
                 min_ngram: int, max_ngram: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt-lookup proposal (`NGramIndex.lookup`) as one tensor program.

    tokens: [slots + 1, capacity] int64, row `rows[b]` holding request b's context in its first
    `lengths[b]` columns (what lies past them is never read); rows, lengths, counts: [B] int64;
    span: columns read (>= every length, <= capacity); block: the widest proposal (>= every count).
    Returns (proposals [B, block]: each row's tokens, then zeros; proposal_lengths [B]: counts[b]
    where an earlier occurrence of some suffix of size min_ngram..max_ngram exists, else 0)."""
    window = tokens[:, :span].index_select(0, rows)  # [B, S]
    batch = window.shape[0]
    ends = torch.arange(span, device=window.device)  # [S] where an earlier occurrence ends
    # the window shifted right: padded[:, max_ngram - 1 - shift + e] is the token `shift` before e (NO_TOKEN before 0)
    padded = torch.cat([window.new_full((batch, max_ngram - 1), NO_TOKEN), window], dim=1)  # [B, S + max_ngram - 1]
    last = lengths - 1  # [B] the suffix's last position
    earlier = ends[None, :] <= lengths[:, None] - 2  # [B, S] an occurrence ending there is followed by a context token
    matches = torch.ones(batch, span, dtype=torch.bool, device=window.device)  # [B, S] an occurrence of size `size` ends here
    continuation = torch.full_like(lengths, -1)  # [B] where the chosen occurrence's continuation starts (-1: none)
    for size in range(1, max_ngram + 1):
        shift = size - 1
        suffix_token = window.gather(1, (last - shift).clamp(min=0)[:, None])  # [B, 1] the suffix's token `shift` before its end
        shifted = padded[:, max_ngram - 1 - shift: max_ngram - 1 - shift + span]  # [B, S]
        matches = matches & (shifted == suffix_token)
        if size < min_ngram:
            continue
        latest = torch.where(matches & earlier, ends, -1).amax(dim=1)  # [B] the latest earlier occurrence's end
        continuation = torch.where(latest >= 0, latest + 1, continuation)  # a longer size overrides a shorter one
    found = continuation >= 0
    start = continuation.clamp(min=0)
    # copy_forward: past the context the copy continues into itself, i.e. it repeats the last `period` tokens
    period = (lengths - start).clamp(min=1)  # [B]
    offsets = torch.arange(block, device=window.device)  # [K]
    positions = start[:, None] + offsets[None, :] % period[:, None]  # [B, K], inside the context (or column 0)
    proposal_lengths = torch.where(found, counts.clamp(min=0, max=block), 0)  # [B]
    proposals = torch.where(offsets[None, :] < proposal_lengths[:, None], window.gather(1, positions), 0)  # [B, K]
    return proposals, proposal_lengths


class DeviceNGramTier(BatchedTier):
    """`NGramTier`'s proposals from `ngram_lookup` over a token buffer on the device, a row per request (module docstring)."""

    def __init__(self, tier: NGramTier, slots: int, context: int, device: torch.device | str = "cpu") -> None:
        """`slots`: requests the buffer holds at once; `context`: the longest context a request reaches
        (each row keeps `SLOT_MARGIN` columns past it, as the model tiers' KV slots do)."""
        super().__init__(tier)
        self.device = torch.device(device)
        self.slots = slots
        self.capacity = context + SLOT_MARGIN
        self.max_context = context
        self.tokens = torch.zeros(slots + 1, self.capacity, dtype=torch.long, device=self.device)  # [slots + 1, capacity]
        self.graphs = StepGraphs(self.device.type == "cuda")
        self.slot_table = SlotTable(slots, self.name, "rows of its token buffer")  # each row's tokens, columns 0 ..

    @property
    def scratch_row(self) -> int:
        return self.slot_table.scratch

    @property
    def open_sequences(self) -> int:
        return self.slot_table.open_sequences

    def release(self, seq_id) -> None:
        self.slot_table.release(seq_id)

    def truncate(self, seq_id, length: int) -> None:
        self.slot_table.truncate(seq_id, length)

    def cached(self, seq_id) -> int:
        return self.slot_table.cached(seq_id)

    def _sync(self, slots: list[int], contexts: list[list[int]]) -> None:
        """Each slot's row rolled back to what it shares with its context, then the rest of the context
        written after it: one scatter for the whole batch."""
        write_rows: list[int] = []
        write_columns: list[int] = []
        write_tokens: list[int] = []
        longest = max(len(context) for context in contexts)
        if longest > self.capacity:  # refused before any row's bookkeeping changes
            raise RuntimeError(f"tier {self.name!r}: a context of {longest} tokens does not fit its rows of {self.capacity}")
        for slot, context in zip(slots, contexts):
            keep = self.slot_table.sync(slot, context)
            tail = context[keep:]
            self.slot_table.tokens[slot] += tail
            write_rows += [slot] * len(tail)
            write_columns += range(keep, len(context))
            write_tokens += tail
        if write_tokens:
            writes = torch.tensor([write_rows, write_columns, write_tokens], dtype=torch.long)  # [3, N]: row, column, token
            writes = writes.to(self.device, non_blocking=True)
            self.tokens.index_put_((writes[0], writes[1]), writes[2])

    @torch.inference_mode()
    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        """Each request's lookup proposal of up to `counts[r]` tokens (no draft rows: point masses), one step for the batch."""
        started = time.perf_counter()
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seq_ids]
        live = [r for r, n in enumerate(counts) if n > 0]
        if not live:
            return out
        slots = [self.slot_table.slot(seq_ids[r]) for r in live]
        self._sync(slots, [contexts[r] for r in live])
        rows = bucket(len(live))
        lengths = [len(contexts[r]) for r in live]
        span = min(bucket(max(lengths), MIN_SPAN), self.capacity)
        block = max(counts[r] for r in live)
        min_ngram, max_ngram = self.tier.min_ngram, self.tier.max_ngram

        def lookup(requests):
            row_ids, row_lengths, row_counts = requests
            proposals, proposal_lengths = ngram_lookup(self.tokens, row_ids, row_lengths, row_counts, span, min_ngram, max_ngram,
                                                       block)
            return torch.cat([proposals, proposal_lengths[:, None]], dim=1)  # [R, K + 1]: one copy to the host

        padding = rows - len(live)  # padding rows read the scratch row, with length 0 and count 0
        requests = torch.tensor([slots + [self.scratch_row] * padding, lengths + [0] * padding,
                                 [counts[r] for r in live] + [0] * padding], dtype=torch.long)  # [3, R]: rows, lengths, counts
        found = self.graphs.run(("lookup", rows, span, block), lookup, [requests.to(self.device, non_blocking=True)])
        host = found[: len(live)].cpu().tolist()  # the call's one copy to the host
        for r, row in zip(live, host):
            out[r] = (row[: row[-1]], None)
        self.tier.busy_s += time.perf_counter() - started
        return out
