"""The device round's verification kernels (polyspec.workers.core.device_verify).

- bit for bit against the slow, obvious references: `warp_logits` row by row, and
  `verify_greedy` / `verify_chain_drawn` request by request, on mixed batches (greedy and
  sampled rows, blocks of 0..6 tokens, every warp);
- the counter-based streams: a request's draws do not depend on its batch;
- lossless: a chi-square test of the emitted tokens against the target distribution;
- capturable: `torch.compile(fullgraph=True)` traces the warp + verification step without a
  graph break (no host sync inside) and compiles it once for every step of one shape bucket.
"""

from __future__ import annotations

import collections

import pytest
import torch
from scipy import stats

from core_helpers import CompiledGraphs

from polyspec.workers.core.device_verify import (
    DOMAIN_ACCEPT,
    DOMAIN_DRAFT,
    DOMAIN_NEXT,
    DOMAINS,
    MASK32,
    _mix32,
    stream_keys,
    unit_interval,
    verify_greedy_chains,
    stream_exponentials,
    stream_uniforms,
    verify_chains,
    warp_batch,
)
from polyspec.workers.core.sampling import SamplingParams, warp_logits
from reference_verification import PLACEHOLDER_TOKEN_ID, emitted_tokens, verify_chain_drawn, verify_greedy

ALPHA = 1e-3  # chi-square false-alarm rate per test
PARAMS = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
          SamplingParams(0.9, top_p=0.5, top_k=12), SamplingParams(2e-5), SamplingParams(1.0, top_p=0.0),
          SamplingParams(0.5, top_k=10**6), SamplingParams(1000.0, top_p=0.95)]


def _param_tensors(params: list[SamplingParams]):
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32))


def test_warp_batch_equals_warp_logits_row_by_row():
    generator = torch.Generator().manual_seed(0)
    params = PARAMS * 3
    logits = torch.randn(len(params), 97, generator=generator) * 4  # [R, V]
    logits[3, 10] = logits[3, 11] = logits[3].max() + 2  # a tie at the top
    logits = logits.to(torch.bfloat16)  # any model dtype
    batched = warp_batch(logits, *_param_tensors(params))
    for row, p in enumerate(params):
        assert torch.equal(batched[row], warp_logits(logits[row], p)), (row, p)


def test_warp_without_truncation_equals_warp_logits():
    """The static `truncate=False` path, for steps where no request has top-k or top-p."""
    params = [p for p in PARAMS if p.top_k == 0 and p.top_p == 1.0]
    logits = torch.randn(len(params), 97, generator=torch.Generator().manual_seed(1)) * 4
    batched = warp_batch(logits, *_param_tensors(params), truncate=False)
    for row, p in enumerate(params):
        assert torch.equal(batched[row], warp_logits(logits[row], p)), (row, p)
    sampled = [r for r, p in enumerate(params) if not p.greedy]  # without a greedy row the host skips the one-hot rows
    assert len(sampled) >= 2
    batched = warp_batch(logits[sampled], *_param_tensors([params[r] for r in sampled]), truncate=False)
    for row, r in enumerate(sampled):
        assert torch.equal(batched[row], warp_logits(logits[r], params[r])), (r, params[r])


def test_greedy_chains_equal_verify_greedy_with_padding():
    generator = torch.Generator().manual_seed(3)
    batch, block, vocab = 7, 5, 30
    logits = torch.randn(batch, block + 1, vocab, generator=generator)
    drafts = logits[:, :block].argmax(-1)  # drafts that follow the target ...
    drafts[torch.rand(batch, block, generator=generator) < 0.3] = 0  # ... until they do not
    num_draft = torch.tensor([5, 0, 3, 5, 1, 2, 4])
    num_accepted, next_tokens = verify_greedy_chains(logits.argmax(dim=-1), drafts, num_draft)
    for r in range(batch):
        k = int(num_draft[r])
        assert (int(num_accepted[r]), int(next_tokens[r])) == verify_greedy(logits[r, : k + 1].argmax(-1), drafts[r, :k]), r


