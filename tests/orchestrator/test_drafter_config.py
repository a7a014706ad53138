"""Config of the trained-drafter tiers: `model: {feature_head: PATH}` / `model: {early_exit: PATH, ...}`."""

from __future__ import annotations

import pytest
import yaml

from polyspec.orchestrator.cli import main
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import ConfigError, ModelLoadError


def chain(family, *drafters, **sections):
    return {"tiers": [{"name": "target", "model": family["target"]}, *drafters], **sections}


def test_drafter_tiers_parse(tiny_drafters):
    config = parse_config(
        chain(
            tiny_drafters,
            {"name": "f", "model": {"feature_head": tiny_drafters["feature"]}},
            {"name": "e", "model": {"early_exit": tiny_drafters["early_exit"], "layers": 1, "exit_threshold": 0.4}},
        )
    )
    feature, early = config.tiers[1:]
    assert (feature.drafter, feature.model) == ("feature", tiny_drafters["feature"])
    assert (early.drafter, early.layers, early.exit_threshold) == ("early_exit", 1, 0.4)


BAD = {
    "threshold above 1": ({"early_exit": "E", "exit_threshold": 1.5}, "exit_threshold' must be a probability in [0, 1], got 1.5"),
    "threshold not a number": ({"early_exit": "E", "exit_threshold": "high"}, "exit_threshold' must be a number"),
    "layers zero": ({"early_exit": "E", "layers": 0}, "layers' must be >= 1"),
    "layers on a feature head": ({"feature_head": "F", "layers": 2}, "unknown config key 'tiers[1].model.layers'"),
    "both kinds": ({"feature_head": "F", "early_exit": "E"}, "exactly one of feature_head: PATH or early_exit: PATH"),
    "no kind": ({"path": "F"}, "exactly one of feature_head: PATH or early_exit: PATH"),
    "missing checkpoint": ({"feature_head": "/nowhere/head"}, "drafter checkpoint '/nowhere/head' is not a directory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_drafter_values_fail_in_one_line(tiny_drafters, case):
    model, message = BAD[case]
    model = {k: (tiny_drafters["feature"] if v == "F" else tiny_drafters["early_exit"] if v == "E" else v) for k, v in model.items()}
    with pytest.raises(ConfigError) as info:
        parse_config(chain(tiny_drafters, {"name": "d", "model": model}))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_drafter_placement_rules(tiny_drafters):
    feature = {"name": "f", "model": {"feature_head": tiny_drafters["feature"]}}
    early = {"name": "e", "model": {"early_exit": tiny_drafters["early_exit"]}}
    small = {"name": "small", "model": tiny_drafters["small"]}
    with pytest.raises(ConfigError, match="must be the second tier"):
        parse_config(chain(tiny_drafters, small, feature))
    with pytest.raises(ConfigError, match="runs in its target's Ray actor"):
        parse_config(chain(tiny_drafters, {**early, "resources": {"node_a": 1}}, runtime={"backend": "ray"}))
    assert parse_config(chain(tiny_drafters, early, runtime={"backend": "ray"})).tiers[1].drafter == "early_exit"
    with pytest.raises(ConfigError, match="verifies chains only"):
        parse_config(chain(tiny_drafters, feature, small, speculation={"tree_width": 2}))
    with pytest.raises(ConfigError, match="quantize the target instead"):
        parse_config(chain(tiny_drafters, {**early, "quantize": "int8"}))
    with pytest.raises(ConfigError, match="unknown config key 'tiers\\[1\\].exit_threshold'"):
        parse_config(chain(tiny_drafters, {**early, "exit_threshold": 0.5}))
    parse_config(chain(tiny_drafters, feature, small))  # a cheaper tier may draft for the head


def test_a_mismatched_checkpoint_fails_at_load_in_one_line(tiny_drafters):
    config = parse_config(chain(tiny_drafters, {"name": "e", "model": {"early_exit": tiny_drafters["early_exit"], "layers": 2}}))
    with pytest.raises(ModelLoadError, match="tier 'e': layers is 2 but the adapter .* first 1 layers"):
        Engine(config)


def test_validate_prints_one_line_for_a_bad_threshold(tiny_drafters, tmp_path, capsys):
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(chain(tiny_drafters, {"name": "e", "model": {"early_exit": tiny_drafters["early_exit"], "exit_threshold": -1}})))
    assert main(["validate", "-c", str(path)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exit_threshold' must be a probability" in err
    path.write_text(yaml.safe_dump(chain(tiny_drafters, {"name": "e", "model": {"early_exit": tiny_drafters["early_exit"], "exit_threshold": 0.3}})))
    assert main(["validate", "-c", str(path)]) == 0
    assert "early exit" in capsys.readouterr().out
    path.write_text(yaml.safe_dump(chain(tiny_drafters, {"name": "e", "model": {"early_exit": tiny_drafters["early_exit"]}}, runtime={"backend": "ray"})))
    assert main(["validate", "-c", str(path)]) == 0
    assert "node: its target's ('target'), in the target's actor" in capsys.readouterr().out


def test_the_planner_hears_the_early_exit_tiers_rounds(tiny_drafters):
    """With lengths: auto the goodput planner hears the early-exit tier's rounds (a block it stopped early counts
    as what it proposed, not as what it was asked for) and keeps the pair's acceptance."""
    early = {"name": "e", "model": {"early_exit": tiny_drafters["early_exit_noisy"], "exit_threshold": 0.9}}
    engine = Engine(parse_config(chain(tiny_drafters, early, speculation={"lengths": "auto"})))
    engine.scheduler.eos_token_ids = frozenset()
    result = engine.generate(engine.parse_request({"prompt": "def f(x):\n    return", "max_new_tokens": 24}))
    stage = result["stats"]["stages"][0]
    assert stage["blocks"] > 0
    assert (0, 1, True) in engine.scheduler.planner.acceptance.pairs()
