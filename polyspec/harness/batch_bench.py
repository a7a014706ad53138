"""Benchmarks through `polyspec batch`, timed as a user sees it: the pieces benchmarks/qwen_batch.py and
benchmarks/planner.py share.

One system run is one `polyspec batch -i IN -o OUT --stats STATS` process; its tokens/s is read back from
the stats file (generated tokens / decoding wall time, model load and start-up profile excluded). Finished
runs are appended to a `.partial.jsonl` file, so a benchmark stopped half way resumes where it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polyspec.harness.draft_report import stage_summary  # (the pooling benchmarks/drafters.py reports too)


def pin_here(taskset: str | None) -> None:
    """Pin this process to the runs' CPUs (`taskset -c` syntax: "1", "0,1", "0-1"), with as many torch threads: the
    runs are pinned by `taskset`, and the greedy check's target forward here ran on every core, slowing whatever
    ran on the other one."""
    if not taskset:
        return
    cpus: set[int] = set()
    for part in taskset.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(len(cpus))


def run_batch(config: Path, rows: list[dict], *, tokens: int, concurrency: int, threads: str, taskset: str | None = None,
              speculative: bool = True, lengths: str | None = None, python: str = sys.executable,
              cwd: Path | None = None) -> dict:
    """One `polyspec batch` process over `rows` (request objects with an `id` and a `prompt` or `messages`),
    `concurrency` requests at once; `lengths` overrides the config's speculation lengths (`--lengths`). `python`, `cwd`:
    the interpreter and directory it runs in (another checkout's: benchmarks/qwen_commit_ab.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out, stats = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl", Path(tmp) / "stats.json"
        inp.write_text("".join(json.dumps({**r, "max_new_tokens": tokens}) + "\n" for r in rows))
        cmd = [python, "-m", "polyspec.orchestrator.cli", "batch", "-c", str(config), "-i", str(inp), "-o", str(out),
               "--stats", str(stats), "--concurrency", str(concurrency), "--threads", threads]
        if not speculative:
            cmd.append("--no-speculation")
        if lengths:
            cmd += ["--lengths", lengths]
        if taskset:
            cmd = ["taskset", "-c", taskset, *cmd]
        started = time.perf_counter()
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=cwd)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{config.name}: polyspec batch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        results = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        summary = json.loads(stats.read_text())
    failed = [r for r in results if "error" in r]
    if failed:
        raise SystemExit(f"{config.name}: {len(failed)} request(s) failed: {failed[0]['error']}")
    first = results[0]["stats"]
    return {"tokens_per_s": summary["tokens_per_s"], "generated_tokens": summary["generated_tokens"],
            "decode_wall_s": summary["time_s"], "process_wall_s": round(wall, 1), "load_s": first.get("load_s"),
            "profile_s": first.get("profile_s"), "texts": {r["id"]: r["text"] for r in results},
            "token_ids": {r["id"]: r["token_ids"] for r in results}, "stages": run_stages(results),
            "plans": summary.get("plans"), "load_average": [round(x, 2) for x in os.getloadavg()]}


def run_stages(results: list[dict]) -> list[dict]:
    """Each (tier, drafter) pair's rounds summed over every request of a run, in the order the pairs first ran: its
    mean accepted length over all of them and the lengths it ran at. (One request's stages told little: on 4 HumanEval
    prompts the 0.5B accepted 0.07 of the n-gram tier's tokens a block on the first, and most on the third, which
    repeats its own docstring.)"""
    pairs: dict[tuple, list[dict]] = {}
    for result in results:
        for stage in result["stats"]["stages"]:
            pairs.setdefault((stage["tier"], stage["drafter"]), []).append(stage)
    out = []
    for (tier, drafter), stages in pairs.items():
        pooled = stage_summary(stages)
        out.append({"tier": tier, "drafter": drafter, "blocks": pooled["blocks"],
                    "mean_accepted_length": pooled["mean_accepted_length"],
                    "lengths": sorted({length for stage in stages for length in stage.get("lengths") or ()})})
    return out


def tier_set(config: Path) -> frozenset:
    """What a config's tiers are (model and quantization each): an -auto config can run any fixed chain of its tiers."""
    import yaml

    raw = yaml.safe_load(config.read_text())
    return frozenset((str(t["model"]), t.get("quantize")) for t in raw["tiers"])


def target_of(config: Path) -> tuple:
    """The config's first tier (model, quantization): chains compare only over one target."""
    import yaml

    first = yaml.safe_load(config.read_text())["tiers"][0]
    return str(first["model"]), first.get("quantize")


def read_partial(path: Path) -> list[dict]:
    """Finished runs (a line torn by a crash is dropped and redone)."""
    if not path.exists():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return runs


def append_partial(path: Path, run: dict) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(run) + "\n")


def first_divergences(target_config: Path, requests: dict[str, dict], target_ids: dict[str, list[int]],
                      others: list[tuple[str, dict[str, list[int]]]]) -> dict[str, dict[str, dict]]:
    """Where each other system's greedy tokens differ from the target alone's: per (system, request id) the
    first differing token and the target's own top-two logit gap there (the target forward over the request's
    prompt and the tokens both agree on, in the dtype the runs resolved). A gap of one rounding step of that
    dtype is a tie that a forward over another shape (a batch of blocks instead of single tokens) may break the
    other way; a larger gap is a bug. `requests`: each id's request object (`prompt` or `messages`)."""
    differing = [(system, key, ids) for system, token_ids in others for key, ids in token_ids.items()
                 if ids != target_ids.get(key)]
    if not differing:
        return {}
    import torch

    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tokenization import encode_chat, encode_prompt

    # the target as the runs loaded it (dtype: auto resolved from this machine's cached measurement)
    engine = Engine(load_config(str(target_config)), speculative=False, auto_tune=False, cache_profiles=True)
    model, tokenizer = engine.tiers[0].model, engine.tokenizer
    out: dict[str, dict[str, dict]] = {}
    for system, key, theirs in differing:
        ours = target_ids[key]
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        if at >= min(len(ours), len(theirs)):
            out.setdefault(system, {})[key] = {"token": at, "note": "one output is a prefix of the other (a stop)"}
            continue
        request = requests[key]
        prompt_ids = encode_chat(tokenizer, request["messages"]) if "messages" in request else encode_prompt(tokenizer, request["prompt"])
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + ours[:at]])).logits[0, -1]
        gap = float(logits[ours[at]].float() - logits[theirs[at]].float())
        step = float(torch.finfo(logits.dtype).eps) * abs(float(logits[ours[at]].float()))
        out.setdefault(system, {})[key] = {"token": at, "target_token": ours[at], "other_token": theirs[at],
                                           "logit_gap": round(gap, 5), "dtype": str(logits.dtype).replace("torch.", ""),
                                           "tie": abs(gap) <= step}
    engine.close()
    return out


def describe_divergences(found: dict[str, dict]) -> str:
    """One line for a system's divergences: each at a tie of the dtype's rounding, or not."""
    return "; ".join(f"{key}: token {d['token']}, " + (d.get("note") or f"gap {d['logit_gap']} {d['dtype']}"
                                                       f"{' (a tie)' if d['tie'] else ' (NOT a tie)'}")
                     for key, d in sorted(found.items()))
