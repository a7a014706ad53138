"""Pricing a tier whose forward changes regime at a row count: a weight-only tier's quantized kernel gives way to
its block path (workers/tiers/weight_only.py), so its cost has a kink or a step there. The start-up profile
measures on both sides of it (`switch_widths`) instead of interpolating
across it; checked on a synthetic cost curve, and through `profile_batched` on a tier whose forwards advance a fake clock by that curve."""

from __future__ import annotations

import types

import pytest
import torch

from polyspec.orchestrator.tuning.batch_model import BATCH_GRID, WIDTH_GRID, ForwardTable, switch_widths
from polyspec.orchestrator.tuning import profiler
from polyspec.orchestrator.tuning.profiler import monotone, profile_batched
from polyspec.workers.tiers import weight_only as wo
from polyspec.workers.tiers.tier import NGramTier

SWITCH = 48  # rows from which the block path runs


def cost(rows: int) -> float:
    """ms of a forward over `rows` rows: the kernel's steep line, then the block path's nearly flat one (a step down)."""
    return 0.5 * rows if rows < SWITCH else 6.0 + 0.01 * rows


def test_switch_widths_straddle_the_switch_inside_the_grid():
    assert switch_widths(4, (SWITCH,)) == (11, 12)  # 44 rows: the kernel, 48: the block path
    assert switch_widths(16, (SWITCH,)) == (2, 3)
    assert switch_widths(1, (SWITCH,)) == ()  # 48 rows are past batch 1's widest block
    assert switch_widths(64, (SWITCH,)) == ()  # every width of batch 64 is past the switch
    assert switch_widths(4, (SWITCH, 40)) == (9, 10, 11, 12)
    assert switch_widths(2, (16,)) == (7,)  # 8 is a grid width


def table_of(batches, switch_rows) -> ForwardTable:
    ms = {(b, w): cost(b * w) for b in BATCH_GRID for w in WIDTH_GRID}
    ms.update({(b, w): cost(b * w) for b in batches for w in switch_widths(b, switch_rows)})
    return ForwardTable(monotone(ms, switch_rows))


def test_the_batched_table_prices_both_sides_of_the_switch():
    """At every grid batch and width the estimate is the curve (it is linear on each side and measured on both); the
    grid alone put 44 rows at batch 4 (the kernel, 22 ms) between 32 rows (16 ms) and 64 rows (the block path)."""
    priced = table_of(BATCH_GRID, (SWITCH,))
    for b in BATCH_GRID:
        for w in range(1, WIDTH_GRID[-1] + 1):
            assert priced.estimate(b, w) == pytest.approx(cost(b * w)), (b, w)
    grid_only = ForwardTable({(b, w): cost(b * w) for b in BATCH_GRID for w in WIDTH_GRID})
    assert grid_only.estimate(4, 11) < 0.65 * cost(44)
    # forwards of a shape price it at their ratio to the profile, which keeps the profile's step at the switch around it
    priced.observe(4, 11, 2 * cost(44))
    priced.observe(4, 11, 2 * cost(44))
    assert priced.estimate(4, 11) == pytest.approx(2 * cost(44)) and priced.estimate(4, 12) == pytest.approx(2 * cost(48))


def test_monotone_does_not_carry_the_block_paths_price_below_the_switch():
    ms = {(b, w): cost(b * w) for b in BATCH_GRID for w in WIDTH_GRID}
    assert monotone(ms)[(4, 8)] < cost(32)  # the old rule: 32 rows priced as the block path's 64
    assert monotone(ms, (SWITCH,))[(4, 8)] == cost(32)
    noisy = {**ms, (4, 4): 2 * cost(16)}  # an outlier on the kernel's side is still smoothed away
    assert monotone(noisy, (SWITCH,))[(4, 4)] == cost(32)


