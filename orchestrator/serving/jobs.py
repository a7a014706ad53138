"""Batch jobs persisted in SQLite (`<state-dir>/jobs.sqlite3`, tables `jobs` and `items` below), so they survive
the server dying: docs/serving.md ("Jobs survive crashes") says what a crash, damage or a full disk leaves.

An item's result is written in the same transaction that marks it done and bumps its job's counters.
Job ids are made here; no path a client names is ever opened. A job belongs to the tenant that
submitted it; reads and cancels name the caller's tenant and see only its jobs (tenant None: every
job). An idempotency key is unique per tenant: `create` with a key already used returns that job, if
the requests are the same (their digest is kept with the job), and refuses otherwise. Job data holds
prompts and results: the folder is made 0700 and the database 0600 (SQLite gives its -wal / -shm
files the database's mode).

Thread use: one connection behind a lock; the scheduler thread writes results, the
server's event loop reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

from polyspec.orchestrator.serving.security import short
from polyspec.workers.core.errors import first_line

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
_JOB_COLUMNS = {"tenant": "TEXT NOT NULL DEFAULT ''", "idempotency_key": "TEXT", "request_digest": "TEXT",
                "bytes": "INTEGER NOT NULL DEFAULT 0"}  # bytes: the job's stored requests, errors and results (the quota's measure)
_JOB_INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, created_at);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_at) WHERE finished_at > 0;
"""
_JOB_FIELDS = "job_id, state, total, completed, failed, created_at, finished_at"
DAMAGED_REQUEST = "the stored request of this item is damaged (the job store needs repair)"
DAMAGED_RESULT = "the stored result of this item is damaged (the job store needs repair)"
MIN_PAUSE_S, MAX_PAUSE_S = 5.0, 60.0  # job work paused after a store failure: first, longest
MAX_ERROR_CHARS = 300  # of an item's stored error


class LimitExceeded(Exception):
    """A configured limit (live jobs, pending items, stored bytes) would be passed: RESOURCE_EXHAUSTED."""


@dataclasses.dataclass(frozen=True)
class Quota:
    """What one submission may add to: the server's totals and its tenant's share of them
    (security.Tenants.share); None: no such limit. Each is counted in the transaction that
    stores the job, and a refusal names the limit's flag."""

    max_live_jobs: int | None = None  # queued or running jobs, all tenants
    max_pending_items: int | None = None  # items not run yet, all tenants
    tenant_live_jobs: int | None = None
    tenant_pending_items: int | None = None
    tenant_store_bytes: int | None = None  # the tenant's jobs' requests, errors and results, finished jobs included


class IdempotencyConflict(Exception):
    """An idempotency key the tenant already used for a job with other requests: FAILED_PRECONDITION / 409."""


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


class DamagedStore(Exception):
    """The job store's file fails its integrity check: the server refuses to start on it."""


FULL, DAMAGED, BROKEN = "full", "damaged", "broken"  # what a SQLite error says about the store
TROUBLE = {
    FULL: "the server's disk is full: the job store cannot be written",
    DAMAGED: "the job store is damaged",
    BROKEN: "the job store failed",
}


