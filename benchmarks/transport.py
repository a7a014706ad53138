"""How dense rows should travel between two tiers: gRPC inline vs torch.distributed (gloo).

    python benchmarks/transport.py [--repeats 50] [--out benchmarks/transport]

Two processes on the machine this runs on (loopback). For each payload size (float32 rows):
- grpc:       one unary call of the tier protocol carrying the rows inline (Rows.INLINE),
              request out, empty reply back: what a Draft reply with rows costs;
- gloo-p2p:   dist.send / dist.recv of the same tensor (what Rows.DIST uses), plus the
              gRPC call that would carry the tag (counted separately, see the table);
- gloo-bcast: dist.broadcast in the 2-rank group (for reference: a collective may be cheaper
              than a send/recv pair).
Median and p90 over `repeats` round trips after a warm-up; 1 torch thread per process.
Writes OUT.json and OUT.md; orchestrator/distributed/transport.py cites the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 32000
ROWS = (0, 1, 8, 32, 128)  # rows per message: greedy (ids only), 1 row, a k=8 block, trees / larger vocabularies


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _grpc_server(port: int, ready) -> None:
    import grpc

    from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc
    from polyspec.orchestrator.distributed.transport import CHANNEL_OPTIONS, Counters, encode_rows

    torch.set_num_threads(1)
    tensors = {rows: torch.softmax(torch.randn(rows, VOCAB), dim=-1) if rows else None for rows in ROWS}

    class Drafter(tier_pb2_grpc.TierServicer):
        def Draft(self, request, context):  # a Draft reply carrying `num_tokens` rows inline
            return tier_pb2.DraftReply(tokens=[0] * request.num_tokens, rows=encode_rows(tensors[request.num_tokens], Counters()))

    server = grpc.server(futures.ThreadPoolExecutor(4), options=CHANNEL_OPTIONS)
    tier_pb2_grpc.add_TierServicer_to_server(Drafter(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def bench_grpc(repeats: int) -> dict:
    """Round trips of a Draft call whose reply carries the rows inline: encode, send, decode."""
    import grpc

    from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc
    from polyspec.orchestrator.distributed.transport import CHANNEL_OPTIONS, decode_rows

    port = _free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_grpc_server, args=(port, ready), daemon=True)
    server.start()
    ready.wait(60)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    stub = tier_pb2_grpc.TierStub(channel)
    out = {}
    try:
        for rows in ROWS:
            request = tier_pb2.DraftRequest(num_tokens=rows, context=list(range(256)))
            times = []
            for i in range(repeats + 5):
                started = time.perf_counter()
                reply = stub.Draft(request, timeout=30)
                decoded = decode_rows(reply.rows)
                assert (decoded is None) == (rows == 0)
                if i >= 5:
                    times.append((time.perf_counter() - started) * 1000.0)
            out[rows] = times
    finally:
        channel.close()
        server.kill()
    return out


def _gloo_rank(rank: int, port: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {"p2p": {}, "bcast": {}}
    for rows in ROWS:
        if rows == 0:
            continue
        tensor = torch.rand(rows, VOCAB)
        for kind in ("p2p", "bcast"):
            times = []
            for i in range(repeats + 5):
                dist.barrier()
                started = time.perf_counter()
                if kind == "p2p":
                    if rank == 0:
                        dist.send(tensor, dst=1, tag=i)
                    else:
                        dist.recv(tensor, src=0, tag=i)
                    # the reply direction: a 1-element ack so both sides time a round trip
                    ack = torch.zeros(1)
                    if rank == 1:
                        dist.send(ack, dst=0, tag=10_000 + i)
                    else:
                        dist.recv(ack, src=1, tag=10_000 + i)
                else:
                    dist.broadcast(tensor, src=0)
                if i >= 5:
                    times.append((time.perf_counter() - started) * 1000.0)
            results[kind][rows] = times
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def bench_gloo(repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "transport"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    grpc_times = bench_grpc(args.repeats)
    gloo = bench_gloo(args.repeats)

    def summary(times):
        ordered = sorted(times)
        return {"median_ms": round(statistics.median(ordered), 3), "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3)}

    rows_out = []
    for rows in ROWS:
        entry = {"rows": rows, "bytes": rows * VOCAB * 4, "grpc_inline": summary(grpc_times[rows])}
        if rows:
            entry["gloo_p2p"] = summary(gloo["p2p"][rows])
            entry["gloo_broadcast"] = summary(gloo["bcast"][rows])
        rows_out.append(entry)
    report = {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_average": list(os.getloadavg()), "threads_per_process": 1},
        "vocab": VOCAB, "repeats": args.repeats, "results": rows_out,
    }
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = [
        "# Dense rows between two tiers: gRPC inline vs gloo (loopback, this machine)",
        "",
        f"`python benchmarks/transport.py --repeats {args.repeats}`; vocabulary {VOCAB}, float32 rows, two processes, "
        f"1 torch thread each, load average at the end {report['machine']['load_average'][0]:.1f}. "
        "grpc = one unary call carrying the rows inline, with encoding and decoding; gloo p2p = send + 1-element ack "
        "(a round trip, as a Draft reply needs); broadcast = 2-rank dist.broadcast. Median (p90) ms.",
        "",
        "| rows | bytes | gRPC inline | gloo send/recv | gloo broadcast |",
        "|---:|---:|---:|---:|---:|",
    ]
    for e in rows_out:
        fmt = lambda s: f"{s['median_ms']:.2f} ({s['p90_ms']:.2f})"  # noqa: E731
        lines.append(f"| {e['rows']} | {e['bytes']:,} | {fmt(e['grpc_inline'])} | "
                     f"{fmt(e['gloo_p2p']) if 'gloo_p2p' in e else '-'} | {fmt(e['gloo_broadcast']) if 'gloo_broadcast' in e else '-'} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
