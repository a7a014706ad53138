"""What one n-gram draft call costs: `DeviceNGramTier` (the lookup as one tensor program over a token
buffer, graph-replayed on CUDA) against `BatchedNGramTier` (a Python index per request, on the host).

Decoding-like calls: every request's context grows by a few tokens between calls (a verdict's
accepted tokens and the next one), so both tiers sync only what is new. Prints ms per call at each
(batch, context); nothing is asserted.

    OMP_NUM_THREADS=1 python benchmarks/ngram_lookup.py [--device cuda] [--calls 50]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedNGramTier
from polyspec.workers.tiers.device_ngram import DeviceNGramTier
from polyspec.workers.tiers.tier import NGramTier

VOCAB = 1000
GROWTH = 4  # tokens a context gains between calls
COUNT = 6  # tokens asked for per request


def _context(rng: random.Random, length: int) -> list[int]:
    """Text-like: a small vocabulary with repeated phrases, so lookups find continuations."""
    phrases = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))] for _ in range(40)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(VOCAB)]
    return out[:length]


def ms_per_call(tier, batch: int, length: int, calls: int) -> float:
    rng = random.Random(0)
    contexts = [_context(rng, length) for _ in range(batch)]
    seq_ids = list(range(batch))
    args = ([COUNT] * batch, [SamplingParams()] * batch, [None] * batch)
    tier.draft_batch(seq_ids, contexts, *args)  # the prompts' first sync (and, on CUDA, the capture) are not timed
    total = 0.0
    for _ in range(calls):
        contexts = [c + [rng.randrange(VOCAB) for _ in range(GROWTH)] for c in contexts]
        started = time.perf_counter()
        tier.draft_batch(seq_ids, contexts, *args)
        total += time.perf_counter() - started
    for seq_id in seq_ids:
        tier.release(seq_id)
    return total / calls * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, {args.calls} calls, count {COUNT}, "
          f"+{GROWTH} tokens per call")
    print(f"{'batch':>5} {'context':>7} {'device tier ms':>14} {'host index ms':>13}")
    for batch in (1, 16, 64):
        for length in (128, 1024, 4000):
            calls_span = length + GROWTH * (args.calls + 1)
            device_tier = DeviceNGramTier(NGramTier("ngram", VOCAB), slots=batch, context=calls_span, device=args.device)
            host_tier = BatchedNGramTier(NGramTier("ngram", VOCAB))
            device_ms = ms_per_call(device_tier, batch, length, args.calls)
            host_ms = ms_per_call(host_tier, batch, length, args.calls)
            print(f"{batch:>5} {length:>7} {device_ms:>14.3f} {host_ms:>13.3f}")


if __name__ == "__main__":
    main()