def trouble(exc: BaseException) -> str:
    """FULL, DAMAGED or BROKEN for a SQLite error (TROUBLE has each in words a client may read)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc):
        return FULL
    if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB) or any(
            sign in str(exc) for sign in ("malformed", "not a database", "Could not decode")):  # the last: text that is not UTF-8
        return DAMAGED
    return BROKEN


def check_integrity(path: Path) -> None:
    """DamagedStore (one line) unless `path` is a sound SQLite database; never writes to it.

    A 0-byte file is damage too: a new store is made under another name and renamed into
    place (`_create_store`), so this program never leaves one. Without a write-ahead log the
    check opens the file immutable (no -wal / -shm made beside it); with one, read-only, so
    the check sees the transactions the log holds."""
    if path.stat().st_size == 0:
        raise DamagedStore(f"the job store {path} is damaged (an empty file); it was left as it is: restore it "
                           "from a backup, or move it away to start with an empty store")
    wal = Path(f"{path}-wal")
    mode = "mode=ro" if wal.exists() and wal.stat().st_size > 0 else "immutable=1"
    try:
        db = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?{mode}", uri=True)
        try:
            verdict = [row[0] for row in db.execute("PRAGMA integrity_check(1)")]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        if trouble(exc) != DAMAGED:  # e.g. it cannot be opened at all: not damage, the caller says why
            raise
        verdict = [str(exc)]
    if verdict != ["ok"]:
        lines = [line for text in verdict for line in str(text).splitlines() if line and not line.startswith("***")]
        detail = (lines[0] if lines else "integrity check failed")[:200]
        raise DamagedStore(f"the job store {path} is damaged ({detail}); it was left as it is: restore it from a "
                           "backup, or move it away to start with an empty store")


def _create_store(path: Path) -> None:
    """A new, empty store at `path`, made under another name and renamed into place, so that
    an empty file at `path` is never ours (a crash here leaves only the other name)."""
    fresh = path.with_name(f"{path.name}.new-{os.getpid()}")
    def remove_fresh() -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{fresh}{suffix}")

    remove_fresh()
    try:
        os.close(os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        db = sqlite3.connect(str(fresh), isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
        finally:
            db.close()  # checkpoints: the file holds it all, no -wal left
        _fsync(fresh)
    except (OSError, sqlite3.Error):  # e.g. a full disk: leave nothing half-made behind
        remove_fresh()
        raise
    try:
        os.link(fresh, path)  # never over a store another process made meanwhile
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        os.rename(fresh, path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fresh)
    _fsync(path.parent)  # the new name survives a crash too


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JobStore:
    def __init__(self, state_dir: str | Path) -> None:
        path = Path(state_dir)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # also when it existed: it holds prompts and results
        self.path = path / "jobs.sqlite3"
        if self.path.exists():
            check_integrity(self.path)
        else:
            _create_store(self.path)
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{self.path}{suffix}").exists():
                os.chmod(f"{self.path}{suffix}", 0o600)
        self._lock = threading.Lock()
        self._paused_until = 0.0  # the request loop's calls: no job work before this (monotonic), after a store failure
        self._pause_s = 0.0
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
               quota: Quota | None = None, digest: str | None = None) -> JobRecord:
        """A job from (id, raw request, error or None) items; items with an error are failed at once,
        stored with their error only (the request that made them invalid is not kept).

        With an `idempotency_key` the tenant already used: that job, unchanged, when its
        requests had the same `digest` (a hash of the submitted requests), else
        IdempotencyConflict. Over a limit of `quota` (counted in the same transaction): LimitExceeded."""
        job_id = "job-" + uuid.uuid4().hex[:16]
        now = time.time()
        failed = sum(1 for _, _, error in items if error)
        rows, size = [], 0
        for idx, (item_id, raw, error) in enumerate(items):
            request = "{}" if error else json.dumps(raw)
            error = error[:MAX_ERROR_CHARS] if error else None
            size += len(item_id) + len(request) + len(error or "")
            rows.append((job_id, idx, item_id, request, ITEM_FAILED if error else PENDING, None, error))
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if idempotency_key:
                row = self._db.execute(
                    "SELECT job_id, request_digest FROM jobs WHERE tenant = ? AND idempotency_key = ?", (tenant, idempotency_key)
                ).fetchone()
                if row:
                    job_id, used_digest = row
                    if digest and used_digest and digest != used_digest:  # jobs stored before digests: taken as the same
                        raise IdempotencyConflict(
                            f"idempotency_key {short(idempotency_key)!r} was already used for job {job_id} with other "
                            "requests; a new batch needs a new key")
                    rows = []
            if rows:
                self._check_quota(tenant, len(items) - failed, size, quota or Quota())
                self._db.execute(
                    "INSERT INTO jobs (job_id, state, total, failed, created_at, tenant, idempotency_key, request_digest, bytes) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, QUEUED, len(items), failed, now, tenant, idempotency_key or None, digest, size),
                )
                seq = self._next_seq()
                numbered = []
                for row in rows:
                    numbered.append((*row, seq if row[4] == ITEM_FAILED else None))
                    seq += row[4] == ITEM_FAILED
                self._db.executemany(
                    "INSERT INTO items (job_id, idx, id, request, status, result, error, done_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    numbered,
                )
                self._settle(job_id)
        return self.get(job_id)

    def _check_quota(self, tenant: str, new_pending: int, new_bytes: int, quota: Quota) -> None:
        """Inside the transaction: LimitExceeded, naming the limit, unless the job fits every one."""
        live_states = (QUEUED, RUNNING)
        if quota.tenant_live_jobs is not None:
            live = self._db.execute("SELECT COUNT(*) FROM jobs WHERE tenant = ? AND state IN (?, ?)", (tenant, *live_states)).fetchone()[0]
            if live >= quota.tenant_live_jobs:
                raise LimitExceeded(f"this tenant has {live} unfinished jobs, its share of --max-live-jobs is "
                                    f"{quota.tenant_live_jobs}; retry when one finishes")
        if quota.max_live_jobs is not None:
            live = self._db.execute("SELECT COUNT(*) FROM jobs WHERE state IN (?, ?)", live_states).fetchone()[0]
            if live >= quota.max_live_jobs:
                raise LimitExceeded(f"the server holds {live} unfinished jobs (--max-live-jobs {quota.max_live_jobs}); retry later")
        if quota.tenant_pending_items is not None:
            pending = self._pending_count(tenant)
            if pending + new_pending > quota.tenant_pending_items:
                raise LimitExceeded(f"this tenant has {pending} job items pending; {new_pending} more would pass its share of "
                                    f"--max-pending-items ({quota.tenant_pending_items})")
        if quota.max_pending_items is not None:
            pending = self._pending_count()
            if pending + new_pending > quota.max_pending_items:
                raise LimitExceeded(
                    f"the server has {pending} job items pending; {new_pending} more would pass --max-pending-items "
                    f"({quota.max_pending_items})")
        if quota.tenant_store_bytes is not None:
            stored = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM jobs WHERE tenant = ?", (tenant,)).fetchone()[0]
            if stored + new_bytes > quota.tenant_store_bytes:
                raise LimitExceeded(f"this tenant's jobs hold {stored} bytes; {new_bytes} more would pass its share of "
                                    f"--max-store-bytes ({quota.tenant_store_bytes}); jobs are deleted --job-retention-s after they end")

    def purge(self, finished_before: float) -> int:
        """Delete the jobs (and their items) that finished, failed or were cancelled before
        `finished_before` (a time.time()); how many. Their pages are reused by new jobs."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            old = [row[0] for row in self._db.execute(
                "SELECT job_id FROM jobs WHERE finished_at > 0 AND finished_at < ? AND state IN (?, ?, ?)",
                (finished_before, *TERMINAL))]
            for job_id in old:
                self._db.execute("DELETE FROM items WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        return len(old)

    def finish_item(self, item: PendingItem, result: dict | None, error: str | None) -> JobRecord | None:
        """Mark one item done (with its result) or failed (with its error), in one transaction.

        A no-op when the item is no longer pending (its job was cancelled meanwhile). When the
        store cannot be written (disk full): one line logged, job work paused, None; the item
        stays pending and runs again (`_loop_failed`)."""
        try:
            with self._lock, self._db:
                self._db.execute("BEGIN IMMEDIATE")
                status = ITEM_FAILED if error else DONE
                error = error[:MAX_ERROR_CHARS] if error else None
                stored = error or json.dumps(result)
                changed = self._db.execute(
                    "UPDATE items SET status = ?, result = ?, error = ?, done_seq = ? "
                    "WHERE job_id = ? AND idx = ? AND status = ?",
                    (status, None if error else stored, error, self._next_seq(), item.job_id, item.idx, PENDING),
                ).rowcount
                if changed:
                    column = "failed" if error else "completed"
                    self._db.execute(f"UPDATE jobs SET {column} = {column} + 1, bytes = bytes + ? WHERE job_id = ?",
                                     (len(stored), item.job_id))
                    self._settle(item.job_id)
            job = self.get(item.job_id)
        except sqlite3.Error as exc:
            self._loop_failed(f"writing the result of job {item.job_id} item {item.idx}", exc)
            return None
        self._pause_s, self._paused_until = 0.0, 0.0  # it can be written again: no need to wait out the pause
        return job

    def mark_running(self, job_id: str) -> None:
        try:
            with self._lock, self._db:
                self._db.execute("UPDATE jobs SET state = ? WHERE job_id = ? AND state = ?", (RUNNING, job_id, QUEUED))
        except sqlite3.Error as exc:  # the state is only shown; the item runs all the same
            self._loop_failed(f"marking job {job_id} running", exc)

    def _loop_failed(self, what: str, exc: sqlite3.Error) -> None:
        """The request loop's calls never raise for the store's sake (the loop also serves
        interactive requests): a store that cannot be read or written logs one line and
        gives the loop no job work for a while (5 s, doubling up to a minute while it keeps
        failing); every item not written stays pending, to run again."""
        now = time.monotonic()
        if now < self._paused_until:  # items already in flight when it began: one line, one pause
            return
        _log(f"{TROUBLE[trouble(exc)]} ({what}: {first_line(exc, 200)}); "
             "job items stay pending and are retried")
        self._pause_s = min(MAX_PAUSE_S, max(MIN_PAUSE_S, self._pause_s * 2))
        self._paused_until = now + self._pause_s

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
        items = self.pending_items(1, set())
        return items[0] if items else None

    def pending_items(self, limit: int, skip: set[tuple[str, int]]) -> list[PendingItem]:
        """Up to `limit` pending items, oldest live job first, leaving out `skip` ((job_id, idx) already in flight).

        An item whose stored request does not decode is failed with DAMAGED_REQUEST instead.
        None while job work is paused (`_loop_failed`), or when the store cannot be read."""
        if time.monotonic() < self._paused_until:
            return []
        try:
            with self._lock:
                return self._pending_items(limit, skip)
        except sqlite3.Error as exc:
            self._loop_failed("reading pending job items", exc)
            return []

    def _pending_items(self, limit: int, skip: set[tuple[str, int]]) -> list[PendingItem]:
        """Round robin between tenants: each next item goes to the tenant with the fewest items in
        flight (`skip` counted), from its oldest live job; so one tenant's big job never holds up
        another tenant's."""
        live = self._db.execute(
            "SELECT job_id, tenant FROM jobs WHERE state IN (?, ?) ORDER BY created_at, rowid", (QUEUED, RUNNING)
        ).fetchall()
        jobs_of: dict[str, list[str]] = {}
        for job_id, tenant in live:
            jobs_of.setdefault(tenant, []).append(job_id)
        tenant_of = dict(live)
        in_flight = {tenant: 0 for tenant in jobs_of}
        for job_id, _ in skip:
            if job_id in tenant_of:
                in_flight[tenant_of[job_id]] += 1
        sources = {tenant: self._tenant_pending(job_ids, limit, skip) for tenant, job_ids in jobs_of.items()}
        found: list[PendingItem] = []
        while len(found) < limit and sources:
            tenant = min(sources, key=in_flight.__getitem__)  # ties: the tenant whose oldest job is oldest
            item = next(sources[tenant], None)
            if item is None:
                del sources[tenant]
                continue
            found.append(item)
            in_flight[tenant] += 1
        return found

    def _tenant_pending(self, job_ids: list[str], limit: int, skip: set[tuple[str, int]]):
        """One tenant's pending items not in `skip`, oldest job first (up to `limit` per job)."""
        for job_id in job_ids:
            taken = sum(1 for job, _ in skip if job == job_id)
            rows = self._db.execute(  # as bytes: a damaged row must not fail the whole query
                "SELECT idx, CAST(id AS BLOB), CAST(request AS BLOB) FROM items WHERE status = ? AND job_id = ? "
                "ORDER BY idx LIMIT ?",
                (PENDING, job_id, limit + taken),
            ).fetchall()
            for idx, item_id, request in rows:
                if (job_id, idx) in skip:
                    continue
                decoded = _json_object(request)
                if decoded is None:
                    self._fail_damaged(job_id, idx)
                    continue
                yield PendingItem(job_id, idx, _text(item_id), decoded)

    def _fail_damaged(self, job_id: str, idx: int) -> None:
        """Inside the lock: fail an item whose stored request is damaged, as it would fail validation."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            changed = self._db.execute(
                "UPDATE items SET status = ?, error = ?, done_seq = ? WHERE job_id = ? AND idx = ? AND status = ?",
                (ITEM_FAILED, DAMAGED_REQUEST, self._next_seq(), job_id, idx, PENDING),
            ).rowcount
            if changed:
                self._db.execute("UPDATE jobs SET failed = failed + 1 WHERE job_id = ?", (job_id,))
                self._settle(job_id)
        _log(f"job {job_id} item {idx}: {DAMAGED_REQUEST}; failed")

    def pending_count(self) -> int:
        with self._lock:
            return self._pending_count()

    def _pending_count(self, tenant: str | None = None) -> int:
        query, args = ("SELECT COUNT(*) FROM items i JOIN jobs j ON j.job_id = i.job_id WHERE i.status = ? AND j.state IN (?, ?)",
                       [PENDING, QUEUED, RUNNING])
        if tenant is not None:
            query, args = query + " AND j.tenant = ?", args + [tenant]
        return self._db.execute(query, args).fetchone()[0]

    def results_after(self, job_id: str, after_seq: int) -> list[tuple[int, ItemResult]]:
        """Finished items of a job in the order they finished, after `after_seq`: [(seq, result)].

        An item whose stored result or error does not decode comes back with DAMAGED_RESULT
        as its error: what it held is never quoted to the client."""
        with self._lock:
            rows = self._db.execute(  # as bytes: a damaged row must not fail the whole query
                "SELECT done_seq, CAST(id AS BLOB), CAST(result AS BLOB), CAST(error AS BLOB) FROM items "
                "WHERE job_id = ? AND done_seq > ? ORDER BY done_seq",
                (job_id, after_seq),
            ).fetchall()
        results = []
        for seq, item_id, result, error in rows:
            decoded = _json_object(result) if result is not None else None
            try:
                message = error.decode("utf-8") if error is not None else ""
            except UnicodeDecodeError:
                message = None
            if (result is not None and decoded is None) or message is None:
                decoded, message = None, DAMAGED_RESULT
            results.append((seq, ItemResult(_text(item_id), decoded, message)))
        return results


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw is not None else ""


def _json_object(raw: bytes) -> dict | None:
    """A stored JSON object, or None when the bytes are not one (a damaged row)."""
    try:
        decoded = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return decoded if isinstance(decoded, dict) else None


def _log(message: str) -> None:
    print(f"polyspec serve: {message}", file=sys.stderr, flush=True)
