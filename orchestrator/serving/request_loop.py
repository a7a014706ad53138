"""The server's one model thread: every request advances one target round at a time, in turn.

The Engine is not thread-safe, so all model work happens on this thread. Each pass:

    1. admit waiting interactive requests (at most MAX_ACTIVE hold caches at once; with the
       batched engine, its `max_requests`)
    2. one round (`engine.step`) for every active interactive request, round robin —
       a long request never holds the others back by more than one round each. With the
       batched engine all of them take that round together: one `engine.step_all` (one
       forward per tier), after the prompts of newly admitted requests are cached within
       the step's token budget (they join the round once cached)
    3. only when no interactive request is waiting or running: one round of the current
       job item (interactive first); the item pauses, caches kept, while interactive
       traffic is served. With the batched engine, job items instead fill the batch's free
       slots (all but JOB_RESERVE_SHARE of them, kept for interactive requests) and take the
       same batched rounds

A request reports through its `on_event(kind, payload)`, called on this thread:
("delta", (token_ids, text)) after each round, then ("done", result) or ("error", exc).
Job items write their result through the JobStore (result and "done" in one transaction).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from typing import Any, Callable

from polyspec.orchestrator.batch_runner import is_unavailable, step_isolated
from polyspec.orchestrator.serving.jobs import JobStore, PendingItem
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.tokenization import REPLACEMENT_CHAR
from polyspec.workers.core.errors import RequestError

MAX_ACTIVE = 32  # interactive requests holding caches at once; the rest wait their turn
JOB_RESERVE_SHARE = 0.25  # batched: this share of the slots is never taken by job items
IDLE_WAIT_S = 1.0  # re-check the job table this often when idle
UNAVAILABLE_RETRY_S = 1.0  # a job item that met a down chain is retried after this


@dataclasses.dataclass(eq=False)
class Work:
    """One request on its way through the scheduler."""

    request: Any  # engine.GenerationRequest
    on_event: Callable[[str, Any], None] | None = None
    job_item: PendingItem | None = None
    received_at: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False  # set from any thread; honoured before the next round
    state: Any = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text_sent: str = ""
    started_at: float | None = None
    first_token_at: float | None = None

    def timings(self) -> dict:
        """Seconds waiting before the first round, and from arrival to the first tokens."""
        start = self.started_at or time.perf_counter()
        return {
            "queue_s": round(start - self.received_at, 6),
            "first_token_s": round((self.first_token_at or start) - self.received_at, 6),
        }


INTERNAL_REASON = "internal error (the server's log has the details)"


def public_reason(exc: BaseException) -> str:
    """What a client is told about `exc`, one line: a request's own mistake or a down chain is
    described (the server's own words); any other exception's text stays in the server's log."""
    if isinstance(exc, RequestError) or is_unavailable(exc):
        text = str(exc)
        return text.splitlines()[0][:500] if text else type(exc).__name__
    return INTERNAL_REASON


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class RoundScheduler(threading.Thread):
    def __init__(self, engine, store: JobStore | None, metrics: Metrics, max_queue: int,
                 on_jobs_changed: Callable[[], None] = lambda: None, tokenizer_lock: threading.Lock | None = None) -> None:
        super().__init__(name="polyspec-rounds", daemon=True)
        self.engine = engine
        self._pool = None  # threads for concurrent rounds (distributed chains only)
        self.store = store
        self.metrics = metrics
        self.max_queue = max_queue
        self.on_jobs_changed = on_jobs_changed
        self.tokenizer_lock = tokenizer_lock or threading.Lock()  # shared with the server's request parsing
        self._cond = threading.Condition()
        self._waiting: list[Work] = []
        self._active: list[Work] = []
        self._job_work: Work | None = None
        self._job_batch: list[Work] = []  # batched: job items in flight
        self._cancelled_jobs: set[str] = set()
        self._draining = False
        self._stopping = False
        self.idle = threading.Event()  # set while no interactive request is waiting or running

    # --------------------------------------------------------- called from any thread

    def submit(self, work: Work) -> None:
        self.submit_all([work])

    def submit_all(self, works: list[Work]) -> None:
        """Queue every one of `works`, or (QueueFull, Draining) none of them."""
        with self._cond:
            if self._draining:
                raise Draining("the server is shutting down")
            queued = len(self._waiting) + len(self._active)
            if queued + len(works) > self.max_queue:
                more = f" for {len(works)} more" if len(works) > 1 else ""
                raise QueueFull(f"the server queue is full ({self.max_queue} requests){more}; retry later")
            self._waiting.extend(works)
            self._publish_queue()
            self.idle.clear()
            self._cond.notify()

    def _publish_queue(self) -> None:
        """The queue_depth gauge, whenever waiting / running change (caller holds _cond)."""
        self.metrics.queue(len(self._waiting), len(self._active))

    def cancel(self, work: Work) -> None:
        work.cancelled = True
        with self._cond:
            self._cond.notify()

    def cancel_job(self, job_id: str) -> None:
        with self._cond:
            self._cancelled_jobs.add(job_id)
            self._cond.notify()

    def jobs_added(self) -> None:
        with self._cond:
            self._cond.notify()

    def drain(self) -> None:
        """No new work from now on; running requests go on. The current job item is dropped
        (not written), so it runs again at the next start."""
        with self._cond:
            self._draining = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._draining = self._stopping = True
            self._cond.notify()

    def queue_depth(self) -> tuple[int, int]:
        """(waiting, running) interactive requests."""
        with self._cond:
            return len(self._waiting), len(self._active)

    # ---------------------------------------------------------------- the thread

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active and not self._job_batch and not self._has_job_work():
                    self.idle.set()
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    break
                # batched: a paused job item keeps its cache slot
                # batched: job items in flight keep their cache slots
                room = (self.engine.max_requests - len(self._job_batch) if self._batched else MAX_ACTIVE) - len(self._active)
                admitted, self._waiting = self._waiting[:room], self._waiting[room:]
                self._active.extend(admitted)
                active = list(self._active)
                self._publish_queue()
            if len(active) > 1 and getattr(self.engine.scheduler, "concurrent_steps", False):
                # a distributed chain: the tiers overlap the rounds of different requests
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(MAX_ACTIVE, thread_name_prefix="polyspec-round")
                over = list(self._pool.map(self._advance, active))
            elif self._batched:
                jobs = self._fill_job_batch(len(active))
                over = self._advance_batch(active + jobs) if active or jobs else []
                for work, finished in zip(jobs, over[len(active):]):
                    if finished:
                        self._job_batch.remove(work)
                over = over[: len(active)]
            else:
                over = [self._advance(work) for work in active]
            for work, finished in zip(active, over):
                if finished:
                    with self._cond:
                        self._active.remove(work)
                        self._publish_queue()
                        if not self._active and not self._waiting:
                            self.idle.set()
            if not active and not self._batched:
                self._advance_job()
        self._abandon_all()

    @property
    def _batched(self) -> bool:
        return bool(getattr(self.engine, "batched", False))

    def _advance_batch(self, active: list[Work]) -> list[bool]:
        """One batched round of every active request; for each, True when it is over."""
        over = [False] * len(active)
        live = []
        for index, work in enumerate(active):
            try:
                if work.cancelled:
                    over[index] = self._cancel(work)
                    continue
                if work.state is None:
                    work.started_at = time.perf_counter()
                    work.state = self.engine.start(work.request)
                live.append(index)
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
                self._failed(work, exc)
                over[index] = True
        # one request's row raising fails that request alone (polyspec.orchestrator.batch_runner.step_isolated)
        outcome = step_isolated(self.engine, [active[i].state for i in live])
        index_of = {id(active[i].state): i for i in live}
        for state, exc in outcome.failed:
            self._failed(active[index_of[id(state)]], exc, shared=outcome.shared_fault)
            over[index_of[id(state)]] = True
        step = self.engine.scheduler.last_step
        if outcome.advanced and step.get("batch"):
            self.metrics.batch_step(step["batch"], step["tokens"], step["seconds"], len(step.get("tiers", ())) > 1)
        for state, tokens in outcome.advanced:
            i = index_of[id(state)]
            work = active[i]
            try:
                if tokens:
                    self._emit_delta(work, tokens)
                if work.state.done:
                    with self.tokenizer_lock:
                        result = self.engine.finish(work.state)
                    self._finished(work, result)
                    over[i] = True
            except Exception as exc:  # noqa: BLE001
                self._failed(work, exc)
                over[i] = True
        return over

    def _decode(self, token_ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.engine.decode(token_ids)

    def _has_job_work(self) -> bool:
        if self._job_work is not None:
            return True
        return not self._draining and self.store is not None and self.store.next_pending() is not None

    def _advance(self, work: Work) -> bool:
        """One round of `work`; True when it is over (finished, cancelled or failed)."""
        try:
            if work.cancelled:
                return self._cancel(work)
            if work.state is None:
                work.started_at = time.perf_counter()
                work.state = self.engine.start(work.request)
            tokens = self.engine.step(work.state) if not work.state.done else []
            if tokens:
                self._emit_delta(work, tokens)
            if work.state.done:
                with self.tokenizer_lock:
                    result = self.engine.finish(work.state)
                self._finished(work, result)
                return True
            return False
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            self._failed(work, exc)
            return True

    def _emit_delta(self, work: Work, tokens: list[int]) -> None:
        if work.first_token_at is None:
            work.first_token_at = time.perf_counter()
            if work.job_item is None:
                self.metrics.first_token(work.first_token_at - work.received_at)
        work.token_ids.extend(tokens)
        self.metrics.tokens(len(tokens))
        text = self._decode(work.token_ids) if work.job_item is None else ""
        if text.endswith(REPLACEMENT_CHAR) and not work.state.done:
            delta = ""  # wait for the rest of the character
        else:
            delta = text[len(work.text_sent):] if text.startswith(work.text_sent) else ""
            work.text_sent += delta
        if work.on_event is not None:
            work.on_event("delta", (list(tokens), delta))

    def publish_speculation(self) -> None:
        """The lengths in use (a tuner moves them) -> the speculation_length gauge."""
        chain = self.engine.scheduler
        self.metrics.speculation([(chain.tiers[i].name, chain.tiers[i + 1].name, k) for i, k in enumerate(chain.lengths)])

    def _finished(self, work: Work, result: dict) -> None:
        stats = result.get("stats") or {}
        self.metrics.stage_stats(stats.get("stages", []))
        self.publish_speculation()
        if result.get("mode"):  # only an approximate result names its mode
            self.metrics.approximate_request(result["mode"])
        if work.job_item is not None:
            self._write_item(work, result, None)
            return
        final = self._decode(work.token_ids)
        tail = final[len(work.text_sent):] if final.startswith(work.text_sent) else ""
        status = "cancelled" if result.get("finish_reason") == "cancelled" else "ok"
        self.metrics.request_finished(status, time.perf_counter() - work.received_at)
        if work.on_event is not None:
            work.on_event("done", (result, tail, work.timings()))

    def _cancel(self, work: Work) -> bool:
        """Stop `work` and free its caches (`Engine.cancel`)."""
        result = {"token_ids": work.token_ids, "finish_reason": "cancelled", "stats": {}}
        if work.state is not None:
            with self.tokenizer_lock:
                result = self.engine.cancel(work.state)
        if work.job_item is not None:
            return True  # not written: the item stays pending (its job was cancelled, or it reruns at the next start)
        self._finished(work, {**result, "finish_reason": "cancelled"})
        return True

    def _failed(self, work: Work, exc: Exception, shared: bool = False) -> None:
        """`work` ends with `exc`. `shared`: every request of its step failed alone too (the chain's fault):
        a job item is then not failed for good but left pending and retried, as when the chain is down."""
        if work.state is not None:
            try:
                self.engine.cancel(work.state)
            except Exception:  # noqa: BLE001 - already failing; the first error is the one to report
                pass
        if not isinstance(exc, RequestError):
            print(f"polyspec serve: request failed: {exc!r}", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)
        if work.job_item is not None:
            if is_unavailable(exc) or shared:  # the chain is down or broken, not the item: it stays pending and is retried
                time.sleep(UNAVAILABLE_RETRY_S)
                return
            self._write_item(work, None, public_reason(exc))
            return
        status = "invalid_argument" if isinstance(exc, RequestError) else "unavailable" if is_unavailable(exc) else "internal"
        self.metrics.request_finished(status)
        if work.on_event is not None:
            work.on_event("error", exc)

    # ---------------------------------------------------------------------- jobs

    def _fill_job_batch(self, interactive: int) -> list[Work]:
        """Batched: mark cancelled job items, then admit pending ones into the free slots (but the reserve)."""
        for work in self._job_batch:
            if work.job_item.job_id in self._cancelled_jobs or self._draining:
                work.cancelled = True
        reserve = max(1, int(self.engine.max_requests * JOB_RESERVE_SHARE)) if self.engine.max_requests > 1 else 0
        room = self.engine.max_requests - reserve - interactive - len(self._job_batch)
        if room > 0 and not self._draining and self.store is not None:
            skip = {(w.job_item.job_id, w.job_item.idx) for w in self._job_batch}
            for item in self.store.pending_items(room, skip):
                if item.job_id in self._cancelled_jobs:
                    continue
                work = self._parse_job_item(item)
                if work is not None:
                    self._job_batch.append(work)
        return list(self._job_batch)

    def _advance_job(self) -> None:
        work = self._job_work
        if work is not None and (work.job_item.job_id in self._cancelled_jobs or self._draining):
            work.cancelled = True
        if work is None:
            if self._draining or self.store is None:
                return
            item = self.store.next_pending()
            if item is None:
                return
            work = self._job_work = self._parse_job_item(item)
            if work is None:
                return
        if self._advance(work):
            self._job_work = None

    def _parse_job_item(self, item) -> Work | None:
        """A pending job item marked running and parsed into work; None (its error written) when invalid."""
        self.store.mark_running(item.job_id)
        try:
            with self.tokenizer_lock:
                request = self.engine.parse_request({**item.request, "id": item.id})
        except RequestError as exc:
            self._write_item(Work(None, job_item=item), None, str(exc))
            return None
        return Work(request, job_item=item)

    def _write_item(self, work: Work, result: dict | None, error: str | None) -> None:
        self.store.finish_item(work.job_item, result, error)
        self.metrics.job_item("failed" if error else "done")
        self.on_jobs_changed()

    def _abandon_all(self) -> None:
        """Stopping: free every cache; interactive requests end as cancelled."""
        with self._cond:
            pending = self._waiting + self._active + ([self._job_work] if self._job_work else []) + self._job_batch
            self._waiting, self._active, self._job_work, self._job_batch = [], [], None, []
            self._publish_queue()
        for work in pending:
            work.cancelled = True
            try:
                self._cancel(work)
            except Exception:  # noqa: BLE001 - shutting down
                pass
