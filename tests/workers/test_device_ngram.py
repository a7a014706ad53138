"""The n-gram lookup on the device (polyspec.workers.tiers.device_ngram).

- `ngram_lookup` bit for bit against `NGramIndex.lookup` (the slow, obvious form: `NGramTier`'s scan,
  tests/orchestrator/test_batch_model.py), 400 random batches over several (min_ngram, max_ngram):
  vocabularies of 1..4 tokens (matches everywhere), periodic contexts with noise, contexts shorter
  than max_ngram (0..3 tokens), counts past the continuation (copy_forward's self-overlapping copy),
  rows of different lengths in one batch, padding rows on the scratch row, stale tokens past each
  row's length;
- `DeviceNGramTier` proposes what `BatchedNGramTier` does through 300 calls of growing, rolled-back
  and diverging contexts over several requests (released and reopened), and its rows hold the contexts;
- capturable: `ngram_lookup` compiles whole (`fullgraph`), once for every call of one bucket;
- on CUDA (skipped on the CPU): the tier's graph-replayed calls propose what `BatchedNGramTier` does.
"""

from __future__ import annotations

import random

import pytest
import torch

from core_helpers import CompiledGraphs

from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedNGramTier, NGramIndex
from polyspec.workers.tiers.device_ngram import DeviceNGramTier, ngram_lookup
from polyspec.workers.tiers.tier import NGramTier

SIZES = [(1, 3), (2, 4), (1, 1), (3, 3), (1, 5)]  # (min_ngram, max_ngram)
CAPACITY = 96


def _random_context(rng: random.Random) -> list[int]:
    """A context where lookups find something: tiny vocabularies, or a period repeated with noise; often very short."""
    length = rng.choice([0, 1, 2, 3, rng.randrange(4, 80)])
    if rng.random() < 0.5:
        vocab = rng.randint(1, 4)
        return [rng.randrange(vocab) for _ in range(length)]
    pattern = [rng.randrange(50) for _ in range(rng.randint(1, 6))]
    return [rng.randrange(50) if rng.random() < 0.1 else pattern[i % len(pattern)] for i in range(length)]


def _expected(context: list[int], count: int, min_ngram: int, max_ngram: int) -> list[int]:
    index = NGramIndex(min_ngram, max_ngram)
    index.sync(context)
    return index.lookup(count) if count > 0 else []


@pytest.mark.parametrize("min_ngram,max_ngram", SIZES)
def test_the_lookup_kernel_proposes_what_the_index_does(min_ngram, max_ngram):
    rng = random.Random(min_ngram * 10 + max_ngram)
    slots = 9
    for trial in range(80):
        tokens = torch.randint(0, 50, (slots + 1, CAPACITY))  # stale tokens everywhere past the contexts
        requests = rng.randint(1, slots)
        chosen = rng.sample(range(slots), requests)
        contexts = [_random_context(rng) for _ in chosen]
        counts = [rng.randrange(0, 14) for _ in chosen]
        for slot, context in zip(chosen, contexts):
            tokens[slot, : len(context)] = torch.tensor(context, dtype=torch.long)
        padding = rng.randint(0, 3)  # padding rows read the scratch row with length 0
        rows = torch.tensor(chosen + [slots] * padding)
        lengths = torch.tensor([len(c) for c in contexts] + [0] * padding)
        block = max(counts + [1])
        proposals, proposal_lengths = ngram_lookup(tokens, rows, lengths, torch.tensor(counts + [0] * padding), CAPACITY,
                                                   min_ngram, max_ngram, block)
        assert proposals.shape == (requests + padding, block) and proposal_lengths.shape == (requests + padding,)
        for r, (context, count) in enumerate(zip(contexts, counts)):
            got = proposals[r, : int(proposal_lengths[r])].tolist()
            assert got == _expected(context, count, min_ngram, max_ngram), (trial, context, count)
            assert not proposals[r, int(proposal_lengths[r]):].any(), "zeros past a proposal"
        assert not proposal_lengths[requests:].any(), "padding rows propose nothing"


def test_the_lookup_reads_only_the_span():
    """Columns past the span are never read: a span bucket of the longest context gives the full width's proposals."""
    rng = random.Random(7)
    contexts = [_random_context(rng) for _ in range(6)]
    tokens = torch.randint(0, 4, (7, CAPACITY))
    for slot, context in enumerate(contexts):
        tokens[slot, : len(context)] = torch.tensor(context, dtype=torch.long)
    args = (torch.arange(6), torch.tensor([len(c) for c in contexts]), torch.full((6,), 9))
    narrow = ngram_lookup(tokens, *args, max(len(c) for c in contexts), 1, 3, 9)
    wide = ngram_lookup(tokens, *args, CAPACITY, 1, 3, 9)
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide))


