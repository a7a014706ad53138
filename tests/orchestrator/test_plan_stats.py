"""The planner's decisions are visible: per request, each plan it ran under (chain and lengths) with the planner's
predicted and the measured tokens/s, in the result's stats; the `tuning:` options a path does not read named at start."""

from __future__ import annotations

import math

import pytest

from family_chains import tier_specs
from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.decode.contract import PlanTally, chain_label, note_plan, note_round, plan_records
from polyspec.orchestrator.engine import Engine

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in",
           "x = [1, 2, 3]\ny = ["]
MAX_NEW = 24


def test_a_plans_record_sums_its_rounds():
    plans: list[dict] = []
    note_plan(plans, 0, [4], ["target", "ngram"])
    note_round(plans, 3, 0.5, 8.0)
    note_round(plans, 1, 0.25, 2.0)
    note_plan(plans, 4, [4], ["target", "ngram"])  # the same plan: the same record
    note_round(plans, 2, 0.25, None)  # a round without a prediction counts in the measured rate only
    note_plan(plans, 6, [], ["target"])
    note_round(plans, 1, 0.5, 2.0)
    first, second = plan_records(plans)
    assert first == {"new_tokens": 0, "tiers": ["target", "ngram"], "lengths": [4], "rounds": 3, "tokens": 6, "seconds": 1.0,
                     "measured_tokens_per_s": 6.0, "predicted_tokens_per_s": round((8.0 * 0.5 + 2.0 * 0.25) / 0.75, 3)}
    assert second["measured_tokens_per_s"] == 2.0 and second["predicted_tokens_per_s"] == 2.0
    tally = PlanTally()
    tally.add([first, second])
    tally.add([first])
    totals = tally.as_dict()
    assert totals["target<-ngram"]["rounds"] == 6 and totals["target<-ngram"]["measured_tokens_per_s"] == 6.0
    assert totals["target"] == {"rounds": 1, "tokens": 1, "seconds": 0.5, "measured_tokens_per_s": 2.0, "predicted_tokens_per_s": 2.0}
    assert chain_label(["t", "m", "n"]) == "t<-m<-n"


def check_plans(result: dict) -> list[dict]:
    """Every plan record: rounds, tokens and seconds positive, measured = tokens / seconds, a positive prediction;
    their tokens are the request's."""
    plans = result["stats"]["plans"]
    assert plans and plans[0]["new_tokens"] == 0
    for plan in plans:
        assert plan["rounds"] > 0 and plan["tokens"] > 0 and plan["seconds"] > 0, plan
        assert math.isclose(plan["measured_tokens_per_s"], plan["tokens"] / plan["seconds"], rel_tol=1e-3, abs_tol=2e-3), plan
        assert plan["predicted_tokens_per_s"] > 0, plan
    assert sum(plan["tokens"] for plan in plans) == len(result["token_ids"])
    assert [plan["new_tokens"] for plan in plans] == [sum(p["tokens"] for p in plans[:i]) for i in range(len(plans))]
    return plans


@pytest.mark.parametrize("batched", [False, True])
def test_each_plan_a_request_ran_under_carries_its_predicted_and_measured_tokens_per_s(tiny_family, batched, capsys):
    """One request at a time and batched, both planned by the goodput planner; a `tuning:` option it reads is not
    named on stderr when the engine starts."""
    raw = {"tiers": tier_specs(tiny_family, ["target", "mid", "ngram"]), "speculation": {"lengths": "auto"},
           "tuning": {"decay": 0.9}}
    engine = Engine(parse_config(raw), batched=batched)
    assert "tuning:" not in capsys.readouterr().err  # an option it reads is not named
    engine.scheduler.eos_token_ids = frozenset()
    requests = [engine.parse_request({"prompt": p, "max_new_tokens": MAX_NEW, "id": str(i)}) for i, p in enumerate(PROMPTS)]
    results = []
    run_requests(engine, requests, results.append, max_requests=4 if batched else 1)
    assert len(results) == len(PROMPTS)
    names = [tier.name for tier in engine.tiers]
    for result in results:
        for plan in check_plans(result):  # the target, then tiers of the chain in order
            assert plan["tiers"][0] == names[0] and plan["tiers"] == sorted(plan["tiers"], key=names.index)


def write_config(path, tiny_family, lengths, tuning: dict) -> str:
    import yaml

    path.write_text(yaml.safe_dump({"tiers": tier_specs(tiny_family, ["target", "mid", "ngram"]), "speculation": {"lengths": lengths},
                                    "sampling": {"max_new_tokens": 16}, "tuning": tuning}))
    return str(path)


def test_the_cli_shows_the_planners_chains(tiny_family, tmp_path, capsys):
    """`polyspec generate`'s summary line names each chain's rounds, measured and predicted tokens/s; `polyspec batch`
    writes each result's plans and --stats sums them per chain; with fixed lengths the `tuning:` section is named."""
    import json

    from polyspec.orchestrator.cli import main

    auto = write_config(tmp_path / "auto.yaml", tiny_family, "auto", {"max_length": 4})
    assert main(["generate", "-c", auto, "-p", "def f(x):", "-n", "12"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert ", planned: target" in summary and " rounds " in summary and "tok/s (predicted " in summary, summary
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    assert main(["batch", "-c", auto, "-i", str(requests), "-o", str(out), "--stats", str(stats)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    tally = PlanTally()
    for result in results:
        tally.add(check_plans(result))
    totals = json.loads(stats.read_text())["plans"]
    assert totals == tally.as_dict() and all(total["rounds"] > 0 for total in totals.values())
    capsys.readouterr()
    fixed = write_config(tmp_path / "fixed.yaml", tiny_family, [4, 2], {"max_length": 4})
    assert main(["generate", "-c", fixed, "-p", "def f(x):", "-n", "4"]) == 0
    err = capsys.readouterr().err
    assert "polyspec: tuning: max_length set, but no planner runs" in err and "planned:" not in err
