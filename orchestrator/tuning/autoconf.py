"""`dtype: auto` and `threads: auto`: chosen per machine from a short measurement.

Which dtype and thread count run a model fastest depends on the CPU, its BLAS and oneDNN
kernels and the model's shapes: on one Xeon with AMX-bf16, float32 beat bfloat16 (target
alone 1.16x, a 2-tier chain 1.9x) although the CPU computes bf16 natively, while on an EPYC
bf16 was 3x float32. So a tier set to `auto` is loaded in each candidate dtype and timed
through its own forward (one decode step plus one 8-token verification, the two shapes a
chain runs most) at each candidate thread count, and the fastest pair is kept. Candidates:
float32 and bfloat16 (float16 is slow on CPUs, so on a CPU it is never picked unless named);
1, 2, 4, ... threads up to the cores this process may use. The choice is cached with the
start-up profiles (profile_cache), so only the first start on a machine measures.
"""

from __future__ import annotations

import dataclasses
import os
import time

from polyspec.orchestrator.tuning.profile_cache import ProfileCache
from polyspec.orchestrator.tuning.profiler import profile_forward, synthetic_context

AUTO = "auto"
DTYPE_CANDIDATES = ("float32", "bfloat16")
MEASURED_SIZES = (1, 8)  # new tokens per forward: a decode step and a verified block
CONTEXT_TOKENS = 64
REPEATS = 3


def thread_candidates() -> list[int]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    counts, count = [], 1
    while count < cores:
        counts.append(count)
        count *= 2
    return [*counts, cores]


def needs_choice(tier) -> bool:
    return not tier.is_ngram and not tier.drafter and AUTO in (tier.dtype, tier.threads)


def resolve_auto(tiers, cache: ProfileCache | None = None, log=None) -> tuple:
    """The tiers with every `auto` replaced by the measured best (int8 tiers compute in float32:
    their dtype is float32 whatever was asked)."""
    from polyspec.workers.core.heartbeat import heartbeat
    from polyspec.workers.tiers.batched import BatchedModelTier
    from polyspec.workers.tiers.loading import load_model_tier

    resolved = []
    for index, tier in enumerate(tiers):
        if not needs_choice(tier):
            resolved.append(tier)
            continue
        dtypes = ("float32",) if tier.quantize == "int8" else DTYPE_CANDIDATES if tier.dtype == AUTO else (tier.dtype,)
        threads = thread_candidates() if tier.threads == AUTO else [tier.threads]
        measurement = {"kind": "autoconf", "dtypes": list(dtypes), "threads": threads, "sizes": list(MEASURED_SIZES),
                       "context": CONTEXT_TOKENS, "repeats": REPEATS}
        hit = cache.get(index, measurement) if cache is not None else None
        if hit is None:
            if log is not None:
                log(f"tier {tier.name}: measuring {' x '.join(map(str, dtypes))} at {', '.join(map(str, threads))} thread(s) "
                    "for auto (once per machine: the choice is cached)")
            started, timings = time.perf_counter(), {}
            for dtype in dtypes:
                with heartbeat(log, f"tier {tier.name}: measuring {dtype}"):
                    loaded = BatchedModelTier(load_model_tier(dataclasses.replace(tier, dtype=dtype, threads=threads[0])), max_slots=1)
                    context = synthetic_context(loaded.vocab_size, CONTEXT_TOKENS)
                    for count in threads:
                        loaded.threads = count
                        ms = profile_forward(loaded, context, list(MEASURED_SIZES), _greedy(), REPEATS)
                        timings[f"{dtype} x{count}"] = sum(ms.values())
                    del loaded
            best = min(timings, key=timings.get)
            hit = {"dtype": best.split(" x")[0], "threads": int(best.split(" x")[1]), "ms": timings}
            if cache is not None:
                cache.put(index, measurement, hit)
            if log is not None:
                measured = ", ".join(f"{name} {ms:.1f} ms" for name, ms in sorted(timings.items(), key=lambda item: item[1]))
                log(f"tier {tier.name}: auto -> {hit['dtype']}, {hit['threads']} thread(s) "
                    f"(decode + 8-token block: {measured}; measured in {time.perf_counter() - started:.1f}s)")
        elif log is not None:
            log(f"tier {tier.name}: auto -> {hit['dtype']}, {hit['threads']} thread(s) (measured before on this machine)")
        resolved.append(dataclasses.replace(tier, dtype=hit["dtype"], threads=hit["threads"]))
    return tuple(resolved)


def _greedy():
    from polyspec.workers.core.sampling import SamplingParams

    return SamplingParams()
