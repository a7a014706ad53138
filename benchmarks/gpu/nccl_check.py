"""The dense-row transport between two tiers over torch.distributed, checked end to end.

Two processes join one group through `DistChannel` (the class the Ray runtime uses), rank 0
sends draft-verification rows of the vocabulary's width and rank 1 checks them bit for bit,
then the round trip is timed. On a machine with two GPUs each rank takes its own device
(NCCL); with one GPU NCCL refuses two ranks on the same device, so the script says so and
checks the same path over gloo with the rows staged from the GPU, which is what the
runtime falls back to for two tiers sharing a GPU.

    python benchmarks/gpu/nccl_check.py [--backend nccl|gloo] [--vocab 49152] [--rows 16]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, backend: str, port: int, rows: int, vocab: int, iters: int, queue) -> None:
    from polyspec.orchestrator.distributed.transport import Counters, DistChannel

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        channel = DistChannel(backend, rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=60.0)
        counters = Counters()
        generator = torch.Generator().manual_seed(0)
        sent = torch.randn(rows, vocab, generator=generator)
        if torch.cuda.is_available():
            sent = sent.cuda()  # rows leave a tier's forward on its device
        times = []
        for i in range(iters + 1):
            start = time.perf_counter()
            if rank == 0:
                tag = channel.send(sent, 1, counters)
                got = channel.recv(rows, vocab, 1, tag)
            else:
                got = channel.recv(rows, vocab, 0, i + 1)
                channel.send(got, 0, counters)
            if i:
                times.append(time.perf_counter() - start)
            ok = torch.equal(got, sent.cpu())
            if not ok:
                break
        torch.distributed.barrier()  # the last isend completes before either process leaves the group
        queue.put({"rank": rank, "ok": ok, "round_trip_ms": 1000 * sorted(times)[len(times) // 2] if times else None,
                   "bytes_per_message": rows * vocab * 4})
    except Exception as exc:  # reported, not raised: the parent prints one JSON line
        queue.put({"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})


def check(backend: str, rows: int, vocab: int, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, backend, port, rows, vocab, iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        try:
            results.append(queue.get(timeout=120))
        except Exception:
            results.append({"ok": False, "error": "timed out"})
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return {"backend": backend, "ok": all(r.get("ok") for r in results), "ranks": sorted(results, key=lambda r: r.get("rank", 9))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    report = {"gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    report["runs"] = [check(args.backend, args.rows, args.vocab, args.iters)]
    if args.backend == "nccl" and not report["runs"][0]["ok"]:
        report["runs"].append(check("gloo", args.rows, args.vocab, args.iters))
    print(json.dumps(report))
    return 0 if any(run["ok"] for run in report["runs"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
