"""JobStore: results committed with their "done" mark, exactly once, counters and states right."""

from __future__ import annotations

import sqlite3

from polyspec.orchestrator.serving import jobs
from polyspec.orchestrator.serving.jobs import JobStore


def test_items_finish_once_and_the_job_settles(tmp_path):
    store = JobStore(tmp_path)
    job = store.create([("a", {"prompt": "x"}, None), ("b", {"prompt": "y"}, None), ("bad", {"top_p": 2}, "top_p must be in (0, 1]")])
    assert (job.state, job.total, job.completed, job.failed) == ("queued", 3, 0, 1)
    first = store.next_pending()
    assert (first.id, first.request) == ("a", {"prompt": "x"})
    store.mark_running(job.job_id)
    store.finish_item(first, {"id": "a", "token_ids": [1]}, None)
    assert store.finish_item(first, {"id": "a", "token_ids": [2]}, None).completed == 1  # a second finish is a no-op
    reopened = JobStore(tmp_path)  # what a restarted server sees
    second = reopened.next_pending()
    assert second.id == "b"
    done = reopened.finish_item(second, {"id": "b", "token_ids": [3]}, None)
    assert (done.state, done.completed, done.failed, done.finished_at > 0) == ("succeeded", 2, 1, True)
    results = reopened.results_after(job.job_id, 0)
    assert [r.id for _, r in results] == ["bad", "a", "b"]  # finishing order
    assert results[1][1].result == {"id": "a", "token_ids": [1]} and results[0][1].error == "top_p must be in (0, 1]"
    assert reopened.results_after(job.job_id, results[1][0]) == results[2:]
    assert reopened.next_pending() is None


def test_cancel_stops_pending_items_and_keeps_finished_jobs(tmp_path):
    store = JobStore(tmp_path)
    job = store.create([(f"r{i}", {"prompt": "x"}, None) for i in range(3)])
    item = store.next_pending()
    assert store.cancel(job.job_id).state == "cancelled"
    assert store.next_pending() is None
    assert store.finish_item(item, {"token_ids": []}, None).state == "cancelled"  # a late result does not revive it
    failed = store.create([("a", {}, "no prompt")])
    assert failed.state == "failed" and store.cancel(failed.job_id).state == "failed"
    assert store.get("job-unknown") is None and store.cancel("job-unknown") is None
    assert [j.job_id for j in store.list()] == [failed.job_id, job.job_id] and len(store.list(1)) == 1


def test_pending_items_skip_those_in_flight(tmp_path):
    """The batched request loop takes several items at once, never one already running."""
    store = JobStore(tmp_path)
    first = store.create([(f"a{i}", {"prompt": "x"}, None) for i in range(3)])
    second = store.create([(f"b{i}", {"prompt": "y"}, None) for i in range(2)])
    taken = store.pending_items(4, set())
    assert [item.id for item in taken] == ["a0", "a1", "a2", "b0"]
    skip = {(item.job_id, item.idx) for item in taken}
    assert [item.id for item in store.pending_items(4, skip)] == ["b1"]
    store.finish_item(taken[0], {"token_ids": [1]}, None)
    assert [item.id for item in store.pending_items(2, skip - {(first, 0)})] == ["b1"]
    assert second and store.pending_items(0, set()) == []


class _FullDisk:
    """A connection whose every write fails as SQLite's does on a full disk; reads pass."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args):
        if sql.lstrip().split()[0].upper() in ("BEGIN", "UPDATE", "INSERT"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __enter__(self):
        return self.db.__enter__()

    def __exit__(self, *exc):
        return self.db.__exit__(*exc)


def test_a_full_disk_keeps_items_pending_logs_once_and_pauses_job_work(tmp_path, capsys, monkeypatch):
    store = JobStore(tmp_path)
    job = store.create([("a", {"prompt": "x"}, None), ("b", {"prompt": "y"}, None)])
    first, second = store.pending_items(2, set())
    sound, now = store._db, [1000.0]
    monkeypatch.setattr(jobs.time, "monotonic", lambda: now[0])
    store._db = _FullDisk(sound)
    assert store.finish_item(first, {"token_ids": [1]}, None) is None  # no exception into the request loop
    assert store.finish_item(second, {"token_ids": [2]}, None) is None
    store.mark_running(job.job_id)
    logged = [line for line in capsys.readouterr().err.splitlines() if "disk is full" in line]
    assert len(logged) == 1, logged  # one line for the pause, not one per item
    store._db = sound
    assert store.pending_items(2, set()) == []  # job work waits out the pause
    now[0] += jobs.MIN_PAUSE_S
    assert [item.id for item in store.pending_items(2, set())] == ["a", "b"]  # nothing was lost
    assert store.finish_item(first, {"token_ids": [1]}, None).completed == 1
    assert store.finish_item(second, {"token_ids": [2]}, None).state == "succeeded"


def test_rows_that_do_not_decode_are_their_items_errors(tmp_path):
    store = JobStore(tmp_path)
    job = store.create([(name, {"prompt": "x"}, None) for name in ("a", "b", "c")])
    a, b, c = store.pending_items(3, set())
    store.finish_item(a, {"text": "fine"}, None)
    store.finish_item(b, {"text": "secret"}, None)
    store._db.execute("UPDATE items SET result = CAST(? AS TEXT) WHERE id = 'b'", (b'{"text": "secret \xff"}',))
    store._db.execute("UPDATE items SET request = CAST(? AS TEXT) WHERE id = 'c'", (b"\xfe",))
    assert store.pending_items(3, set()) == []  # c: failed, not handed to the request loop
    results = {result.id: result for _, result in store.results_after(job.job_id, 0)}
    assert results["a"].result == {"text": "fine"}
    assert (results["b"].result, results["b"].error) == (None, jobs.DAMAGED_RESULT)
    assert (results["c"].result, results["c"].error) == (None, jobs.DAMAGED_REQUEST)
    assert store.get(job.job_id).state == "succeeded"
