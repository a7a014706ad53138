"""`polyspec tune` on the tiny family: the report's shape, the prompt file, user mistakes."""

from __future__ import annotations

import json

import pytest
import yaml

from orchestrator.cli import main


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
    assert set(report["tiers"][0]["forward_ms"]) >= {"1", "2", "5"}
    assert report["tiers"][0]["acceptance"]["drafter"] == "mid" and report["tiers"][2]["acceptance"] is None
    assert report["prompts"] == 2 and 0 <= report["summary"]["median_relative_error"]
    assert report["auto"]["measured_ms_per_token"] > 0 and report["auto"]["plans"]


def test_tune_table_with_builtin_prompts(config_path, capsys):
    assert main(["tune", "-c", config_path, "--grid-max", "1", "--temperature", "1", "-n", "6", "--max-prompts", "1", "--heldout-repeats", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "held-out pass 2/2" in captured.err
    assert "tuner's choice" in out and "without mid" in out and "median |predicted - measured|" in out
    assert "held out, lengths: auto with a tuner that has served the tuning prompts" in out


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


def test_split_prompts_runs_repetitive_code_in_the_shift_test_only(tmp_path):
    from orchestrator.tune import split_prompts

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

    from orchestrator.bench import measured_prompts, quick_subset, read_prompts
    from orchestrator.tune import split_prompts

    path = Path(__file__).resolve().parents[2] / "models" / "stdlib" / "prompts.jsonl"
    prompts = read_prompts(str(path))
    repetitive = {p.text for p in prompts if p.kind == "repetitive-code"}
    assert len(repetitive) >= 4
    sets = split_prompts(str(path), None, 8)
    assert set(sets.shift_code) <= repetitive and len(sets.shift_code) == 4
    assert not repetitive & set(sets.tuning + sets.heldout + sets.shift_prose)
    measured = measured_prompts(prompts)
    assert {p.kind for p in measured} == {"code", "prose"} and {p.kind for p in quick_subset(measured)} == {"code", "prose"}
