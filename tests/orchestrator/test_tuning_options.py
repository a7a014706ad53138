"""Every `tuning:` option reaches the planner that runs on its path, or is named in one line (tuning/options.py)."""

from __future__ import annotations

import dataclasses

from polyspec.orchestrator.config import TuningConfig, parse_config
from polyspec.orchestrator.tuning import options
from polyspec.orchestrator.tuning.batch_model import LOOKUP_PRIOR_RATE, MIN_STEPS, PRIOR_RATE, BatchPlanner

from tests.orchestrator.test_batch_model import accept, chain, run_steps, table

TIERS = [{"name": "t", "model": "some/model"}, {"name": "m", "model": "some/model"}, {"name": "n", "model": "ngram"}]


def tuning(section: dict, **extra) -> TuningConfig:
    return parse_config({"tiers": TIERS, "speculation": {"lengths": "auto"}, "tuning": section, **extra}).tuning


def goodput(section: dict, distributed: bool = False) -> BatchPlanner:
    """The goodput planner as Engine.make_planner builds it from a config's `tuning:` section."""
    return BatchPlanner(chain(), [table(lambda b, w: 10.0), table(lambda b, w: 1.0), None], [0.0, 0.0, 0.05],
                        **options.goodput_options(tuning(section), distributed))


def test_every_option_is_in_the_audit():
    fields = {f.name for f in dataclasses.fields(TuningConfig)} - {"given"}
    assert set(options._ALL) == fields == set(options.READS[False])
    assert set(options.READS[True]) == fields - {"allow_bypass", "shadow"}
    assert options.note(tuning({name: getattr(TuningConfig(), name) for name in fields}), options.GOODPUT) is None


def test_an_option_written_at_its_default_counts_as_set():
    written = tuning({"decay": 0.93, "max_length": 6})
    assert written == dataclasses.replace(TuningConfig(), max_length=6)  # (what was written is not compared)
    assert options.set_options(written) == ["max_length", "decay"]
    assert options.set_options(TuningConfig(explore_every=8)) == ["explore_every"]  # built in code: what differs


def test_a_ray_chain_names_the_options_about_tiers_left_out():
    line = options.note(tuning({"allow_bypass": True, "shadow": False, "decay": 0.9}), options.GOODPUT, distributed=True)
    assert line.startswith("tuning: allow_bypass, shadow set, but a Ray chain runs every tier in every round")
    assert "\n" not in line and line.endswith("it reads max_length, switch_hysteresis, decay, prior_mean, prior_strength, explore_every")
    assert options.note(tuning({"allow_bypass": True, "decay": 0.9}), options.GOODPUT) is None
    assert not options.goodput_options(tuning({"allow_bypass": True}), distributed=True)["allow_bypass"]


def test_with_fixed_lengths_no_planner_runs_and_the_section_is_named():
    assert options.planner_of(False, True, 3) is None and options.planner_of(True, False, 3) is None
    assert options.planner_of(True, True, 3) == options.GOODPUT and options.planner_of(True, True, 1) is None
    line = options.note(tuning({"max_length": 4}), None)
    assert line.startswith("tuning: max_length set, but no planner runs")
    assert options.note(TuningConfig(), None) is None


def test_decay_and_the_prior_reach_the_goodput_planner():
    """Unset, the planner keeps its own defaults; set, the acceptance starts at prior_mean with prior_strength's weight
    and fades by decay per round: after 20 rounds at 0.9 then 20 at 0.1, decay 0.5 has forgotten the first ones."""
    default = goodput({})
    assert default.rate(0, 1) == PRIOR_RATE and default.rate(0, 2) == LOOKUP_PRIOR_RATE
    set_prior = goodput({"prior_mean": 0.3, "prior_strength": 100.0})
    assert set_prior.rate(0, 1) == 0.3 and set_prior.rate(0, 2) == 0.3
    accept(set_prior, 0, 1, 0.9, rounds=20)
    assert set_prior.rate(0, 1) < 0.6  # 100 tokens of prior weigh against 20 rounds
    rates = {}
    for decay in (None, 0.5):  # (a light prior: the counts speak)
        plan = goodput({"prior_strength": 0.1, **({} if decay is None else {"decay": decay})})
        accept(plan, 0, 1, 0.9, rounds=20)
        accept(plan, 0, 1, 0.1, rounds=20)
        rates[decay] = plan.rate(0, 1)
    assert rates[0.5] < 0.3 < 0.6 < rates[None]


def test_switch_hysteresis_sets_the_gain_speculation_needs_to_be_switched_on():
    """A machine where speculating measures 1.2x off's tokens/s: by default (1.05x) the planner speculates;
    with switch_hysteresis 0.5 it stays off, but for its probes."""
    modest = lambda active: 120.0 if len(active) > 1 else 100.0
    shares = {}
    for section in ({}, {"switch_hysteresis": 0.5}):
        plan = goodput(section)
        accept(plan, 0, 1, 0.95)
        accept(plan, 1, 2, 0.9)
        speculated = run_steps(plan, 4, 300, modest)[2]
        shares[len(section)] = sum(speculated[-200:]) / 200
    assert shares[0] > 0.9 and shares[1] < 0.1
    assert goodput({"switch_hysteresis": 0.5}).switch_on == 1.5 and MIN_STEPS


def test_validate_names_what_the_planner_would_not_read(tmp_path, capsys):
    import yaml

    from polyspec.orchestrator.cli import main

    config = tmp_path / "chain.yaml"
    config.write_text(yaml.safe_dump({"tiers": TIERS, "speculation": {"lengths": "auto"}, "tuning": {"explore_every": 8}}))
    assert main(["validate", "-c", str(config), "--no-model-check"]) == 0
    assert "note:" not in capsys.readouterr().out
    config.write_text(yaml.safe_dump({"tiers": TIERS, "speculation": {"lengths": [2, 2]}, "tuning": {"explore_every": 8}}))
    assert main(["validate", "-c", str(config), "--no-model-check"]) == 0
    assert "note: tuning: explore_every set, but no planner runs" in capsys.readouterr().out
    config.write_text(yaml.safe_dump({"tiers": TIERS, "speculation": {"lengths": "auto"}, "tuning": {"hysteresis": 0.1}}))
    assert main(["validate", "-c", str(config), "--no-model-check"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'tuning.hysteresis' (did you mean 'switch_hysteresis'?" in err and err.count("\n") == 1
