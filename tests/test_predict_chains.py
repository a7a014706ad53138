"""benchmarks/gpu/predict_chains.py: the report's shape, and its numbers against the time model's formula by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from polyspec.orchestrator.tuning.batch_model import INNER_LENGTHS, LENGTHS

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("predict_chains", ROOT / "benchmarks" / "gpu" / "predict_chains.py")
predict_chains = importlib.util.module_from_spec(_spec)
sys.modules["predict_chains"] = predict_chains  # dataclasses look their module up by name
_spec.loader.exec_module(predict_chains)

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("qwen2.5-coder-*.yaml") if len(predict_chains.chain_roles(p)[0]) > 1)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("predicted")
    written = predict_chains.main(["--out-dir", str(out)])
    assert json.loads((out / "predicted-chains.json").read_text()) == json.loads(json.dumps(written))
    return written | {"markdown": (out / "predicted-chains.md").read_text()}


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_every_shipped_chain_at_every_batch(report):
    rows = {(row["config"], row["batch"]): row for row in report["chains"]}
    assert set(rows) == {(config, batch) for config in CONFIGS for batch in predict_chains.BATCHES}
    for (config, batch), row in rows.items():
        assert positive(row["tokens_per_s"]) and positive(row["x_target"]), row
        assert row["tiers"][0] == "target" and len(row["lengths"]) == len(row["tiers"]) - 1
        if len(row["tiers"]) <= 3:  # the goodput model prices plans of up to 3 tiers
            assert positive(row["goodput_model_x_target"]), row
        else:
            assert row["goodput_model_x_target"] is None
        assert f"| {config.removeprefix('qwen2.5-coder-')} | {' <- '.join(row['tiers'])} |" in report["markdown"]
    assert rows[("qwen2.5-coder-4tier", 1)]["tiers"] == ["target", "fp8", "0.5B", "n-gram"]
    assert all(positive(v) for v in report["target_alone_tokens_per_s"].values())


def test_the_planner_picks_for_each_auto_config_and_batch(report):
    autos = [c for c in CONFIGS if c.endswith("-auto")]
    assert {(p["config"], p["batch"]) for p in report["planner"]} == {(c, b) for c in autos for b in predict_chains.BATCHES}
    rows = {(row["config"], row["batch"]): row for row in report["chains"]}
    for pick in report["planner"]:
        chosen = pick["pick"]
        assert chosen["tiers"][0] == "target"
        assert positive(pick["pick_goodput_x_target"]) and positive(pick["full_search_x_target"])
        assert all(k in (LENGTHS if i == 0 else INNER_LENGTHS) for i, k in enumerate(chosen["lengths"]))  # the planner's grid
        row = rows[(pick["config"], pick["batch"])]
        assert row["auto"] and (row["tiers"], row["lengths"]) == (chosen["tiers"], chosen["lengths"])


def test_rates_invert_expected_tokens(report):
    acceptance = report["acceptance"]
    assert acceptance["measurements"] and set(acceptance["rates"]) == {m["pair"] for m in acceptance["measurements"]}
    for m in acceptance["measurements"]:
        assert 0 < m["rate"] < 1
        # fitted_rate rounds to 4 digits; E moves by at most k (k + 1) / 2 per unit of rate
        assert abs(m["expected_tokens"] - (1 + m["mean_accepted"])) < 1e-4 * m["k"] * (m["k"] + 1)
    for by_k in report["claims"].values():
        assert list(by_k) == [str(k) for k in range(1, predict_chains.MAX_LENGTH + 1)] and all(map(positive, by_k.values()))


def expected_emitted(rate: float, k: int) -> float:
    """DESIGN.md §5: E(k) = (1 - a^(k+1)) / (1 - a)."""
    return (1 - rate ** (k + 1)) / (1 - rate)


def between(grid: dict, batch: int, low: int, high: int, width: int) -> float:
    """A ForwardTable's estimate between two grid widths of one batch: linear in the width."""
    lo, hi = grid[f"{batch}x{low}"], grid[f"{batch}x{high}"]
    return lo + (hi - lo) * (width - low) / (high - low)


@pytest.mark.parametrize("config, batch", [("qwen2.5-coder-ngram", 1), ("qwen2.5-coder-2tier", 16)])
def test_a_two_tier_row_is_the_time_model_by_hand(report, config, batch):
    """C_0 = (t_0(B, k + 1) + draft(B, k)) / E(k) for a 2-tier chain at k = 4, batch B; tokens/s = B / C_0
    and x target = t_0(B, 1) / C_0. The lookup drafts for B x its ms; the 0.5B a 2-token forward, then
    k - 1 one-token forwards."""
    row = next(r for r in report["chains"] if r["config"] == config and r["batch"] == batch)
    costs, rates = report["costs"], report["acceptance"]["rates"]
    target = costs["models"]["target"]["grid_ms"]
    k = row["lengths"][0]
    assert k == 4
    verify_ms = between(target, batch, 4, 8, k + 1)
    if config.endswith("ngram"):
        draft_ms, rate = batch * costs["lookup_ms_per_request"], rates["target<-n-gram"]
    else:
        small = costs["models"]["0.5B"]["grid_ms"]
        draft_ms, rate = between(small, batch, 1, 4, 2) + (k - 1) * small[f"{batch}x1"], rates["target<-0.5B"]
    ms_per_token = (verify_ms + draft_ms) / expected_emitted(rate, k)
    assert row["tokens_per_s"] == pytest.approx(batch * 1000.0 / ms_per_token, rel=2e-3)
    assert row["x_target"] == pytest.approx(target[f"{batch}x1"] / ms_per_token, rel=2e-3)


def test_costs_measured_on_a_gpu_replace_the_reference(tmp_path):
    """A reference.py JSON's cell is taken as measured and scales the target's other cells; device-round.json's
    drafter step becomes the 0.5B's one-token forward."""
    reference = {"shape": "benchmarks/gpu/shapes/qwen2.5-coder-1.5b.json", "weight_bytes": 3.09e9, "copy_GBps": 4170.0,
                 "steps": [{"batch": 1, "width": 1, "eager_ms": 14.0, "graph_ms": 6.6}]}
    device_round = {"one_request": {"ms_per_token": 6.6}, "steps": {"drafter_draft_step_ms": 4.62}}
    (tmp_path / "reference-1.5b.json").write_text(json.dumps(reference))
    (tmp_path / "device-round.json").write_text(json.dumps(device_round))
    written = predict_chains.main(["--costs", str(tmp_path / "reference-1.5b.json"), str(tmp_path / "device-round.json"),
                                   str(tmp_path / "absent.json"), "--out-dir", str(tmp_path)])
    models = written["costs"]["models"]
    assert len(written["cost_files"]) == 2
    assert models["target"]["grid_ms"]["1x1"] == 6.6 and models["target"]["grid_ms"]["64x1"] == pytest.approx(8.0)  # 4.00 x 2
    assert models["0.5B"]["grid_ms"]["1x1"] == 4.62 and "device-round.json drafter_draft_step_ms" in models["0.5B"]["source"]
    assert models["fp8"]["source"].startswith("ESTIMATE")
    assert written["target_alone_tokens_per_s"]["1"] == pytest.approx(1000.0 / 6.6, rel=1e-3)