class Clock:
    """A stand-in for `time.perf_counter` in the profiler: it moves only when a forward says it took time, so what the
    profile reads is exactly the cost curve (no wall-clock in the test)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedTier:
    """What profile_batched calls of a batched model tier; a forward takes `cost(rows)` ms on `clock`. As a BatchedModelTier's,
    its `model` is a forward, not a torch module; its loaded tier (`tier`) declares where its one weight-only Linear
    switches, at SWITCH rows (`Tier.switch_rows`, what the profile reads)."""

    name, has_weights, caches_prompts, profile_kind = "int4", True, True, "batched"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        linear = wo.WeightOnlyLinear.from_int4(wo.quantize_int4_groups(torch.randn(64, 64), 32), None)
        linear.dense_rows = SWITCH
        self.model = types.SimpleNamespace(layers=[(linear.forward,)])  # BatchedLlama keeps the modules' forwards
        self.tier = types.SimpleNamespace(switch_rows=wo.switch_rows(torch.nn.Sequential(linear)))
        self.forward_log: list = []
        self.rows_run: set[int] = set()

    def prefill(self, ids, contexts, tokens) -> None:
        pass

    def truncate(self, seq_id, length) -> None:
        pass

    def release(self, seq_id) -> None:
        pass

    def score_batch(self, ids, contexts, trees, params) -> None:
        rows = sum(len(tree) + 1 for tree in trees)  # a tail of one token and the block
        self.rows_run.add(rows)
        self.clock.now += cost(rows) / 1000.0


def test_profile_batched_measures_a_weight_only_tier_at_its_switch(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(profiler.time, "perf_counter", clock)
    tier = CostedTier(clock)
    assert tier.tier.switch_rows == (SWITCH,) and NGramTier("ngram", 100).switch_rows == ()
    (table,), _ = profile_batched([tier], vocab_size=100, max_batch=16, repeats=1)
    assert {44, 48} <= tier.rows_run and {32, 64} <= tier.rows_run  # 4 x 11 and 4 x 12 beside the grid's 4 x 8, 4 x 16
    assert sorted(w for b, w in table.ms if b == 4) == [1, 4, 8, 11, 12, 16]
    # the kernel's side at 44 rows is priced as the kernel, the block path's at 48 as the block path: not a mix
    assert table.estimate(4, 11) == pytest.approx(cost(44))
    assert table.estimate(4, 12) == pytest.approx(cost(48))


def test_switch_rows_near_one_another_are_priced_once():
    model = torch.nn.Sequential(*(wo.WeightOnlyLinear.from_int4(wo.quantize_int4_groups(torch.randn(64, 64), 32), None) for _ in range(5)))
    for module, rows in zip(model, (52, 56, 64, 72, wo.NEVER)):
        module.dense_rows = rows
    assert wo.switch_rows(model) == (52, 72)  # 56 and 64 within 1.25x of 52; a kernel-only Linear adds none
    assert wo.switch_rows(None) == () and wo.switch_rows(torch.nn.Linear(4, 4)) == ()


def test_between_grid_batches_the_table_reads_its_neighbours_at_the_same_rows():
    """Batch 8 x width 6 = 48 rows (the block path): read at equal widths, batch 4 x 6 (24 rows, the kernel) and
    16 x 6 (96 rows) mixed the two regimes, 60 % over; at equal rows (4 x 12, 16 x 3) both are on the block path's
    side. Over off-grid batches 2-48 and widths 1-16 the mean error is ~1 % (~24 % at equal widths); what is left is a
    neighbour whose rows fall between two of its widths across the switch (20 x 2: batch 16 at width 2.5)."""
    priced = table_of(BATCH_GRID, (SWITCH,))
    grid_only = ForwardTable({(b, w): cost(b * w) for b in BATCH_GRID for w in WIDTH_GRID})
    assert priced.estimate(8, 6) == pytest.approx(cost(48)) and grid_only.estimate(8, 6) > 1.5 * cost(48)
    cells = [(b, w) for b in (2, 3, 5, 6, 8, 10, 12, 20, 32, 48) for w in range(1, 17)]

    def mean_error(table: ForwardTable) -> float:
        return sum(abs(table.estimate(b, w) / cost(b * w) - 1) for b, w in cells) / len(cells)

    assert mean_error(priced) < 0.03 and mean_error(grid_only) > 0.2
    # a table without switch widths keeps reading its neighbours at the same width (exact for a bilinear cost)
    plain = ForwardTable({(b, w): 1.0 + b + 0.1 * b * w for b in BATCH_GRID for w in WIDTH_GRID})
    assert plain.estimate(8, 6) == pytest.approx(1.0 + 8 + 0.1 * 48)
