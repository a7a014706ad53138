"""The config file's `tuning:` section: typed knobs with one-line errors, handed to the goodput planner."""

from __future__ import annotations

import dataclasses

import pytest

from polyspec.orchestrator.config import TuningConfig, parse_config
from polyspec.workers.core.errors import ConfigError

TIERS = [{"name": "t", "model": "some/model"}, {"name": "n", "model": "ngram"}]


def config(tuning):
    return parse_config({"tiers": TIERS, "speculation": {"lengths": "auto"}, "tuning": tuning})


def test_the_section_is_optional_and_defaults_to_the_defaults():
    assert parse_config({"tiers": TIERS}).tuning == TuningConfig()
    assert config(None).tuning == TuningConfig()


def test_knobs_are_read_typed():
    tuning = config({"max_length": 6, "switch_hysteresis": 0, "allow_bypass": False, "decay": 1}).tuning
    assert tuning == dataclasses.replace(TuningConfig(), max_length=6, switch_hysteresis=0.0, allow_bypass=False, decay=1.0)
    assert isinstance(tuning.switch_hysteresis, float) and isinstance(tuning.decay, float)


@pytest.mark.parametrize("tuning, message", [
    ({"max_lenght": 6}, "unknown config key 'tuning.max_lenght' (did you mean 'max_length'? known keys: allow_bypass, decay,"),
    ({"max_length": 0}, "config key 'tuning.max_length' must be >= 1, got 0"),
    ({"max_length": 2.5}, "config key 'tuning.max_length' must be an integer, got 2.5"),
    ({"decay": 0}, "config key 'tuning.decay' must be > 0.0, got 0.0"),
    ({"decay": 1.5}, "config key 'tuning.decay' must be <= 1.0, got 1.5"),
    ({"switch_hysteresis": "small"}, "config key 'tuning.switch_hysteresis' must be a number, got 'small'"),
    ({"hysteresis": 0.1}, "unknown config key 'tuning.hysteresis' (did you mean 'switch_hysteresis'? known keys:"),
    ({"shadow": "yes"}, "config key 'tuning.shadow' must be true or false, got 'yes'"),
    ([4], "config section 'tuning' must be a mapping, got list"),
])
def test_mistakes_are_one_line_errors_naming_the_key(tuning, message):
    with pytest.raises(ConfigError) as error:
        config(tuning)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_planner_reads_its_knobs_from_the_config_and_keeps_them_frozen():
    from polyspec.orchestrator.tuning.options import goodput_options

    knobs = config({"max_length": 3, "explore_every": 8}).tuning
    assert goodput_options(knobs)["max_length"] == 3 and goodput_options(knobs)["explore_every"] == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        knobs.max_length = 5
