"""The gRPC API (protos/polyspec/v1/polyspec.proto) over one Engine; `serve.py` runs it.

    event loop (grpc.aio)  --Work-->  RoundScheduler thread (all model work, request_loop.py)
         ^                                    |
         +------ deltas / results ------------+   (loop.call_soon_threadsafe)

Streams carry one message per target round; a client that cancels (or whose deadline passes)
cancels its request's work. Health, draining and the status code of each error (one line of
text) are as docs/serving.md ("The API", "Jobs survive crashes") describes them. Nothing that
can block runs on the event loop: tokenizing (with a copy of the tokenizer, so the round
thread's decoding never waits for it) and every SQLite call go through `asyncio.to_thread`, and
every size is checked before that work starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import queue
import threading
import time

import grpc

from polyspec.orchestrator.serving.bounded_json import JsonRefused, loads_bounded
from polyspec.orchestrator.serving.jobs import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    IdempotencyConflict,
    JobRecord,
    JobStore,
    LimitExceeded,
    Quota,
)
from polyspec.orchestrator.serving.logprobs import MAX_TOP_LOGPROBS, TargetScorer, TokenLogprob
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.openai_request import MAX_CHOICES, MAX_MESSAGES
from polyspec.orchestrator.serving.request_loop import Choice, Draining, QueueFull, RoundScheduler, Work, is_unavailable, public_reason
from polyspec.orchestrator.serving.security import (
    MAX_ID_CHARS,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_JOB_ID_CHARS,
    Limits,
    Tenants,
    short,
)
from polyspec.orchestrator.tokenization import check_stops
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.protos.polyspec.v1 import polyspec_pb2_grpc as pb_grpc
from polyspec.workers.core.errors import RequestError
from polyspec.workers.core.grammar import KINDS

MAX_OPTIONS_JSON_BYTES = 16 << 10  # approximate_json: an options object ({"mode": "bild", ...})
PROMPT_TOKENIZERS = 4  # requests tokenized at once (each with its own copy of the tokenizer)
JOB_STATES = {
    QUEUED: pb.JOB_STATE_QUEUED,
    RUNNING: pb.JOB_STATE_RUNNING,
    SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    FAILED: pb.JOB_STATE_FAILED,
    CANCELLED: pb.JOB_STATE_CANCELLED,
}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
STATUS_LABELS = {  # a refusal's status -> polyspec_requests_total's label
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.INTERNAL: "internal",
}


# ------------------------------------------------------------------ message <-> dict


def request_dict(request: pb.GenerateRequest, request_id: str | None = None) -> dict:
    """A GenerateRequest as the dict `Engine.parse_request` validates (unset fields left out)."""
    raw: dict = {}
    if request_id or request.id:
        raw["id"] = request_id or request.id
    if request.prompt:
        raw["prompt"] = request.prompt
    if request.prompt_ids:
        raw["prompt_ids"] = list(request.prompt_ids)
    if request.messages:
        raw["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    if request.max_new_tokens:
        raw["max_new_tokens"] = request.max_new_tokens
    for field in SAMPLING_FIELDS:
        if request.HasField(field):
            raw[field] = getattr(request, field)
    for field in KINDS:  # structured output: compiled (and refused when invalid) by parse_request
        if getattr(request, field):
            raw[field] = getattr(request, field)
    if request.approximate_json:  # measured before it is parsed: an options object needs kilobytes, not megabytes
        try:
            raw["approximate"] = loads_bounded(request.approximate_json, "approximate_json", MAX_OPTIONS_JSON_BYTES)
        except JsonRefused as exc:
            raise RequestError(str(exc)) from None
    return raw


def generate_options(request: pb.GenerateRequest) -> tuple[int, int | None]:
    """(choices, alternatives per token's logprob, or None when no logprobs) a GenerateRequest asks for."""
    if not 0 <= request.n <= MAX_CHOICES:  # 0 is proto3's "not set": one choice
        raise RequestError(f"n must be an integer from 1 to {MAX_CHOICES}, got {request.n}")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
    if request.top_logprobs and not request.logprobs:
        raise RequestError("top_logprobs needs logprobs: true")
    return max(1, request.n), (request.top_logprobs if request.logprobs else None)


def logprob_messages(scored: list[TokenLogprob], names: dict[int, str]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=s.token_id, token=names[s.token_id], logprob=s.logprob,
                            top_logprobs=[pb.TokenLogprob(token_id=i, token=names[i], logprob=v) for i, v in s.top])
            for s in scored]


