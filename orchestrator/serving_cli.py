"""CLI commands around the server: `polyspec serve`, `polyspec submit`, `polyspec jobs ...`.

`submit` and `jobs` are clients (polyspec.client): they load grpcio and protobuf only.
A server-side error is one line naming its gRPC status, e.g.
`polyspec: error: NOT_FOUND: no job 'job-42'`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

from polyspec.orchestrator import chain_args
from polyspec.workers.core.errors import RequestError

SERVER_ENV = "POLYSPEC_SERVER"
TOKEN_ENV = "POLYSPEC_TOKEN"


def add_parsers(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve the chain over gRPC, and the OpenAI API (/v1/completions, /v1/chat/completions) with --http-port",
        description="Serve the chain: gRPC (protos/polyspec/v1/polyspec.proto) on --port; with --http-port an "
                    "OpenAI-compatible API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health.")
    chain_args.add_chain_flags(serve)
    serve.add_argument("--host", default=None, help="address to bind (default: config server.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="gRPC port (default: config server.port, 50051; 0 = any free port)")
    serve.add_argument("--state-dir", default=None, help="where jobs are kept (default: $XDG_STATE_HOME/polyspec or ~/.local/state/polyspec)")
    serve.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics port (0 = off)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="OpenAI-compatible API on this port: /v1/completions, /v1/chat/completions, /v1/models")
    serve.add_argument("--exact-only", action="store_true",
                       help="refuse requests in an approximate decoding mode (docs/approximate.md): HTTP 400, INVALID_ARGUMENT")
    serve.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="the model name(s) the OpenAI API answers to (repeatable; default: the target's folder name or id); "
                            "any other name is 404 model_not_found")
    serve.add_argument("--auth-token-file", default=None, help="require 'authorization: Bearer <token>' with the token in this file")
    serve.add_argument("--tenants-file", default=None,
                       help="one 'TENANT TOKEN [WEIGHT]' per line: each token's tenant sees, reads and cancels only its own jobs, "
                            "and gets its share (by weight, 1 by default) of the queue, the batch and the job limits")
    serve.add_argument("--auth-reflection", action="store_true", help="server reflection needs a token too (health stays open)")
    serve.add_argument("--auth-metrics", action="store_true", help="/metrics needs a token too")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key): gRPC, HTTP and /metrics speak TLS")
    serve.add_argument("--tls-key", default=None)
    serve.add_argument("--grace", type=float, default=30.0, help="seconds running streams get to finish after SIGTERM")
    limits = serve.add_argument_group("limits (a request over one: RESOURCE_EXHAUSTED, HTTP 413 / 429)")
    for flag, kind, default, text in (
        ("--max-prompt-bytes", int, "1 MiB", "bytes of one prompt, checked before tokenizing"),
        ("--max-job-items", int, "100000", "requests in one job"),
        ("--max-live-jobs", int, "1000", "queued or running jobs, all tenants (each tenant: its share by weight)"),
        ("--max-pending-items", int, "1000000", "job items not run yet, all jobs together (each tenant: its share)"),
        ("--max-store-bytes", int, "4 GiB", "stored requests, errors and results of jobs, all tenants (each tenant: its share)"),
        ("--job-retention-s", float, "604800 (7 days)", "seconds a finished, failed or cancelled job is kept before it is deleted"),
        ("--max-message-bytes", int, "4 MiB", "one gRPC message (a job's requests arrive in one); larger: RESOURCE_EXHAUSTED"),
        ("--max-prompts", int, "64", "prompts in one HTTP /v1/completions list"),
        ("--max-body-bytes", int, "8 MiB", "bytes of one HTTP request body"),
        ("--max-connections", int, "256", "open HTTP connections (more get 503)"),
        ("--max-rpcs", int, "1024", "gRPC calls in progress, streams included (more get RESOURCE_EXHAUSTED)"),
        ("--request-timeout-s", float, "30", "seconds an HTTP client has to send its request"),
    ):
        limits.add_argument(flag, type=kind, default=None, help=f"{text} (default {default})")

    submit = sub.add_parser("submit", help="submit a JSONL file (polyspec batch's format) as a job to a server")
    submit.add_argument("-i", "--input", required=True)
    _add_client_flags(submit)
    submit.add_argument("--wait", action="store_true", help="wait for the job, with a progress bar")
    submit.add_argument("-o", "--output", default=None, help="with --wait: write the results here as JSONL")
    submit.add_argument("--idempotency-key", default=None,
                        help="the same key again (same tenant) returns the job it made instead of a second one")
    submit.add_argument("--retry-s", type=float, default=0.0,
                        help="keep retrying this long while the server is unreachable (with the same key: one job)")

    jobs = sub.add_parser("jobs", help="list, inspect, fetch or cancel jobs on a server")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    listing = jobs_sub.add_parser("list", help="all jobs, newest first")
    status = jobs_sub.add_parser("status", help="one job's state and counts")
    status.add_argument("job_id")
    results = jobs_sub.add_parser("results", help="a job's results as JSONL (waits for the rest while it runs)")
    results.add_argument("job_id")
    results.add_argument("-o", "--output", default=None)
    cancel = jobs_sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")
    for parser in (listing, status, results, cancel):
        _add_client_flags(parser)


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=None, help=f"host:port (default: ${SERVER_ENV} or 127.0.0.1:50051)")
    parser.add_argument("--auth-token-file", default=None, help=f"file with the server's token (or ${TOKEN_ENV})")
    parser.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this CA certificate (PEM)")


def cmd_serve(args) -> int:
    config = chain_args.chain_config(args)  # flag and config mistakes before torch loads
    from polyspec.orchestrator.serving.serve_options import serve_options

    options = serve_options(args, config)  # the server's own flags too (files, TLS, port, job store)
    from polyspec.orchestrator.serving.serve import cmd_serve as serve

    return serve(options)


# ------------------------------------------------------------------------ clients


@contextlib.contextmanager
def _connection(args):
    """A Client from the common flags, closed at the end; ClientError -> one-line RequestError."""
    from polyspec.client import Client, ClientError, Unavailable

    address = args.server or os.environ.get(SERVER_ENV) or "127.0.0.1:50051"
    token = os.environ.get(TOKEN_ENV)
    if args.auth_token_file:
        try:
            token = Path(args.auth_token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise RequestError(f"cannot read auth token file {args.auth_token_file}: {exc.strerror or exc}") from None
    if args.tls_ca and not Path(args.tls_ca).is_file():
        raise RequestError(f"TLS CA file not found: {args.tls_ca}")
    client = Client(address, token=token, tls=args.tls_ca)
    try:
        yield client
    except ClientError as exc:
        if isinstance(exc, Unavailable) and "connect" in exc.details.lower():
            raise RequestError(f"cannot reach a polyspec server at {address} (is `polyspec serve` running?)") from None
        raise RequestError(f"{exc.code.name}: {exc.details}") from None
    finally:
        client.close()


def read_requests(path: str) -> list[dict]:
    """JSONL requests as `polyspec batch` reads them: a line without an id gets `line-N`."""
    from polyspec.client import ClientError, request_message

    source = Path(path)
    if not source.is_file():
        raise RequestError(f"input file not found: {path}")
    requests = []
    for number, data in enumerate(source.read_bytes().splitlines(), start=1):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{path} line {number}: not valid UTF-8 (byte {exc.start + 1})") from None
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{path} line {number}: malformed JSON: {exc.msg} at column {exc.colno}") from None
        except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, nesting past the recursion limit
            raise RequestError(f"{path} line {number}: malformed JSON: {str(exc).splitlines()[0][:100]}") from None
        if not isinstance(raw, dict):
            raise RequestError(f"{path} line {number}: a request must be a JSON object")
        raw = {**raw, "id": str(raw["id"]) if raw.get("id") is not None else f"line-{number}"}
        try:
            request_message(raw)
        except ClientError as exc:
            raise RequestError(f"{path} line {number}: {exc.details}") from None
        requests.append(raw)
    if not requests:
        raise RequestError(f"{path} holds no requests")
    return requests


def _write_results(results, output: str | None) -> None:
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        for result in results:
            out.write(json.dumps(result) + "\n")
            out.flush()
    finally:
        if output:
            out.close()


def _describe(job) -> str:
    return f"{job.job_id}  {job.state:<9}  {job.completed + job.failed}/{job.total} done  ({job.failed} failed)"


def cmd_submit(args) -> int:
    requests = read_requests(args.input)
    with _connection(args) as client:
        job = client.submit_job(requests, idempotency_key=args.idempotency_key, retry_s=args.retry_s)
        print(job.job_id, flush=True)
        if not args.wait:
            return 0
        from tqdm import tqdm

        with tqdm(total=job.total, desc=job.job_id, unit="req", file=sys.stderr, disable=None) as bar:
            def progress(current) -> None:
                bar.update(current.completed + current.failed - bar.n)

            job = client.wait(job.job_id, progress=progress)
        if args.output:
            _write_results(client.results(job.job_id), args.output)
    print(_describe(job), file=sys.stderr)
    return 0 if job.state == "succeeded" else 1


def cmd_jobs(args) -> int:
    with _connection(args) as client:
        if args.jobs_command == "list":
            for job in client.jobs():
                print(_describe(job))
        elif args.jobs_command == "status":
            print(json.dumps(dataclasses.asdict(client.job(args.job_id))))
        elif args.jobs_command == "results":
            _write_results(client.results(args.job_id), args.output)
        elif args.jobs_command == "cancel":
            print(_describe(client.cancel(args.job_id)))
    return 0


COMMANDS = {"serve": cmd_serve, "submit": cmd_submit, "jobs": cmd_jobs}
