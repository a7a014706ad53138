"""Held-out acceptance of a drafter under its target, measured through the real chain.

The drafter runs as the target's only drafter (`ChainScheduler`, fixed length k) on the
held-out prompts that ship with the demo family (`models/stdlib/prompts.jsonl`, class
`code`, never trained on), end-of-sequence ignored. Per temperature the report gives the
mean accepted length (draft tokens accepted per verified block), the acceptance per
position (P(accepted >= j): the mean accepted length is their sum), the mean block
length (below k for an early-exit drafter), and tokens/s with the target alone's
tokens/s measured on the same prompts, interleaved.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path


def held_out_prompts(target_dir: str, count: int, classes: tuple[str, ...] = ("code",)) -> list[str]:
    path = Path(target_dir).parent / "prompts.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no held-out prompts next to the target ({path}); write them with `polyspec bench --write-prompts`")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = [row["prompt"] for row in rows if row.get("class") in classes]
    step = max(1, len(chosen) // count) if count else 1
    return chosen[::step][:count] if count else chosen


def stage_summary(stages: list[dict]) -> dict:
    """Pooled acceptance of one stage over many requests."""
    blocks = sum(s["blocks"] for s in stages)
    proposed = sum(s["proposed"] for s in stages)
    accepted = sum(s["accepted"] for s in stages)
    counts: list[int] = []
    for stage in stages:
        for j, n in enumerate(stage["accepted_counts"]):
            while len(counts) <= j:
                counts.append(0)
            counts[j] += n
    per_position = [round(sum(counts[j:]) / blocks, 4) for j in range(1, len(counts))] if blocks else []
    return {
        "blocks": blocks,
        "mean_accepted_length": round(accepted / blocks, 4) if blocks else 0.0,
        "per_position": per_position,
        "mean_block_length": round(proposed / blocks, 4) if blocks else 0.0,
    }


def chain_acceptance(
    target_dir: str,
    drafters: dict[str, dict],
    prompts: list[str],
    length: int,
    temperatures=(0.0, 1.0),
    max_new_tokens: int = 48,
    seed: int = 0,
    threads: int = 1,
) -> dict:
    """{drafter name: {"T=<t>": summary}} for each `drafters` tier spec under the target, plus
    the target alone, all on the same prompts, interleaved per prompt."""
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine, GenerationRequest
    from polyspec.orchestrator.tokenization import encode_prompt
    from polyspec.workers.core.sampling import SamplingParams

    target = {"name": "target", "model": os.path.abspath(target_dir), "threads": threads}
    engines = {"target": Engine(parse_config({"tiers": [target], "speculation": {"lengths": []}}), speculative=False)}
    for name, spec in drafters.items():
        engines[name] = Engine(parse_config({"tiers": [target, {"name": name, "threads": threads, **spec}], "speculation": {"lengths": [length]}}))
    for engine in engines.values():
        engine.scheduler.eos_token_ids = frozenset()
    tokenizer = engines["target"].tokenizer
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    stages: dict = {(n, t): [] for n in engines for t in temperatures}
    speeds: dict = {(n, t): [] for n in engines for t in temperatures}
    names = list(engines)
    for index, ids in enumerate(prompt_ids):
        for temperature in temperatures:
            order = names[index % len(names) :] + names[: index % len(names)]
            for name in order:
                started = time.perf_counter()
                out = engines[name].generate(GenerationRequest(tuple(ids), max_new_tokens, SamplingParams(temperature=temperature), seed + index))
                speeds[(name, temperature)].append(len(out["token_ids"]) / (time.perf_counter() - started))
                stages[(name, temperature)] += out["stats"]["stages"][:1]
    report: dict = {}
    for name in names:
        for temperature in temperatures:
            row = stage_summary(stages[(name, temperature)]) if name != "target" else {}
            tokens_per_s = statistics.median(speeds[(name, temperature)])
            row["tokens_per_s"] = round(tokens_per_s, 2)
            row["speedup_vs_target"] = round(tokens_per_s / statistics.median(speeds[("target", temperature)]), 3)
            report.setdefault(name, {})[f"T={temperature:g}"] = row
    report["settings"] = {"length": length, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "threads": threads, "load_average": os.getloadavg()}
    return report
