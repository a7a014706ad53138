"""A large `polyspec batch` run: N requests from the demo prompts, resumable, timed.

    python benchmarks/batch_file.py [--requests 2000] [--config configs/demo.yaml] [--work DIR]
                                    [--max-new-tokens 64]

Writes DIR/requests.jsonl (the demo family's held-out prompts, cycled; every other request
samples at temperature 1 with its own seed, the rest are greedy), then runs

    polyspec batch -c CONFIG -i DIR/requests.jsonl -o DIR/results.jsonl --resume --stats DIR/stats.json

and prints the wall time, the results written and the peak memory of the run. Killed (or
interrupted) and started again with the same --work, it resumes: results already in
DIR/results.jsonl are kept and their requests are not generated again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_requests(path: Path, count: int, max_new_tokens: int) -> None:
    prompts = [json.loads(line)["prompt"] for line in (REPO / "models" / "stdlib" / "prompts.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(count):
            prompt = prompts[i % len(prompts)]
            prompt = prompt[(i // len(prompts)) * 7 % max(1, len(prompt) // 2):]  # cycled prompts start at different places
            request = {"id": f"r{i}", "prompt": prompt, "max_new_tokens": max_new_tokens,
                       "temperature": 1.0 if i % 2 else 0.0, "seed": i}
            out.write(json.dumps(request) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--work", default=str(REPO / ".batch-file"), help="requests, results and stats (resumable)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    requests = work / "requests.jsonl"
    if not requests.exists():
        write_requests(requests, args.requests, args.max_new_tokens)
    command = [sys.executable, "-m", "polyspec", "batch", "-c", args.config, "-i", str(requests), "-o", str(work / "results.jsonl"),
               "--resume", "--stats", str(work / "stats.json")]
    print(" ".join(command), file=sys.stderr)
    started = time.perf_counter()
    code = subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    elapsed = time.perf_counter() - started
    results = [json.loads(line) for line in (work / "results.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [r["id"] for r in results]
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"exit": code, "wall_s": round(elapsed, 1), "results": len(results), "distinct_ids": len(set(ids)),
                      "errors": sum("error" in r for r in results), "peak_rss_mb": round(peak_mb),
                      "load_avg": [round(x, 2) for x in os.getloadavg()]}))
    return code


if __name__ == "__main__":
    sys.exit(main())
