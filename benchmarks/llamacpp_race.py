"""polyspec against llama.cpp's own server on the same Qwen2.5-Coder GGUF pair: single stream and 4 at once.

    python benchmarks/llamacpp_race.py                      # 8 prompts, both modes, every system
    python benchmarks/llamacpp_race.py --prompts 2 --modes 1 --polyspec target qwen2.5-coder-int4-target

The peer is llama.cpp's `llama-server`, built from source once by benchmarks/llamacpp_build.py (never a
dependency of polyspec), run with the files `polyspec zoo fetch qwen2.5-coder` downloads: the 1.5B
Q4_K_M as the model, the 0.5B Q4_K_M as its draft model. polyspec runs the shipped configs on the
folders converted from the same files (and the weight-only int4 configs quantize those again).

Greedy, `--tokens` new tokens a prompt, `--threads` threads for both. The prompts are HumanEval tasks
that neither the project's tuning nor its other benchmarks read (12, then every 19th). Systems run
interleaved (one pass over every system per mode, the order rotated each round), so a slow stretch of a
shared machine hits all alike. Measures:

- single stream, `decode tok/s`: generated tokens / decode time, summed over the prompts (llama.cpp:
  `timings.predicted_n / predicted_ms`; polyspec: the result's `decode_s`, from its first committed
  token), and `end-to-end tok/s` with the prompt's time added (llama.cpp `prompt_ms`, polyspec `prefill_s`);
- `wall tok/s` (the measure for 4 at once: `-np 4` slots, 4 requests in flight; `polyspec batch
  --concurrency 4`): all generated tokens / the wall time from the first request to the last answer
  (polyspec: the batch's `time_s`, load excluded).

Writes OUT.json (every request), OUT.md and OUT.png, with the CPU named.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from llamacpp_build import CACHE, build_server  # noqa: E402
from polyspec.harness.real_report import cpu_name

TARGET_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
LLAMA_SYSTEMS = {  # name -> extra llama-server arguments (the model is the 1.5B)
    "llama.cpp": [],
    "llama.cpp draft 0.5B": ["-md", "{draft}", "--spec-draft-n-max", "16", "--spec-draft-p-min", "0.75"],
    "llama.cpp ngram-mod": ["--spec-type", "ngram-mod"],
}
TARGET = "target"  # the 2-tier config with --no-speculation: the bf16 target alone
ALONE = "/alone"  # a config name with this suffix runs its target alone (--no-speculation)
POLYSPEC_SYSTEMS = [TARGET, "qwen2.5-coder-2tier", "qwen2.5-coder-3tier-auto", "qwen2.5-coder-int4-target" + ALONE,
                    "qwen2.5-coder-int4-target", "qwen2.5-coder-int4", "qwen2.5-coder-gguf" + ALONE, "qwen2.5-coder-gguf"]
TASKSET = None  # --taskset: the CPUs both systems are pinned to
CONTEXT = 4096
START_TIMEOUT_S = 300




def prompts(count: int) -> list[dict]:
    from polyspec.harness.realbench import humaneval_path

    with gzip.open(humaneval_path(), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    picked = [tasks[(12 + 19 * i) % len(tasks)] for i in range(count)]
    return [{"id": t["task_id"].replace("/", "-"), "prompt": t["prompt"]} for t in picked]


def gguf_paths() -> tuple[Path, Path]:
    from polyspec.workers.tiers.model_cache import model_cache_dir

    folder = model_cache_dir() / "gguf"
    target, draft = folder / TARGET_GGUF, folder / DRAFT_GGUF
    if not (target.exists() and draft.exists()):
        subprocess.run([sys.executable, "-m", "polyspec", "zoo", "fetch", "qwen2.5-coder"], check=True)
    return target, draft


# ------------------------------------------------------------------------------ llama.cpp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(server: Path, system: str, target: Path, draft: Path, threads: int, slots: int, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    extra = [arg.format(draft=draft) for arg in LLAMA_SYSTEMS[system]]
    command = [str(server), "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT * slots), "-np", str(slots),
               "--temp", "0", "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra]
    if "-md" in extra:
        command += ["-td", str(threads)]
    if TASKSET:
        command = ["taskset", "-c", TASKSET, *command]
    handle = open(log, "w")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{system}: llama-server exited ({process.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process, port
        except OSError:
            time.sleep(1)
    process.kill()
    raise SystemExit(f"{system}: llama-server did not come up in {START_TIMEOUT_S}s; see {log}")


def llama_request(port: int, row: dict, tokens: int) -> dict:
    body = {"prompt": row["prompt"], "n_predict": tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "seed": 0}
    started = time.perf_counter()
    answer = post(port, "/completion", body)
    timings = answer.get("timings", {})
    return {"id": row["id"], "tokens": timings.get("predicted_n", 0), "decode_s": timings.get("predicted_ms", 0.0) / 1e3,
            "prefill_s": timings.get("prompt_ms", 0.0) / 1e3, "wall_s": time.perf_counter() - started,
            "text": answer.get("content", ""), "stop": answer.get("stop_type") or answer.get("stopped_eos")}


def run_llama(server: Path, system: str, rows: list[dict], tokens: int, threads: int, slots: int, target: Path, draft: Path,
              logs: Path) -> tuple[list[dict], float]:
    """Every row through one server with `slots` slots, `slots` requests in flight; (results, wall seconds)."""
    process, port = start_server(server, system, target, draft, threads, slots, logs / f"{system.replace(' ', '_')}-{slots}.log")
    try:
        llama_request(port, {"id": "warm-up", "prompt": "def f():"}, 8)
        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(slots) as pool:
            results = list(pool.map(lambda row: llama_request(port, row, tokens), rows))
        return results, time.perf_counter() - began
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


# ------------------------------------------------------------------------------- polyspec


def run_polyspec(system: str, rows: list[dict], tokens: int, threads: int, slots: int) -> tuple[list[dict], float]:
    """Every row through one `polyspec batch` process, `slots` requests in flight; (results, wall seconds of the requests:
    the batch's own `time_s`, load excluded)."""
    name = "qwen2.5-coder-2tier" if system == TARGET else system.removesuffix(ALONE)
    config = REPO / "configs" / f"{name}.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        inp, out, stats = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl", Path(tmp) / "stats.json"
        inp.write_text("".join(json.dumps({**r, "max_new_tokens": tokens}) + "\n" for r in rows))
        command = [sys.executable, "-m", "polyspec.orchestrator.cli", "batch", "-c", str(config), "-i", str(inp), "-o", str(out),
                   "--stats", str(stats), "--concurrency", str(slots), "--threads", str(threads)]
        if system == TARGET or system.endswith(ALONE):
            command.append("--no-speculation")
        if TASKSET:
            command = ["taskset", "-c", TASKSET, *command]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{system}: polyspec batch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        summary = json.loads(stats.read_text())
        results = []
        for line in out.read_text().splitlines():
            result = json.loads(line)
            results.append({"id": result["id"], "tokens": len(result["token_ids"]), "decode_s": result["stats"]["decode_s"],
                            "prefill_s": result["stats"]["prefill_s"], "text": result["text"], "stop": result.get("finish_reason"),
                            "load_s": result["stats"].get("load_s")})
    return results, summary["time_s"]


# -------------------------------------------------------------------------------- report


def summarize(runs: list[dict]) -> list[dict]:
    table = []
    for system, slots in dict.fromkeys((r["system"], r["slots"]) for r in runs):
        mine = [run for run in runs if (run["system"], run["slots"]) == (system, slots)]
        rows = [r for run in mine for r in run["requests"]]
        tokens = sum(r["tokens"] for r in rows)
        entry = {"system": system, "slots": slots, "requests": len(rows), "tokens": tokens,
                 "stopped_before_limit": sum(1 for run in mine for r in run["requests"] if r["tokens"] < run["max_tokens"]),
                 "wall_tok_s": round(tokens / max(sum(run["wall_s"] for run in mine), 1e-9), 2)}
        if slots == 1:
            entry["decode_tok_s"] = round(tokens / max(sum(r["decode_s"] for r in rows), 1e-9), 2)
            entry["end_to_end_tok_s"] = round(tokens / max(sum(r["decode_s"] + r["prefill_s"] for r in rows), 1e-9), 2)
        table.append(entry)
    return table


def markdown(report: dict) -> str:
    pinned = f", pinned to CPU {report['taskset']}" if report.get("taskset") else ""
    lines = [f"# polyspec vs llama.cpp: {report['cpu']}, {report['threads']} thread(s){pinned}",
             "",
             f"Qwen2.5-Coder-1.5B-Instruct Q4_K_M (llama.cpp; polyspec: the folder converted from it, and int4 copies of it), "
             f"draft 0.5B Q4_K_M; greedy, {report['tokens']} new tokens, HumanEval {', '.join(report['prompt_ids'])}; "
             f"{report['rounds']} round(s), systems interleaved. llama.cpp {report['llama_version']}; torch {report['torch']}.",
             "",
             "| system | at once | requests | tokens | decode tok/s | end-to-end tok/s | wall tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for e in report["summary"]:
        lines.append(f"| {e['system']} | {e['slots']} | {e['requests']} | {e['tokens']} | {e.get('decode_tok_s', '')} | "
                     f"{e.get('end_to_end_tok_s', '')} | {e['wall_tok_s']} |")
    if report.get("llama_eog_tokens"):
        lines += ["", f"End of generation: llama.cpp {', '.join(report['llama_eog_tokens'])}; polyspec "
                  f"{', '.join(map(str, report['polyspec_gguf_stops']))}."]
    lines += ["", "decode tok/s: tokens / decode time (prompt excluded); wall tok/s: tokens / wall time of all requests, "
              "`at once` of them in flight (prompt included). A request that stops before the token limit (an end-of-generation "
              "token) counts the tokens it made.", ""]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({e["slots"] for e in report["summary"]})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for axis, slots in zip(axes[0], modes):
        entries = [e for e in report["summary"] if e["slots"] == slots]
        values = [e.get("decode_tok_s") if slots == 1 else e["wall_tok_s"] for e in entries]
        colors = ["tab:orange" if e["system"].startswith("llama.cpp") else "tab:blue" for e in entries]
        axis.barh([e["system"] for e in entries], values, color=colors)
        axis.set_xlabel("decode tokens/s" if slots == 1 else "tokens/s, 4 requests at once (wall)")
        axis.set_title(f"{slots} at once")
    fig.suptitle(f"Qwen2.5-Coder-1.5B, {report['cpu']}, {report['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", type=int, nargs="+", default=[1, 4], help="requests at once")
    parser.add_argument("--llama", nargs="*", default=list(LLAMA_SYSTEMS), help=f"llama.cpp systems: {', '.join(LLAMA_SYSTEMS)}")
    parser.add_argument("--polyspec", nargs="*", default=POLYSPEC_SYSTEMS, help="config names under configs/, or target")
    parser.add_argument("--taskset", help="pin both systems to these CPUs (taskset -c), e.g. 1 on a shared machine")
    parser.add_argument("--out", type=Path, default=HERE / "llamacpp-race")
    args = parser.parse_args()
    global TASKSET
    TASKSET = args.taskset

    rows = prompts(args.prompts)
    target, draft = gguf_paths()
    server = build_server() if args.llama else None
    logs = Path(tempfile.mkdtemp(prefix="llamacpp-race-"))
    systems = [("llama", name) for name in args.llama] + [("polyspec", name) for name in args.polyspec]
    runs = []
    partial = args.out.with_suffix(".partial.jsonl")
    for round_index in range(args.rounds):
        for slots in args.modes:
            shift = round_index % len(systems)
            for kind, name in systems[shift:] + systems[:shift]:
                started = time.perf_counter()
                if kind == "llama":
                    requests, wall = run_llama(server, name, rows, args.tokens, args.threads, slots, target, draft, logs)
                else:
                    requests, wall = run_polyspec(name, rows, args.tokens, args.threads, slots)
                run = {"system": name, "slots": slots, "round": round_index, "requests": requests, "wall_s": round(wall, 3),
                       "max_tokens": args.tokens,
                       "load_average": [round(x, 2) for x in os.getloadavg()], "run_s": round(time.perf_counter() - started, 1)}
                runs.append(run)
                with open(partial, "a") as handle:
                    handle.write(json.dumps(run) + "\n")
                done = summarize([run])[0]
                print(f"{name:32s} x{slots}: {done.get('decode_tok_s', '-')} decode tok/s, {done['wall_tok_s']} wall tok/s", flush=True)

    import torch

    from polyspec.workers.tiers.loading import gguf_stop_token_ids

    eog = sorted({line.split("EOG token", 1)[1].strip(" =").strip() for log in logs.glob("*.log")
                  for line in log.read_text(errors="replace").splitlines() if "EOG token" in line})
    version = next(CACHE.glob("sdist/*.tar.gz"), None)
    report = {"cpu": cpu_name(), "threads": args.threads, "taskset": args.taskset, "tokens": args.tokens, "rounds": args.rounds,
              "prompt_ids": [r["id"] for r in rows], "llama_version": version.name if version else "?", "torch": torch.__version__,
              "llama_eog_tokens": eog, "polyspec_gguf_stops": list(gguf_stop_token_ids(str(target))),
              "summary": summarize(runs), "runs": runs, "logs": str(logs)}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
