"""Latency profiles t_i(m) for the time model: measured at start-up, refined online.

Two tables per tier, both in milliseconds:

    forward_ms[m]  one verification round of the tier over m new tokens: `score` (ONE forward
                   over the last committed token + an (m-1)-token block, warp included) plus
                   the verification rule, i.e. exactly what ChainScheduler times per round
    draft_ms[k]    proposing a k-token block when the tier is the bottom of the chain:
                   k autoregressive forwards for a model (fitted through the origin,
                   `fit_proportional`), one lookup for the n-gram tier

`profile_batched` measures the batched decoder's table instead: one forward per (batch, width)
cell of batch_model's grid. Both read and write the on-disk cache of profile_cache.py when
given one, so a second start on the same machine measures nothing.

`profile_tiers` measures both at start-up through the tiers' own interface (median of a few
repeats at one representative context length; a few seconds for the demo chain), then fits
t(m) = a + b m through the medians (Theil-Sen: the median of pairwise slopes), because one
forward of a few ms is noisy on a shared CPU and the time model compares sizes with each other. During
generation the scheduler reports every round; `LatencyProfile.observe_*` folds them in with
an exponential moving average keyed by (tier, m), per set of tiers in use (see LatencyProfile). Sizes the chain has not run recently are
read from the start-up table times the tier's online slow-down factor (observed / start-up),
so a node that becomes slower moves every entry, not only the sizes it happens to run; the
table the time model reads is the same affine fit through those per-size estimates.
Observations are clipped to [1/3, 3] x the current estimate: a forward that re-feeds a long
tail (prefill, a tier coming back from bypass) must not pass for a slow node, while a node
that really slows down still moves the estimate by up to ~40 % per round.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import torch

from polyspec.orchestrator.tuning.batch_model import BATCH_GRID, PROFILE_CONTEXT, WIDTH_GRID, ForwardTable, switch_widths
from polyspec.orchestrator.tuning.profile_cache import decode_table, encode_table
from polyspec.orchestrator.tuning.time_model import latency
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedTier as Tier
from polyspec.workers.core.tree import DraftTree
from polyspec.workers.tiers.weight_only import switch_rows

OUTLIER_FACTOR = 3.0
DEFAULT_SMOOTHING = 0.2
DEFAULT_REPEATS = 5


@dataclasses.dataclass
class OnlineTable:
    """A start-up table (size -> ms) refined by an EMA per size and a tier-wide slow-down factor,
    or (`counts` not None: `LatencyProfile.restart_means`) by plain means since the restart."""

    base: dict[int, float]
    smoothing: float = DEFAULT_SMOOTHING
    online: dict[int, float] = dataclasses.field(default_factory=dict)
    scale: float = 1.0  # EMA of observed / start-up
    counts: dict[int, int] | None = None  # plain-mean mode: observations per size since the restart ...
    scale_count: int = 0  # ... and of the slow-down factor
    breaks: tuple[int, ...] = ()  # sizes where the tier's forward changes regime: the fit is affine between them (`fit_affine_pieces`)
    _fitted: dict[int, float] | None = dataclasses.field(default=None, repr=False, compare=False)  # table(), until the next observation

    def estimate(self, size: int) -> float:
        if size in self.online:
            return self.online[size]
        return latency(self.base, size) * self.scale if self.base else latency(self.online, size)

    def observe(self, size: int, ms: float) -> None:
        self._fitted = None
        if not self.base and not self.online:
            self.online[size] = ms
            return
        current = self.estimate(size)
        ms = min(max(ms, current / OUTLIER_FACTOR), current * OUTLIER_FACTOR)
        means = self.counts is not None
        if means:
            self.counts[size] = self.counts.get(size, 0) + 1
        self.online[size] = current + (1.0 / self.counts[size] if means else self.smoothing) * (ms - current)
        if self.base:
            ratio = ms / latency(self.base, size)
            self.scale_count += 1
            self.scale += (1.0 / self.scale_count if means else self.smoothing) * (ratio - self.scale)

    def restart_means(self) -> None:
        """From now on each size's estimate is the plain mean of the observations that follow
        (its first one replaces the estimate)."""
        self.counts, self.scale_count = {}, 0

    def table(self) -> dict[int, float]:
        """Every size known (start-up or online) -> the affine fit through the current estimates.
        (The tuner reads it several times per round: the fit is kept until the next observation.)"""
        if self._fitted is None:
            self._fitted = fit_affine_pieces({size: self.estimate(size) for size in sorted(set(self.base) | set(self.online))}, self.breaks)
        return dict(self._fitted)


Config = tuple[int, ...]  # the tiers in use (ChainScheduler.active); () = none in particular


@dataclasses.dataclass
class LatencyProfile:
    """Start-up tables per tier, refined online per (tier, tiers in use).

    On a shared CPU a tier's forward is slower when other tiers run between its forwards
    (they evict its weights from the caches): the demo target runs ~1.3x slower inside the
    full chain than next to the n-gram tier alone. So the online refinement is kept per set
    of tiers in use; a set not run yet reads the start-up table times the tier's mean
    slow-down in the sets that did run (conservative: no switch on optimism alone), except
    where no other tier of the set has weights (`weights`; the target with the n-gram tier):
    then nothing evicts the tier's and it reads the start-up table, measured alone
    (`_runs_alone`)."""

    names: list[str]
    forward: list[dict[int, float] | None]  # start-up forward_ms per tier (None: cannot verify)
    draft: list[dict[int, float] | None]  # start-up draft_ms per tier (None: cannot be the bottom)
    smoothing: float = DEFAULT_SMOOTHING
    online_forward: dict[tuple[int, Config], OnlineTable] = dataclasses.field(default_factory=dict)
    online_draft: dict[tuple[int, Config], OnlineTable] = dataclasses.field(default_factory=dict)
    plain_means: bool = False  # new online tables start in plain-mean mode (restart_means)
    weights: list[bool] | None = None  # per tier: runs model weights (False: the n-gram lookup); None: unknown, all do
    breaks: list[tuple[int, ...]] | None = None  # per tier: sizes where its forward changes regime (`tier_switch_rows`)

    def observe_forward(self, tier: int, new_tokens: int, ms: float, config: Config = ()) -> None:
        self._online(self.online_forward, self.forward, tier, config).observe(new_tokens, ms)

    def observe_draft(self, tier: int, num_tokens: int, ms: float, config: Config = ()) -> None:
        self._online(self.online_draft, self.draft, tier, config).observe(num_tokens, ms)

    def forward_ms(self, tier: int, config: Config = ()) -> dict[int, float]:
        return self._table(self.online_forward, self.forward, tier, config, "forward")

    def draft_ms(self, tier: int, config: Config = ()) -> dict[int, float]:
        return self._table(self.online_draft, self.draft, tier, config, "draft")

    def _online(self, online: dict, base: list, tier: int, config: Config) -> OnlineTable:
        table = online.get((tier, config))
        if table is None:
            breaks = self.breaks[tier] if self.breaks and base is self.forward else ()
            table = online[(tier, config)] = OnlineTable(dict(base[tier] or {}), self.smoothing, breaks=breaks)
            if self.plain_means:
                table.restart_means()
        return table

    def restart_means(self) -> None:
        """Every online table (and every one made later) becomes the plain mean of what is
        observed from now on (`polyspec tune`: one calibration pass's mean, not its last
        few forwards); `plain_means = False` makes new tables EMAs again."""
        self.plain_means = True
        for table in itertools.chain(self.online_forward.values(), self.online_draft.values()):
            table.restart_means()

    def _table(self, online: dict, base: list, tier: int, config: Config, kind: str) -> dict[int, float]:
        table = online.get((tier, config))
        if table is not None:
            return table.table()
        if base[tier] is None:
            raise KeyError(f"tier {self.names[tier]!r} has no {kind} profile")
        # a set of tiers not run yet: the start-up table, slowed down as much as this tier
        # runs slower than it in the sets that did run (a slower node slows them all), unless
        # it runs alone there
        scale = 1.0 if self._runs_alone(tier, config) else self._slowdown(online, tier)
        return {size: ms * scale for size, ms in base[tier].items()}

    def _runs_alone(self, tier: int, config: Config) -> bool:
        """No other tier of `config` has weights: nothing evicts this tier's between its forwards,
        as in the start-up profile. On the demo chain at T = 1 the target ran 1.37x its start-up
        t(1) in the full chain, 1.14x beside the n-gram tier alone; read at 1.37x, target + n-gram
        looked 10-20 % slower than it was, below the switch margin, and a fresh tuner stayed on
        the full chain through eight held-out prompts where target + n-gram ran 1.16x faster."""
        return self.weights is not None and bool(config) and not any(self.weights[t] for t in config if t != tier)

    def _slowdown(self, online: dict, tier: int) -> float:
        """The tier's mean online / start-up factor in the sets that ran it in this role; with
        none, in its other role (a model tier's drafts are its forwards too). Without that a
        middle tier that has only verified so far kept its start-up draft cost: in a fresh
        tuner on the demo chain, up to 1.5x less than it then measured inside the chain, so
        the chain without the bottom tier looked better than it is (by the 20 % switch
        margin), and the tuner dropped the n-gram tier and came back, over and over."""
        for tables in (online, self.online_draft if online is self.online_forward else self.online_forward):
            scales = [t.scale for (index, _), t in tables.items() if index == tier and t.base]
            if scales:
                return sum(scales) / len(scales)
        return 1.0

    def as_dict(self, config: Config = ()) -> list[dict]:
        out = []
        for i, name in enumerate(self.names):
            entry: dict = {"name": name}
            if self.forward[i] is not None:
                entry["forward_ms"] = {str(m): round(v, 4) for m, v in self.forward_ms(i, config).items()}
            if self.draft[i] is not None:
                entry["draft_ms"] = {str(k): round(v, 4) for k, v in self.draft_ms(i, config).items()}
            out.append(entry)
        return out


# ---------------------------------------------------------------------- start-up


def synthetic_context(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random context when no real prompt is at hand."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def fit_affine(points: dict[int, float]) -> dict[int, float]:
    """Theil-Sen fit of ms = a + b * size through `points`; the fitted value at every size.

    The slope is clipped at 0 (a longer block never makes a forward faster)."""
    sizes = sorted(points)
    if len(sizes) < 2:
        return dict(points)
    slopes = [(points[j] - points[i]) / (j - i) for i, j in itertools.combinations(sizes, 2)]
    slope = max(0.0, statistics.median(slopes))
    intercept = statistics.median(points[m] - slope * m for m in sizes)
    return {m: intercept + slope * m for m in sizes}


def fit_affine_pieces(points: dict[int, float], breaks: tuple[int, ...] = ()) -> dict[int, float]:
    """`fit_affine` on each run of sizes between `breaks` (sizes at which the forward changes regime: a weight-only
    tier's switch from its quantized kernel to the block path, `tier_switch_rows`), joined. One line through
    a kernel's steep segment and a block path's flat one prices both wrong."""
    edges = sorted(b for b in breaks if points and min(points) < b <= max(points))
    if not edges:
        return fit_affine(points)
    out: dict[int, float] = {}
    for piece in range(len(edges) + 1):
        low = edges[piece - 1] if piece else float("-inf")
        high = edges[piece] if piece < len(edges) else float("inf")
        out.update(fit_affine({m: ms for m, ms in points.items() if low <= m < high}))
    return dict(sorted(out.items()))


def tier_switch_rows(tier) -> tuple[int, ...]:
    """Row counts at which the tier's forward changes regime (weight_only.switch_rows of its model; none for a
    tier without one). A batched tier's `model` is its forward (BatchedLlama, not a torch module): the modules
    are its serial tier's model's (`tier.tier.model`), the same WeightOnlyLinear objects."""
    for model in (getattr(tier, "model", None), getattr(getattr(tier, "tier", None), "model", None)):
        if isinstance(model, torch.nn.Module):
            return switch_rows(model)
    return ()


def fit_proportional(points: dict[int, float]) -> dict[int, float]:
    """ms = b * size through `points` (b: the median of ms / size): a model drafter's k-token
    draft is k forwards. An affine fit through a handful of noisy medians can come out with a
    negative intercept (e.g. D(1) = 2.2 ms, D(8) = 25 ms); the online slow-down factor, which
    multiplies the whole table, then inflates the per-token cost of every unobserved k and a
    chain running k = 1 never learns that longer drafts pay."""
    if not points:
        return {}
    per_token = statistics.median(ms / size for size, ms in points.items())
    return {size: per_token * size for size in sorted(points)}


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
    tier.verify_batch([seq_id], [context], [DraftTree.chain(block, None)], [params], [generator])


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


def forward_sizes(tier_index: int, num_tiers: int, max_length: int, tree_width: int = 1) -> range:
    """Block sizes tier i can see: up to 2k+1 tokens when a middle tier below can overshoot."""
    has_middle_below = tier_index < num_tiers - 2
    largest = max(tree_width * max_length, 2 * max_length if has_middle_below else max_length) + 1
    return range(1, largest + 1)


def profile_tiers(
    tiers: list[Tier],
    context: list[int],
    params: SamplingParams,
    max_length: int,
    tree_width: int = 1,
    scheme: str = "specinfer",
    repeats: int = DEFAULT_REPEATS,
    cache=None,
    bar=None,
    log=None,
) -> LatencyProfile:
    """Measure every tier at start-up: forward_ms for the tiers that verify, draft_ms for the others.
    `cache` (profile_cache.ProfileCache): tiers measured before on this machine are read from it, the
    others written to it; `bar` (a tqdm): its total is set and it steps once per size measured;
    `log(line)`: where each tier's profile came from."""
    plans = []
    breaks = [tier_switch_rows(tier) for tier in tiers]  # a weight-only tier's forward: kernel, then block path
    for index, tier in enumerate(tiers):
        can_verify = tier.can_verify and index < len(tiers) - 1
        sizes = forward_sizes(index, len(tiers), max_length, tree_width) if can_verify else range(0)
        draft_sizes = range(1, max_length + 1) if index > 0 else range(0)
        measurement = {"kind": "serial", "index": index, "tiers": len(tiers), "sizes": list(sizes), "draft_sizes": list(draft_sizes),
                       "warp": [params.temperature, params.top_p, params.top_k], "tree_width": tree_width, "scheme": scheme,
                       "repeats": repeats, "context": len(context)}
        if breaks[index]:  # not the rows themselves: measured at each load, they move by a probe's noise (see profile_batched)
            measurement["switches"] = "weight_only"
        plans.append((sizes, draft_sizes, measurement, cache.get(index, measurement) if cache is not None else None))
    if bar is not None:
        bar.total = sum(len(sizes) + len(draft_sizes) for sizes, draft_sizes, _, hit in plans if hit is None)
        bar.refresh()
    tick = bar.update if bar is not None else None
    forward: list[dict[int, float] | None] = []
    draft: list[dict[int, float] | None] = []
    for index, (tier, (sizes, draft_sizes, measurement, hit)) in enumerate(zip(tiers, plans)):
        if hit is not None:
            forward.append(decode_table(hit["forward"]))
            draft.append(decode_table(hit["draft"]))
            if log is not None:
                log(f"tier {tier.name}: start-up profile read from the cache")
            continue
        started = time.perf_counter()
        forward.append(fit_affine_pieces(profile_forward(tier, context, sizes, params, repeats, tick), breaks[index]) if sizes else None)
        fit = fit_affine if tier.deterministic_drafts else fit_proportional  # a lookup costs about the same for any k
        draft.append(fit(profile_draft(tier, context, draft_sizes, params, tree_width, scheme, repeats, tick)) if draft_sizes else None)
        if cache is not None:
            cache.put(index, measurement, {"forward": encode_table(forward[-1]), "draft": encode_table(draft[-1])})
        if log is not None:
            log(f"tier {tier.name}: profiled in {time.perf_counter() - started:.1f}s")
    return LatencyProfile([t.name for t in tiers], forward, draft, weights=[t.has_weights for t in tiers], breaks=breaks)


def profile_batched(tiers, vocab_size: int, max_batch: int, repeats: int = 2, cache=None, bar=None,
                    log=None) -> tuple[list[ForwardTable | None], list[float]]:
    """Start-up tables: each model tier's forward on the (batch, width) grid, each lookup tier's ms per request.
    `cache` (profile_cache.ProfileCache), `bar` (a tqdm) and `log(line)` as for profile_tiers."""
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
    knots = []
    for index, tier in enumerate(tiers):
        rows = tier_switch_rows(tier)
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
        tables.append(ForwardTable(monotone(ms, tier_switch_rows(tier)), catch_up))
        if cacheable[index]:
            cache.put(index, measurements[index], {"ms": encode_table(tables[-1].ms), "catch_up": catch_up})
        if log is not None:
            log(f"tier {tier.name}: profiled in {time.perf_counter() - started_tier:.1f}s")
    for tier in tiers:
        tier.forward_log.clear()
    return tables, lookup


def _chains(tokens: list[int], count: int) -> list[DraftTree]:
    return [DraftTree.chain(tokens, None) for _ in range(count)]


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
