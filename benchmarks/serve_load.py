"""`polyspec serve` under concurrent clients against the engine it wraps, at the same load.

    python benchmarks/serve_load.py                        # demo chain, lengths: auto, 16 clients, T = 0
    python benchmarks/serve_load.py --concurrency 16 --passes 2 --out /tmp/serve-load

C clients each keep one request in flight (closed loop, as benchmarks/load.py) over the same
held-out code prompts, greedy, until max(4 C, 48) requests are done:

- engine:  the batched engine in this process (`Engine(config, batched=True)` driven by the
           continuous-batching loop: exactly benchmarks/load.py's "batched auto" cell);
- serve:   a `polyspec serve` process (gRPC on loopback), C client threads of the SDK
           (`polyspec.client.Client.generate`), each with its own channel.

Total tokens/s = all new tokens / wall time of the cell. The model work runs on CPU 0 in both
(the server process is pinned there, and this process while it runs the engine); the clients
run on CPU 1, as a server's clients would run elsewhere. Passes alternate engine / serve, so
a noisy stretch hits both. Both sides honour end of sequence, and the greedy tokens of every
request must agree. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
PROMPT_TOKENS = 160


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_cell(engine, raws: list[dict], concurrency: int) -> tuple[float, int, dict]:
    from load import closed_loop  # benchmarks/load.py's closed loop, as its "batched auto" cell

    requests = [engine.parse_request(raw) for raw in raws]
    tokens_by_id: dict = {}
    finish = engine.finish

    def recording_finish(state):
        result = finish(state)
        tokens_by_id[state.request.id] = result["token_ids"]
        return result

    engine.finish = recording_finish
    try:
        cell = closed_loop(engine, requests, concurrency)
    finally:
        engine.finish = finish
    return cell.tokens / cell.seconds, cell.tokens, tokens_by_id


def serve_cell(address: str, raws: list[dict], concurrency: int) -> tuple[float, int, dict]:
    from polyspec.client import Client

    queue = list(raws)
    lock = threading.Lock()
    tokens_by_id: dict = {}
    errors: list = []

    def client() -> None:
        with Client(address) as sdk:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    raw = queue.pop(0)
                try:
                    out = sdk.generate(prompt_ids=raw["prompt_ids"], max_new_tokens=raw["max_new_tokens"],
                                       temperature=raw["temperature"], seed=raw["seed"], id=raw["id"])
                except Exception as exc:  # noqa: BLE001 (reported below)
                    errors.append(exc)
                    return
                with lock:
                    tokens_by_id[raw["id"]] = out["token_ids"]

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    if errors:
        raise SystemExit(f"a client failed: {errors[0]}")
    tokens = sum(len(t) for t in tokens_by_id.values())
    return tokens / seconds, tokens, tokens_by_id


def start_server(config_path: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = log_path.open("w")
    proc = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "polyspec.orchestrator.cli", "serve", "-c", str(config_path),
                             "--port", str(port), "--state-dir", str(log_path.parent / "state"), "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"polyspec serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        if "ready" in log_path.read_text():
            return proc
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("polyspec serve was not ready in 600 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--passes", type=int, default=2, help="engine / serve pairs, alternating")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "serve-load"))
    args = parser.parse_args(argv)

    import torch

    from polyspec.harness.bench_prompts import code_prompts
    from polyspec.harness.real_report import cpu_name
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tokenization import encode_prompt

    torch.set_num_threads(1)
    raw_config = yaml.safe_load(Path(args.config).read_text())
    raw_config.setdefault("speculation", {})["lengths"] = "auto"
    for tier in raw_config["tiers"]:  # relative model paths stay valid from the temporary folder
        model = tier.get("model")
        if isinstance(model, str) and not os.path.isabs(model) and (Path(args.config).parent / model).exists():
            tier["model"] = str((Path(args.config).parent / model).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw_config))

    os.sched_setaffinity(0, {0})
    engine = Engine(load_config(str(config_path)), batched=True)
    count = max(4 * args.concurrency, 48)
    prompts = [encode_prompt(engine.tokenizer, p.text)[-PROMPT_TOKENS:] for p in code_prompts(engine.tokenizer, count)]
    while len(prompts) < count:
        prompts += prompts[: count - len(prompts)]
    raws = [{"id": f"r{i}", "prompt_ids": p, "max_new_tokens": args.new_tokens, "temperature": 0.0, "seed": i}
            for i, p in enumerate(prompts[:count])]

    port = free_port()
    server = start_server(config_path, port, tmp / "serve.log")
    rows = []
    try:
        for number in range(args.passes):
            os.sched_setaffinity(0, {0})
            rate, tokens, engine_tokens = engine_cell(engine, raws, args.concurrency)
            rows.append({"pass": number, "path": "engine", "tokens_per_s": round(rate, 2), "tokens": tokens})
            os.sched_setaffinity(0, {1} if os.cpu_count() > 1 else {0})
            rate, tokens, served_tokens = serve_cell(f"127.0.0.1:{port}", raws, args.concurrency)
            rows.append({"pass": number, "path": "serve", "tokens_per_s": round(rate, 2), "tokens": tokens})
            same = sum(engine_tokens[r["id"]] == served_tokens[r["id"]] for r in raws)
            rows[-1]["greedy_equal"] = f"{same}/{len(raws)}"
            print(json.dumps(rows[-2:]), file=sys.stderr, flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        engine.close()
    engine_rate = statistics.median(r["tokens_per_s"] for r in rows if r["path"] == "engine")
    serve_rate = statistics.median(r["tokens_per_s"] for r in rows if r["path"] == "serve")
    result = {"config": os.path.relpath(args.config, REPO), "lengths": "auto", "concurrency": args.concurrency,
              "requests": count, "new_tokens": args.new_tokens, "passes": rows,
              "engine_tokens_per_s": engine_rate, "serve_tokens_per_s": serve_rate,
              "serve_over_engine": round(serve_rate / engine_rate, 3),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# `polyspec serve` at {args.concurrency} concurrent clients vs the engine",
             "", f"Config `{result['config']}` with `lengths: auto`; {count} requests of {args.new_tokens} new tokens, greedy, "
             f"closed loop; model work pinned to CPU 0, clients on CPU 1. Machine: {result['machine']['cpu']}, "
             f"{result['machine']['cores']} cores. Command: `python benchmarks/serve_load.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", "",
             "| pass | path | tokens/s | tokens | greedy = engine |", "|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['pass']} | {r['path']} | {r['tokens_per_s']} | {r['tokens']} | {r.get('greedy_equal', '')} |")
    lines += ["", f"Median: engine {engine_rate:.1f} tok/s, serve {serve_rate:.1f} tok/s: serve / engine = {result['serve_over_engine']}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
