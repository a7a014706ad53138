"""A start-up that explains itself: a line per tier as it loads, the `lengths: auto` profile
cached on disk per tier and machine (a second start reads it; `--reprofile` measures again),
and load / prefill / decode times in the summary line and the stats."""

from __future__ import annotations

import dataclasses
import json

import pytest

from polyspec.orchestrator.chain_args import models_config
from polyspec.orchestrator.cli import main
from polyspec.orchestrator.tuning.profile_cache import ProfileCache, tier_key


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    folder = tmp_path / "profiles"
    monkeypatch.setenv("POLYSPEC_PROFILE_CACHE", str(folder))
    return folder


def _chain(tiny_family) -> list[str]:
    return ["generate", "-m", tiny_family["target"], "--draft", tiny_family["mid"], "--ngram", "--threads", "1",
            "-p", "import os", "-n", "8"]


def test_generate_says_what_it_loads_and_how_long_each_part_took(tiny_family, profile_dir, capsys):
    assert main(_chain(tiny_family)) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("polyspec: tier ")]
    assert [line.split(":")[1].strip() for line in lines] == ["tier target", "tier target", "tier draft", "tier draft"]
    assert f"loading {tiny_family['target']} (float32, 1 thread, auto)" in lines[0]
    assert "loaded in" in lines[1] and "on cpu" in lines[1] and "MB resident" in lines[1]
    summary = err[-1]
    for part in ("tokens", "tok/s", "load ", "prefill ", "decode ", "finish="):
        assert part in summary, summary
    assert main([*_chain(tiny_family), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["load_s"] > 0 and stats["prefill_s"] > 0 and stats["decode_s"] >= 0
    assert stats["prefill_s"] + stats["decode_s"] <= stats["time_s"] + 0.5


def test_auto_lengths_profile_is_cached_per_tier_and_reused(tiny_family, profile_dir, capsys):
    assert main([*_chain(tiny_family), "--lengths", "auto"]) == 0
    first = capsys.readouterr().err
    assert first.count("profiled in") == 2 and "read from the cache" not in first
    assert len(list(profile_dir.glob("*.json"))) == 2  # target, draft (the ngram tier's lookup is timed every time)
    assert main([*_chain(tiny_family), "--lengths", "auto"]) == 0
    second = capsys.readouterr().err
    assert second.count("start-up profile read from the cache") == 2 and "profiled in" not in second
    assert main([*_chain(tiny_family), "--lengths", "auto", "--reprofile"]) == 0
    assert capsys.readouterr().err.count("profiled in") == 2


def test_a_cached_profile_is_the_one_measured(tiny_family, profile_dir):
    from polyspec.orchestrator.engine import Engine

    config = models_config(tiny_family["target"], [tiny_family["mid"]], True)
    config = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, lengths="auto"))
    one = Engine(config, cache_profiles=True).scheduler.planner
    cached = Engine(config, cache_profiles=True).scheduler.planner
    assert [t.ms if t else None for t in cached.tables] == [t.ms if t else None for t in one.tables]
    batched = Engine(config, cache_profiles=True, batched=True).scheduler.planner
    again = Engine(config, cache_profiles=True, batched=True).scheduler.planner
    assert [t.ms if t else None for t in again.tables] == [t.ms if t else None for t in batched.tables]


def test_the_cache_key_follows_what_changes_timings(tiny_family, tmp_path):
    config = models_config(tiny_family["target"], [], False)
    tier = config.tiers[0]
    measurement = {"kind": "serial", "sizes": [1, 2]}
    key = tier_key(tier, measurement)
    assert key == tier_key(tier, dict(measurement))
    for changed in (dataclasses.replace(tier, threads=2), dataclasses.replace(tier, dtype="bfloat16"),
                    dataclasses.replace(tier, device="cpu"), dataclasses.replace(tier, model=tiny_family["mid"])):
        assert tier_key(changed, measurement) != key
    assert tier_key(tier, {"kind": "serial", "sizes": [1, 2, 3]}) != key
    cache = ProfileCache(config.tiers, directory=tmp_path)
    cache.put(0, measurement, {"forward": [[1, 2.5]]})
    assert cache.get(0, measurement) == {"forward": [[1, 2.5]]}
    assert ProfileCache(config.tiers, refresh=True, directory=tmp_path).get(0, measurement) is None
    (next(tmp_path.glob("*.json"))).write_text("{torn")
    assert cache.get(0, measurement) is None  # a torn file is measured again, not an error


def test_a_profile_in_a_log_reports_progress_every_few_seconds(monkeypatch):
    from polyspec.orchestrator.tuning import profiler

    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5])
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(clock))
    lines: list[str] = []
    progress = profiler.ProgressLines(lines.append, every_s=5.0)  # started at 0
    progress.total = 8
    for _ in range(4):  # at 1 s (quiet), 6 s (a line), 7 s (quiet), 12.5 s (a line)
        progress.update(1)
    assert lines == ["profile: 2/8 sizes measured, about 18s left", "profile: 4/8 sizes measured, about 12s left"]


def test_a_long_start_up_step_says_it_is_still_going():
    import time

    from polyspec.workers.core.heartbeat import heartbeat

    lines: list[str] = []
    with heartbeat(lines.append, "tier target: loading", every_s=0.05):
        time.sleep(0.4)  # ~8 beats; a busy machine may delay some, never add any
    assert 2 <= len(lines) <= 8 and all(line.startswith("tier target: loading: still at it after ") for line in lines)
    count = len(lines)
    time.sleep(0.15)
    assert len(lines) == count  # silent once the step is over
    with heartbeat(None, "nothing"):  # no log: no thread
        pass


def test_tiers_with_the_same_tokenizer_files_read_them_once(tiny_family, monkeypatch):
    from polyspec.orchestrator.config import parse_config
    from polyspec.workers.tiers import loading

    read: list[str] = []
    real = loading.load_tokenizer
    monkeypatch.setattr(loading, "load_tokenizer", lambda model, name: read.append(name) or real(model, name))
    same = parse_config({"tiers": [{"name": "target", "model": tiny_family["target"]}, {"name": "mid", "model": tiny_family["mid"]}]})
    tiers, tokenizer = loading.load_tiers(same.tiers)
    assert read == ["target"] and tokenizer is not None and len(tiers) == 2  # mid ships the target's files
    read.clear()
    other = parse_config({"tiers": [{"name": "target", "model": tiny_family["target"]},
                                    {"name": "other", "model": tiny_family["other_vocab"]}]})
    with pytest.raises(Exception, match="vocabular"):  # a different vocabulary is still read, and refused
        loading.load_tiers(other.tiers)
    assert read == ["target", "other"]
