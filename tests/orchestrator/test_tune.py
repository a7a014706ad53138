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
    assert main(["tune", "-c", config_path, "--grid-max", "1", "--temperature", "1", "-n", "6", "--max-prompts", "1"]) == 0
    out = capsys.readouterr().out
    assert "tuner's choice" in out and "without mid" in out and "median |predicted - measured|" in out


def test_tune_user_mistakes(config_path, tmp_path, capsys):
    assert main(["tune", "-c", config_path, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "prompts file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert main(["tune", "-c", config_path, "--prompts", str(bad)]) == 2
    assert 'expected {"prompt": "..."}' in capsys.readouterr().err
    assert main(["tune", "-c", config_path, "--grid-max", "0"]) == 2
