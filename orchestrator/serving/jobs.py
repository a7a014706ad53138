"""Batch jobs persisted in SQLite (`<state-dir>/jobs.sqlite3`), so they survive the server dying.

    jobs:  job_id, state, total, completed, failed, created_at, finished_at,
           tenant, idempotency_key
    items: job_id, idx, id, request (JSON), status (pending | done | failed),
           result (JSON), error, done_seq

An item's result is written in the same transaction that marks it done and bumps its
job's counters, so after a crash (even SIGKILL) every item is either done with its
result or still pending and is run again: every id exactly once, no gap. Item ids are
unique inside a job (the table's key). Job ids are made here; no path a client names is
ever opened. A job belongs to the tenant that submitted it; reads and cancels name the
caller's tenant and see only its jobs (tenant None: every job). An idempotency key is
unique per tenant: `create` with a key already used returns that job.

Job data holds prompts and results: the folder is made 0700 and the database 0600
(SQLite gives its -wal / -shm files the database's mode).

Thread use: one connection behind a lock; the scheduler thread writes results, the
server's event loop reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)
PENDING, DONE, ITEM_FAILED = "pending", "done", "failed"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    finished_at REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS items (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    idx INTEGER NOT NULL,
    id TEXT NOT NULL,
    request TEXT NOT NULL,
    status TEXT NOT NULL,
    result TEXT,
    error TEXT,
    done_seq INTEGER,
    PRIMARY KEY (job_id, idx),
    UNIQUE (job_id, id)
);
CREATE INDEX IF NOT EXISTS items_pending ON items (status, job_id, idx);
CREATE INDEX IF NOT EXISTS items_done ON items (job_id, done_seq);
CREATE INDEX IF NOT EXISTS items_seq ON items (done_seq);
CREATE INDEX IF NOT EXISTS jobs_live ON jobs (state, created_at);
"""
# added after the first release: an older database gains them on open
_JOB_COLUMNS = {"tenant": "TEXT NOT NULL DEFAULT ''", "idempotency_key": "TEXT"}
_JOB_INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, created_at);
"""
_JOB_FIELDS = "job_id, state, total, completed, failed, created_at, finished_at"


class LimitExceeded(Exception):
    """A configured limit (live jobs, pending items) would be passed: RESOURCE_EXHAUSTED."""


@dataclasses.dataclass(frozen=True)
class JobRecord:
    job_id: str
    state: str
    total: int
    completed: int
    failed: int
    created_at: float
    finished_at: float

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


@dataclasses.dataclass(frozen=True)
class PendingItem:
    job_id: str
    idx: int
    id: str
    request: dict


@dataclasses.dataclass(frozen=True)
class ItemResult:
    id: str
    result: dict | None  # {id, text, token_ids, finish_reason, stats}
    error: str


class JobStore:
    def __init__(self, state_dir: str | Path) -> None:
        path = Path(state_dir)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # also when it existed: it holds prompts and results
        self.path = path / "jobs.sqlite3"
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{self.path}{suffix}").exists():
                os.chmod(f"{self.path}{suffix}", 0o600)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed result survives power loss too
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in _JOB_COLUMNS.items():
            if column not in columns:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        self._db.executescript(_JOB_INDEXES)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ writes

    def create(self, items: list[tuple[str, dict, str | None]], tenant: str = "", idempotency_key: str | None = None,
               max_live_jobs: int | None = None, max_pending_items: int | None = None) -> JobRecord:
        """A job from (id, raw request, error or None) items; items with an error are failed at once.

        With an `idempotency_key` the tenant already used: that job, unchanged. Over a limit
        (live jobs, pending items, counted in the same transaction): LimitExceeded."""
        job_id = "job-" + uuid.uuid4().hex[:16]
        now = time.time()
        failed = sum(1 for _, _, error in items if error)
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if idempotency_key:
                row = self._db.execute(
                    "SELECT job_id FROM jobs WHERE tenant = ? AND idempotency_key = ?", (tenant, idempotency_key)
                ).fetchone()
                if row:
                    job_id = row[0]
                    items = []
            if items:
                self._check_limits(len(items) - failed, max_live_jobs, max_pending_items)
                self._db.execute(
                    "INSERT INTO jobs (job_id, state, total, failed, created_at, tenant, idempotency_key) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job_id, QUEUED, len(items), failed, now, tenant, idempotency_key or None),
                )
            seq = self._next_seq()
            rows = []
            for idx, (item_id, raw, error) in enumerate(items):
                if error:
                    rows.append((job_id, idx, item_id, json.dumps(raw), ITEM_FAILED, None, error, seq))
                    seq += 1
                else:
                    rows.append((job_id, idx, item_id, json.dumps(raw), PENDING, None, None, None))
            if rows:
                self._db.executemany(
                    "INSERT INTO items (job_id, idx, id, request, status, result, error, done_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self._settle(job_id)
        return self.get(job_id)

    def _check_limits(self, new_pending: int, max_live_jobs: int | None, max_pending_items: int | None) -> None:
        if max_live_jobs is not None:
            live = self._db.execute("SELECT COUNT(*) FROM jobs WHERE state IN (?, ?)", (QUEUED, RUNNING)).fetchone()[0]
            if live >= max_live_jobs:
                raise LimitExceeded(f"the server holds {live} unfinished jobs (at most {max_live_jobs}); retry later")
        if max_pending_items is not None:
            pending = self._pending_count()
            if pending + new_pending > max_pending_items:
                raise LimitExceeded(
                    f"the server has {pending} job items pending; {new_pending} more would pass its limit of {max_pending_items}"
                )

    def finish_item(self, item: PendingItem, result: dict | None, error: str | None) -> JobRecord | None:
        """Mark one item done (with its result) or failed (with its error), in one transaction.

        A no-op when the item is no longer pending (its job was cancelled meanwhile)."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            status = ITEM_FAILED if error else DONE
            changed = self._db.execute(
                "UPDATE items SET status = ?, result = ?, error = ?, done_seq = ? WHERE job_id = ? AND idx = ? AND status = ?",
                (status, None if error else json.dumps(result), error, self._next_seq(), item.job_id, item.idx, PENDING),
            ).rowcount
            if changed:
                column = "failed" if error else "completed"
                self._db.execute(f"UPDATE jobs SET {column} = {column} + 1 WHERE job_id = ?", (item.job_id,))
                self._settle(item.job_id)
        return self.get(item.job_id)

    def mark_running(self, job_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("UPDATE jobs SET state = ? WHERE job_id = ? AND state = ?", (RUNNING, job_id, QUEUED))

    def cancel(self, job_id: str, tenant: str | None = None) -> JobRecord | None:
        """Cancel a job that is not over (a finished job is returned as it is); None if unknown
        (or another tenant's)."""
        if self.get(job_id, tenant) is None:
            return None
        with self._lock, self._db:
            self._db.execute(
                "UPDATE jobs SET state = ?, finished_at = ? WHERE job_id = ? AND state IN (?, ?)",
                (CANCELLED, time.time(), job_id, QUEUED, RUNNING),
            )
        return self.get(job_id)

    def _next_seq(self) -> int:
        return self._db.execute("SELECT COALESCE(MAX(done_seq), 0) + 1 FROM items").fetchone()[0]

    def _settle(self, job_id: str) -> None:
        """Inside a transaction: end the job when no item is pending."""
        total, completed, failed, state = self._db.execute(
            "SELECT total, completed, failed, state FROM jobs WHERE job_id = ?", (job_id,)
        ).fetchone()
        if state in TERMINAL or completed + failed < total:
            return
        final = FAILED if failed == total else SUCCEEDED
        self._db.execute("UPDATE jobs SET state = ?, finished_at = ? WHERE job_id = ?", (final, time.time(), job_id))

    # ------------------------------------------------------------------- reads

    def get(self, job_id: str, tenant: str | None = None) -> JobRecord | None:
        """The job, or None when it is unknown or belongs to another tenant (None: any tenant)."""
        query, args = f"SELECT {_JOB_FIELDS} FROM jobs WHERE job_id = ?", [job_id]
        if tenant is not None:
            query, args = query + " AND tenant = ?", args + [tenant]
        with self._lock:
            row = self._db.execute(query, args).fetchone()
        return JobRecord(*row) if row else None

    def list(self, limit: int = 0, tenant: str | None = None) -> list[JobRecord]:
        query, args = f"SELECT {_JOB_FIELDS} FROM jobs", []
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", [tenant]
        query += " ORDER BY created_at DESC, rowid DESC"
        if limit > 0:
            query, args = query + " LIMIT ?", args + [limit]
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [JobRecord(*row) for row in rows]

    def next_pending(self) -> PendingItem | None:
        """The oldest live job's first pending item (indexed: cheap even with many items)."""
        with self._lock:
            live = self._db.execute(
                "SELECT job_id FROM jobs WHERE state IN (?, ?) ORDER BY created_at, rowid", (QUEUED, RUNNING)
            ).fetchall()
            for (job_id,) in live:
                row = self._db.execute(
                    "SELECT idx, id, request FROM items WHERE status = ? AND job_id = ? ORDER BY idx LIMIT 1", (PENDING, job_id)
                ).fetchone()
                if row:
                    return PendingItem(job_id, row[0], row[1], json.loads(row[2]))
        return None

    def pending_items(self, limit: int, skip: set[tuple[str, int]]) -> list[PendingItem]:
        """Up to `limit` pending items, oldest live job first, leaving out `skip` ((job_id, idx) already in flight)."""
        found: list[PendingItem] = []
        with self._lock:
            live = self._db.execute(
                "SELECT job_id FROM jobs WHERE state IN (?, ?) ORDER BY created_at, rowid", (QUEUED, RUNNING)
            ).fetchall()
            for (job_id,) in live:
                taken = sum(1 for job, _ in skip if job == job_id)
                rows = self._db.execute(
                    "SELECT idx, id, request FROM items WHERE status = ? AND job_id = ? ORDER BY idx LIMIT ?",
                    (PENDING, job_id, limit - len(found) + taken),
                ).fetchall()
                for idx, item_id, request in rows:
                    if (job_id, idx) not in skip and len(found) < limit:
                        found.append(PendingItem(job_id, idx, item_id, json.loads(request)))
                if len(found) >= limit:
                    break
        return found

    def pending_count(self) -> int:
        with self._lock:
            return self._pending_count()

    def _pending_count(self) -> int:
        return self._db.execute(
            "SELECT COUNT(*) FROM items i JOIN jobs j ON j.job_id = i.job_id WHERE i.status = ? AND j.state IN (?, ?)",
            (PENDING, QUEUED, RUNNING),
        ).fetchone()[0]

    def results_after(self, job_id: str, after_seq: int) -> list[tuple[int, ItemResult]]:
        """Finished items of a job in the order they finished, after `after_seq`: [(seq, result)]."""
        with self._lock:
            rows = self._db.execute(
                "SELECT done_seq, id, result, error FROM items WHERE job_id = ? AND done_seq > ? ORDER BY done_seq",
                (job_id, after_seq),
            ).fetchall()
        return [(seq, ItemResult(item_id, json.loads(result) if result else None, error or "")) for seq, item_id, result, error in rows]