def fields_message(cls, values: dict, **extra):
    """A `cls` message from the entries of `values` it has fields for (a field with no entry keeps its default;
    an `optional` one stays unset), then `extra`."""
    fields = cls.DESCRIPTOR.fields_by_name
    return cls(**{**{key: value for key, value in values.items() if key in fields}, **extra})


def stats_message(stats: dict, timings: dict | None = None) -> pb.GenerationStats:
    """A result's stats (and its request's `Work.timings`) as a GenerateResponse's `stats`."""
    return fields_message(pb.GenerationStats, {**stats, **(timings or {})},
                          stages=[fields_message(pb.StageStats, stage) for stage in stats.get("stages", [])],
                          tiers=[fields_message(pb.TierBusy, tier) for tier in stats.get("tiers", [])])


def chain_plan_message(chain: str, total: dict) -> pb.ChainPlanStats:
    """One chain's sums (`PlanTally.as_dict()`'s entry under its label) as GetStats' `plans` entry."""
    return fields_message(pb.ChainPlanStats, total, chain=chain, tiers=chain.split("<-"))


def plan_record_message(record: dict) -> pb.PlanRecord:
    """One `plan_records` entry (a result's stats.plans) as GetStats' `recent_plans` entry."""
    return fields_message(pb.PlanRecord, record, lengths=[int(k) for k in record["lengths"]])


def requests_digest(requests) -> str:
    """A job's requests, hashed as this server parsed them (so the same requests hash alike
    whatever client encoded them): what an idempotency key is checked against."""
    digest = hashlib.sha256()
    for request in requests:
        encoded = request.SerializeToString(deterministic=True)
        digest.update(len(encoded).to_bytes(8, "little"))  # length-prefixed: no two lists run together alike
        digest.update(encoded)
    return digest.hexdigest()


def job_message(job: JobRecord) -> pb.Job:
    return fields_message(pb.Job, dataclasses.asdict(job), state=JOB_STATES[job.state])


# ------------------------------------------------------------------------- service