def _random_batch(seed: int, vocab: int = 50):
    """A mixed batch: per request its block length (0..6), greedy or not, rows and drafts."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [0, 3, 6, 1, 4, 2, 5, 3, 0, 6]
    greedy = [bool(i % 3 == 0) for i in range(len(lengths))]
    target = torch.softmax(torch.randn(sum(lengths) + len(lengths), vocab, generator=generator) * 2, dim=-1)
    draft = torch.softmax(torch.randn(sum(lengths), vocab, generator=generator) * 2, dim=-1)
    draft[2, :] = 0.0  # a draft row that gave its token probability 0: always rejected
    draft[2, 7] = 1.0
    tokens = torch.multinomial(draft, 1, generator=generator)[:, 0]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)
    # greedy requests' target rows are one-hot (warp_logits at temperature 0) and some drafts follow them
    for r, is_greedy in enumerate(greedy):
        if is_greedy:
            rows = slice(int(cu[r]) + r, int(cu[r + 1]) + r + 1)
            target[rows] = torch.nn.functional.one_hot(target[rows].argmax(-1), vocab).float()
            for j in range(lengths[r] - 1):
                tokens[int(cu[r]) + j] = target[int(cu[r]) + r + j].argmax()
    seeds = torch.randint(0, 2**62, (len(lengths),), generator=generator)
    counters = torch.randint(0, 1000, (len(lengths),), generator=generator)
    uniforms = stream_uniforms(seeds, counters, DOMAIN_ACCEPT, max(lengths))  # [B, K]
    flat_uniforms = torch.cat([uniforms[r, :k] for r, k in enumerate(lengths)])  # [N]
    exponentials = stream_exponentials(seeds, counters, DOMAIN_NEXT, vocab)  # [B, V]
    return lengths, torch.tensor(greedy), target, draft, tokens, cu, flat_uniforms, exponentials


@pytest.mark.parametrize("seed,all_sampled", [(seed, False) for seed in range(6)] + [(seed, True) for seed in range(3)])
def test_verify_chains_equals_the_per_request_reference(seed, all_sampled):
    lengths, greedy, target, draft, tokens, cu, uniforms, exponentials = _random_batch(seed)
    if all_sampled:  # no greedy request: the host skips the argmax rows (the one-hot rows are then sampled ones)
        greedy = torch.zeros_like(greedy)
    num_accepted, next_tokens = verify_chains(target, draft, tokens, cu, greedy, uniforms, exponentials)
    out = emitted_tokens(tokens, cu, num_accepted, next_tokens, max(lengths))
    for r, k in enumerate(lengths):
        drafts, rows = slice(int(cu[r]), int(cu[r + 1])), slice(int(cu[r]) + r, int(cu[r + 1]) + r + 1)
        if greedy[r]:
            expected = verify_greedy(target[rows].argmax(-1), tokens[drafts])
        else:
            expected = verify_chain_drawn(target[rows], draft[drafts], tokens[drafts], uniforms[drafts], exponentials[r])
        assert (int(num_accepted[r]), int(next_tokens[r])) == expected, (seed, r)
        row = out[r].tolist()
        assert row[: expected[0]] == tokens[drafts][: expected[0]].tolist() and row[expected[0]] == expected[1]
        assert all(t == PLACEHOLDER_TOKEN_ID for t in row[expected[0] + 1:])


def test_streams_do_not_depend_on_the_batch():
    seeds = torch.tensor([5, 2**62 + 3, 5, 17], dtype=torch.int64)
    counters = torch.tensor([0, 9, 1, 0], dtype=torch.int64)
    together = stream_uniforms(seeds, counters, DOMAIN_ACCEPT, 64)
    for r in range(4):
        assert torch.equal(stream_uniforms(seeds[r:r + 1], counters[r:r + 1], DOMAIN_ACCEPT, 64)[0], together[r])
    assert not torch.equal(together[0], together[2])  # the next round draws afresh
    assert not torch.equal(together[0], stream_uniforms(seeds[:1], counters[:1], DOMAIN_NEXT, 64)[0])  # so does another domain
    offsets = torch.zeros(4, dtype=torch.int64)  # the same draws through the uncached index hash
    assert torch.equal(stream_uniforms(seeds, counters, DOMAIN_ACCEPT, 64, first=offsets), together)
    many = stream_uniforms(torch.arange(200), torch.zeros(200, dtype=torch.int64), DOMAIN_ACCEPT, 500).flatten()
    assert 0 < float(many.min()) and float(many.max()) < 1
    assert stats.kstest(many.numpy(), "uniform").pvalue > ALPHA  # 100,000 draws


def test_the_host_keys_are_the_tensor_keys():
    """On the CPU a round's keys are hashed in Python integers and its draws in numpy; the device's tensor form must give
    the same numbers (seeds to 2^63 - 1, counters past 2^32, every domain), and an empty draw is an empty row per request."""
    seeds = torch.tensor([0, 5, 17, 2**32 - 1, 2**32, 2**62 + 3, 2**63 - 1, 123456789012345], dtype=torch.int64)
    counters = torch.tensor([0, 1, 9, 2**31, 2**32 + 5, 2**40, 3, 77], dtype=torch.int64)
    for domain in range(DOMAINS):
        lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
        tensor_keys = _mix32(lo ^ _mix32(hi ^ _mix32((counters * DOMAINS + domain) & MASK32)))
        assert torch.equal(stream_keys(seeds, counters, domain), tensor_keys), domain
        for count in (1, 13, 4096):  # the host's draws (numpy's uint32) are the tensor form's numbers
            tensor_uniforms = unit_interval(_mix32(tensor_keys[:, None] ^ _mix32(torch.arange(count)[None, :])))
            assert torch.equal(stream_uniforms(seeds, counters, domain, count), tensor_uniforms), (domain, count)
    assert stream_uniforms(seeds, counters, DOMAIN_ACCEPT, 0).shape == (8, 0)


def test_the_extreme_hashes_stay_strictly_inside_the_unit_interval():
    """The hashes that map to the smallest and largest uniforms: both strictly inside (0, 1) in float32, so every Exp(1)
    noise is positive and finite, and a token of probability 0 never wins the exponential race (at u = 1 the noise was
    0 and 0 / 0 = NaN won the argmax: a top-k 4 draw over SmolLM2's 49,152 tokens emitted a token outside its top 4)."""
    bits = torch.tensor([0, 511, 1 << 31, MASK32 - 511, MASK32], dtype=torch.int64)
    uniforms = unit_interval(bits)
    assert float(uniforms.min()) > 0 and float(uniforms.max()) < 1
    assert float(uniforms.max()) == 1 - 2.0**-24
    noise = -torch.log(uniforms)
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0, 0.0]])
    for column in range(5):  # the extreme noise on any token: the race stays inside the support
        race = torch.full((1, 5), 1.0)
        race[0, column] = float(noise.min())
        assert int(torch.argmax(probs / race)) in (1, 2)


