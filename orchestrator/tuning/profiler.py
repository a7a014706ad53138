"""Start-up timings: the goodput planner's batched table, and one tier's serial rounds.

`profile_batched` measures what the goodput planner (batch_model.BatchPlanner) reads: one forward per
(batch, width) cell of batch_model's grid for each model tier, a lookup tier's ms per request. It reads
and writes the on-disk cache of profile_cache.py when given one, so a second start on the same machine
measures nothing.

`profile_forward` and `profile_draft` time one request's verification rounds over m new tokens and its
proposals of k tokens through the tier's own interface (median of a few repeats): what `threads: auto` /
`dtype: auto` compare (autoconf.py) and realbench reports.
"""

from __future__ import annotations

import statistics
import time

import torch

from polyspec.orchestrator.tuning.batch_model import BATCH_GRID, PROFILE_CONTEXT, WIDTH_GRID, ForwardTable, switch_widths
from polyspec.orchestrator.tuning.profile_cache import decode_table, encode_table
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedTier as Tier
from polyspec.workers.core.tree import Blocks

DEFAULT_REPEATS = 5


# ---------------------------------------------------------------------- start-up


def synthetic_context(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random context when no real prompt is at hand."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def _median_ms(run, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


def _verify_round(tier: Tier, seq_id, context: list[int], block: list[int], params: SamplingParams, generator) -> None:
    """What ChainScheduler.round_batch does for a chain block: score, then the verification rule (a lookup's block:
    point masses)."""
    tier.verify_batch([seq_id], [context], Blocks.of_chains([block], [None]), [params], [generator])


class ProgressLines:
    """A progress bar for a log (stderr not a terminal): a line at most every `every_s` seconds
    with the share done and an estimate of the rest, so a long profile is never a silent stretch.
    The calls a profile makes of a tqdm bar: `total`, `refresh()`, `update(n)`."""

    def __init__(self, log, every_s: float = 5.0) -> None:
        self.log, self.every_s = log, every_s
        self.total, self.done = 0, 0
        self.started = self.shown = time.perf_counter()

    def refresh(self) -> None:
        pass

    def update(self, steps: int = 1) -> None:
        self.done += steps
        now = time.perf_counter()
        if now - self.shown >= self.every_s and self.total:
            self.shown = now
            left = (now - self.started) / self.done * max(0, self.total - self.done)
            self.log(f"profile: {self.done}/{self.total} sizes measured, about {left:.0f}s left")


def _ticking(measure, tick):
    """`measure()`, then `tick()` (a progress bar's step) when there is one."""
    value = measure()
    if tick is not None:
        tick()
    return value


def profile_forward(tier: Tier, context: list[int], sizes: range, params: SamplingParams, repeats: int = DEFAULT_REPEATS,
                    tick=None) -> dict[int, float]:
    """forward_ms[m] for m in `sizes`: median of `repeats` rounds at len(context) committed tokens
    (`tick()` after each size: a progress bar)."""
    seq_id = ("profile-forward", id(tier))
    generator = torch.Generator().manual_seed(0)
    filler = context[-max(sizes) :] if len(context) >= max(sizes) else (context * max(sizes))[: max(sizes)]
    try:
        _verify_round(tier, seq_id, context, filler[:1], params, generator)  # prefill, not timed
        return {m: _ticking(lambda: _median_ms(lambda: _verify_round(tier, seq_id, context, filler[: m - 1], params, generator), repeats),
                            tick) for m in sizes}
    finally:
        tier.release(seq_id)


def profile_draft(
    tier: Tier, context: list[int], sizes: range, params: SamplingParams, tree_width: int = 1, scheme: str = "specinfer", repeats: int = DEFAULT_REPEATS,
    tick=None,
) -> dict[int, float]:
    """draft_ms[k] for k in `sizes`: proposing a k-token chain (or a width x k tree)."""
    seq_id = ("profile-draft", id(tier))
    generator = torch.Generator().manual_seed(0)

    def propose(k: int) -> None:
        if tree_width > 1:
            tier.draft_tree_batch([seq_id], [context], tree_width, [k], [params], scheme, [generator])
        else:
            tier.draft_batch([seq_id], [context], [k], [params], [generator])

    try:
        propose(1)  # prefill, not timed
        return {k: _ticking(lambda: _median_ms(lambda: propose(k), repeats), tick) for k in sizes}
    finally:
        tier.release(seq_id)


def profile_batched(tiers, vocab_size: int, max_batch: int, repeats: int = 2, cache=None, bar=None,
                    log=None) -> tuple[list[ForwardTable | None], list[float]]:
    """Start-up tables: each model tier's forward on the (batch, width) grid, each lookup tier's ms per request.
    `cache` (profile_cache.ProfileCache): tiers measured before on this machine are read from it, the others
    written to it; `bar` (a tqdm): its total is set and it steps once per cell measured; `log(line)`: where
    each tier's table came from."""
    generator = torch.Generator().manual_seed(0)
    tables: list[ForwardTable | None] = []
    lookup: list[float] = []
    batches = [b for b in BATCH_GRID if b <= max(max_batch, 1)] or [1]
    measurement = {"kind": "batched", "batches": batches, "widths": list(WIDTH_GRID), "repeats": repeats,
                   "context": PROFILE_CONTEXT, "vocab": vocab_size}
    # a tier that catches up inside its calls is timed against the others' caches: measured every time
    cacheable = [cache is not None and tier.has_weights and tier.caches_prompts for tier in tiers]
    # a device tier's steps (static shapes, graph-replayed on CUDA) cost what the ragged forward's do not
    measurements = [dict(measurement, kind=tier.profile_kind) for tier in tiers]
    # a weight-only tier leaves its quantized kernel for the block path at some row counts: its forward is also
    # measured on both sides of each (ForwardTable interpolates between all widths measured at a batch)
    switches = [tier.tier.switch_rows for tier in tiers]  # (the loaded tier's: `Tier.switch_rows`)
    knots = []
    for index, rows in enumerate(switches):
        knots.append({b: switch_widths(b, rows) for b in batches})
        if rows:  # a table with switch widths; not keyed by the rows themselves, which each load measures again and which
            # move by a probe's noise: a cached table's switch widths stay cells measured on this machine, a few rows off at worst
            measurements[index]["switches"] = "weight_only"
    hits = [cache.get(index, measurements[index]) if cacheable[index] else None for index in range(len(tiers))]
    if bar is not None:
        bar.total = sum(len(batches) * len(WIDTH_GRID) + sum(map(len, extra.values()))
                        for tier, hit, extra in zip(tiers, hits, knots) if tier.has_weights and hit is None)
        bar.refresh()
    for index, tier in enumerate(tiers):
        context = torch.randint(1, vocab_size, (PROFILE_CONTEXT,), generator=generator).tolist()
        if hits[index] is not None:
            lookup.append(0.0)
            tables.append(ForwardTable(decode_table(hits[index]["ms"]), hits[index]["catch_up"]))
            if log is not None:
                log(f"tier {tier.name}: start-up profile read from the cache")
            continue
        started_tier = time.perf_counter()
        if not tier.has_weights:
            started = time.perf_counter()
            for _ in range(8):
                tier.draft_batch([("profile", index)], [context], [8], [SamplingParams()], [None])
            lookup.append((time.perf_counter() - started) / 8 * 1000.0)
            tier.release(("profile", index))
            tables.append(None)
            continue
        lookup.append(0.0)
        ms: dict[tuple[int, int], float] = {}
        ids = [("profile", index, r) for r in range(max(batches))]
        tier.prefill(ids, [context] * len(ids), PROFILE_CONTEXT * len(ids))
        warm = False
        for b in batches:
            for w in sorted(WIDTH_GRID + knots[index][b]):
                best = float("inf")
                for _ in range(repeats + (0 if warm else 1)):  # the very first run warms up
                    for seq_id in ids[:b]:
                        tier.truncate(seq_id, PROFILE_CONTEXT - 1)
                    started = time.perf_counter()  # a tail of 1 token and a block of w - 1: w new positions per row
                    tier.score_batch(ids[:b], [context] * b, _chains(context[1:w], b), [SamplingParams()] * b)
                    best = min(best, (time.perf_counter() - started) * 1000.0)
                ms[(b, w)] = best
                warm = True
                if bar is not None:
                    bar.update(1)
        for other in tiers:  # a drafter's calls may open sequences in the tier it reads from (a feature head's target)
            for seq_id in ids:
                other.release(seq_id)
        catch_up = None
        if not tier.caches_prompts:  # it catches up inside its next call: time one on a fresh context the caching tiers hold
            fresh = ("profile", index, len(ids))
            for other in tiers:
                if other.has_weights and other.caches_prompts:
                    other.prefill([fresh], [context], PROFILE_CONTEXT)
            started = time.perf_counter()
            tier.draft_batch([fresh], [context], [1], [SamplingParams()], [None])
            catch_up = (time.perf_counter() - started) * 1000.0 / PROFILE_CONTEXT
            for other in tiers:
                other.release(fresh)
        tier.forward_log.clear()
        for b in BATCH_GRID:  # beyond the largest batch profiled: proportional to the rows
            if b not in batches:
                for w in WIDTH_GRID:
                    ms[(b, w)] = ms[(batches[-1], w)] * b / batches[-1]
        tables.append(ForwardTable(monotone(ms, switches[index]), catch_up))
        if cacheable[index]:
            cache.put(index, measurements[index], {"ms": encode_table(tables[-1].ms), "catch_up": catch_up})
        if log is not None:
            log(f"tier {tier.name}: profiled in {time.perf_counter() - started_tier:.1f}s")
    for tier in tiers:
        tier.forward_log.clear()
    return tables, lookup


def _chains(tokens: list[int], count: int) -> Blocks:
    return Blocks.of_chains([tokens] * count, [None] * count)


def monotone(ms: dict[tuple[int, int], float], switch_rows: tuple[int, ...] = ()) -> dict[tuple[int, int], float]:
    """A forward never gets cheaper with more rows or more tokens: each cell becomes the smallest
    measurement at or beyond it, so one slow outlier (a busy machine) cannot dent the table. Along the
    widths of a batch that includes its switch widths (`switch_widths`); along the batches, the grid's.
    Except across a switch (`switch_rows`: where a weight-only tier's kernel gives way to its block path,
    a forward of more rows may really cost less): no cell takes a cheaper one from the other side."""
    def same_side(rows: int, more: int) -> bool:
        return not any(rows < switch <= more for switch in switch_rows)

    out = dict(ms)
    for b in BATCH_GRID:
        widths = sorted(w for batch, w in out if batch == b)
        for w, nxt in reversed(list(zip(widths, widths[1:]))):
            if same_side(b * w, b * nxt):
                out[(b, w)] = min(out[(b, w)], out[(b, nxt)])
    for w in WIDTH_GRID:
        for b in reversed(BATCH_GRID[:-1]):
            nxt = BATCH_GRID[BATCH_GRID.index(b) + 1]
            if same_side(b * w, nxt * w):
                out[(b, w)] = min(out[(b, w)], out[(nxt, w)])
    return out
