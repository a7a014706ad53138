"""The server's one model thread: interactive requests and job items through the one request loop.

The Engine is not thread-safe, so all model work happens on this thread. It drives a
`ContinuousBatch` (polyspec.orchestrator.batch_runner: the loop `polyspec batch` runs); this
module only chooses what runs, each pass (`run`): admit waiting requests, fairly between tenants
(`_admit`, `_slot_cap`), fill free slots with job items (`_fill_jobs`), cancel what was cancelled,
then one step of the batch, where a request whose own row raises fails alone. docs/serving.md
("Scheduling", "Tenants share the server") gives the rules.

A request reports through its `on_event(kind, payload)`, called on this thread from the batch's
callbacks: ("delta", (token_ids, text)) after each round (only the new text; a stop string ends
the request there: its last delta ends before the stop, its result's finish_reason is "stop"),
then ("done", (result, timings)) or ("error", exc).
Job items write their result through the JobStore (result and "done" in one transaction).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from typing import Any, Callable

from polyspec.orchestrator.batch_runner import ContinuousBatch, is_unavailable
from polyspec.orchestrator.decode.contract import FINISH_STOP
from polyspec.orchestrator.serving.jobs import JobStore, PendingItem
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.security import Tenants
from polyspec.workers.core.errors import RequestError, first_line

MAX_ACTIVE = 32  # interactive requests holding caches at once; the rest wait their turn
JOB_RESERVE_SHARE = 0.25  # batched: this share of the slots is never taken by job items
TENANT_ACTIVE_S = 5.0  # a tenant counts as having work this long after its last request arrived (request after request)
IDLE_WAIT_S = 1.0  # re-check the job table this often when idle
UNAVAILABLE_RETRY_S = 1.0  # a job item that met a down chain is retried after this


@dataclasses.dataclass(eq=False)
class Work:
    """One request on its way through the scheduler."""

    request: Any  # engine.GenerationRequest
    on_event: Callable[[str, Any], None] | None = None
    job_item: PendingItem | None = None
    tenant: str = ""  # whose share of the queue and of the batch it takes
    received_at: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False  # set from any thread; honoured before the next round
    stops: tuple[str, ...] = ()  # stop strings that end it (the batch's TextStream)
    state: Any = None
    started_at: float | None = None
    first_token_at: float | None = None

    def timings(self) -> dict:
        """Seconds waiting before the first round, and from arrival to the first tokens."""
        start = self.started_at or time.perf_counter()
        return {
            "queue_s": round(start - self.received_at, 6),
            "first_token_s": round((self.first_token_at or start) - self.received_at, 6),
        }


class Choice:
    """One choice of an answer (OpenAI's `n`, gRPC's `n`; both APIs use it): one request's work, submitted with its
    stop strings, and what its events have shown so far. The round thread's batch cuts its text and tokens at the
    first stop string (`TextStream`) and ends it there as "stop"; a choice gathers the deltas' tokens and text, then
    the result's finish_reason."""

    def __init__(self, work: Work, scheduler, index: int = 0) -> None:
        self.work, self.scheduler = work, scheduler  # scheduler: the RoundScheduler the work was submitted to
        self.index = index  # its place among the answer's choices
        self.token_ids: list[int] = []  # up to the token that completed a stop string
        self.text = ""  # shown so far
        self.finish_reason: str | None = None  # once done: "stop" when a stop string cut it, else the engine's reason
        self.finished = False  # done, or failed
        self.plans: list[dict] | None = None  # once done, with `lengths: auto`: the planner's plans (stats.plans)

    @property
    def stopped(self) -> bool:
        return self.finish_reason == FINISH_STOP

    def delta(self, token_ids: list[int], text: str) -> str:
        """A round's tokens and new text -> the text to show."""
        self.token_ids += token_ids
        self.text += text
        return text

    def done(self, result: dict) -> None:
        self.finish_reason = result["finish_reason"]
        self.plans = (result.get("stats") or {}).get("plans")
        self.finished = True

    def failed(self) -> None:
        self.finished = True

    def cancel(self) -> None:
        self.scheduler.cancel(self.work)  # a no-op for finished work


