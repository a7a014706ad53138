"""Hostile cases around the job store, against a real `polyspec serve` on the demo chain:
an idempotency key reused for other requests, a damaged `jobs.sqlite3` (at start-up, and a
bad row met at run time), and a full disk. No raw exception text reaches a client."""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from serving_helpers import DEMO_CONFIG, ServerProcess, polyspec_command, server_env

from polyspec.client import Client, ClientError, FailedPrecondition, ResourceExhausted
from polyspec.orchestrator.serving.jobs import DAMAGED_REQUEST, DAMAGED_RESULT, JobStore

SECRET = "stored-result-text-7f3a"  # what a damaged row holds: never to be quoted to a client
RAW_ERRORS = ("OperationalError", "sqlite3", "Traceback", "Unexpected <class", SECRET)


def assert_clean(text: str) -> None:
    assert not any(raw in text for raw in RAW_ERRORS) and "\n" not in text, text


def damage(path: Path, sql: str, *args) -> None:
    """Write to the store behind the server's back (as a bad disk or a bad copy would)."""
    db = sqlite3.connect(str(path), isolation_level=None)
    try:
        db.execute(sql, args)
    finally:
        db.close()


@pytest.fixture(scope="module")
def damaged_rows(tmp_path_factory):
    """A state dir holding a finished job with one result stored as bytes that are not UTF-8,
    a queued job with one request stored that way, and a job whose own row is stored that
    way; -> (state dir, finished id, queued id, broken id)."""
    state = tmp_path_factory.mktemp("damaged_rows") / "state"
    store = JobStore(state)
    done = store.create([(name, {"prompt": "def f(x):", "max_new_tokens": 4}, None) for name in ("a", "b", "c")])
    for item in store.pending_items(3, set()):
        store.finish_item(item, {"id": item.id, "text": f"{SECRET} {item.id}", "token_ids": [1, 2], "finish_reason": "length",
                                 "stats": {}}, None)
    queued = store.create([(name, {"prompt": "import os", "max_new_tokens": 4}, None) for name in ("x", "y", "z")])
    broken = store.create([("only", {"prompt": "x"}, "a request that failed validation")])
    store.close()
    bad = b'{"text": "' + SECRET.encode() + b' \xff\xfe"}'
    damage(store.path, "UPDATE items SET result = CAST(? AS TEXT) WHERE job_id = ? AND id = 'b'", bad, done.job_id)
    damage(store.path, "UPDATE items SET request = CAST(? AS TEXT) WHERE job_id = ? AND id = 'y'",
           b'{"prompt": "\xff', queued.job_id)
    damage(store.path, "UPDATE jobs SET state = CAST(? AS TEXT) WHERE job_id = ?", SECRET.encode() + b"\xff", broken.job_id)
    return state, done.job_id, queued.job_id, broken.job_id


@pytest.fixture(scope="module")
def store_server(damaged_rows):
    process = ServerProcess(DEMO_CONFIG, damaged_rows[0])
    try:
        process.wait_ready().close()
        yield process
    finally:
        process.stop()


@pytest.fixture
def store_client(store_server):
    with Client(store_server.address) as connected:
        yield connected


# ------------------------------------------------------------------ idempotency keys


def test_an_idempotency_key_reused_for_other_requests_is_refused_naming_it(store_client, store_server):
    requests = [{"id": "one", "prompt": "def f(x):", "max_new_tokens": 2}]
    first = store_client.submit_job(requests, idempotency_key="batch-17")
    assert store_client.submit_job(requests, idempotency_key="batch-17").job_id == first.job_id  # a retry: the same job
    other = [{"id": "one", "prompt": "import sys", "max_new_tokens": 2}]
    with pytest.raises(FailedPrecondition) as caught:
        store_client.submit_job(other, idempotency_key="batch-17")
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'batch-17'" in caught.value.details and first.job_id in caught.value.details
    assert_clean(caught.value.details)
    with pytest.raises(FailedPrecondition):  # one more request is another body too
        store_client.submit_job(requests + [{"id": "two", "prompt": "x", "max_new_tokens": 2}], idempotency_key="batch-17")
    job = store_client.wait(first.job_id, timeout=120)
    assert (job.total, job.completed) == (1, 1)  # the first job, untouched
    assert store_client.submit_job(other, idempotency_key="batch-18").job_id != first.job_id


# ----------------------------------------------------------- a bad row at run time


def test_a_damaged_result_row_is_that_items_error(store_client, damaged_rows):
    _, done_id, _, _ = damaged_rows
    results = {result["id"]: result for result in store_client.results(done_id)}
    assert set(results) == {"a", "b", "c"}
    assert results["b"] == {"id": "b", "error": DAMAGED_RESULT}
    assert results["a"]["text"] == f"{SECRET} a" and results["c"]["token_ids"] == [1, 2]  # the sound rows as stored


def test_a_damaged_request_row_fails_that_item_alone(store_client, store_server, damaged_rows):
    _, _, queued_id, _ = damaged_rows
    job = store_client.wait(queued_id, timeout=120)
    assert (job.state, job.completed, job.failed) == ("succeeded", 2, 1)
    results = {result["id"]: result for result in store_client.results(queued_id)}
    assert results["y"] == {"id": "y", "error": DAMAGED_REQUEST}
    assert results["x"]["token_ids"] and results["z"]["token_ids"]
    assert "Traceback" not in store_server.output()


