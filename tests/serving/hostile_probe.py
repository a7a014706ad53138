"""Issue 56's hostile run, as a measurement (not a test): start `polyspec serve` with two tenants,
send what the issue sent, and print per case the answers, the slowest health check while it
ran (gRPC and HTTP, polled every 50 ms) and the server's RSS after it.

    python tests/serving/hostile_probe.py -c configs/demo.yaml [--flood-s 30]

Every process it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from serving_helpers import ServerProcess, free_port, polyspec_command, server_env  # noqa: E402

from polyspec.client import Client, ClientError  # noqa: E402
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb  # noqa: E402
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc  # noqa: E402

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def nested_arrays(depth: int, total_bytes: int) -> str:
    unit = "[" * depth + "]" * depth
    return "[" + ",".join([unit] * (total_bytes // (2 * depth + 1))) + "]"


class HealthWatch:
    """Polls gRPC health and HTTP /health; `slowest()` since the last `reset()`."""

    def __init__(self, address: str, http_port: int) -> None:
        self.address, self.http_port = address, http_port
        self.worst, self.failures = 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = Client(self.address)
        while not self._stop.is_set():
            start = time.perf_counter()
            ok = client.ready(timeout=30)
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
                connection.request("GET", "/health")
                ok = ok and connection.getresponse().status == 200
                connection.close()
            except OSError:
                ok = False
            self.worst = max(self.worst, time.perf_counter() - start)
            self.failures += not ok
            time.sleep(0.05)
        client.close()

    def reset(self) -> None:
        self.worst, self.failures = 0.0, 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def grpc_code(address: str, call: str, request, token: str = ALICE) -> str:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.PolyspecStub(channel)
        metadata = (("authorization", f"Bearer {token}"),)
        try:
            if call == "Generate":
                list(stub.Generate(request, timeout=120, metadata=metadata))
            else:
                getattr(stub, call)(request, timeout=120, metadata=metadata)
            return "OK"
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()[:90]}"


def http_post(port: int, body: bytes, token: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        payload = response.read()
        message = json.loads(payload).get("error", {}).get("message", "") if payload else ""
        return f"{response.status} {message[:80]}"
    finally:
        connection.close()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", default="configs/demo.yaml")
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument("--fairness-only", action="store_true", help="skip the oversized and nested inputs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hostile-probe-"))
    (root / "tenants.txt").write_text(f"alice {ALICE}\nbob {BOB}\n")
    http_port = free_port()
    server = ServerProcess(str(Path(args.config).resolve()), root / "state", "--tenants-file", str(root / "tenants.txt"),
                           "--http-port", str(http_port))

    try:
        server.wait_ready(token=ALICE).close()
        pid = server.proc.pid
        start_rss = rss_mb(pid)
        print(json.dumps({"case": "ready", "rss_mb": round(start_rss)}), flush=True)
        watch = HealthWatch(server.address, http_port)

        def report(case: str, answers) -> None:
            time.sleep(0.5)
            row = {"case": case, "answers": answers, "slowest_health_s": round(watch.worst, 3),
                   "health_failures": watch.failures, "rss_mb": round(rss_mb(pid)),
                   "rss_over_start_mb": round(rss_mb(pid) - start_rss)}

            print(json.dumps(row), flush=True)
            watch.reset()

        if not args.fairness_only:
            hostile_inputs(server, http_port, root, args.config, report)
        fairness(server, args.flood_s, report)
        watch.stop()
    finally:
        code = server.stop(60)
        print(json.dumps({"case": "stopped", "exit": code}), flush=True)
    return 0


def hostile_inputs(server, http_port: int, root: Path, config: str, report) -> None:
    sixty = nested_arrays(30, 60 << 20)
    report("Generate, 60 MB nested approximate_json",
           grpc_code(server.address, "Generate", pb.GenerateRequest(prompt="x", approximate_json=sixty)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        two = [pool.submit(grpc_code, server.address, "Generate", pb.GenerateRequest(prompt="x", approximate_json=sixty))
               for _ in range(2)]
        report("Generate x2 at once, 60 MB approximate_json", [f.result() for f in two])
    job = pb.SubmitJobRequest(requests=[pb.GenerateRequest(prompt="x", approximate_json=sixty)])
    report("SubmitJob, 60 MB approximate_json", grpc_code(server.address, "SubmitJob", job))
    del sixty, job
    almost = nested_arrays(30, (4 << 20) - 4096)
    report("Generate, 4 MB nested approximate_json",
           grpc_code(server.address, "Generate", pb.GenerateRequest(prompt="x", approximate_json=almost)))
    report("SubmitJob, 4 MB nested approximate_json",
           grpc_code(server.address, "SubmitJob", pb.SubmitJobRequest(requests=[pb.GenerateRequest(prompt="x", approximate_json=almost)])))
    deep = "[" * 100_000 + "]" * 100_000
    report("Generate, 100,000-deep approximate_json",
           grpc_code(server.address, "Generate", pb.GenerateRequest(prompt="x", approximate_json=deep)))

    body = b'{"prompt": "x", "max_tokens": 2, "stop": ' + nested_arrays(30, (8 << 20) - 100).encode() + b"}"
    for token, who in ((ALICE, "alice"), (None, "no token")):
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: http_post(http_port, body, token or ""), range(10)))
        report(f"HTTP x10 at once, 8 MiB of 30-deep arrays in stop ({who})", sorted(set(answers)))

    state = root / "state"
    before = dir_bytes(state)
    invalid = [pb.GenerateRequest(id=f"i{i}", prompt="y" * 3_000_000, top_p=2) for i in range(1)]
    answers = [grpc_code(server.address, "SubmitJob", pb.SubmitJobRequest(requests=invalid)) for _ in range(20)]
    report("SubmitJob x20, an invalid item of a 3 MB prompt", {"answers": sorted(set(answers)),
                                                               "state_dir_growth_bytes": dir_bytes(state) - before})

    second = subprocess.run(polyspec_command() + ["serve", "-c", str(Path(config).resolve()), "--port", "0",
                                                  "--metrics-port", "0", "--state-dir", str(state)],
                            capture_output=True, text=True, timeout=120, env=server_env())
    report("a second server on the same state dir", {"exit": second.returncode, "stderr": second.stderr.strip()})



def fairness(server, flood_s: float, report) -> None:
    """alice floods on 4 connections with n = 16 completions; bob sends 8-token requests."""
    def bob_requests(seconds: float) -> tuple[list[float], dict, list[int]]:
        """bob's 8-token requests one after another for `seconds`: latencies, answers, running counts seen."""
        latencies, answers, running = [], {}, []
        with Client(server.address, token=BOB) as bob:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    bob.generate("def f(x):", max_new_tokens=8)
                    key = "OK"
                except ClientError as exc:
                    key = exc.code.name
                latencies.append(time.perf_counter() - start)
                answers[key] = answers.get(key, 0) + 1
                running.append(bob.stats()["queue"]["running"])
        return sorted(latencies), answers, running

    alone, _, _ = bob_requests(10.0)
    report("bob's 8-token requests, the server otherwise idle",
           {"bob_p50_s": round(alone[len(alone) // 2], 2), "bob_max_s": round(alone[-1], 2)})
    stop_flood = threading.Event()
    flood_answers: dict[str, int] = {}

    def flood() -> None:
        with Client(server.address, token=ALICE) as client:
            while not stop_flood.is_set():
                try:
                    client.generate("def parse(text):", max_new_tokens=64, n=16, temperature=1.0)
                    key = "OK"
                except ClientError as exc:
                    key = exc.code.name
                    time.sleep(0.05)
                flood_answers[key] = flood_answers.get(key, 0) + 1

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for thread in flooders:
        thread.start()
    time.sleep(3)
    latencies, bob_answers, running_seen = bob_requests(flood_s)
    jobs_alice, jobs_bob = {}, "not tried"
    with Client(server.address, token=BOB) as bob, Client(server.address, token=ALICE) as alice:
        # the job limit: alice fills her share of --max-live-jobs (500 of 1000), bob submits
        long_job = [{"prompt": "def g(y):", "max_new_tokens": 64}]
        submitted = []
        for _ in range(600):
            try:
                submitted.append(alice.submit_job(long_job).job_id)
                jobs_alice["OK"] = jobs_alice.get("OK", 0) + 1
            except ClientError as exc:
                jobs_alice[exc.code.name] = jobs_alice.get(exc.code.name, 0) + 1
                jobs_alice["message"] = exc.details[:100]
                break
        try:
            bob.cancel(bob.submit_job(long_job).job_id)
            jobs_bob = "OK"
        except ClientError as exc:
            jobs_bob = f"{exc.code.name}: {exc.details[:80]}"
        for job_id in submitted:
            alice.cancel(job_id)
    stop_flood.set()
    for thread in flooders:
        thread.join(300)
    report("alice floods (4 connections, n = 16); bob's 8-token requests", {
        "bob": bob_answers, "bob_p50_s": round(latencies[len(latencies) // 2], 2),
        "bob_p99_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 2),
        "bob_max_s": round(latencies[-1], 2), "running_seen": running_seen, "alice_flood": flood_answers,
        "alice_jobs": jobs_alice, "bob_job_after": jobs_bob})

if __name__ == "__main__":
    raise SystemExit(main())