def test_device_verification_is_lossless():
    """Chi-square over 40,000 requests (one per seed, all in one batch): each drafts a 2-token
    block from the draft distribution with its own stream and the first two emitted tokens must be
    distributed as the target's (exact two-token joint, here the same row at both positions)."""
    vocab, samples, block = 5, 40_000, 2
    target_row = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    draft_row = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1])
    seeds = torch.arange(samples, dtype=torch.int64)
    zero = torch.zeros(samples, dtype=torch.int64)
    drafted = torch.argmax(draft_row / stream_exponentials(seeds, zero, DOMAIN_DRAFT, vocab * block).view(samples, block, vocab), -1)
    cu = torch.arange(0, samples * block + 1, block, dtype=torch.int64)
    num_accepted, next_tokens = verify_chains(target_row.expand(samples * (block + 1), vocab), draft_row.expand(samples * block, vocab),
                                              drafted.flatten(), cu, torch.zeros(samples, dtype=torch.bool),
                                              stream_uniforms(seeds, zero, DOMAIN_ACCEPT, block).flatten(),
                                              stream_exponentials(seeds, zero, DOMAIN_NEXT, vocab))
    out = emitted_tokens(drafted.flatten(), cu, num_accepted, next_tokens, block)
    pairs = collections.Counter()
    for row, accepted in zip(out.tolist(), num_accepted.tolist()):
        if accepted >= 1:  # two tokens emitted in this round
            pairs[(row[0], row[1])] += 1
    firsts = collections.Counter(out[:, 0].tolist())
    observed = [firsts[t] for t in range(vocab)]
    assert stats.chisquare(observed, (target_row * samples).tolist()).pvalue > ALPHA
    # given that the first draft was accepted, the second emitted token is again distributed as the target row
    seconds = collections.Counter()
    for (_, second), count in pairs.items():
        seconds[second] += count
    total = sum(seconds.values())
    assert total > samples / 4
    assert stats.chisquare([seconds[t] for t in range(vocab)], (target_row * total).tolist()).pvalue > ALPHA


