"""The Ray runtime under load: batched rounds (VerifyBatch / DraftBatch) against one round per request.

    python benchmarks/ray_load.py [--config configs/demo-ray-local.yaml] [--concurrency 1,4,16]
                                  [--new-tokens 32] [--temperatures 0] [--out benchmarks/ray-load]

C clients each keep one request in flight (closed loop, max(4 C, 16) requests per cell, as
benchmarks/load.py; end of sequence ignored, so every system generates the same count).
Systems, each a Ray chain of the config (a local Ray instance, one actor per tier):

- ray batched:      `batching.enabled` (the default): one VerifyBatch per step carries every
                    running request; each tier scores all their blocks in one forward
- ray per-request:  `batching.enabled: false`, the runtime before batching: every running
                    request's round is its own Verify, the rounds in flight at once (threads),
                    as `polyspec serve` overlapped them

Only one chain's actors fit the machine at a time, so the systems alternate per temperature
(batched, per-request, then per-request, batched for the next), each over every concurrency.
Writes <out>.json, <out>.md and <out>.png (throughput against concurrency).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import PROMPT_TOKENS, Cell, closed_loop  # noqa: E402  (benchmarks/load.py: the same cells and summaries)

SYSTEMS = ("ray batched", "ray per-request")


def run_cell(engine, requests, concurrency: int) -> Cell:
    """benchmarks/load.py's closed loop; unbatched, the rounds of the running requests are in flight at once
    (the distributed chain's `concurrent_steps`)."""
    return closed_loop(engine, requests, concurrency)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo-ray-local.yaml"))
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--lengths", default="5,2", help="fixed speculation lengths (the same for every arm: the planner is left out)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "ray-load"))
    args = parser.parse_args(argv)
    from polyspec.harness.bench_prompts import code_prompts
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tokenization import encode_prompt

    levels = [int(c) for c in args.concurrency.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    config = load_config(args.config)
    lengths = [int(k) for k in args.lengths.split(",")]
    config = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, lengths=lengths))
    configs = {"ray batched": config,
               "ray per-request": dataclasses.replace(config, batching=dataclasses.replace(config.batching, enabled=False))}
    total = max(max(4 * c, 16) for c in levels)
    results: dict = {}
    order = list(SYSTEMS)
    for temperature in temperatures:
        for name in order:
            started = time.perf_counter()
            engine = Engine(configs[name], batched=True)
            try:
                assert engine.batched == (name == "ray batched")
                engine.scheduler.eos_token_ids = frozenset()  # every request generates exactly --new-tokens
                prompts = [encode_prompt(engine.tokenizer, p.text)[-PROMPT_TOKENS:] for p in code_prompts(engine.tokenizer, total)]
                while len(prompts) < total:
                    prompts += prompts[: total - len(prompts)]
                print(f"{name}: chain up in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
                for concurrency in levels:
                    count = max(4 * concurrency, 16)
                    requests = [engine.parse_request({"prompt_ids": p, "max_new_tokens": args.new_tokens, "temperature": temperature,
                                                      "seed": i}) for i, p in enumerate(prompts[:count])]
                    cell = run_cell(engine, requests, concurrency).summary()
                    results.setdefault(f"T={temperature:g}", {}).setdefault(str(concurrency), {})[name] = cell
                    print(f"T={temperature:g} C={concurrency:>2} {name:<16} {cell['tokens_per_s']:8.1f} tok/s  p50 {cell['p50_s']:.2f}s  "
                          f"p99 {cell['p99_s']:.2f}s  load {cell['load_avg_1m']:.1f}", file=sys.stderr, flush=True)
            finally:
                engine.close()
        order.reverse()
    ratios = {t: {c: round(row["ray batched"]["tokens_per_s"] / row["ray per-request"]["tokens_per_s"], 3)
                  for c, row in by_c.items()} for t, by_c in results.items()}
    report = {"config": os.path.relpath(args.config, REPO), "lengths": lengths, "new_tokens": args.new_tokens,
              "requests_per_cell": "max(4 C, 16)", "prompt_tokens_max": PROMPT_TOKENS,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "actor_threads": 1},
              "results": results, "batched_over_per_request": ratios}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(report), encoding="utf-8")
    plot(report, out.with_suffix(".png"))
    return 0


def markdown(report: dict) -> str:
    lines = [f"# The Ray runtime under load ({report['config']}, lengths {report['lengths']}, {report['new_tokens']} new tokens)", "",
             f"{report['machine']['cpus']} CPUs, one torch thread per actor; {report['requests_per_cell']} requests per cell.", "",
             "| T | C | batched tok/s | per-request tok/s | batched / per-request | batched p50 / p99 s | per-request p50 / p99 s |",
             "|---|---:|---:|---:|---:|---|---|"]
    for t, by_c in report["results"].items():
        for c, row in by_c.items():
            b, p = row["ray batched"], row["ray per-request"]
            lines.append(f"| {t[2:]} | {c} | {b['tokens_per_s']} | {p['tokens_per_s']} | {report['batched_over_per_request'][t][c]} | "
                         f"{b['p50_s']} / {b['p99_s']} | {p['p50_s']} / {p['p99_s']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for t, by_c in report["results"].items():
        levels = [int(c) for c in by_c]
        for name, style in zip(SYSTEMS, ("-o", "--s")):
            ax.plot(levels, [by_c[str(c)][name]["tokens_per_s"] for c in levels], style, label=f"{name} ({t})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("total tokens/s")
    ax.set_title("Ray runtime: batched rounds vs one round per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
