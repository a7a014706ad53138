"""The config file's `tuning:` section: typed knobs with one-line errors, handed to the tuner."""

from __future__ import annotations

import dataclasses

import pytest

from polyspec.orchestrator.config import TuningConfig, parse_config
from polyspec.orchestrator.decode.contract import StepInput
from polyspec.orchestrator.tuning.profiler import LatencyProfile
from polyspec.orchestrator.tuning.tuner import Tuner
from polyspec.workers.core.errors import ConfigError

TIERS = [{"name": "t", "model": "some/model"}, {"name": "n", "model": "ngram"}]


def config(tuning):
    return parse_config({"tiers": TIERS, "speculation": {"lengths": "auto"}, "tuning": tuning})


def test_the_section_is_optional_and_defaults_to_the_tuner_defaults():
    assert parse_config({"tiers": TIERS}).tuning == TuningConfig()
    assert config(None).tuning == TuningConfig()


def test_knobs_are_read_typed():
    tuning = config({"max_length": 6, "hysteresis": 0, "allow_bypass": False, "decay": 1}).tuning
    assert tuning == dataclasses.replace(TuningConfig(), max_length=6, hysteresis=0.0, allow_bypass=False, decay=1.0)
    assert isinstance(tuning.hysteresis, float) and isinstance(tuning.decay, float)


@pytest.mark.parametrize("tuning, message", [
    ({"max_lenght": 6}, "unknown config key 'tuning.max_lenght' (did you mean 'max_length'? known keys: allow_bypass, decay,"),
    ({"max_length": 0}, "config key 'tuning.max_length' must be >= 1, got 0"),
    ({"max_length": 2.5}, "config key 'tuning.max_length' must be an integer, got 2.5"),
    ({"decay": 0}, "config key 'tuning.decay' must be > 0.0, got 0.0"),
    ({"decay": 1.5}, "config key 'tuning.decay' must be <= 1.0, got 1.5"),
    ({"hysteresis": "small"}, "config key 'tuning.hysteresis' must be a number, got 'small'"),
    ({"shadow": "yes"}, "config key 'tuning.shadow' must be true or false, got 'yes'"),
    ([4], "config section 'tuning' must be a mapping, got list"),
])
def test_mistakes_are_one_line_errors_naming_the_key(tuning, message):
    with pytest.raises(ConfigError) as error:
        config(tuning)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_tuner_reads_its_knobs_from_the_config_and_keeps_them_frozen():
    profile = LatencyProfile(["t", "n"], forward=[{m: 10.0 + m for m in range(1, 10)}, None],
                             draft=[None, {k: 0.05 for k in range(1, 10)}])
    knobs = config({"max_length": 3, "warmup_rounds": 2}).tuning
    tuner = Tuner(profile, knobs, tree_width=1)
    assert tuner.config is knobs or tuner.config == knobs
    lengths, active = tuner.plan(StepInput((_greedy(),), (100,)))
    assert max(lengths) <= 3 and active[0] == 0  # the searches stay within max_length
    assert Tuner(profile, knobs, max_length=2).config.max_length == 2  # one knob overridden
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuner.config.max_length = 5
    with pytest.raises(TypeError):
        Tuner(profile, knobs, max_lenght=2)  # a misspelt knob is an error, not a new attribute


def _greedy():
    from polyspec.workers.core.sampling import SamplingParams

    return SamplingParams(temperature=0.0)
