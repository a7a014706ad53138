"""`dtype: auto` / `threads: auto`: measured once per machine through the tier's own forward,
the fastest candidate kept, the choice cached with the start-up profiles."""

from __future__ import annotations

import pytest

from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.tuning import autoconf
from polyspec.orchestrator.tuning.profile_cache import ProfileCache
from polyspec.workers.core.errors import ConfigError


def test_auto_is_a_config_value_and_needs_the_local_runtime(tiny_family):
    config = parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], "dtype": "auto", "threads": "auto"},
                                     {"name": "n", "model": "ngram"}]})
    assert (config.tiers[0].dtype, config.tiers[0].threads) == ("auto", "auto")
    assert autoconf.needs_choice(config.tiers[0]) and not autoconf.needs_choice(config.tiers[1])
    with pytest.raises(ConfigError, match="threads' must be >= 1 or auto"):
        parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], "threads": 0}]})
    with pytest.raises(ConfigError, match="need runtime.backend: local"):
        parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], "dtype": "auto"}], "runtime": {"backend": "ray"}})


def test_the_fastest_measured_candidate_is_kept_and_cached(tiny_family, tmp_path, monkeypatch):
    monkeypatch.setattr(autoconf, "thread_candidates", lambda: [1, 2])
    config = parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], "dtype": "auto", "threads": "auto"},
                                     {"name": "m", "model": tiny_family["mid"], "threads": "auto", "dtype": "bfloat16"}]})
    cache = ProfileCache(config.tiers, directory=tmp_path)
    lines: list[str] = []
    chosen = autoconf.resolve_auto(config.tiers, cache, lines.append)
    assert chosen[0].dtype in ("float32", "bfloat16") and chosen[0].threads in (1, 2)
    assert (chosen[1].dtype, chosen[1].threads in (1, 2)) == ("bfloat16", True)  # a named dtype stays
    measured = cache.get(0, {"kind": "autoconf", "dtypes": ["float32", "bfloat16"], "threads": [1, 2], "sizes": [1, 8],
                             "context": autoconf.CONTEXT_TOKENS, "repeats": autoconf.REPEATS})
    assert set(measured["ms"]) == {"float32 x1", "float32 x2", "bfloat16 x1", "bfloat16 x2"}
    assert f"{chosen[0].dtype} x{chosen[0].threads}" == min(measured["ms"], key=measured["ms"].get)
    assert any("auto -> " in line and "measured in" in line for line in lines)

    def no_load(*args, **kwargs):
        raise AssertionError("a cached choice loads nothing")

    monkeypatch.setattr("polyspec.workers.tiers.loading.load_model_tier", no_load)
    lines.clear()
    assert autoconf.resolve_auto(config.tiers, cache, lines.append) == chosen
    assert all("measured before on this machine" in line for line in lines) and len(lines) == 2


def test_engine_and_cli_run_with_auto(tiny_family, tmp_path, monkeypatch, capsys):
    from polyspec.orchestrator.cli import main

    monkeypatch.setenv("POLYSPEC_PROFILE_CACHE", str(tmp_path))
    monkeypatch.setattr(autoconf, "thread_candidates", lambda: [1])
    args = ["generate", "-m", tiny_family["target"], "--draft", tiny_family["mid"], "-p", "import os", "-n", "6", "--json"]
    assert main([*args, "--dtype", "auto", "--threads", "auto"]) == 0
    assert "auto -> " in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse: usage and one error line
        main(["generate", "-m", tiny_family["target"], "-p", "x", "--threads", "many"])
    assert exited.value.code == 2 and "--threads: must be a number of threads or auto, got 'many'" in capsys.readouterr().err