class PolyspecService(pb_grpc.PolyspecServicer):
    def __init__(self, store: JobStore, metrics: Metrics, max_queue: int, tenants: Tenants | None = None,
                 limits: Limits | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.max_queue = max_queue
        self.tenants = tenants or Tenants({})
        self.limits = limits or Limits()
        self.engine = None
        self.scheduler: RoundScheduler | None = None
        self.served_model_names: list[str] | None = None  # `serve --served-model-name`: the OpenAI API's model names
        self.scorer: TargetScorer | None = None  # logprobs, for gRPC and HTTP alike (loads its target copy on first use)
        self.draining = False
        self.started = time.time()
        self._scorer_lock = threading.Lock()
        self._prompt_tokenizers: queue.Queue = queue.Queue()  # copies for tokenizing requests in worker threads
        self._jobs_changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def attach(self, engine, scheduler: RoundScheduler) -> None:
        for _ in range(PROMPT_TOKENIZERS):
            tokenizer = getattr(engine, "tokenizer", None)
            self._prompt_tokenizers.put(copy.deepcopy(tokenizer) if tokenizer is not None else None)
        self.engine, self.scheduler = engine, scheduler

    @contextlib.contextmanager
    def prompt_tokenizer(self):
        """One of the request threads' tokenizer copies, for as long as the block runs (a
        tokenizer is not safe to share between threads; a long prompt holds up only its own copy)."""
        tokenizer = self._prompt_tokenizers.get()
        try:
            yield tokenizer
        finally:
            self._prompt_tokenizers.put(tokenizer)

    def jobs_changed(self) -> None:
        """Wake every StreamJobResults (called from any thread)."""

        def wake() -> None:
            self._jobs_changed.set()
            self._jobs_changed = asyncio.Event()

        try:
            self._loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    async def _ready(self, context) -> None:
        if self.draining:
            self.metrics.request_finished("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the models are still loading; retry when health says SERVING")

    def _tenant(self, context) -> str | None:
        """The caller's tenant; None (every job) when the server has no tokens. The Guard
        interceptor has already turned away a caller without a valid token."""
        if not self.tenants.enabled:
            return None
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        return self.tenants.tenant_of(given) or ""

    # ------------------------------------------------------- shared with HTTP

    def check_sizes(self, raw: dict) -> None:
        """Bounds checked before any work: the id's length (RequestError), the prompt's bytes (LimitExceeded)."""
        request_id = raw.get("id")
        if isinstance(request_id, str) and len(request_id) > MAX_ID_CHARS:
            raise RequestError(f"id has {len(request_id)} characters (at most {MAX_ID_CHARS})")
        prompt = raw.get("prompt")
        if isinstance(prompt, str) and len(prompt) > self.limits.max_prompt_bytes // 4:
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.limits.max_prompt_bytes:
                raise LimitExceeded(f"the prompt has {size} bytes (at most {self.limits.max_prompt_bytes})")
        messages = raw.get("messages")
        if isinstance(messages, list):
            if len(messages) > MAX_MESSAGES:
                raise LimitExceeded(f"{len(messages)} messages (at most {MAX_MESSAGES})")
            size = sum(len(m.get("content", "")) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
            if size > self.limits.max_prompt_bytes:
                raise LimitExceeded(f"the messages hold {size} characters (at most {self.limits.max_prompt_bytes} bytes)")
        ids = raw.get("prompt_ids")
        if isinstance(ids, list) and len(ids) > self.limits.max_prompt_bytes // 4:
            raise LimitExceeded(f"prompt_ids has {len(ids)} tokens (at most {self.limits.max_prompt_bytes // 4})")

    def parse_now(self, raw: dict):
        """Validate and tokenize (on the calling thread: never the event loop's), with the
        request threads' own tokenizer: the round thread's decoding never waits for it."""
        self.check_sizes(raw)
        with self.prompt_tokenizer() as tokenizer:
            return self.engine.parse_request(raw, tokenizer=tokenizer)

    def score_choice(self, choice: Choice, top: int) -> tuple[list[TokenLogprob], dict[int, str]]:
        """The target's log-probabilities of a finished choice's tokens (when a stop string cut
        it, those its text holds), and the text of every token they name; a structured-output request's
        rows restricted as the chain's were. Blocking: call it from a request thread."""
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

        request, token_ids = choice.work.request, choice.token_ids
        with self.prompt_tokenizer() as tokenizer:
            if choice.stopped:  # the longest prefix of the tokens whose text the answer holds
                token_ids = token_ids[: max(m for m in range(len(token_ids) + 1) if choice.text.startswith(decode(token_ids[:m])))]
        with self._scorer_lock:  # request threads: the first that asks for logprobs makes the scorer
            if self.scorer is None:
                self.scorer = TargetScorer(self.engine.config.tiers[0])
        grammar = None if request.constraint is None else self.engine.grammars.start(request.constraint, len(request.prompt_ids))
        scored = self.scorer.score(list(request.prompt_ids), token_ids, request.params, top, grammar)
        with self.prompt_tokenizer() as tokenizer:
            names = {t: tokenizer.decode([t]) if tokenizer is not None else "" for s in scored for t in (s.token_id, *(i for i, _ in s.top))}
        return scored, names

    def submit(self, requests: list, tenant: str, stops: tuple[str, ...], kind=Choice) -> tuple[list, asyncio.Queue]:
        """One `kind` (a Choice) per request, queued as `tenant`'s work: every one, or (QueueFull, Draining) none.
        They all report on the one queue returned, from the round thread: (choice index, event kind, payload)."""
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(*event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: shutting down
                pass

        choices = [kind(Work(parsed, on_event=functools.partial(on_event, index), tenant=tenant, stops=stops), self.scheduler, index)
                   for index, parsed in enumerate(requests)]
        self.scheduler.submit_all([choice.work for choice in choices])
        return choices, events

    # ---------------------------------------------------------------- Generate

    async def _refuse(self, context, code: grpc.StatusCode, message: str) -> None:
        """Abort the call with `code` and one line, counted in polyspec_requests_total."""
        self.metrics.request_finished(STATUS_LABELS.get(code, "invalid_argument"))
        await context.abort(code, message)

    def _parse_generate(self, request) -> tuple[tuple[str, ...], object]:
        """(stop strings, the parsed request) of a GenerateRequest: on a request thread, never the loop."""
        return check_stops(list(request.stop) or None), self.parse_now(request_dict(request))

    async def Generate(self, request, context):
        await self._ready(context)
        tenant = self._tenant(context) or ""
        try:
            count, top = generate_options(request)
            if count > self.limits.max_prompts:
                raise LimitExceeded(f"n = {count} choices in one request (at most {self.limits.max_prompts})")
            stops, parsed = await asyncio.to_thread(self._parse_generate, request)
        except RequestError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LimitExceeded as exc:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            choices, events = self.submit([parsed.choice(j) for j in range(count)], tenant, stops)  # every choice, or none
        except QueueFull as exc:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Draining as exc:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            while not all(choice.finished for choice in choices):
                index, kind, payload = await events.get()
                choice = choices[index]
                if kind == "delta":
                    token_ids, text = payload
                    yield pb.GenerateResponse(token_ids=token_ids, text=choice.delta(token_ids, text), id=request.id, index=index)
                elif kind == "done":
                    result, timings = payload
                    choice.done(result)
                    stats = result.get("stats") or {}
                    message = pb.GenerateResponse(
                        finish_reason=choice.finish_reason,
                        stats=stats_message(stats, timings),
                        stats_json=json.dumps(stats),
                        id=request.id,
                        index=index,
                    )
                    if top is not None:
                        scored, names = await asyncio.to_thread(self.score_choice, choice, top)
                        message.logprobs.extend(logprob_messages(scored, names))
                    yield message
                else:
                    choice.failed()
                    code = (
                        grpc.StatusCode.INVALID_ARGUMENT if isinstance(payload, RequestError)
                        else grpc.StatusCode.UNAVAILABLE if is_unavailable(payload)
                        else grpc.StatusCode.INTERNAL
                    )
                    await context.abort(code, public_reason(payload))
        finally:
            for choice in choices:
                if not choice.finished:  # the client went away, its deadline passed, or another choice failed
                    choice.cancel()

    # -------------------------------------------------------------------- jobs

    async def SubmitJob(self, request, context):
        await self._ready(context)
        invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
        if not request.requests:
            await self._refuse(context, invalid, "a job needs at least one request")
        if len(request.requests) > self.limits.max_job_items:
            await self._refuse(context, exhausted, f"a job holds at most {self.limits.max_job_items} requests "
                                                   f"(--max-job-items), got {len(request.requests)}")
        key = request.idempotency_key
        if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
            await self._refuse(context, invalid, f"idempotency_key has {len(key)} characters (at most {MAX_IDEMPOTENCY_KEY_CHARS})")
        tenant = self._tenant(context) or ""
        digest = await asyncio.to_thread(requests_digest, request.requests) if key else None
        try:
            if key:  # a retry: answer before tokenizing anything
                job = await asyncio.to_thread(self.store.create, [], tenant, key, digest=digest)
                if job is not None:
                    return job_message(job)
            try:  # a prompt over its limit, or a job over the store's
                items = await asyncio.to_thread(self._job_items, request.requests)  # tokenizing many prompts: off the loop
                if isinstance(items, str):
                    await self._refuse(context, invalid, items)
                job = await asyncio.to_thread(self.store.create, items, tenant, key or None, self.job_quota(tenant), digest)
            except LimitExceeded as exc:
                await self._refuse(context, exhausted, str(exc))
        except IdempotencyConflict as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.scheduler.jobs_added()
        self.jobs_changed()
        return job_message(job)

    def job_quota(self, tenant: str) -> Quota:
        """The limits a job of `tenant` is stored within: the server's, and the tenant's shares of them."""
        limits, share = self.limits, self.tenants.share
        return Quota(
            max_live_jobs=limits.max_live_jobs,
            max_pending_items=limits.max_pending_items,
            tenant_live_jobs=share(tenant, limits.max_live_jobs),
            tenant_pending_items=share(tenant, limits.max_pending_items),
            tenant_store_bytes=share(tenant, limits.max_store_bytes),
        )

    def _job_items(self, requests) -> list[tuple[str, dict, str | None]] | str:
        """(id, raw request, validation error) per request, or the message for a job that
        cannot be taken; LimitExceeded for a prompt over the limit."""
        items, seen = [], set()
        for number, item in enumerate(requests, start=1):
            if len(item.id) > MAX_ID_CHARS:
                return f"request {number}: id has {len(item.id)} characters (at most {MAX_ID_CHARS})"
            if item.stop:
                return f"request {number}: stop strings are for Generate; a job's requests run to their end"
            if item.n > 1 or item.logprobs or item.top_logprobs:
                return f"request {number}: n and logprobs are for Generate; a job's request has one result, without logprobs"
            item_id = item.id or f"item-{number}"
            if item_id in seen:
                return f"request id {short(item_id)!r} appears twice in the job (ids must be unique)"
            seen.add(item_id)
            raw: dict = {"id": item_id}
            try:
                raw = request_dict(item, item_id)
                self.parse_now(raw)
                error = None
            except RequestError as exc:
                error = f"request {number}: {exc}"
            except LimitExceeded as exc:
                raise LimitExceeded(f"request {number}: {exc}") from None
            items.append((item_id, raw, error))
        return items

    async def _job(self, job_id: str, context) -> JobRecord:
        if not job_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, "job_id is empty")
        job = None
        if len(job_id) <= MAX_JOB_ID_CHARS:
            job = await asyncio.to_thread(self.store.get, job_id, self._tenant(context))
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {short(job_id)!r}")
        return job

    async def GetJob(self, request, context):
        return job_message(await self._job(request.job_id, context))

    async def ListJobs(self, request, context):
        jobs = await asyncio.to_thread(self.store.list, max(0, request.limit), self._tenant(context))
        return pb.ListJobsResponse(jobs=[job_message(job) for job in jobs])

    async def CancelJob(self, request, context):
        await self._job(request.job_id, context)
        job = await asyncio.to_thread(self.store.cancel, request.job_id, self._tenant(context))
        if self.scheduler is not None:
            self.scheduler.cancel_job(request.job_id)
        self.jobs_changed()
        return job_message(job)

    async def StreamJobResults(self, request, context):
        job = await self._job(request.job_id, context)
        seq = 0
        while True:
            changed = self._jobs_changed
            over = job.finished
            for seq, item in await asyncio.to_thread(self.store.results_after, job.job_id, seq):
                result = item.result or {}  # {id, text, token_ids, finish_reason, stats}; {} for a failed item
                yield fields_message(pb.JobResult, result, id=item.id, error=item.error,
                                     stats_json=json.dumps(result["stats"]) if "stats" in result else "")
            if over:
                return
            try:
                await asyncio.wait_for(changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            job = await asyncio.to_thread(self.store.get, job.job_id)

    # ------------------------------------------------------------------- stats

    async def GetStats(self, request, context):
        snapshot = self.metrics.snapshot()
        waiting, running = self.scheduler.queue_depth() if self.scheduler else (0, 0)
        pending = await asyncio.to_thread(self.store.pending_count)
        response = pb.StatsResponse(
            stages=[
                fields_message(pb.StageStats, totals, tier=tier, drafter=drafter,
                               mean_accepted_length=totals["accepted"] / totals["blocks"] if totals["blocks"] else 0.0)
                for (tier, drafter), totals in snapshot["stages"].items()
            ],
            queue=pb.QueueStats(waiting=waiting, running=running, max_queue=self.max_queue, job_items_pending=pending),
            requests=pb.RequestCounts(
                ok=snapshot["requests"].get("ok", 0),
                cancelled=snapshot["requests"].get("cancelled", 0),
                invalid=snapshot["requests"].get("invalid_argument", 0),
                rejected=snapshot["requests"].get("resource_exhausted", 0),
                failed=snapshot["requests"].get("internal", 0) + snapshot["requests"].get("unavailable", 0),
                job_items_done=sum(snapshot["job_items"].values()),
            ),
            generated_tokens=snapshot["generated_tokens"],
            uptime_s=time.time() - self.started,
            ready=self.scheduler is not None,
            draining=self.draining,
            plans=[chain_plan_message(chain, total) for chain, total in snapshot["plans"].items()],
            recent_plans=[plan_record_message(record) for record in snapshot["recent_plans"]],
        )
        if self.engine is not None:
            chain = self.engine.scheduler
            active = chain.active
            response.speculation_lengths.extend(int(k) for k in chain.lengths)
            response.active_tiers.extend(chain.tiers[i].name for i in active)
            for tier, config in zip(self.engine.tiers, self.engine.config.tiers):
                response.tiers.add(tier=tier.name, model=config.model, up=tier.up, busy_s=tier.busy_s)
        return response
