"""`polyspec bench` on the tiny family: the report's schema, its systems, greedy equality, the outputs.

No timing is asserted: tokens/s on a shared test machine says nothing.
"""

from __future__ import annotations

import json

import pytest

from polyspec.harness.bench import BenchSettings, markdown_table, run_bench, write_outputs
from polyspec.harness.bench_prompts import QUICK_PROMPTS, BenchPrompt, cut_points, quick_subset
from polyspec.orchestrator.cli import main
from polyspec.orchestrator.config import parse_config

PROMPTS = [
    BenchPrompt("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "code"),
    BenchPrompt("The cache keeps the most recent entries and", "prose"),
]
SETTINGS = BenchSettings(max_new_tokens=12, temperatures=(0.0, 1.0), repeats=1, warmup=False)
ROW_KEYS = {"system", "temperature", "tokens_per_s", "speedup_vs_target", "mean_accepted_length", "greedy_equal"}
MACHINE_KEYS = {"cpu", "cores", "threads", "torch", "transformers", "python", "dtype", "date"}


def chain_config(family) -> dict:
    return {
        "tiers": [
            {"name": "target", "model": family["target"]},
            {"name": "int8", "model": family["target"], "quantize": "int8"},
            {"name": "small", "model": family["small"]},
            {"name": "ngram", "model": "ngram"},
        ],
        "speculation": {"lengths": [4, 3, 2]},
    }


@pytest.fixture(scope="module")
def report(tiny_family):
    return run_bench(parse_config(chain_config(tiny_family)), PROMPTS, SETTINGS, "inline")


def test_report_schema(report):
    assert MACHINE_KEYS <= set(report["machine"])
    assert report["machine"]["threads"] == 1
    assert report["config"]["tiers"][1]["quantize"] == "int8"
    for row in report["results"]:
        assert ROW_KEYS <= set(row)
        assert row["tokens_per_s"] > 0
    json.dumps(report)  # JSON-ready as is


def test_every_system_runs_at_both_temperatures(report):
    expected = {
        "target",
        "hf-generate",
        "hf-assisted:int8",
        "hf-assisted:small",
        "hf-prompt-lookup",
        "polyspec:target+int8",
        "polyspec:target+small",
        "polyspec:target+ngram",
        "polyspec:target+int8+small+ngram",
    }
    for temperature in (0.0, 1.0):
        systems = {row["system"].removesuffix("@auto") for row in report["results"] if row["temperature"] == temperature}
        assert systems == expected | {"hf-assisted:int8@k4", "hf-assisted:small@k3"}
        auto = {row["system"] for row in report["results"] if row["temperature"] == temperature and row["system"].endswith("@auto")}
        assert auto == {name + "@auto" for name in expected if name.startswith("polyspec:")}  # lengths: auto, the goodput planner
    assert [s["system"] for s in report["skipped"]] == ["hf-assisted:ngram"]


def test_greedy_outputs_equal_the_target(report):
    greedy = [row for row in report["results"] if row["temperature"] == 0.0]
    assert all(row["greedy_equal"] is True for row in greedy if row["system"].startswith("polyspec:"))
    assert next(row for row in greedy if row["system"] == "hf-generate")["greedy_equal"] is True
    assert all(row["greedy_equal"] is None for row in report["results"] if row["temperature"] == 1.0)


def test_accepted_lengths_per_stage(report):
    rows = {(row["system"], row["temperature"]): row for row in report["results"]}
    assert set(rows[("polyspec:target+int8+small+ngram", 0.0)]["mean_accepted_length"]) == {"target<-int8", "int8<-small", "small<-ngram"}
    assert rows[("hf-generate", 0.0)]["mean_accepted_length"] is None
    assert rows[("target", 0.0)]["speedup_vs_target"] == 1.0


def test_outputs_are_written(report, tmp_path):
    paths = [tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"]
    write_outputs(report, *map(str, paths))
    assert json.loads(paths[0].read_text())["results"] == report["results"]
    assert "| polyspec:target+ngram | 0 |" in paths[1].read_text()
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
    assert "Skipped hf-assisted:ngram" in markdown_table(report)


def test_cut_points_fall_after_headers_and_docstrings():
    source = 'import os\n\n\ndef f(x):\n    """Doc."""\n    a = 1\n    b = 2\n    c = 3\n    return a\n\n\ndef g(): return 1\n'
    assert cut_points(source) == [5]


def test_quick_subset_keeps_every_class():
    prompts = [BenchPrompt(str(i), "code") for i in range(10)] + [BenchPrompt("p", "prose")] * 3
    kinds = [p.kind for p in quick_subset(prompts)]
    assert kinds.count("code") == QUICK_PROMPTS["code"] and kinds.count("prose") == QUICK_PROMPTS["prose"] == 2


def test_cli_reports_a_missing_prompts_file(tiny_family, tmp_path, capsys):
    config = tmp_path / "chain.yaml"
    config.write_text(json.dumps(chain_config(tiny_family)))
    assert main(["bench", "-c", str(config), "--prompts", str(tmp_path / "nope.jsonl"), "--json", str(tmp_path / "o.json")]) == 2
    assert "prompts file not found" in capsys.readouterr().err


def test_quick_leaves_out_the_auto_chains():
    import argparse

    from polyspec.harness.bench import settings_from_args

    args = argparse.Namespace(threads=1, max_new_tokens=None, repeats=None, temperature=None, quick=True)
    assert settings_from_args(args).tuned is False
    assert settings_from_args(argparse.Namespace(**{**vars(args), "quick": False})).tuned is True