def test_a_damaged_job_row_is_data_loss_without_its_text(store_client, store_server, damaged_rows):
    with pytest.raises(ClientError) as caught:
        store_client.job(damaged_rows[3])
    assert caught.value.code == grpc.StatusCode.DATA_LOSS and caught.value.details == "the job store is damaged"
    assert "GetJob failed" in store_server.output()  # the details are for the operator
    assert store_client.job(damaged_rows[1]).state == "succeeded"  # the other jobs are read as ever


# ------------------------------------------------------------ damaged at start-up


def finished_store(state: Path, items: int = 300) -> Path:
    """A store holding one finished job of `items` results, checkpointed (closed cleanly)."""
    store = JobStore(state)
    job = store.create([(f"r{n}", {"prompt": "def f(x):"}, None) for n in range(items)])
    for item in store.pending_items(items, set()):
        store.finish_item(item, {"id": item.id, "text": "x = 1\n" * 60, "token_ids": list(range(64)), "finish_reason": "length",
                                 "stats": {}}, None)
    assert store.get(job.job_id).completed == items
    store.close()
    assert not Path(f"{store.path}-wal").exists()  # checkpointed into the file
    return store.path


def overwrite_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8192] = random.Random(44).randbytes(8192)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["8 KiB of random bytes in the middle", "an empty file", "not a database"])
def test_a_damaged_store_stops_the_server_at_start_up_and_is_left_as_it_is(tmp_path, how):
    state = tmp_path / "state"
    path = finished_store(state)
    if how == "an empty file":
        path.write_bytes(b"")
    elif how == "not a database":
        path.write_bytes(random.Random(7).randbytes(64 << 10))
    else:
        overwrite_middle(path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    listing = sorted(os.listdir(state))
    proc = subprocess.run(polyspec_command() + ["serve", "-c", DEMO_CONFIG, "--port", "0", "--metrics-port", "0",
                                                "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=120, env=server_env())
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("polyspec: error: the job store ") and "is damaged" in lines[0], proc.stderr
    assert str(path) in lines[0] and "listening" not in proc.stderr
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before  # not repaired, emptied or rewritten
    assert sorted(os.listdir(state)) == listing  # no -wal / -shm made beside it


def test_a_sound_store_that_was_killed_mid_write_still_starts(tmp_path):
    """The start-up check reads what the write-ahead log holds, and finds nothing wrong with it."""
    state = tmp_path / "state"
    code = ("import os, sys\nfrom polyspec.orchestrator.serving.jobs import JobStore\n"
            "store = JobStore(sys.argv[1])\nstore.create([('a', {'prompt': 'x'}, None)])\nos._exit(0)\n")
    subprocess.run([polyspec_command()[0], "-c", code, str(state)], check=True, timeout=60, env=server_env())
    assert Path(state / "jobs.sqlite3-wal").stat().st_size > 0  # the job lives in the log only
    reopened = JobStore(state)
    assert [item.id for item in reopened.pending_items(5, set())] == ["a"]
    reopened.close()


# ---------------------------------------------------------------------- disk full


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (root only), unmounted at the end whatever happens."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> Path:
    """Take every free byte of `disk`; -> the filler file (remove it to free them)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # unbuffered: nothing left to flush at close
    try:
        for size in (1 << 20, 4096, 1):  # then the last partial blocks
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_full_disk_is_resource_exhausted_logged_and_loses_nothing(small_disk, start_server):
    server = start_server(DEMO_CONFIG, small_disk / "state")
    with server.wait_ready() as client:
        filler = fill(small_disk)
        with pytest.raises(ResourceExhausted) as caught:
            client.submit_job([{"id": "a", "prompt": "def f(x):", "max_new_tokens": 4}])
        assert "disk is full" in caught.value.details
        assert_clean(caught.value.details)
        assert client.jobs() == []  # nothing half-made
        assert "disk is full" in server.output()
        filler.unlink()

        # results of a running job meet a full disk: they wait, and every item ends once
        requests = [{"id": f"r{n}", "prompt": f"def f{n}(x):", "max_new_tokens": 64} for n in range(12)]
        job = client.submit_job(requests)
        logged = server.output().count("disk is full")
        filler = fill(small_disk)
        wait_for(lambda: server.output().count("disk is full") > logged, 120, "a failed result write to be logged")
        assert client.job(job.job_id).completed < len(requests)
        assert client.generate("import os", max_new_tokens=4)["token_ids"]  # interactive requests carry on
        filler.unlink()
        done = client.wait(job.job_id, timeout=300)
        assert (done.state, done.completed, done.failed) == ("succeeded", len(requests), 0)
        results = list(client.results(job.job_id))
        assert sorted(result["id"] for result in results) == sorted(r["id"] for r in requests)  # each exactly once
        assert all(result.get("token_ids") for result in results)
    assert "Traceback" not in server.output()
