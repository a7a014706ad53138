"""`polyspec bench --quick` of two checkouts, interleaved: is this tree as fast as an earlier commit?

A redesign must keep speed: this runs the same quick bench (demo chain, 4 code + 2 prose prompts x 64
tokens, T = 0 and 1, one torch thread) alternately in a base checkout (its own interpreter, e.g. a git
worktree of the commit before the work with a venv over it) and in this tree, pinned to one core, and
reports each polybasic system's tokens/s per round and this tree's ratio to the base in the same round
(which checkout runs first alternates by round, so an order effect falls on both sides alike).
Every bench run also measures transformers' `generate()`, whose code is the same in both checkouts: its
ratio is the run-to-run noise of the machine.

    git worktree add --detach /tmp/base BASE_REV && python -m venv --system-site-packages /tmp/venv-base
    /tmp/venv-base/bin/pip install --no-deps -e /tmp/base
    python benchmarks/commit_ab.py --base-dir /tmp/base --base-python /tmp/venv-base/bin/python --rounds 2 --core 1

Writes benchmarks/commit-ab.{json,md,png} (`--out` for another stem).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from polyspec.harness.real_report import cpu_name

REPO = Path(__file__).resolve().parents[1]
SAME_CODE = "hf-generate"  # transformers' own decode: identical in both checkouts




def bench(directory: Path, python: str, core: int, out: Path) -> dict[tuple[str, float], float]:
    """One `polyspec bench --quick` in `directory`: tokens/s per (system, temperature)."""
    command = ["taskset", "-c", str(core), python, "-m", "polyspec", "bench", "-c", "configs/demo.yaml", "--quick",
               "--json", str(out) + ".json", "--markdown", str(out) + ".md", "--plot", str(out) + ".png"]
    subprocess.run(command, cwd=directory, check=True, capture_output=True, text=True)
    results = json.loads(Path(str(out) + ".json").read_text())["results"]
    return {(row["system"], row["temperature"]): row["tokens_per_s"] for row in results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-dir", required=True, help="the base checkout")
    parser.add_argument("--base-python", required=True, help="an interpreter that imports polyspec from the base checkout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "commit-ab"))
    args = parser.parse_args()
    base_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.base_dir, capture_output=True, text=True).stdout.strip()
    this_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    rounds = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(args.rounds):
            # which checkout runs first alternates by round, so that an order effect (a warmer or a more loaded
            # second run) does not land on one side only
            runs = {"base": (Path(args.base_dir), args.base_python), "this": (REPO, sys.executable)}
            order = ("base", "this") if number % 2 == 0 else ("this", "base")
            measured = {side: bench(*runs[side], args.core, Path(scratch) / f"{side}-{number}") for side in order}
            base, this = measured["base"], measured["this"]
            rounds.append({"base": base, "this": this})
            print(f"round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    keys = sorted({key for r in rounds for key in r["this"] if key[0].startswith("polyspec") or key[0] in ("target", SAME_CODE)},
                  key=lambda k: (k[1], k[0]))
    rows = []
    for system, temperature in keys:
        ratios = [r["this"][(system, temperature)] / r["base"][(system, temperature)] for r in rounds]
        rows.append({"system": system, "temperature": temperature,
                     "base_tokens_per_s": [round(r["base"][(system, temperature)], 1) for r in rounds],
                     "this_tokens_per_s": [round(r["this"][(system, temperature)], 1) for r in rounds],
                     "ratio_per_round": [round(x, 3) for x in ratios], "ratio_median": round(statistics.median(ratios), 3)})
    report = {"base": base_rev, "this": this_rev, "cpu": cpu_name(), "core": args.core, "rounds": args.rounds,
              "command": "polyspec bench -c configs/demo.yaml --quick (1 torch thread), base and this tree alternately, the first of a round alternating",
              "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# `polyspec bench --quick`: {this_rev} against {base_rev}, interleaved", "",
             f"CPU: {report['cpu']}, pinned to core {args.core}; {args.rounds} rounds (base and this tree each round, "
             f"which one first alternating by round). "
             f"`{SAME_CODE}` runs the same code in both: its ratio is the machine's noise.", "",
             "| system | T | base tokens/s | this tokens/s | this / base per round | median |", "|---|---:|---|---|---|---:|"]
    for row in rows:
        lines.append(f"| {row['system']} | {row['temperature']:g} | {', '.join(map(str, row['base_tokens_per_s']))} | "
                     f"{', '.join(map(str, row['this_tokens_per_s']))} | {', '.join(map(str, row['ratio_per_round']))} | "
                     f"{row['ratio_median']} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4))
    labels = [f"{row['system']} T={row['temperature']:g}" for row in rows]
    axis.barh(labels, [row["ratio_median"] for row in rows])
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.axvline(0.95, color="red", linestyle="--", linewidth=0.8)
    axis.set_xlabel(f"tokens/s, {this_rev} / {base_rev} (median of {args.rounds} interleaved rounds)")
    figure.tight_layout()
    figure.savefig(args.out + ".png", dpi=100)
    print(json.dumps({"out": args.out, "rows": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
