"""Throughput and latency under load: the batched engine against the round-robin one and transformers' static batches.

    python benchmarks/load.py [--config configs/demo.yaml] [--concurrency 1,4,16,64] [--new-tokens 32]
                              [--requests-per-client 4 | --quick] [--temperatures 0,1] [--out benchmarks/load]

C clients each keep one request in flight (closed loop: a client sends its next request
when the previous one finishes) until max(4 C, 48) requests are done (each client sends
several, so requests join and leave the batch as a server's would, and the goodput planner
runs long enough at each load to settle its A/B); every request asks for
`--new-tokens` tokens (end of sequence ignored, so every system generates the same count)
from a held-out code prompt. For each temperature and concurrency the systems run back to
back (interleaved, on one machine, 1 torch thread each):

- batched auto:  the batched engine, `speculation.lengths: auto` (the goodput planner)
- batched off:   the batched engine with speculation off (target only)
- round-robin:   the engine before batching: one round of one request at a time, in turn
                 (the config's fixed lengths, as `polyspec serve` stepped them)
- hf static:     transformers `generate` of the target, static batches of C left-padded prompts

Total tokens/s = all new tokens / wall time; latency = a request's finish - its send.
Writes <out>.json (with the machine's load average during each cell), <out>.md, <out>.png.
Until the run ends, <out>.partial.json and <out>.partial.md hold the cells done so far
(rewritten after each cell, removed at the end): a run stopped early keeps what it measured
and leaves a previous full result in place.

On a GPU the config's tiers say where each model runs (configs/demo-gpu.yaml: CUDA,
bfloat16); `hf static` then runs the target as the chain loads it (device, dtype).
`--quick` sends max(C, 16) requests per cell instead of max(4 C, 48), the same levels and
temperatures (benchmarks/gpu/load_gpu.sh runs it so on a lent GPU).

The committed result is the full run on a quiet machine (nothing else running; the numbers
are ratios within one run, but a busy machine makes every cell noisy), pinned to one core:

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/load.py

(all defaults: concurrency 1,4,16,64, T = 0 and 1, 32 new tokens, out benchmarks/load).
A quick check that it runs: --concurrency 1,4 --temperatures 0 --out /tmp/load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("batched auto", "batched off", "round-robin", "hf static")
PROMPT_TOKENS = 160  # prompts keep their last this many tokens


@dataclasses.dataclass
class Cell:
    tokens: int
    seconds: float
    latencies: list[float]
    load: float

    def summary(self) -> dict:
        ordered = sorted(self.latencies)
        p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
        return {"tokens": self.tokens, "seconds": round(self.seconds, 3), "tokens_per_s": round(self.tokens / self.seconds, 2),
                "p50_s": round(statistics.median(ordered), 3), "p99_s": round(p99, 3), "requests": len(ordered),
                "load_avg_1m": round(self.load, 2)}


def closed_loop(engine, requests, concurrency: int) -> Cell:
    """`concurrency` clients over `requests`, through the one request loop (batch_runner.ContinuousBatch: a batched
    engine steps them together, one that is not batched takes their rounds in turn)."""
    from polyspec.orchestrator.batch_runner import ContinuousBatch

    queue = list(requests)
    sent: dict[int, float] = {}
    latencies: list[float] = []
    tokens = [0]

    def finished(state, result: dict) -> None:
        latencies.append(time.perf_counter() - sent.pop(id(state)))
        tokens[0] += len(result["token_ids"])

    batch = ContinuousBatch(engine, concurrency, on_result=finished)  # (no on_error: a failure raises)
    started = time.perf_counter()
    try:
        while queue or batch.running:
            while queue and batch.room:
                state = batch.admit(queue.pop(0))
                sent[id(state)] = time.perf_counter()
            batch.step()
    finally:
        batch.close()
    return Cell(tokens[0], time.perf_counter() - started, latencies, os.getloadavg()[0])


def hf_static(model, prompts: list[list[int]], concurrency: int, new_tokens: int, temperature: float) -> Cell:
    """Static batches of `concurrency` left-padded prompts through `generate`; every request of a batch waits for all of it."""
    latencies, tokens = [], 0
    started = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        group = prompts[first : first + concurrency]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
        sent = time.perf_counter()
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 eos_token_id=None, pad_token_id=0, **kwargs)
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        done = time.perf_counter()
        tokens += (out.shape[1] - width) * len(group)
        latencies += [done - sent] * len(group)
    return Cell(tokens, time.perf_counter() - started, latencies, os.getloadavg()[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=None,
                        help="requests per cell: this many per client, at least 48 (default 4; 1 and at least 16 with --quick)")
    parser.add_argument("--quick", action="store_true", help="one request per client per cell (at least 16): a short run, same levels")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "load"))
    args = parser.parse_args(argv)
    if args.requests_per_client is None:
        args.requests_per_client = 1 if args.quick else 4
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from polyspec.harness.bench_prompts import code_prompts
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.tokenization import encode_prompt
    from polyspec.orchestrator.engine import Engine
    from polyspec.workers.tiers.loading import load_model, quiet_transformers, resolve_device

    quiet_transformers()
    levels = [int(c) for c in args.concurrency.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    config = load_config(args.config)
    auto = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, lengths="auto"))
    load_started = time.perf_counter()
    engines = {
        "batched auto": Engine(auto, batched=True),
        "batched off": Engine(config, speculative=False, batched=True),
        "round-robin": Engine(config),
    }
    for engine in engines.values():
        engine.scheduler.eos_token_ids = frozenset()  # every request generates exactly --new-tokens
    tokenizer = engines["round-robin"].tokenizer
    device = resolve_device(config.tiers[0].device)
    if device.type == "cpu":
        model = AutoModelForCausalLM.from_pretrained(config.tiers[0].model, dtype=torch.float32).eval()
    else:  # the target as the chain runs it: its device and dtype
        model = load_model(config.tiers[0]).eval()
    print(f"engines ready in {time.perf_counter() - load_started:.0f}s (the planner's profile included)", file=sys.stderr)
    # short cells at low concurrency (a few seconds) are dominated by the machine's noise and the planner's
    # first measurements at a new load; a server's load lasts longer
    floor = 16 if args.quick else 48

    def cell_requests(concurrency: int) -> int:
        return max(args.requests_per_client * concurrency, floor)

    total = max(cell_requests(c) for c in levels)
    prompts = [encode_prompt(tokenizer, p.text)[-PROMPT_TOKENS:] for p in code_prompts(tokenizer, total)]
    while len(prompts) < total:
        prompts += prompts[: total - len(prompts)]
    results: dict = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from polyspec.harness.real_report import cpu_name

    machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads": 1,
               "torch": torch.__version__,
               "device": f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type}

    def report(partial: bool) -> dict:
        planner = engines["batched auto"].scheduler.planner
        return {
            "config": os.path.relpath(args.config, REPO), "new_tokens": args.new_tokens,
            "requests_per_cell": f"max({args.requests_per_client} C, {floor})", "prompt_tokens_max": PROMPT_TOKENS,
            "machine": {**machine, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
            **({"partial": True} if partial else {}),
            "results": results, "ratios": ratios(results), "planner": planner.describe() if planner is not None else None,
        }

    for temperature in temperatures:
        for concurrency in levels:
            count = cell_requests(concurrency)
            raws = [{"prompt_ids": p, "max_new_tokens": args.new_tokens, "temperature": temperature, "seed": i}
                    for i, p in enumerate(prompts[:count])]
            row = {}
            for name in SYSTEMS:
                if name == "hf static":
                    cell = hf_static(model, prompts[:count], concurrency, args.new_tokens, temperature)
                else:
                    engine = engines[name]
                    requests = [engine.parse_request(r) for r in raws]
                    cell = closed_loop(engine, requests, concurrency)
                row[name] = cell.summary()
                print(f"T={temperature:g} C={concurrency:>2} {name:<13} {row[name]['tokens_per_s']:8.1f} tok/s  "
                      f"p50 {row[name]['p50_s']:.2f}s  p99 {row[name]['p99_s']:.2f}s  load {cell.load:.1f}", file=sys.stderr, flush=True)
            results.setdefault(f"T={temperature:g}", {})[str(concurrency)] = row
            write(report(partial=True), out.with_suffix(".partial.json"), out.with_suffix(".partial.md"))
    final = report(partial=False)
    write(final, out.with_suffix(".json"), out.with_suffix(".md"))
    plot(final, out.with_suffix(".png"))
    for partial in (out.with_suffix(".partial.json"), out.with_suffix(".partial.md")):
        partial.unlink(missing_ok=True)
    return 0


def write(report: dict, json_path: Path, markdown_path: Path) -> None:
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    markdown_path.write_text(markdown(report), encoding="utf-8")


def ratios(results: dict) -> dict:
    """The issue's bars, per temperature: ratios of total tokens/s and of p99 latency."""
    out = {}
    for temp, rows in results.items():
        rate = {c: {s: rows[c][s]["tokens_per_s"] for s in SYSTEMS} for c in rows}
        entry = {c: {"auto / off": round(r["batched auto"] / r["batched off"], 3),
                     "auto / round-robin": round(r["batched auto"] / r["round-robin"], 3),
                     "auto / hf static": round(r["batched auto"] / r["hf static"], 3)} for c, r in rate.items()}
        if "1" in rows and "16" in rows:
            entry["p99 at 16 / p99 at 1 (auto)"] = round(rows["16"]["batched auto"]["p99_s"] / rows["1"]["batched auto"]["p99_s"], 3)
        out[temp] = entry
    return out


