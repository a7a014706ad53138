"""`polyspec tune` on the tiny family: the report's shape, the prompt file, user mistakes."""

from __future__ import annotations

import json

import pytest
import yaml

from polyspec.orchestrator.cli import main
from polyspec.harness.tune_report import format_report


@pytest.fixture(scope="module")
def config_path(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "chain.yaml"
    tiers = [{"name": "target", "model": tiny_family["target"]}, {"name": "mid", "model": tiny_family["mid"]}, {"name": "ng", "model": "ngram"}]
    path.write_text(yaml.safe_dump({"tiers": tiers, "speculation": {"lengths": "auto"}, "sampling": {"max_new_tokens": 8}}))
    return str(path)


def test_tune_json_report(config_path, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return x", "class": "code"}) + "\n\n" + json.dumps({"prompt": "for i in"}) + "\n")
    assert main(["tune", "-c", config_path, "--prompts", str(prompts), "--grid-max", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [entry["lengths"] for entry in report["grid"]] == [[1, 1], [1, 2], [2, 1], [2, 2]]
    for entry in report["grid"] + [report["chosen"], report["baseline"]] + report["bypass"]:
        assert entry["predicted_ms_per_token"] > 0 and entry["measured_ms_per_token"] > 0
    assert report["chosen"]["tiers"][0] == "target"
    assert [b["bypassed"] for b in report["bypass"]] == ["mid", "ng"]
    names = [tier["name"] for tier in report["tiers"]]
    assert names == ["target", "mid", "ng"]
    assert set(report["tiers"][0]["forward_ms"]) >= {"1", "4"} and report["tiers"][2]["lookup_ms"] > 0
    assert report["tiers"][0]["acceptance"]["drafter"] == "mid" and report["tiers"][2]["acceptance"] is None
    assert 0 < report["tiers"][0]["acceptance"]["rate"] < 1 and report["tiers"][0]["acceptance_skip"]["drafter"] == "ng"
    assert report["prompts"] == 2 and 0 <= report["summary"]["median_relative_error"]
    assert report["auto"]["measured_ms_per_token"] > 0 and report["auto"]["plans"]
    assert report["baseline"]["tiers"] == ["target"]
    # the table's code -> prose line, with and without a change of plan
    for rounds, expected in ((None, "16 prose rounds from round 9; no change of plan"), (3, "first change of plan after 3 rounds")):
        report["shift"] = {"prose_rounds": 16, "prose_from_round": 9, "rounds_to_first_change": rounds}
        assert expected in format_report(report)


def test_tune_table_with_builtin_prompts(config_path, capsys):
    assert main(["tune", "-c", config_path, "--grid-max", "1", "--temperature", "1", "-n", "6", "--max-prompts", "1", "--heldout-repeats", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "held-out pass 2/2" in captured.err
    assert "planner's choice" in out and "without mid" in out and "median |predicted - measured|" in out
    assert "held out, lengths: auto with a planner that has served the tuning prompts" in out


def test_tune_user_mistakes(config_path, tmp_path, capsys):
    assert main(["tune", "-c", config_path, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "prompts file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert main(["tune", "-c", config_path, "--prompts", str(bad)]) == 2
    assert 'expected {"prompt": "..."}' in capsys.readouterr().err
    assert main(["tune", "-c", config_path, "--grid-max", "0"]) == 2
    assert main(["tune", "-c", config_path, "--heldout-repeats", "0"]) == 2
    assert "--heldout-repeats must be >= 1" in capsys.readouterr().err
    assert main(["tune", "-c", config_path, "--heldout-prompts", "0"]) == 2
    assert "--heldout-prompts" in capsys.readouterr().err


def test_split_prompts_runs_repetitive_code_in_the_shift_test_only(tmp_path):
    from polyspec.harness.tune_prompts import split_prompts

    rows = [{"prompt": f"code {i}", "class": "code"} for i in range(12)] + [{"prompt": f"prose {i}", "class": "prose"} for i in range(6)]
    repetitive = [{"prompt": f"table {i}", "class": "repetitive-code"} for i in range(6)]
    plain, mixed = tmp_path / "plain.jsonl", tmp_path / "mixed.jsonl"
    plain.write_text("".join(json.dumps(row) + "\n" for row in rows))
    mixed.write_text("".join(json.dumps(row) + "\n" for row in rows[:5] + repetitive[:3] + rows[5:] + repetitive[3:]))
    expected_tables = {1: [0], 4: [0, 3], 6: [0, 2, 4], 8: [0, 1, 3, 4]}  # max(1, count // 2), evenly spaced
    for count, tables in expected_tables.items():
        before, after = split_prompts(str(plain), None, count), split_prompts(str(mixed), None, count)
        # the tuning, held-out and prose sets are the ones picked before the file had the class
        assert (after.tuning, after.heldout, after.shift_prose) == (before.tuning, before.heldout, before.shift_prose)
        assert not any(text.startswith("table") for text in after.tuning + after.heldout)
        # the shift test's code half: that class, evenly spaced (else held-out code prompts)
        assert after.shift_code == [f"table {i}" for i in tables]
        assert before.shift_code and all(text.startswith("code") and text in before.heldout for text in before.shift_code)


def test_shipped_prompts_keep_repetitive_code_out_of_tuning_and_bench():
    from pathlib import Path

    from polyspec.harness.bench_prompts import measured_prompts, quick_subset, read_prompts
    from polyspec.harness.tune_prompts import split_prompts

    path = Path(__file__).resolve().parents[2] / "models" / "stdlib" / "prompts.jsonl"
    prompts = read_prompts(str(path))
    repetitive = {p.text for p in prompts if p.kind == "repetitive-code"}
    assert len(repetitive) >= 4
    sets = split_prompts(str(path), None, 8)
    assert set(sets.shift_code) <= repetitive and len(sets.shift_code) == 4
    assert not repetitive & set(sets.tuning + sets.heldout + sets.shift_prose)
    wide = split_prompts(str(path), None, 8, heldout_prompts=16)  # polyspec tune's default held-out set
    assert wide.tuning == sets.tuning and len(set(wide.heldout)) == 16 and set(sets.heldout) <= set(wide.heldout)
    assert not (set(wide.heldout) & (set(wide.tuning) | repetitive))
    measured = measured_prompts(prompts)
    assert {p.kind for p in measured} == {"code", "prose"} and {p.kind for p in quick_subset(measured)} == {"code", "prose"}


def test_interleaved_pass_runs_every_item_on_a_prompt_before_the_next():
    """Per-prompt interleaving: each prompt is generated by every item (shuffled) before the
    next prompt; a Plan runs with no planner at its lengths / tiers, a planner is attached and
    keeps learning over the prompts in order; wall time and tokens add up per item."""
    import types

    from polyspec.harness.tune_measure import TuneSettings, interleaved_pass
    from polyspec.orchestrator.tuning.batch_model import Plan

    calls = []

    class Scheduler:
        planner = None
        lengths, active = [1, 1], (0, 1, 2)

        def generate(self, request):  # Engine.generate's, reading this scheduler's plan
            ids, seed = request.prompt_ids, request.seed
            who = self.planner.name if self.planner is not None else tuple(self.lengths)
            calls.append((who, ids[0], seed))
            if self.planner is not None:
                self.planner.seen.append(ids[0])
            tokens = 4 if who == (2, 2) else 2
            return {"stats": {"time_s": 0.01 * tokens * (1 + ids[0])}, "token_ids": [0] * tokens}

    class FakePlanner:
        def __init__(self, name):
            self.name, self.seen = name, []

    scheduler = Scheduler()
    engine = types.SimpleNamespace(scheduler=scheduler, generate=scheduler.generate)
    auto = FakePlanner("auto")
    items = [Plan((0, 1, 2), (2, 2)), Plan((0, 2), (3, 1)), auto]
    settings = TuneSettings(max_new_tokens=4, seed=7)
    results = interleaved_pass(engine, items, [[0], [1], [2]], settings, seed=0)
    assert [prompt for _, prompt, _ in calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [{who for who, prompt, _ in calls if prompt == p} for p in range(3)] == [{(2, 2), (3, 1), "auto"}] * 3
    assert all(seed == 7 + prompt for _, prompt, seed in calls)  # one seed per prompt for every item
    # another pass samples another realisation: new seeds, still one per prompt for every item
    first = {prompt: seed for _, prompt, seed in calls}
    calls.clear()
    interleaved_pass(engine, [Plan((0, 1, 2), (2, 2)), Plan((0, 2), (3, 1))], [[0], [1], [2]], settings, seed=1)
    again = {prompt: {seed for _, p, seed in calls if p == prompt} for prompt in range(3)}
    assert all(len(seeds) == 1 for seeds in again.values())
    assert len({first[p] for p in range(3)} | {next(iter(again[p])) for p in range(3)}) == 6
    assert auto.seen == [0, 1, 2] and engine.scheduler.planner is None
    # 2x2 plan: 4 tokens at 10 ms each x (1 + prompt) -> (40 + 80 + 120) ms / 12 tokens
    assert results[0].wall_ms == pytest.approx(20.0) and results[2].wall_ms == pytest.approx(20.0)
    orders = [tuple(who for who, prompt, _ in calls if prompt == p) for p in range(3)]
    assert len(set(orders)) > 1, "the order within a prompt is shuffled"


def test_each_pass_is_predicted_from_calibration_runs_interleaved_with_it():
    """measure(): the calibration items run inside each pass (per prompt, shuffled with the
    measured plans), their `after` hook sees only their own runs, `finish` ends the pass, and
    the pass's predictions are taken after it; the calibration runs are not measured."""
    import types

    from polyspec.harness.tune_measure import Pinned, TuneSettings, measure
    from polyspec.orchestrator.tuning.batch_model import Plan

    calls = []

    class Scheduler:
        planner = None
        lengths, active = [1, 1], (0, 1, 2)

        def generate(self, request):  # Engine.generate's, reading this scheduler's plan
            ids, seed = request.prompt_ids, request.seed
            pinned = isinstance(self.planner, Pinned) and self.planner.planner is calibrating
            calls.append(("cal" if pinned else "measured", ids[0]))
            return {"stats": {"time_s": 0.004}, "token_ids": [0] * 4}

    class FakePlanner:
        pass

    calibrating = FakePlanner()
    events = []
    fixed = [Plan((0, 1, 2), (2, 2)), Plan((0, 1, 2), (3, 1))]
    calibration_plans = [Plan((0, 1, 2), (6, 6)), Plan((0, 1, 2), (1, 1))]

    def calibration():
        events.append("start")
        return ([(plan, calibrating) for plan in calibration_plans], lambda index: events.append(("after", index)),
                lambda: events.append("finish"))

    def predict(repeat):
        events.append(("predict", repeat))
        return {"pass": repeat}

    scheduler = Scheduler()
    engine = types.SimpleNamespace(scheduler=scheduler, generate=scheduler.generate)
    settings = TuneSettings(max_new_tokens=4, repeats=2)
    measured, planners, predictions = measure(engine, fixed, [[0], [1]], settings, FakePlanner, lambda message: None,
                                              predict=predict, calibration=calibration)
    assert predictions == [{"pass": 0}, {"pass": 1}] and len(planners) == 2
    assert set(measured) == {*fixed, "auto"}  # the calibration runs are not measurements
    per_pass = events[: events.index(("predict", 0)) + 1]
    assert per_pass[0] == "start" and per_pass[-2:] == ["finish", ("predict", 0)]
    assert sorted(e for e in per_pass if isinstance(e, tuple) and e[0] == "after") == [("after", 0), ("after", 0), ("after", 1), ("after", 1)]
    # per prompt: both calibration runs among the measured ones (prompt 0's before prompt 1's)
    first = calls[: len(calls) // 2]
    assert [prompt for _, prompt in first] == [0] * 5 + [1] * 5
    assert sum(kind == "cal" for kind, _ in first) == 4


def test_heldout_report_keeps_each_pass_per_prompt_with_the_planners_plans(monkeypatch):
    """The held-out comparison reports every pass: each item's ms/token per prompt, and for a
    planner the plans it ran in each prompt (what a reader needs to see why auto lost a pass)."""
    import types

    from polyspec.harness import tune_measure
    from polyspec.harness.tune_measure import TuneSettings, measure_heldout
    from polyspec.orchestrator.tuning.batch_model import Plan

    class Scheduler:
        planner = None
        lengths, active = [1, 1], (0, 1, 2)

        def generate(self, request):  # Engine.generate's, reading this scheduler's plan
            ids, seed = request.prompt_ids, request.seed
            stats = {"time_s": 0.004 * (1 + ids[0])}
            if self.planner is not None:  # a planner's run: slower on prompt 1, where it switched plans
                stats["time_s"] *= 2 if ids[0] == 1 else 1
                stats["plans"] = [{"new_tokens": 0, "lengths": [1, 1], "tiers": ["t", "m", "n"]}]
                if ids[0] == 1:
                    stats["plans"].append({"new_tokens": 3, "lengths": [4, 2], "tiers": ["t", "m", "n"]})
            return {"stats": stats, "token_ids": [0] * 4}

    class FakePlanner:
        pass

    monkeypatch.setattr(tune_measure, "copy_planner", lambda planner: FakePlanner())
    scheduler = Scheduler()
    engine = types.SimpleNamespace(scheduler=scheduler, generate=scheduler.generate)
    settings = TuneSettings(max_new_tokens=4, heldout_repeats=2)
    report = measure_heldout(engine, Plan((0, 1, 2), (2, 2)), [[0], [1]], settings, FakePlanner, lambda message: None, warm_planner=FakePlanner())
    assert len(report["per_pass"]) == 2
    first = report["per_pass"][0]
    assert first["fixed"]["prompt_ms_per_token"] == [1.0, 2.0] and "plans" not in first["fixed"]
    assert first["auto"]["prompt_ms_per_token"] == [1.0, 4.0] and first["auto"]["ms_per_token"] == pytest.approx(2.5)
    assert first["auto"]["plans"][1] == [[0, [1, 1], ["t", "m", "n"]], [3, [4, 2], ["t", "m", "n"]]]
    assert report["auto_tokens_per_s_over_best"] == pytest.approx(1.5 / 2.5)


def test_heldout_ratio_pairs_each_pass_with_the_fixed_run_beside_it(monkeypatch):
    """The held-out ratio is the median over passes of (best grid point's ms / auto's ms) in the
    same pass, not the ratio of the two medians: passes 2x and 4x slower than the first (a
    machine's drift, or at T = 1 other sampled texts) with auto 1.25x slower than the fixed run
    in one pass only give 1.0 paired (two of three passes even) where the ratio of medians
    (2 / 2.5) would say 0.8."""
    import types

    from polyspec.harness import tune_measure
    from polyspec.harness.tune_measure import TuneSettings, measure_heldout
    from polyspec.orchestrator.tuning.batch_model import Plan

    pass_speed, auto_slowdown = [1.0, 2.0, 4.0], [1.0, 1.25, 1.0]
    pass_of_seed: dict[int, int] = {}  # one prompt: every item of a pass runs with the pass's own seed

    class Scheduler:
        planner = None
        lengths, active = [1, 1], (0, 1, 2)

        def generate(self, request):  # Engine.generate's, reading this scheduler's plan
            ids, seed = request.prompt_ids, request.seed
            repeat = pass_of_seed.setdefault(seed, len(pass_of_seed))
            ms = pass_speed[repeat] * (auto_slowdown[repeat] if self.planner is not None else 1.0)
            return {"stats": {"time_s": ms * 4 / 1000.0}, "token_ids": [0] * 4}

    class FakePlanner:
        pass

    monkeypatch.setattr(tune_measure, "copy_planner", lambda planner: FakePlanner())
    scheduler = Scheduler()
    engine = types.SimpleNamespace(scheduler=scheduler, generate=scheduler.generate)
    settings = TuneSettings(max_new_tokens=4, heldout_repeats=3)
    report = measure_heldout(engine, Plan((0, 1, 2), (2, 2)), [[0]], settings, FakePlanner, lambda message: None, warm_planner=FakePlanner())
    assert [p["auto"]["ms_per_token"] for p in report["per_pass"]] == pytest.approx([1.0, 2.5, 4.0])
    assert report["auto_tokens_per_s_over_best"] == pytest.approx(1.0)
    assert report["auto_ratio_of_medians"] == pytest.approx(0.8)
    assert report["warm_auto_tokens_per_s_over_best"] == pytest.approx(1.0) and report["warm_auto_ratio_of_medians"] == pytest.approx(0.8)
    assert len(pass_of_seed) == 3


def test_heldout_runs_a_fresh_and_a_warm_planner_without_changing_the_warm_one(tiny_family):
    from core_helpers import generate_alone

    from polyspec.harness.tune_measure import TuneSettings, copy_planner, measure_heldout
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tuning.batch_model import Plan

    tiers = [{"name": n, "model": "ngram" if n == "ngram" else tiny_family[n]} for n in ("target", "mid", "ngram")]
    engine = Engine(parse_config({"tiers": tiers, "speculation": {"lengths": "auto"}}))
    engine.scheduler.eos_token_ids = frozenset()
    warm = engine.scheduler.planner
    start = copy_planner(warm)
    assert start.tiers is warm.tiers  # a copy plans on the same tiers
    ids = [engine.parse_request({"prompt": p, "max_new_tokens": 8}).prompt_ids for p in ("def add(a, b):\n    return", "for i in")]
    settings = TuneSettings(max_new_tokens=8, grid_max=4, heldout_repeats=2)
    for prompt in ids:  # the warm planner serves other prompts first
        generate_alone(engine.scheduler, list(prompt), 8, settings.params(), seed=0)
    engine.scheduler.planner = None
    steps, history = {key: arm.steps for key, arm in warm.arms.items()}, list(warm.history)
    fresh = []

    def make_fresh():
        fresh.append(copy_planner(start))
        return fresh[-1]

    report = measure_heldout(engine, Plan((0, 1, 2), (3, 3)), ids, settings, make_fresh, lambda message: None, warm_planner=warm)
    assert len(fresh) == 2 and all(sum(arm.steps for arm in p.arms.values()) > 0 for p in fresh)  # one fresh planner per pass, each used
    assert ({key: arm.steps for key, arm in warm.arms.items()}, warm.history) == (steps, history)  # each pass ran a copy
    assert report["passes"] == 2 and report["warm_auto_ms_per_token"] > 0
