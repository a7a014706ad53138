"""Server counters: one object feeds both `GetStats` and Prometheus `/metrics`.

The Prometheus metrics are declared in `Metrics.__init__`, each with its help text (docs/serving.md lists
them). The planner's are labelled per chain, its set of tiers ("target<-mid<-ngram": at most 2^(tiers - 1)
labels, so bounded by the config), from each finished request's `stats.plans`; `GetStats` carries the same
per-chain sums (`plans`) and the last RECENT_PLANS plan records as results list them (`recent_plans`).
`build_metrics_app` serves them at GET /metrics (with a Tenants object: only to a caller with a token).
"""

from __future__ import annotations

import collections
import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from polyspec.orchestrator.decode.contract import PlanTally, chain_label

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
RECENT_PLANS = 32  # plan records GetStats' recent_plans keeps (the last ones run, over all requests)
STATUSES = ("ok", "cancelled", "invalid_argument", "resource_exhausted", "unauthenticated", "unavailable", "internal")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self.requests = collections.Counter()  # status -> count
        self.job_items = collections.Counter()  # outcome (done | failed) -> count
        self.generated_tokens = 0
        self.stages: dict[tuple[str, str], dict] = {}  # (tier, drafter) -> cumulative blocks / proposed / accepted / time_s
        r = self.registry
        self._requests = Counter("polyspec_requests", "Generate requests by final status", ["status"], registry=r)
        self._tokens = Counter("polyspec_generated_tokens", "Tokens committed (interactive and job items)", registry=r)
        self._proposed = Counter("polyspec_stage_proposed_tokens", "Draft tokens proposed per stage", ["tier", "drafter"], registry=r)
        self._accepted = Counter("polyspec_stage_accepted_tokens", "Draft tokens accepted per stage", ["tier", "drafter"], registry=r)
        self._length = Gauge("polyspec_speculation_length", "Speculation length in use per stage", ["tier", "drafter"], registry=r)
        self._ttft = Histogram("polyspec_time_to_first_token_seconds", "Request received -> first tokens", buckets=LATENCY_BUCKETS, registry=r)
        self._latency = Histogram("polyspec_request_latency_seconds", "Request received -> finished", buckets=LATENCY_BUCKETS, registry=r)
        self._queue = Gauge("polyspec_queue_depth", "Interactive requests waiting / running", ["state"], registry=r)
        self._tenant_queue = Gauge("polyspec_tenant_queue_depth", "Interactive requests waiting / running per tenant",
                                   ["tenant", "state"], registry=r)
        self._items = Counter("polyspec_job_items_done", "Job items finished", ["outcome"], registry=r)
        self._tier_up = Gauge("polyspec_tier_up", "1 while the tier is loaded and serving", ["tier"], registry=r)
        self._batch = Histogram("polyspec_batch_size", "Requests in one batched step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self._goodput = Gauge("polyspec_goodput_tokens_per_second", "Tokens committed per second of batched steps (smoothed)", registry=r)
        self._speculating = Gauge("polyspec_speculating", "1 while the batched steps speculate", registry=r)
        self._approximate = Counter("polyspec_approximate_requests", "Requests finished in an approximate (not lossless) mode",
                                    ["mode"], registry=r)
        self._plan_rounds = Counter("polyspec_plan_rounds", "Rounds run under each chain the planner chose", ["chain"], registry=r)
        self._plan_tokens = Counter("polyspec_plan_tokens", "Tokens committed under each chain the planner chose", ["chain"], registry=r)
        self._plan_seconds = Counter("polyspec_plan_seconds", "Wall seconds of the rounds under each chain, summed over requests",
                                     ["chain"], registry=r)
        self._plan_rate = Gauge("polyspec_plan_tokens_per_second", "Per request tokens/s under each chain: measured, and the planner's prediction",
                                ["chain", "source"], registry=r)
        self._plan_ratio = Histogram("polyspec_plan_prediction_ratio", "Measured / predicted tokens/s of each plan a request ran under",
                                     buckets=PREDICTION_RATIO_BUCKETS, registry=r)
        self.plans = PlanTally()  # the same sums, for snapshot()
        self.recent_plans: collections.deque[dict] = collections.deque(maxlen=RECENT_PLANS)  # the records themselves
        self.goodput = 0.0
        self._tenants_seen: set[str] = set()
        self.last_batch = 0
        for status in STATUSES:
            self._requests.labels(status)
        for outcome in ("done", "failed"):
            self._items.labels(outcome)

    # ------------------------------------------------------------------ recording

    def request_finished(self, status: str, latency_s: float | None = None) -> None:
        with self._lock:
            self.requests[status] += 1
        self._requests.labels(status).inc()
        if latency_s is not None:
            self._latency.observe(latency_s)

    def batch_step(self, size: int, tokens: int, seconds: float, speculating: bool) -> None:
        """One batched step: its size, and its tokens per second into the smoothed goodput."""
        self._batch.observe(size)
        self._speculating.set(1 if speculating else 0)
        if seconds > 0:
            with self._lock:
                rate = tokens / seconds
                self.goodput = rate if not self.last_batch else self.goodput + 0.2 * (rate - self.goodput)
                self.last_batch = size
            self._goodput.set(self.goodput)

    def plan_stats(self, records: list[dict]) -> None:
        """Add one finished request's `stats["plans"]` (contract.plan_records): what the planner chose and how it ran."""
        with self._lock:
            self.plans.add(records)
            self.recent_plans.extend(dict(record) for record in records)
            totals = self.plans.as_dict()
        for record in records:
            if "rounds" not in record:
                continue
            label = chain_label(record["tiers"])
            self._plan_rounds.labels(label).inc(record["rounds"])
            self._plan_tokens.labels(label).inc(record["tokens"])
            self._plan_seconds.labels(label).inc(record["seconds"])
            total = totals[label]
            self._plan_rate.labels(label, "measured").set(total["measured_tokens_per_s"])
            if "predicted_tokens_per_s" in total:
                self._plan_rate.labels(label, "predicted").set(total["predicted_tokens_per_s"])
            if record.get("predicted_tokens_per_s") and record["seconds"] > 0:
                self._plan_ratio.observe(record["measured_tokens_per_s"] / record["predicted_tokens_per_s"])

    def approximate_request(self, mode: str) -> None:
        self._approximate.labels(mode).inc()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tokens(self, count: int) -> None:
        with self._lock:
            self.generated_tokens += count
        self._tokens.inc(count)

    def job_item(self, outcome: str) -> None:
        with self._lock:
            self.job_items[outcome] += 1
        self._items.labels(outcome).inc()

    def stage_stats(self, stages: list[dict]) -> None:
        """Add one finished request's `stats["stages"]`."""
        with self._lock:
            for stage in stages:
                key = (stage["tier"], stage["drafter"])
                total = self.stages.setdefault(key, {"blocks": 0, "proposed": 0, "accepted": 0, "time_s": 0.0})
                for field in total:
                    total[field] += stage.get(field, 0)
        for stage in stages:
            self._proposed.labels(stage["tier"], stage["drafter"]).inc(stage.get("proposed", 0))
            self._accepted.labels(stage["tier"], stage["drafter"]).inc(stage.get("accepted", 0))

    def speculation(self, stages: list[tuple[str, str, int]]) -> None:
        for tier, drafter, length in stages:
            self._length.labels(tier, drafter).set(length)

    def queue(self, waiting: int, running: int) -> None:
        self._queue.labels("waiting").set(waiting)
        self._queue.labels("running").set(running)

    def tenant_queue(self, counts: dict[str, list[int]]) -> None:
        """tenant -> [waiting, running]; a tenant once seen keeps its gauges (at 0 when idle)."""
        self._tenants_seen |= set(counts)
        for tenant in self._tenants_seen:
            waiting, running = counts.get(tenant, (0, 0))
            self._tenant_queue.labels(tenant or "anonymous", "waiting").set(waiting)
            self._tenant_queue.labels(tenant or "anonymous", "running").set(running)

    def tier_up(self, tier: str, up: bool) -> None:
        self._tier_up.labels(tier).set(1 if up else 0)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "job_items": dict(self.job_items),
                "generated_tokens": self.generated_tokens,
                "stages": {key: dict(value) for key, value in self.stages.items()},
                "plans": self.plans.as_dict(),
                "recent_plans": [dict(record) for record in self.recent_plans],
            }


def build_metrics_app(metrics: Metrics, tenants=None):
    """An ASGI app: GET /metrics in Prometheus' text format; 401 without a token when `tenants` is given."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    async def scrape(request) -> Response:
        if tenants is not None and tenants.enabled:
            given = request.headers.get("authorization", "")
            if tenants.tenant_of(given) is None:
                return PlainTextResponse(tenants.denial(given) + "\n", status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request, exc) -> Response:
        return PlainTextResponse("only GET /metrics here\n", status_code=exc.status_code)

    from starlette.exceptions import HTTPException

    return Starlette(routes=[Route("/metrics", scrape, methods=["GET"])], exception_handlers={HTTPException: not_found})