def markdown(report: dict) -> str:
    lines = ["# Throughput and latency under load (benchmarks/load.py)", "",
             f"Config `{report['config']}`, {report['new_tokens']} new tokens per request, closed loop of C clients, "
             f"{report['requests_per_cell']} requests per cell; load average at the end {report['machine']['load_avg_at_end']} "
             f"on {report['machine']['cpus']} CPUs ({report['machine'].get('cpu', 'CPU not recorded')}; each cell's own load "
             f"in the JSON).", ""]
    device = report["machine"].get("device", "cpu")
    if device != "cpu":
        lines[2:2] = [f"Models on {device}, torch {report['machine']['torch']}.", ""]
    if report.get("partial"):
        lines[2:2] = ["**Partial: the cells done so far; the run had not ended.**", ""]
    for temp, rows in report["results"].items():
        lines += [f"## {temp}", "", "| C | system | tokens/s | p50 s | p99 s | load |", "|---:|---|---:|---:|---:|---:|"]
        for concurrency, row in rows.items():
            for name in SYSTEMS:
                r = row[name]
                lines.append(f"| {concurrency} | {name} | {r['tokens_per_s']:.1f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['load_avg_1m']:.1f} |")
        lines += ["", "| C | auto / off | auto / round-robin | auto / hf static |", "|---:|---:|---:|---:|"]
        for concurrency, entry in report["ratios"][temp].items():
            if isinstance(entry, dict):
                lines.append(f"| {concurrency} | {entry['auto / off']:.2f} | {entry['auto / round-robin']:.2f} | {entry['auto / hf static']:.2f} |")
        p99 = report["ratios"][temp].get("p99 at 16 / p99 at 1 (auto)")
        if p99 is not None:
            lines += ["", f"p99 latency at 16 concurrent / at 1 (batched auto): {p99:.2f}"]
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(report["results"])
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        rows = report["results"][temp]
        levels = [int(c) for c in rows]
        for name in SYSTEMS:
            ax.plot(levels, [rows[str(c)][name]["tokens_per_s"] for c in levels], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("total tokens/s")
        ax.set_title(f"{report['config']}, {temp}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
