"""Can two tiers run at the same time on the machine this runs on? Forward time alone vs two processes at once.

    python benchmarks/cpu_parallelism.py [--repeats 150] [--out benchmarks/cpu-parallelism]

Pipelined stages only pay if two tiers' forwards really overlap. Each case starts fresh
processes (spawn, 1 torch thread each) that load the demo family's models and time
`repeats` forwards; first each model alone, then both processes at once, started together.
throughput x = (sum over processes of forwards per second when together) / (the mean of
their forwards per second alone): 2.0 = two independent cores, 1.0 = no overlap at all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"target": REPO / "models" / "stdlib" / "target", "small": REPO / "models" / "stdlib" / "small"}


def _forward_ms(args) -> float:
    name, tokens, repeats, barrier = args
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(MODELS[name]), dtype=torch.float32).eval()
    x = torch.randint(0, 4000, (1, tokens))
    with torch.inference_mode():
        for _ in range(5):
            model(x)
        if barrier is not None:
            barrier.wait()
        started = time.perf_counter()
        for _ in range(repeats):
            model(x)
    return (time.perf_counter() - started) / repeats * 1000.0


def _python_ms(args) -> float:
    _, _, repeats, barrier = args
    if barrier is not None:
        barrier.wait()
    started = time.perf_counter()
    for _ in range(repeats):
        total = 0
        for i in range(200_000):
            total += i * i
    return (time.perf_counter() - started) / repeats * 1000.0


def run(fn, jobs, together: bool) -> list[float]:
    ctx = mp.get_context("spawn")
    if not together:
        out = []
        for job in jobs:
            with ctx.Pool(1) as pool:
                out.append(pool.map(fn, [(*job, None)])[0])
        return out
    manager = ctx.Manager()
    barrier = manager.Barrier(len(jobs))
    with ctx.Pool(len(jobs)) as pool:
        return pool.map(fn, [(*job, barrier) for job in jobs])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=150)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "cpu-parallelism"))
    args = parser.parse_args()
    cases = [
        ("pure Python loop x2", _python_ms, [("py", 0, 20), ("py", 0, 20)]),
        ("target (1 token) x2", _forward_ms, [("target", 1, args.repeats), ("target", 1, args.repeats)]),
        ("target (5 tokens) + small (1 token)", _forward_ms, [("target", 5, args.repeats), ("small", 1, args.repeats * 3)]),
        ("target (64 tokens) x2", _forward_ms, [("target", 64, args.repeats // 3), ("target", 64, args.repeats // 3)]),
    ]
    results = []
    for name, fn, jobs in cases:
        alone = run(fn, jobs, together=False)
        together = run(fn, jobs, together=True)
        throughput = sum(1.0 / t for t in together) / (sum(1.0 / t for t in alone) / len(alone))
        results.append({"case": name, "alone_ms": [round(t, 3) for t in alone], "together_ms": [round(t, 3) for t in together],
                        "throughput_x": round(throughput, 3)})
        print(f"{name}: alone {alone}, together {together}, throughput {throughput:.2f}x", flush=True)
    report = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average_end": list(os.getloadavg()), "threads_per_process": 1},
              "results": results}
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = ["# Two processes at once on this machine (can tiers overlap?)", "",
             f"`python benchmarks/cpu_parallelism.py --repeats {args.repeats}`: {os.cpu_count()} CPUs, 1 torch thread per "
             f"process, demo family models (fp32); load average at the end {report['machine']['load_average_end'][0]:.1f}. "
             "throughput x: forwards per second of both processes together over one process alone (2.0 = two independent cores).",
             "", "| case | ms alone | ms together | throughput x |", "|---|---|---|---:|"]
    for r in results:
        lines.append(f"| {r['case']} | {' / '.join(f'{t:.2f}' for t in r['alone_ms'])} | "
                     f"{' / '.join(f'{t:.2f}' for t in r['together_ms'])} | {r['throughput_x']:.2f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
