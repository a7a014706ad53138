"""What `polyspec serve` adds per request: time to first token and tokens/s through the server
(SDK over gRPC on loopback) versus the engine called directly, as `polyspec generate` does.

    python benchmarks/server_overhead.py -c configs/demo.yaml --markdown benchmarks/server_overhead.md

Both sides run the same greedy requests (and must return the same tokens); passes alternate
direct / server so background load hits both alike; per prompt the median of the repeats.
The direct side excludes model loading, which `polyspec generate` pays once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def load_prompts(path: Path, count: int) -> list[str]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in records if r.get("class") != "repetitive-code"]  # that class: tune's shift test only
    step = max(1, len(prompts) // count)
    return prompts[::step][:count]


def direct_run(engine, prompt: str, max_new_tokens: int) -> tuple[float, float, list[int]]:
    """(time to first token s, total s, token ids) for one request, as `polyspec generate` runs it."""
    request = engine.parse_request({"prompt": prompt, "max_new_tokens": max_new_tokens})
    started = time.perf_counter()
    first = []
    result = engine.generate(request, on_commit=lambda tokens: first or first.append(time.perf_counter()))
    return first[0] - started, time.perf_counter() - started, result["token_ids"]


def server_run(client, prompt: str, max_new_tokens: int) -> tuple[float, float, list[int]]:
    started = time.perf_counter()
    first, tokens = None, []
    for delta in client.stream(prompt, max_new_tokens=max_new_tokens):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        tokens += delta.token_ids
    return first - started, time.perf_counter() - started, tokens


def start_server(config: str, state_dir: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(Path(state_dir) / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "polyspec.orchestrator.cli", "serve", "-c", config, "--port", "0",
                             "--state-dir", state_dir, "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = re.search(r"listening on [\d.]+:(\d+)", (Path(state_dir) / "serve.log").read_text())
        if match:
            return proc, f"127.0.0.1:{match.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise SystemExit("polyspec serve did not start:\n" + (Path(state_dir) / "serve.log").read_text())


def summarize(runs: list[tuple[float, float, int]]) -> dict:
    ttft = statistics.median(r[0] for r in runs)
    tokens = sum(r[2] for r in runs)
    total = sum(r[1] for r in runs)
    return {"ttft_ms": 1000 * ttft, "tokens_per_s": tokens / total, "ms_per_token": 1000 * total / tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--prompts", default=str(REPO / "models/stdlib/prompts.jsonl"))
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()

    import torch

    from polyspec.client import Client
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    torch.set_num_threads(1)
    prompts = load_prompts(Path(args.prompts), args.max_prompts)
    engine = Engine(load_config(args.config))
    direct_run(engine, prompts[0], 4)  # warm, as the server is
    with tempfile.TemporaryDirectory() as state_dir:
        proc, address = start_server(args.config, state_dir)
        try:
            client = Client(address)
            client.wait_ready(300)
            runs = {"direct": {}, "server": {}}
            for _ in range(args.repeats):
                for index, prompt in enumerate(prompts):
                    for side, run in (("direct", lambda p: direct_run(engine, p, args.max_new_tokens)),
                                      ("server", lambda p: server_run(client, p, args.max_new_tokens))):
                        ttft, total, tokens = run(prompt)
                        runs[side].setdefault(index, []).append((ttft, total, tokens))
            for index in runs["direct"]:
                assert runs["direct"][index][0][2] == runs["server"][index][0][2], f"prompt {index}: server output differs"
            client.close()
        finally:
            proc.terminate()
            proc.wait(60)
    # per prompt: the median repeat (by total time), then pooled over prompts
    table = {}
    for side, per_prompt in runs.items():
        medians = [sorted(reps, key=lambda r: r[1])[len(reps) // 2] for reps in per_prompt.values()]
        table[side] = summarize([(ttft, total, len(tokens)) for ttft, total, tokens in medians])
    overhead = table["server"]["ms_per_token"] / table["direct"]["ms_per_token"] - 1
    lines = [
        f"Server overhead — config `{args.config}`, {len(prompts)} prompts x {args.repeats} repeats, "
        f"{args.max_new_tokens} new tokens, greedy, 1 torch thread, loopback gRPC (SDK stream).",
        "",
        "| path | median TTFT (ms) | tokens/s | ms/token |",
        "| --- | ---: | ---: | ---: |",
    ]
    for side, label in (("direct", "engine direct (`polyspec generate`)"), ("server", "`polyspec serve` + SDK")):
        row = table[side]
        lines.append(f"| {label} | {row['ttft_ms']:.1f} | {row['tokens_per_s']:.1f} | {row['ms_per_token']:.2f} |")
    lines += ["", f"Per-token overhead of the server: {100 * overhead:+.1f} %; TTFT difference: "
              f"{table['server']['ttft_ms'] - table['direct']['ttft_ms']:+.1f} ms.",
              "", f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), no GPU, torch {torch.__version__}, "
              f"load average {os.getloadavg()[0]:.1f} at the end; {time.strftime('%Y-%m-%d', time.gmtime())}. "
              f"Regenerate: `python benchmarks/server_overhead.py -c {args.config} --repeats {args.repeats} --markdown FILE`."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
