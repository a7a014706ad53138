"""JobStore: results committed with their "done" mark, exactly once, counters and states right."""

from __future__ import annotations

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
