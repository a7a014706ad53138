"""benchmarks/planner.py's pure parts: the question file, the requests it sends, which fixed configs an -auto
config is judged against, and the judged ratios (no model runs: the demo smoke test runs the CLI)."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("planner_bench", ROOT / "benchmarks" / "planner.py")
planner = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = planner  # dataclasses look their module up by name
_spec.loader.exec_module(planner)


def test_the_question_file_has_every_workload_in_question_jsonl_format():
    rows = [json.loads(line) for line in planner.QUESTIONS.read_text().splitlines() if line.strip()]
    assert collections.Counter(r["category"] for r in rows) == {w: 8 for w in planner.WORKLOADS}
    assert len({r["question_id"] for r in rows}) == len(rows)
    for row in rows:
        assert row["turns"] and all(isinstance(turn, str) and turn for turn in row["turns"])
        assert row["mode"] == ("completion" if row["category"] == "code" else "chat") and row["source"]


def test_each_qwen_auto_config_is_judged_against_the_fixed_configs_of_its_own_tiers():
    systems = list(planner.FAMILIES["qwen"].systems)
    by_name = {s.name: s for s in systems}
    own = {auto: {s.name.replace("qwen2.5-coder-", "") for s in planner.own_fixed(by_name[auto], systems)}
           for auto in ("qwen2.5-coder-3tier-auto", "qwen2.5-coder-4tier-auto")}
    assert own["qwen2.5-coder-3tier-auto"] == {"ngram", "2tier", "3tier"}
    assert own["qwen2.5-coder-4tier-auto"] == {"ngram", "2tier", "3tier", "int8", "int8-3tier", "int8-0.5b", "4tier"}
    assert [s.name for s in systems if s.auto] == ["qwen2.5-coder-3tier-auto", "qwen2.5-coder-4tier-auto"]


def test_chat_turns_go_as_messages_and_code_as_a_plain_prompt():
    chat, code = {"question_id": 9, "mode": "chat", "turns": ["Hi?", "More."]}, {"question_id": 1, "mode": "completion", "turns": ["def f():"]}
    assert planner.request(chat, planner.FAMILIES["qwen"]) == {"id": "q9", "messages": [{"role": "user", "content": "Hi?"}]}
    assert planner.request(code, planner.FAMILIES["qwen"]) == {"id": "q1", "prompt": "def f():"}
    demo = planner.FAMILIES["demo"]  # no chat template, a 512-token context: plain prompts, clipped
    long_chat = {**chat, "turns": ["x" * 5000]}
    assert planner.request(long_chat, demo) == {"id": "q9", "prompt": "x" * demo.clip_chars}


def _run(system: str, rate: float, ids=(1, 2)) -> dict:
    return {"system": system, "workload": "code", "concurrency": 1, "tokens_per_s": rate, "token_ids": {"q1": list(ids)},
            "generated_tokens": 2, "stages": [], "plans": None}


def test_the_auto_ratio_is_over_the_best_fixed_config_of_its_tiers_and_the_target():
    family = planner.FAMILIES["demo"]
    meta = {"systems": [s.name for s in family.systems], "workloads": ["code"], "concurrency": [1]}
    runs = [_run("target", 10.0), _run("demo", 20.0), _run("demo-2tier", 30.0), _run("demo-auto", 19.5),
            _run("demo-2tier-auto", 12.0, ids=(1, 3))]
    result = planner.report(runs, meta, family)
    judged = result["cells"][0]["auto"]
    assert judged["demo-auto"]["best_fixed_of_its_tiers"] == "demo"  # demo-2tier's small model is not one of its tiers
    assert judged["demo-auto"]["x_best_fixed_of_its_tiers"] == 0.975 and judged["demo-auto"]["meets_bars"]
    assert judged["demo-2tier-auto"]["x_best_fixed_of_its_tiers"] == 0.4 and not judged["demo-2tier-auto"]["meets_bars"]
    assert result["cells"][0]["rows"]["demo-2tier-auto"]["greedy_equals_target"] is False
    assert result["summary"]["demo-auto"] == {"cells": 1, "cells_meeting_bars": 1, "lowest_x_best_fixed": 0.975, "lowest_x_target": 1.95}


def test_a_divergence_at_a_rounding_tie_keeps_the_bar_and_one_past_it_does_not():
    family = planner.FAMILIES["demo"]
    meta = {"systems": [s.name for s in family.systems], "workloads": ["code"], "concurrency": [1]}
    runs = [_run("target", 10.0), _run("demo", 20.0), _run("demo-2tier", 15.0), _run("demo-auto", 19.5, ids=(1, 3)),
            _run("demo-2tier-auto", 15.0, ids=(1, 4))]
    ties = {("code", 1, "demo-auto"): {"q1": {"token": 1, "logit_gap": 0.125, "dtype": "bfloat16", "tie": True}},
            ("code", 1, "demo-2tier-auto"): {"q1": {"token": 1, "logit_gap": -0.5, "dtype": "bfloat16", "tie": False}}}
    result = planner.report(runs, meta, family, ties)
    rows, judged = result["cells"][0]["rows"], result["cells"][0]["auto"]
    assert rows["demo-auto"]["greedy_equal_up_to_ties"] and "(a tie)" in rows["demo-auto"]["greedy_equals_target"]
    assert judged["demo-auto"]["meets_bars"]
    assert not rows["demo-2tier-auto"]["greedy_equal_up_to_ties"] and not judged["demo-2tier-auto"]["meets_bars"]


def test_a_second_turn_continues_after_the_target_alones_first_answer():
    question = {"question_id": 9, "mode": "chat", "turns": ["Hi?", "More."]}
    runs = [{"system": "target", "workload": "chat", "concurrency": 4, "texts": {"q9": "late"}},
            {"system": "target", "workload": "chat", "concurrency": 1, "texts": {"q9": "Hello."}}]
    rows = planner.cell_rows(planner.SECOND_TURNS, {"chat": [question]}, planner.FAMILIES["qwen"], runs)
    assert rows == [{"id": "q9t2", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                                                {"role": "user", "content": "More."}]}]
    assert planner.cell_rows(planner.SECOND_TURNS, {"chat": [question]}, planner.FAMILIES["qwen"], []) is None


def test_a_runs_stages_are_summed_over_every_request():
    """The 'accepted per block' column: each (tier, drafter) pair's accepted tokens over its blocks in all the run's
    requests (not the first request's alone), the pairs in the order they first ran, their lengths merged."""
    from polyspec.harness.batch_bench import run_stages

    def result(*stages):  # as StageStats.as_dict writes them (proposed and the per-count blocks only feed other reports)
        keys = ("tier", "drafter", "blocks", "accepted", "lengths", "proposed", "accepted_counts")
        return {"stats": {"stages": [dict(zip(keys, s)) for s in stages]}}

    results = [result(("target", "small", 7, 22, [4], 28, [0, 1, 1, 2, 3]), ("small", "ngram", 28, 2, [4], 40, [26, 2])),
               result(("small", "ngram", 10, 30, [4, 8], 40, [0, 0, 0, 10]), ("target", "small", 3, 12, [6], 18, [0, 0, 0, 0, 3]),
                      ("target", "ngram", 0, 0, [], 0, []))]
    assert run_stages(results) == [
        {"tier": "target", "drafter": "small", "blocks": 10, "mean_accepted_length": 3.4, "lengths": [4, 6]},
        {"tier": "small", "drafter": "ngram", "blocks": 38, "mean_accepted_length": round(32 / 38, 4), "lengths": [4, 8]},
        {"tier": "target", "drafter": "ngram", "blocks": 0, "mean_accepted_length": 0.0, "lengths": []}]


def test_the_benchmark_process_is_pinned_to_the_runs_cpus():
    """The greedy check's target forward runs in the benchmark's own process: `--taskset` pins it as it pins the runs."""
    import subprocess

    cpu = min(os.sched_getaffinity(0))
    code = ("import os, torch; from polyspec.harness.batch_bench import pin_here; "
            f"pin_here('{cpu}-{cpu}'); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [f"[{cpu}]", "1"]