INTERNAL_REASON = "internal error (the server's log has the details)"


def public_reason(exc: BaseException) -> str:
    """What a client is told about `exc`, one line: a request's own mistake or a down chain is
    described (the server's own words); any other exception's text stays in the server's log."""
    if isinstance(exc, RequestError) or is_unavailable(exc):
        return first_line(exc)
    return INTERNAL_REASON


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class RoundScheduler(threading.Thread):
    def __init__(self, engine, store: JobStore | None, metrics: Metrics, max_queue: int,
                 on_jobs_changed: Callable[[], None] = lambda: None, tenants: Tenants | None = None) -> None:
        super().__init__(name="polyspec-rounds", daemon=True)
        self.engine = engine
        self.batch = ContinuousBatch(engine, engine.max_requests if engine.batched else MAX_ACTIVE,
                                     self._on_delta, self._on_result, self._on_error)
        self._over: list[Work] = []  # the work of the step under way that is over
        self._work_of: dict[int, Work] = {}  # id(state) -> its work, for the step under way
        self.store = store
        self.metrics = metrics
        self.max_queue = max_queue
        self.tenants = tenants or Tenants({})
        self._last_request: dict[str, float] = {}  # tenant -> when its latest request arrived (monotonic)
        self.on_jobs_changed = on_jobs_changed
        self._cond = threading.Condition()
        self._waiting: list[Work] = []
        self._active: list[Work] = []  # interactive requests admitted (changed on this thread only, under _cond)
        self._jobs: list[Work] = []  # job items in flight
        self._cancelled_jobs: set[str] = set()
        self._draining = False
        self._stopping = False
        self.idle = threading.Event()  # set while no interactive request is waiting or running

    # --------------------------------------------------------- called from any thread

    def submit_all(self, works: list[Work]) -> None:
        """Queue every one of `works`, or (QueueFull, Draining) none of them."""
        with self._cond:
            if self._draining:
                raise Draining("the server is shutting down")
            more = f" for {len(works)} more" if len(works) > 1 else ""
            for tenant in {work.tenant for work in works}:
                share = self.tenants.share(tenant, self.max_queue)
                held = sum(1 for work in self._waiting + self._active if work.tenant == tenant)
                asked = sum(1 for work in works if work.tenant == tenant)
                if share < self.max_queue and held + asked > share:
                    raise QueueFull(f"this tenant's share of the server queue is full ({held} of {share} requests){more}; "
                                    "retry later")
            queued = len(self._waiting) + len(self._active)
            if queued + len(works) > self.max_queue:
                raise QueueFull(f"the server queue is full ({self.max_queue} requests){more}; retry later")
            self._waiting.extend(works)
            now = time.monotonic()
            for work in works:
                self._last_request[work.tenant] = now
            self._publish_queue()
            self.idle.clear()
            self._cond.notify()

    def _publish_queue(self) -> None:
        """The queue_depth gauges (all, and per tenant), whenever waiting / running change (caller holds _cond)."""
        self.metrics.queue(len(self._waiting), len(self._active))
        counts = {tenant: [0, 0] for tenant in self.tenants.weights}
        for index, works in enumerate((self._waiting, self._active)):
            for work in works:
                counts.setdefault(work.tenant, [0, 0])[index] += 1
        self.metrics.tenant_queue(counts)

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
        """No new work from now on; running requests go on. Job items in flight are dropped
        (not written), so they run again at the next start."""
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
                while not (self._stopping or self._waiting or self._active or self._jobs or self._has_job_work()):
                    self.idle.set()
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    break
                # job items in flight keep their slots
                room = max(0, self.batch.max_requests - len(self._active) - len(self._jobs))
                self._active.extend(self._admit(room))
                interactive = len(self._active) + len(self._waiting)
                self._publish_queue()
            self._fill_jobs(interactive)
            self._retire(self._step())
        self._abandon_all()

    def _admit(self, room: int) -> list[Work]:
        """Up to `room` waiting requests, taken out of `_waiting` (caller holds _cond): each to the
        tenant with the fewest running for its weight (oldest request first within a tenant), none
        past a tenant's cap (`_slot_cap`)."""
        if len({work.tenant for work in self._waiting}) <= 1 and not self.tenants.enabled:
            admitted, self._waiting = self._waiting[:room], self._waiting[room:]
            return admitted
        running: dict[str, int] = {}
        for work in self._active:
            running[work.tenant] = running.get(work.tenant, 0) + 1
        recent = time.monotonic() - TENANT_ACTIVE_S
        busy = {work.tenant for work in self._waiting} | set(running) | {
            tenant for tenant, arrived in self._last_request.items() if arrived > recent}
        caps = {tenant: self._slot_cap(tenant, busy) for tenant in busy}
        admitted = []
        while len(admitted) < room and self._waiting:
            first: dict[str, int] = {}  # tenant -> index of its oldest waiting request
            for index, work in enumerate(self._waiting):
                if work.tenant not in first and running.get(work.tenant, 0) < caps[work.tenant]:
                    first[work.tenant] = index
            if not first:
                break
            tenant = min(first, key=lambda name: (running.get(name, 0) / self._weight(name), first[name]))
            admitted.append(self._waiting.pop(first[tenant]))
            running[tenant] = running.get(tenant, 0) + 1
        return admitted

    def _weight(self, tenant: str) -> float:
        return self.tenants.weights.get(tenant, 1.0)

    def _slot_cap(self, tenant: str, busy: set[str]) -> int:
        """The most slots `tenant` may hold. While other tenants have requests waiting or running (or sent
        one within TENANT_ACTIVE_S: a client sending request after request is between two): its
        weighted share of the slots among those tenants (a bigger batch would slow their requests'
        every round); else all but one kept for each other tenant (at most half of them), so another
        tenant's first request starts at the next step."""
        slots = self.batch.max_requests
        others = busy - {tenant}
        if others:
            weight = self._weight(tenant)
            return max(1, int(slots * weight / (weight + sum(map(self._weight, others)))))
        return slots - min(len(set(self.tenants.weights) - {tenant}), slots // 2)

    def _step(self) -> list[Work]:
        """Cancel what was cancelled, start what was admitted, then one step of the batch, reported
        request by request (the batch's callbacks); returns the work that is over (finished, cancelled or failed)."""
        self._over, live = [], []
        for work in self._active + self._jobs:
            if work.cancelled:
                self._cancel(work)
                self._over.append(work)
                continue
            if work.state is None:
                try:
                    work.started_at = time.perf_counter()
                    work.state = self.batch.admit(work.request, work.stops, stream=work.job_item is None)
                except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
                    self._failed(work, exc)
                    self._over.append(work)
                    continue
            live.append(work)
        self._work_of = {id(work.state): work for work in live}
        if live:
            interactive = [work for work in live if work.job_item is None]
            # an engine that takes turns: job items wait (caches kept) while interactive requests run
            stepping = live if self.engine.batched or not interactive else interactive
            step = self.batch.step([work.state for work in stepping]).step
            if step.get("batch"):
                self.metrics.batch_step(step["batch"], step["tokens"], step["seconds"], len(step.get("tiers", ())) > 1)
        return self._over

    def _on_delta(self, state, tokens: list[int], text: str) -> None:
        work = self._work_of[id(state)]
        if work.first_token_at is None:
            work.first_token_at = time.perf_counter()
            if work.job_item is None:
                self.metrics.first_token(work.first_token_at - work.received_at)
        self.metrics.tokens(len(tokens))
        if work.on_event is not None:
            work.on_event("delta", (list(tokens), text))

    def _on_result(self, state, result: dict) -> None:
        self._over.append(self._work_of[id(state)])
        self._finished(self._work_of[id(state)], result)

    def _on_error(self, state, exc: Exception, shared: bool) -> None:
        self._over.append(self._work_of[id(state)])
        self._failed(self._work_of[id(state)], exc, shared)

    def _retire(self, over: list[Work]) -> None:
        """Take work that is over out of the running lists (its slot is free for the next)."""
        if not over:
            return
        ended = set(map(id, over))
        self._jobs = [work for work in self._jobs if id(work) not in ended]
        with self._cond:
            self._active = [work for work in self._active if id(work) not in ended]
            self._publish_queue()
            if not self._active and not self._waiting:
                self.idle.set()

    def _has_job_work(self) -> bool:
        return not self._draining and self.store is not None and self.store.next_pending() is not None

    def publish_speculation(self) -> None:
        """The lengths in use (a planner moves them) -> the speculation_length gauge."""
        chain = self.engine.scheduler
        self.metrics.speculation([(chain.tiers[i].name, chain.tiers[i + 1].name, k) for i, k in enumerate(chain.lengths)])

    def _finished(self, work: Work, result: dict) -> None:
        stats = result.get("stats") or {}
        self.metrics.stage_stats(stats.get("stages", []))
        self.metrics.plan_stats(stats.get("plans", []))
        self.publish_speculation()
        if result.get("mode"):  # only an approximate result names its mode
            self.metrics.approximate_request(result["mode"])
        if work.job_item is not None:
            self._write_item(work, result, None)
            return
        status = "cancelled" if result.get("finish_reason") == "cancelled" else "ok"  # (a stop string's end is "ok")
        self.metrics.request_finished(status, time.perf_counter() - work.received_at)
        if work.on_event is not None:
            work.on_event("done", (result, work.timings()))

    def _cancel(self, work: Work) -> None:
        """Stop `work` and free its caches (`Engine.cancel`)."""
        result = {"token_ids": [], "finish_reason": "cancelled", "stats": {}}  # (never admitted: nothing committed)
        if work.state is not None:
            try:
                result = self.batch.cancel(work.state)
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
                self._failed(work, exc)
                return
        if work.job_item is not None:
            return  # not written: the item stays pending (its job was cancelled, or it reruns at the next start)
        self._finished(work, {**result, "finish_reason": "cancelled"})

    def _failed(self, work: Work, exc: Exception, shared: bool = False) -> None:
        """`work` ends with `exc` (its caches are freed already). `shared`: every request of its step failed alone
        too (the chain's fault): a job item is then not failed for good but left pending and retried, as when the
        chain is down."""
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

    def _fill_jobs(self, interactive: int) -> None:
        """Mark the job items of cancelled jobs (all of them, draining) cancelled, then admit pending items
        into the slots jobs may take (`interactive`: requests waiting or running)."""
        for work in self._jobs:
            if work.job_item.job_id in self._cancelled_jobs or self._draining:
                work.cancelled = True
        room = self._job_room(interactive)
        if room <= 0 or self._draining or self.store is None:
            return
        skip = {(w.job_item.job_id, w.job_item.idx) for w in self._jobs}
        for item in self.store.pending_items(room, skip):
            if item.job_id in self._cancelled_jobs:
                continue
            work = self._parse_job_item(item)
            if work is not None:
                self._jobs.append(work)

    def _job_room(self, interactive: int) -> int:
        """How many more job items may run: a batched engine keeps JOB_RESERVE_SHARE of its slots for
        interactive requests; one that takes turns runs one item, only while no interactive request is there."""
        if not self.engine.batched:
            return 0 if interactive else 1 - len(self._jobs)
        capacity = self.batch.max_requests
        reserve = max(1, int(capacity * JOB_RESERVE_SHARE)) if capacity > 1 else 0
        return capacity - reserve - interactive - len(self._jobs)

    def _parse_job_item(self, item) -> Work | None:
        """A pending job item marked running and parsed into work; None (its error written) when invalid."""
        self.store.mark_running(item.job_id)
        try:
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
            pending = self._waiting + self._active + self._jobs
            self._waiting, self._active, self._jobs = [], [], []
            self._publish_queue()
        for work in pending:
            work.cancelled = True
            try:
                self._cancel(work)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self.batch.close()