def _step(logits, temperature, top_k, top_p, draft_probs, draft_tokens, cu, greedy, seeds, counters):
    """A tier's verification step after its forward: warp, draws, verify, the output row."""
    target_probs = warp_batch(logits, temperature, top_k, top_p)
    max_draft = 4
    uniforms = stream_uniforms(seeds, counters, DOMAIN_ACCEPT, max_draft)  # [B, K]
    positions = torch.arange(draft_tokens.shape[0])
    request_of = torch.searchsorted(cu[1:], positions, right=True)
    flat_uniforms = uniforms[request_of, positions - cu[request_of]]
    exponentials = stream_exponentials(seeds, counters, DOMAIN_NEXT, logits.shape[-1])
    num_accepted, next_tokens = verify_chains(target_probs, draft_probs, draft_tokens, cu, greedy, flat_uniforms, exponentials)
    return emitted_tokens(draft_tokens, cu, num_accepted, next_tokens, max_draft)


def test_the_step_compiles_whole_and_once_per_bucket():
    step = CompiledGraphs(_step)
    generator = torch.Generator().manual_seed(0)
    batch, vocab, lengths = 4, 64, [4, 2, 0, 3]  # one bucket: 4 requests, 9 draft tokens
    cu = torch.tensor([0, 4, 6, 6, 9], dtype=torch.int64)
    outputs = []
    for step_index in range(3):  # new values every step, the same shapes
        rows = sum(lengths) + batch
        logits = torch.randn(rows, vocab, generator=generator)
        row_params = [(0.0, 0, 1.0), (0.8, 10, 0.9), (1.0, 0, 1.0), (0.5, 0, 0.7)]
        per_row = [row_params[r] for r, k in enumerate(lengths) for _ in range(k + 1)]
        temperature = torch.tensor([p[0] for p in per_row])
        top_k = torch.tensor([p[1] for p in per_row])
        top_p = torch.tensor([p[2] for p in per_row])
        draft_probs = torch.softmax(torch.randn(sum(lengths), vocab, generator=generator), -1)
        draft_tokens = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        greedy = torch.tensor([True, False, False, False])
        seeds, counters = torch.tensor([1, 2, 3, 4]), torch.full((batch,), step_index)
        args = (logits, temperature, top_k, top_p, draft_probs, draft_tokens, cu, greedy, seeds, counters)
        out = step(*args)
        assert torch.equal(out, _step(*args))  # the traced step computes what the eager one does
        outputs.append(out)
    assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
    step.close()