def _evolve(context: list[int], rng: random.Random) -> list[int]:
    """The next context a drafter sees: grown by a verdict, rolled back by a rejection, or diverging after a shared prefix."""
    roll = rng.random()
    if roll < 0.25:
        return context[: rng.randrange(1, len(context) + 1)]
    if roll < 0.45:
        cut = rng.randrange(1, len(context) + 1)
        return context[:cut] + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
    return context + [rng.randrange(5) for _ in range(rng.randint(1, 6))]


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 3), (2, 4)])
def test_the_tier_proposes_what_the_batched_index_does(min_ngram, max_ngram):
    rng = random.Random(max_ngram)
    device_tier = DeviceNGramTier(NGramTier("ng", 12, max_ngram, min_ngram), slots=6, context=200)
    host_tier = BatchedNGramTier(NGramTier("ng", 12, max_ngram, min_ngram))
    contexts = {seq_id: [rng.randrange(5) for _ in range(rng.randint(1, 8))] for seq_id in range(6)}
    for step in range(300):
        seq_ids = rng.sample(sorted(contexts), rng.randint(1, len(contexts)))
        for seq_id in seq_ids:
            context = _evolve(contexts[seq_id], rng)
            contexts[seq_id] = context if len(context) < 150 else context[:10]
        batch = [contexts[s] for s in seq_ids]
        counts = [rng.randrange(0, 9) for _ in seq_ids]
        params = [SamplingParams(temperature=rng.choice([0.0, 1.0])) for _ in seq_ids]
        got = device_tier.draft_batch(seq_ids, batch, counts, params, [None] * len(seq_ids))
        expected = host_tier.draft_batch(seq_ids, batch, counts, params, [None] * len(seq_ids))
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected], step
        assert all(rows is None for _, rows in got), "a lookup's proposals are point masses: no draft rows"
        for seq_id, count in zip(seq_ids, counts):
            if count > 0:  # a synced row holds the context, on the device and in the bookkeeping
                slot = device_tier.slot_table.slot_of[seq_id]
                assert device_tier.cached(seq_id) == len(contexts[seq_id])
                assert device_tier.tokens[slot, : len(contexts[seq_id])].tolist() == contexts[seq_id], step
        if rng.random() < 0.1:  # a finished request frees its row; the next one starts from nothing
            finished = rng.choice(sorted(contexts))
            device_tier.release(finished)
            host_tier.release(finished)
            contexts[finished] = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.1:
            seq_id = rng.choice(sorted(contexts))
            device_tier.truncate(seq_id, 3)
            assert device_tier.cached(seq_id) <= 3
    for seq_id in contexts:
        device_tier.release(seq_id)
    assert device_tier.open_sequences == 0 and sorted(device_tier.slot_table.free) == list(range(6))


def test_the_tier_refuses_what_does_not_fit_in_one_line():
    tier = DeviceNGramTier(NGramTier("ng", 12), slots=1, context=8)
    with pytest.raises(RuntimeError, match="does not fit its rows"):
        tier.draft_batch(["a"], [list(range(tier.capacity + 1))], [3], [SamplingParams()], [None])
    tier.release("a")
    tier.draft_batch(["b"], [[1, 2, 1]], [3], [SamplingParams()], [None])
    with pytest.raises(RuntimeError, match="rows of its token buffer are in use"):
        tier.draft_batch(["c"], [[1, 2, 1]], [3], [SamplingParams()], [None])


def test_the_lookup_compiles_whole_and_once_per_bucket():
    lookup = CompiledGraphs(ngram_lookup)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):  # one bucket (4 rows, span 64, block 5), new values every call
        tokens = torch.randint(0, 3, (5, CAPACITY), generator=generator)
        lengths = torch.randint(0, 64, (4,), generator=generator)
        counts = torch.randint(0, 6, (4,), generator=generator)
        proposals, proposal_lengths = lookup(tokens, torch.tensor([0, 2, 1, 4]), lengths, counts, 64, 1, 3, 5)
        assert proposals.shape == (4, 5) and bool((proposal_lengths <= counts).all())
    assert len(lookup.graphs) == 1, f"{len(lookup.graphs)} graphs for one bucket (a graph break or a recompilation)"
    lookup.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_tier_on_cuda_replays_graphs_and_proposes_what_the_index_does():
    rng = random.Random(3)
    device_tier = DeviceNGramTier(NGramTier("ng", 12, 3, 1), slots=8, context=300, device="cuda")
    host_tier = BatchedNGramTier(NGramTier("ng", 12, 3, 1))
    assert device_tier.graphs.enabled
    contexts = {seq_id: [rng.randrange(4) for _ in range(rng.randint(1, 8))] for seq_id in range(8)}
    for step in range(200):
        seq_ids = rng.sample(sorted(contexts), rng.randint(1, len(contexts)))
        for seq_id in seq_ids:
            context = _evolve(contexts[seq_id], rng)
            contexts[seq_id] = context if len(context) < 250 else context[:10]
        batch = [contexts[s] for s in seq_ids]
        counts = [rng.randrange(1, 9) for _ in seq_ids]
        got = device_tier.draft_batch(seq_ids, batch, counts, [SamplingParams()] * len(seq_ids), [None] * len(seq_ids))
        expected = host_tier.draft_batch(seq_ids, batch, counts, [SamplingParams()] * len(seq_ids), [None] * len(seq_ids))
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected], step
    assert device_tier.graphs.graphs, "no lookup was captured"
