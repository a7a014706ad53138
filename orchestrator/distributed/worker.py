"""One tier of a distributed chain: its model, its gRPC service, its draft-ahead streams.

A `TierWorker` owns one `Tier` and serves the tier-to-tier protocol
(protos/polyspec/v1/tier.proto) on its node's address. VerifyBatch and DraftBatch are the only
calls that run the round. The driver sends one VerifyBatch per step with every running
sequence (a batch of one for a request stepped alone). The target worker runs the embedded
round (`polyspec.orchestrator.decode.scheduler.ChainScheduler`) over its own two-tier chain
[its batched tier, a `RemoteTier` proxy of the worker below], so every sequence's block comes
from ONE DraftBatch call, the target scores all the blocks in ONE forward, and each sequence
is verified with its own generator. A middle tier answers DraftBatch the same way (its rounds
batched, its own DraftBatch to the tier below); the bottom tier drafts every sequence's block
with one forward per position. So neighbours talk directly, the driver only calls the target's
VerifyBatch, and each tier runs one forward per round for the whole batch, as embedded. A
worker keeps its chains (`_scheduler`) from call to call. A one-sequence `Verify` / `Draft`
is served as a batch of one.

Concurrency: the gRPC server has a thread per call, so while the target scores request A,
the drafters draft request B. One model forward at a time per tier (`ModelLock`); calls of
one sequence are serialised by the sequence's lock (model_lock.py).

Pipelined mode (`header.pipeline`): after handing a block up, a drafter keeps drafting past
it (its stream, grown by the batched draft-ahead loop), betting the block is accepted. Its
stream is tagged with the verifier's epoch; the verifier bumps the epoch with every verdict
that carries a correction, and the Verdict message restarts the stream from the correction at
once. A `DraftBatch` is served from a sequence's stream only when its epoch matches and its
context is a prefix of the stream; the tokens it gets were never examined by any verifier, so
reusing them is lossless. Stale tokens are dropped and counted.

Draft-ahead stays per sequence: a drafter first serves each sequence of a DraftBatch from
its stream (`stream_hit`); only the misses, and the streams still short of their block, are
drafted, together. After the reply each sequence's stream grows on its own bet
(`ahead_until`), but the growing is batched: one thread per worker extends every stream that
wants tokens by one token per forward (`_ahead_loop`), yielding the model to calls a verifier
waits on, and skipping a sequence whose call is being served.

Contexts: a call names its sequence's context by a version this worker keeps and carries only
the tokens past it (`contexts`, transport.KeptContexts); a call naming a version not kept here
(a restart, a lost reply) is refused before any state changes and its caller sends it whole.

Failure: if the tier below stops answering, the current call is redone without it (a model
tier drafts or verifies alone; the target alone is always a valid chain) and the reply says
`degraded`; the driver wires a replacement in when Ray restarts the actor."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
import traceback
from concurrent import futures

import grpc
import torch

from polyspec.orchestrator.distributed import cluster_auth
from polyspec.orchestrator.decode.contract import NO_LIMIT, RoundObservation, StageStats, first_eos
from polyspec.orchestrator.decode.scheduler import ChainScheduler, Run, catch_up
from polyspec.orchestrator.decode.approximate import worker_hooks
from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc
from polyspec.workers.core.grammar import from_wire
from polyspec.workers.core.sampling import RandomStream, SamplingParams
from polyspec.workers.tiers.loading import load_tokenizer
from polyspec.workers.tiers.tier import Tier, scratch_score, scratch_sequence
from polyspec.orchestrator.distributed.model_lock import (
    LockedBatched,
    LockedTiers,
    drafting_ahead,
    model_seconds,
    set_drafting_ahead,
    set_model_seconds,
)
from polyspec.orchestrator.distributed.transport import (
    CHANNEL_OPTIONS,
    Counters,
    DistChannel,
    KeptContexts,
    RemoteTier,
    StaleContextError,
    TierUnavailableError,
    encode_rows,
)
from polyspec.workers.core.tree import DraftTree

MAX_RPC_THREADS = 64
# Drafting past a block bets it is accepted whole. Lost bets are free only on an idle core, on a shared one they slow the
# verifier (benchmarks/ray-pipeline.md): a sequence drafts ahead only while its blocks are mostly accepted whole (EMA).
AHEAD_PRIOR = 0.5
AHEAD_THRESHOLD = 0.5  # it drafts past its block while at least this share of its blocks is accepted whole ...
AHEAD_SMOOTHING = 0.2  # ... measured as an EMA of whole / not whole with this smoothing


@dataclasses.dataclass
class _Stream:
    """Draft-ahead: `tokens` = the context it started from + what this tier drafted past it."""

    base: int  # tokens[:base] is context; tokens[base:] were drafted here, with `rows`
    tokens: list[int]
    rows: list[torch.Tensor | None]
    epoch: int
    times: list[float] = dataclasses.field(default_factory=list)  # perf_counter when each drafted token was ready

    def drafted(self) -> int:
        return len(self.tokens) - self.base

    def extend(self, tokens: list[int], rows: torch.Tensor | None) -> None:
        """Tokens drafted past the stream's end, ready now."""
        self.tokens.extend(tokens)
        self.times.extend([time.perf_counter()] * len(tokens))
        self.rows.extend(list(rows) if rows is not None else [None] * len(tokens))


class _Sequence:
    """One request as seen by this worker."""

    def __init__(self, worker: "TierWorker", header: tier_pb2.SequenceHeader) -> None:
        self.header = tier_pb2.SequenceHeader()
        self.header.CopyFrom(header)
        self.params = SamplingParams(temperature=header.temperature, top_p=header.top_p, top_k=header.top_k)
        if header.constraint_json:  # structured output: this tier's own matcher, its rows restricted here
            # compiled over the target's tokenizer, read from its folder, Hugging Face id or .gguf file
            grammar = from_wire(header.constraint_json, worker.tier.vocab_size, tuple(worker.eos_token_ids),
                                functools.partial(load_tokenizer, tier_name="target"))
            self.params = dataclasses.replace(self.params, grammar=grammar)
        seed = header.seeds[worker.index] if worker.index < len(header.seeds) else None
        self.run = Run(
            seq_id=header.seq_id,
            params=self.params,
            generators=[RandomStream(seed), torch.Generator()],  # the tier below draws with its own
            stages=[StageStats(worker.tier.name, "below")],
            limit=header.limit or NO_LIMIT,
        )
        self.exits = worker_hooks(header.approximate_json, worker.index, self.run, worker.tier)  # an approximate mode's hooks
        self.cond = threading.Condition()
        self.epoch_below = 0  # verdicts with a correction sent to the tier below
        self.lower_continues = False  # the tier below said it drafts past its last block
        self.full_rate = AHEAD_PRIOR  # EMA: how often this tier's blocks are accepted whole (the draft-ahead bet)
        self.served_end = -1  # context length just past the last block handed up (-1: its outcome is known)
        self.served_epoch = -1
        self.served_at = 0.0  # perf_counter when that block was handed up
        self.stream: _Stream | None = None
        self.ahead_until = 0
        self.closed = False
        # rounds run since the last reply (draft-ahead rounds too: they go up with the next one)
        self.reports: list[tier_pb2.StageReport] = []
        self.reset_call()

    def track_whole(self, whole: bool) -> None:
        self.full_rate += AHEAD_SMOOTHING * ((1.0 if whole else 0.0) - self.full_rate)

    def reset_call(self) -> None:
        self.model_below_s = 0.0
        self.degraded = False

    def take_reports(self) -> list[tier_pb2.StageReport]:
        reports, self.reports = self.reports, []
        return reports

    def header_for_lower(self) -> tier_pb2.SequenceHeader:
        header = tier_pb2.SequenceHeader()
        header.CopyFrom(self.header)
        header.epoch = self.epoch_below
        return header

    def absorb(self, reply: tier_pb2.DraftReply) -> None:
        self.reports.extend(reply.stages)
        self.model_below_s += reply.model_s
        self.degraded = self.degraded or reply.degraded


def _served(handler):
    """A servicer method over `handler(worker, request)`: its errors reach the caller as a status (the tier below
    gone: UNAVAILABLE; a context base not kept here: FAILED_PRECONDITION, and the caller sends the contexts whole,
    no traceback; anything else: INTERNAL with the cause); a handler that answers nothing answers an Ack."""

    @functools.wraps(handler)
    def serve(worker: "TierWorker", request, context):
        try:
            reply = handler(worker, request)
        except TierUnavailableError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except StaleContextError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the caller as INTERNAL with the cause
            traceback.print_exc()
            context.abort(grpc.StatusCode.INTERNAL, f"tier {worker.tier.name!r}: {exc!r}")
        return tier_pb2.Ack() if reply is None else reply

    return serve


class TierWorker(tier_pb2_grpc.TierServicer):
    """Tier `index` of a chain, serving protos/polyspec/v1/tier.proto on `host` (its methods named after the
    protocol's calls are the gRPC service's)."""

    _ahead_thread: threading.Thread | None = None
    _ahead_stopping = False
    IDLE_POLL_S = 0.001  # every wanting sequence busy in a call: look again this soon

    def __init__(self, tier: Tier, index: int, *, eos_token_ids=(), host: str = "127.0.0.1", device_slots: int = 0,
                 device_context: int | None = None, siblings: LockedTiers | None = None) -> None:
        """Listens on a free port of `host`. `device_slots` > 0: the tier decodes in static steps on a pool of that
        many requests (`BatchedModelTier`). `siblings`: the batched tiers of every tier this process serves behind
        one lock (a target and its trained drafters), `tier` among them; by default `tier` alone behind a lock."""
        # The forward thread holds the GIL for most of a small model's forward (Python module
        # code between short kernels); a gRPC handler thread waiting for it would wait up to the
        # default 5 ms switch interval each time, serialising requests that should overlap.
        sys.setswitchinterval(float(os.environ.get("POLYSPEC_SWITCH_INTERVAL_S", "0.0005")))
        self.tier = tier
        self.index = index
        self.eos_token_ids = frozenset(eos_token_ids)
        # tiers sharing one model in one process (a target and its trained drafters) share one lock
        self.siblings = siblings or LockedTiers([tier], device_slots=[device_slots], device_context=device_context)
        self.lock = self.siblings.lock
        self.lower: RemoteTier | None = None
        self.lower_error = ""
        self.dist: DistChannel | None = None
        self.counters = Counters()
        self.started = time.time()
        self.ahead_hits = self.ahead_misses = self.ahead_dropped = 0
        self.contexts = KeptContexts()  # what callers sent, by version: a call carries only what is not kept here
        self.context_resends = 0  # calls the tier below refused for a context base it lacked, sent again whole
        self._sequences: dict[int, _Sequence] = {}
        self._sequences_lock = threading.Lock()
        self._wiring = threading.Lock()
        self._schedulers: dict[tuple, object] = {}  # this tier's chains, kept across calls (`_scheduler`)
        self._ahead_cond, self._ahead_wanted = threading.Condition(), {}  # the sequences drafting ahead (`_ahead_loop`)
        self.server = grpc.server(futures.ThreadPoolExecutor(MAX_RPC_THREADS, thread_name_prefix=f"tier-{tier.name}"),
                                  options=CHANNEL_OPTIONS, interceptors=cluster_auth.server_interceptors())
        tier_pb2_grpc.add_TierServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        if not self.port:
            raise RuntimeError(f"tier {tier.name!r}: cannot listen on {host}")
        self.address = f"{host}:{self.port}"
        self.server.start()

    # ------------------------------------------------------------------- wiring

    def set_vocab_size(self, vocab_size: int) -> None:
        self.tier.vocab_size = vocab_size
        with self._wiring:
            self.siblings.reset()  # made again, with this vocabulary, on first use
            self._schedulers.clear()

    def connect(self, address: str | None) -> str:
        """Make `address` the tier below (None: this tier is the bottom). Returns its name."""
        with self._wiring:
            old, self.lower = self.lower, None
            self._schedulers.clear()
            if old is not None:
                old.close()
            if address:
                self.lower = RemoteTier(address, self._sequences.__getitem__, self.counters, self.dist, caller=self.index,
                                        on_resend=self._resent)
                self.lower_error = ""
            return self.lower.name if self.lower is not None else ""

    def join_dist(self, backend: str, init_method: str, world_size: int, min_bytes: int | None = None) -> None:
        self.dist = DistChannel(backend, self.index, world_size, init_method, min_bytes=min_bytes)
        with self._wiring:
            if self.lower is not None:
                self.lower.dist = self.dist

    def stop(self) -> None:
        self.stop_ahead()
        self.server.stop(0)
        if self.lower is not None:
            self.lower.close()

    def _resent(self) -> None:
        self.context_resends += 1

    def _lower_failed(self, lower: RemoteTier, exc: Exception) -> None:
        with self._wiring:
            if self.lower is lower:
                self.lower = None
                self.lower_error = str(exc)
                self._schedulers.clear()
                lower.close()

    # --------------------------------------------------------------- sequences

    def _sequence(self, header: tier_pb2.SequenceHeader) -> _Sequence:
        with self._sequences_lock:
            seq = self._sequences.get(header.seq_id)
            if seq is None:
                seq = self._sequences[header.seq_id] = _Sequence(self, header)
            else:  # lengths may move between rounds (a planner)
                del seq.header.lengths[:]
                seq.header.lengths.extend(header.lengths)
            return seq

    # ------------------------------------------------------------ one sequence

    def Verify(self, request: tier_pb2.VerifyRequest, context) -> tier_pb2.VerifyReply:
        """One sequence's round (an older client's Verify): a batch of one."""
        return self.VerifyBatch(tier_pb2.VerifyBatchRequest(requests=[request]), context).replies[0]

    def Draft(self, request: tier_pb2.DraftRequest, context) -> tier_pb2.DraftReply:
        """One sequence's block (an older client's Draft, or a driver's `sub_chain_block`): a batch of one."""
        return self.DraftBatch(tier_pb2.DraftBatchRequest(requests=[request]), context).replies[0]

    # ------------------------------------------------------------- draft-ahead

    def stream_hit(self, seq: _Sequence, context: list[int], request: tier_pb2.DraftRequest):
        """The requested block from the draft-ahead stream as far as it holds it now, or None. Holds seq.cond."""
        need = request.num_tokens
        continued = request.header.pipeline and seq.served_end >= 0 and request.header.epoch == seq.served_epoch \
            and len(context) >= seq.served_end
        if continued:
            seq.track_whole(True)  # accepted whole and continued (no verdict was sent)
        seq.served_end = -1
        hit = self._from_stream(seq, context, need, request.header.epoch)
        if hit is not None:
            tokens, rows = hit
            self.ahead_hits += 1
            stream = seq.stream
            if continued and tokens and stream is not None and stream.times:
                # the pipelined model's drafting time D: this block, drafted ahead since the last hand-up
                ready = stream.times[min(len(stream.times), len(context) + len(tokens) - stream.base) - 1]
                seq.reports.append(tier_pb2.StageReport(tier=self.index, drafter=self.index, length=need, proposed=len(tokens),
                                                        ahead=True, block_seconds=max(1e-6, ready - seq.served_at)))
        elif request.header.pipeline:
            self.ahead_misses += 1
            self._drop_stream(seq)
        return hit

    def tree_reply(self, seq: _Sequence, need: int, tree: DraftTree, dst_rank: int | None) -> tier_pb2.DraftReply:
        self._report_draft(seq, need, len(tree.tokens))
        rows = encode_rows(tree.draft_rows, self.counters, self.dist, dst_rank)
        return tier_pb2.DraftReply(tokens=tree.tokens, parents=tree.parents, rows=rows, model_s=model_seconds() + seq.model_below_s,
                                   stages=seq.take_reports(), degraded=seq.degraded)

    def draft_reply(self, seq: _Sequence, context: list[int], request: tier_pb2.DraftRequest, hit: bool, tokens, rows,
                    dst_rank: int | None) -> tier_pb2.DraftReply:
        """Hand a block up (from the stream, or just drafted); in pipelined mode bet on it and draft on. Holds seq.cond."""
        need = request.num_tokens
        if not hit:
            self._report_draft(seq, need, len(tokens))
            if request.header.pipeline and tokens:
                seq.stream = _Stream(len(context), context + tokens, list(rows) if rows is not None else [None] * len(tokens),
                                     request.header.epoch, [time.perf_counter()] * len(tokens))
                tokens, rows = tokens[:need], (rows[:need] if rows is not None else None)
        continues = False
        if request.header.pipeline and seq.stream is not None:
            seq.served_end, seq.served_epoch = len(context) + len(tokens), request.header.epoch
            continues = seq.full_rate >= AHEAD_THRESHOLD
            # bet on the block: draft one more past it; else stop at the block (a verdict restarts the stream)
            seq.ahead_until = len(context) + (2 * need if continues else len(tokens))
            seq.served_at = time.perf_counter()
            continues = continues or len(seq.stream.tokens) > seq.served_end  # overshoot already drafted
            self.want_ahead(seq)
        return tier_pb2.DraftReply(tokens=tokens, rows=encode_rows(rows, self.counters, self.dist, dst_rank),
                                   model_s=model_seconds() + seq.model_below_s, ahead_hit=hit, stages=seq.take_reports(),
                                   degraded=seq.degraded, continues=continues)

    def _report_draft(self, seq: _Sequence, need: int, proposed: int) -> None:
        """As the bottom of the chain: how long this proposal took (a stage report's seconds)."""
        if self.lower is None:
            seq.reports.append(tier_pb2.StageReport(tier=self.index, drafter=self.index, length=need, proposed=proposed,
                                                    seconds=model_seconds()))

    def _from_stream(self, seq: _Sequence, context: list[int], need: int, epoch: int):
        """Up to `need` tokens continuing `context` from the draft-ahead stream (what it holds now), or None (a miss)."""
        stream = seq.stream
        if stream is None or stream.epoch != epoch or len(context) < stream.base or len(stream.tokens) <= len(context):
            return None
        if stream.tokens[: len(context)] != context:
            return None
        seq.ahead_until = max(seq.ahead_until, len(context) + need)
        self.want_ahead(seq)
        start = len(context) - stream.base
        tokens = stream.tokens[len(context): len(context) + need]
        rows = stream.rows[start: start + len(tokens)]
        return tokens, (None if not rows or rows[0] is None else torch.stack(rows))

    def _drop_stream(self, seq: _Sequence) -> None:
        if seq.stream is not None:
            self.ahead_dropped += seq.stream.drafted()
            seq.stream = None
            seq.cond.notify_all()

    # --------------------------------------------------------------- verdicts

    @_served
    def Verdict(self, request: tier_pb2.VerdictRequest) -> None:
        seq = self._sequences.get(request.seq_id)
        if seq is None:
            return
        with seq.cond:
            if request.tree:
                self.batched_tier().accept_path(request.seq_id, list(request.path))
                return
            if seq.served_end >= 0 and request.base_len + request.proposed == seq.served_end:
                seq.track_whole(request.accepted >= request.proposed)  # a bonus or a correction
                seq.served_end = -1
            stream = seq.stream
            if stream is None or request.epoch <= stream.epoch:
                return
            keep = request.base_len + request.accepted
            if request.correction < 0 or len(stream.tokens) < keep or keep < stream.base:
                self._drop_stream(seq)
                return
            self.ahead_dropped += len(stream.tokens) - keep
            seq.stream = _Stream(keep + 1, stream.tokens[:keep] + [request.correction], [], request.epoch)
            seq.ahead_until = keep + 1 + max(1, request.proposed)
            seq.cond.notify_all()
            self.want_ahead(seq)  # the next block is drafted while the verifier does the rest

    @_served
    def Rollback(self, request: tier_pb2.RollbackRequest) -> None:
        seq = self._sequences.get(request.seq_id)
        if seq is None:
            return
        with seq.cond:
            self._drop_stream(seq)
            self.batched_tier().truncate(request.seq_id, request.length)

    @_served
    def Prefill(self, request: tier_pb2.PrefillRequest) -> None:
        (context,) = self._contexts_of([request])
        seq = self._sequence(request.header)
        with seq.cond:
            if len(context) > 1:  # (all but the last token: a round feeds at least one)
                self.batched_tier().prefill([request.header.seq_id], [context], len(context))

    @_served
    def Release(self, request: tier_pb2.ReleaseRequest) -> None:
        """Free a sequence here and below; `keep_caches`: its state only, its caches kept (prefix reuse)."""
        seq_id, keep_caches = request.seq_id, request.keep_caches
        seq = self._sequences.get(seq_id)
        if seq is not None:
            # after the call or draft-ahead step that holds it, whose replies from below look it up by id
            with seq.cond:
                seq.closed = True
                self._drop_stream(seq)
                with self._sequences_lock:
                    self._sequences.pop(seq_id, None)
            if seq.exits:
                self.tier.exit_by_seq.pop(seq_id, None)
        self.contexts.drop(seq_id)
        batched = self.siblings.made(self.tier)
        if batched is not None:
            if not keep_caches:
                batched.release(seq_id)
            batched.release(scratch_sequence(seq_id))  # a SpecReason request's scored prompts (Score)
        lower = self.lower
        if lower is not None:
            lower.release(seq_id, keep_caches)

    # ------------------------------------------------------------------ health

    def Health(self, request, context) -> tier_pb2.HealthReply:
        lower_max = self.lower.max_context if self.lower is not None else None
        own = self.tier.max_context
        limits = [c for c in (own, lower_max) if c]
        return tier_pb2.HealthReply(
            tier=self.tier.name, index=self.index, vocab_size=self.tier.vocab_size, max_context=min(limits) if limits else 0,
            can_verify=self.tier.can_verify, deterministic_drafts=self.tier.deterministic_drafts,
            lower=self.lower.address if self.lower is not None else "", busy_s=self.tier.busy_s,
            uptime_s=time.time() - self.started, forwards=self.tier.forwards,
            open_sequences=len(self._sequences), sent=self.counters.as_proto(), ahead_hits=self.ahead_hits,
            ahead_misses=self.ahead_misses, ahead_dropped_tokens=self.ahead_dropped,
            device=str(self.tier.device), pid=os.getpid(), stale_contexts=self.contexts.stale,
            context_resends=self.context_resends,
        )

    def batched_tier(self) -> LockedBatched:
        """This worker's tier behind the batched seam, made on first use (after the chain's vocabulary is set)."""
        return self.siblings.of(self.tier)

    # ----------------------------------------------------------------- plumbing

    @staticmethod
    def _distinct(seqs, method: str) -> None:
        if len({s.run.seq_id for s in seqs}) != len(seqs):
            raise ValueError(f"{method}: a sequence appears twice in one batch")

    @staticmethod
    @contextlib.contextmanager
    def _holding(seqs):
        """Every sequence's lock, in seq-id order (two batches over the same sequences cannot deadlock)."""
        with contextlib.ExitStack() as stack:
            for seq in sorted(seqs, key=lambda s: s.run.seq_id):
                stack.enter_context(seq.cond)
            yield

    def _shape(self, seq) -> tuple:
        """What this tier's chain for `seq` depends on: the length it verifies, tree width, scheme, pipelining."""
        header = seq.header
        length = header.lengths[self.index] if self.index < len(header.lengths) else 0
        return length, max(1, header.tree_width), header.scheme or "specinfer", header.pipeline

    def _scheduler(self, lower: RemoteTier | None, shape: tuple) -> ChainScheduler:
        """This tier's own chain for calls of `shape`: [this tier, the tier below] (or this tier alone).

        Made once and kept, not made per call: a scheduler holds nothing of a call (the rounds mutate
        only the sequences' `Run`s, and no planner moves its lengths), so one per shape serves every
        call and the draft-ahead thread at once, as the embedded engine's one scheduler serves every
        step. Its tiers are this worker's batched tier and the tier below, so the kept chains are
        dropped whenever those change (`connect`, `_lower_failed`, `set_vocab_size`); a call still
        holding a tier below that was just replaced gets a chain of its own, not kept."""
        own = self.batched_tier()
        key = (own, lower, shape if lower is not None else None)
        with self._wiring:
            scheduler = self._schedulers.get(key)
            if scheduler is not None:
                return scheduler
            keep = lower is self.lower
        eos = tuple(self.eos_token_ids)
        if lower is None:
            scheduler = ChainScheduler([own], [], eos_token_ids=eos)
        else:
            length, tree_width, scheme, pipeline = shape
            scheduler = ChainScheduler([own, lower], [length], eos_token_ids=eos, tree_width=tree_width, scheme=scheme,
                                       draft_ahead=pipeline, recorder=_BatchRecorder(self._sequences.get, self.index, lower))
        if keep:
            with self._wiring:
                scheduler = self._schedulers.setdefault(key, scheduler)
        return scheduler

    def lower_fallback(self, seqs, work):
        """`work(lower)`; if the tier below is gone, `work(None)`: this tier alone (the reply says degraded)."""
        lower = self.lower
        if lower is not None:
            try:
                return work(lower)
            except TierUnavailableError as exc:
                self._lower_failed(lower, exc)
                for seq in seqs:
                    seq.degraded = True
        elif self.lower_error:
            for seq in seqs:
                seq.degraded = True
        return work(None)

    def _by_chain(self, lower: RemoteTier | None, indices, seqs) -> list[tuple[ChainScheduler, list[int]]]:
        """The indices `i` of `seqs[i]` grouped by the chain (`_scheduler`) their shape runs on."""
        groups: dict[tuple, list[int]] = {}
        for i in indices:
            groups.setdefault(self._shape(seqs[i]), []).append(i)
        return [(self._scheduler(lower, shape), group) for shape, group in groups.items()]

    # ------------------------------------------------------------------- verify

    def _contexts_of(self, requests) -> list[list[int]]:
        """Each request's whole context, rebuilt from the version it names (StaleContextError: send them whole)."""
        return self.contexts.resolve_all([r.header.seq_id for r in requests], [r.context for r in requests],
                                         [r.delta for r in requests])

    @_served
    def VerifyBatch(self, request: tier_pb2.VerifyBatchRequest) -> tier_pb2.VerifyBatchReply:
        contexts = self._contexts_of(request.requests)
        seqs = [self._sequence(r.header) for r in request.requests]
        self._distinct(seqs, "VerifyBatch")
        set_model_seconds(0.0)
        with self._holding(seqs):
            for seq in seqs:
                seq.reset_call()
            catch_up(self.batched_tier(), [seq.run for seq in seqs], contexts)

            def one_round(lower):
                emitted: list[list[int]] = [[] for _ in seqs]
                for scheduler, group in self._by_chain(lower, range(len(seqs)), seqs):
                    items = [(seqs[i].run, contexts[i], min(scheduler.length_at(0), max(0, request.requests[i].max_tokens - 1)))
                             for i in group]
                    for i, (tokens, _) in zip(group, scheduler.round_batch(0, items)):
                        emitted[i] = tokens
                return emitted

            emitted = self.lower_fallback(seqs, one_round)
            spent = model_seconds()  # the shared forwards: on every sequence's critical path
            replies = [tier_pb2.VerifyReply(tokens=tokens[: r.max_tokens], stages=seq.take_reports(), model_s=spent + seq.model_below_s,
                                            degraded=seq.degraded, degraded_reason=self.lower_error if seq.degraded else "")
                       for seq, r, tokens in zip(seqs, request.requests, emitted)]
        return tier_pb2.VerifyBatchReply(replies=replies)

    # -------------------------------------------------------------------- draft

    @_served
    def DraftBatch(self, request: tier_pb2.DraftBatchRequest) -> tier_pb2.DraftBatchReply:
        requests = list(request.requests)
        # the caller's rank, where it takes rows over torch.distributed
        dst_rank = requests[0].caller if requests and requests[0].accept_dist else None
        contexts = self._contexts_of(requests)
        seqs = [self._sequence(r.header) for r in requests]
        self._distinct(seqs, "DraftBatch")
        started = time.perf_counter()
        with self._holding(seqs):
            # waiting for draft-ahead steps to finish is this tier's model time on the caller's critical path
            set_model_seconds(time.perf_counter() - started)
            for seq in seqs:
                seq.reset_call()
            trees = [i for i, r in enumerate(requests) if r.tree]
            # what each stream holds now, without waiting on it: streams still short are topped up
            # below in the misses' forwards (one wait per sequence would grow them one at a time)
            hits = {i: self.stream_hit(seqs[i], contexts[i], requests[i]) for i in range(len(requests)) if not requests[i].tree}
            misses = [i for i, hit in hits.items() if hit is None]
            short = [i for i, hit in hits.items() if hit is not None and len(hit[0]) < requests[i].num_tokens
                     and first_eos(hit[0], self.eos_token_ids) is None]
            if misses or trees:
                catch_up(self.batched_tier(), [seqs[i].run for i in misses + trees], [contexts[i] for i in misses + trees])
            drafted: dict[int, tuple] = {}
            if misses or short:
                def emit(lower):
                    out = {}
                    for scheduler, group in self._by_chain(lower, misses + short, seqs):
                        items = [(seqs[i].run, contexts[i] + (hits[i][0] if hits[i] else []),
                                  requests[i].num_tokens - (len(hits[i][0]) if hits[i] else 0)) for i in group]
                        out.update(zip(group, ((block.tokens, block.draft_rows) for block in scheduler.emit_batch(0, items))))
                    return out

                drafted = self.lower_fallback([seqs[i] for i in misses + short], emit)
                for i in short:  # the stream goes on from the topped-up block
                    (tokens, rows), (more, more_rows) = hits[i], drafted.pop(i)
                    stream = seqs[i].stream
                    if stream is not None and stream.tokens == contexts[i] + tokens:
                        stream.extend(more, more_rows)
                    hits[i] = (tokens + more, None if rows is None or more_rows is None else torch.cat([rows, more_rows]))
            grown = {}
            if trees:
                own = self.batched_tier()
                header = seqs[trees[0]].header
                grown = dict(zip(trees, own.draft_tree_batch(
                    [seqs[i].run.seq_id for i in trees], [contexts[i] for i in trees], max(1, header.tree_width),
                    [requests[i].num_tokens for i in trees], [seqs[i].params for i in trees], header.scheme or "specinfer",
                    [seqs[i].run.generators[0] for i in trees])))
            replies = []
            for i, (seq, r) in enumerate(zip(seqs, requests)):
                if r.tree:
                    replies.append(self.tree_reply(seq, r.num_tokens, grown[i], dst_rank))
                    continue
                hit = hits[i]
                tokens, rows = hit if hit is not None else drafted[i]
                replies.append(self.draft_reply(seq, contexts[i], r, hit is not None, tokens, rows, dst_rank))
        return tier_pb2.DraftBatchReply(replies=replies)

    @_served
    def Score(self, request: tier_pb2.ScoreRequest) -> tier_pb2.ScoreReply:
        """This tier's distribution after the context, on a sequence of its own (SpecReason's utility score:
        `tier.scratch_score`; a request's scored prompt stays until `release`)."""
        (context,) = self.contexts.resolve_all([request.seq_id], [request.context], [request.delta])
        with self.lock.hold():
            row = scratch_score(self.batched_tier().inner, context, request.seq_id or None, request.temperature or 1.0)
        return tier_pb2.ScoreReply(rows=encode_rows(row[None], self.counters))  # [1, V]

    # --------------------------------------------------------------- profile

    @_served
    def Profile(self, request: tier_pb2.ProfileRequest) -> tier_pb2.ProfileReply:
        """The batched forward's cost on the (batch, width) grid, measured here (the goodput planner's
        t_i(B, W), polyspec.orchestrator.tuning.profiler.profile_batched); a lookup tier's ms per request."""
        from polyspec.orchestrator.tuning.profiler import profile_batched

        (table,), (lookup,) = profile_batched([self.batched_tier()], self.tier.vocab_size, request.max_batch,
                                              repeats=max(1, request.repeats))
        reply = tier_pb2.ProfileReply(can_verify=self.tier.can_verify, deterministic_drafts=self.tier.deterministic_drafts,
                                      lookup_ms=lookup, catch_up_ms=-1.0)
        if table is not None:
            reply.batched.extend(tier_pb2.GridCost(batch=b, width=w, ms=ms) for (b, w), ms in sorted(table.ms.items()))
            if table.catch_up_ms is not None:
                reply.catch_up_ms = table.catch_up_ms
        return reply

    # ------------------------------------------------------------ draft-ahead

    def want_ahead(self, seq) -> None:
        """The sequence's stream joins the batched draft-ahead (grown up to `seq.ahead_until`). Holds seq.cond."""
        if seq.closed or seq.stream is None:
            return
        with self._ahead_cond:
            self._ahead_wanted[seq.run.seq_id] = seq
            if self._ahead_thread is None:
                self._ahead_thread = threading.Thread(target=self._ahead_loop, name=f"ahead-batch-{self.tier.name}", daemon=True)
                self._ahead_thread.start()
            self._ahead_cond.notify()

    def stop_ahead(self) -> None:
        with self._ahead_cond:
            self._ahead_stopping = True
            self._ahead_cond.notify_all()

    def _ahead_loop(self) -> None:
        set_drafting_ahead(True)
        while True:
            with self._ahead_cond:
                while not self._ahead_wanted and not self._ahead_stopping:
                    self._ahead_cond.wait()
                if self._ahead_stopping:
                    return
                wanted = sorted(self._ahead_wanted.values(), key=lambda s: s.run.seq_id)
            held = [seq for seq in wanted if seq.cond.acquire(blocking=False)]  # never waits while holding
            try:
                self._ahead_step(held)
            except Exception as exc:  # noqa: BLE001 - draft-ahead is an optimisation; the next Draft redoes the work
                print(f"polyspec tier {self.tier.name}: draft-ahead stopped: {exc!r}", flush=True)
                for seq in held:
                    self._ahead_done(seq)
            finally:
                for seq in held:
                    seq.cond.release()
            if not held:
                time.sleep(self.IDLE_POLL_S)

    def _ahead_done(self, seq) -> None:
        """The sequence's stream is as long as its bet (or gone): it leaves the draft-ahead. Holds seq.cond."""
        with self._ahead_cond:
            self._ahead_wanted.pop(seq.run.seq_id, None)
        seq.cond.notify_all()

    def _ahead_step(self, held) -> None:
        """One token more on every held sequence's stream that wants one: one forward (per length group)."""
        growing = []
        for seq in held:
            stream = seq.stream
            if seq.closed or stream is None or len(stream.tokens) >= min(seq.ahead_until, seq.run.limit - 1) \
                    or first_eos(stream.tokens[stream.base:], self.eos_token_ids) is not None:
                self._ahead_done(seq)
            else:
                growing.append(seq)
        if not growing:
            return
        lower = self.lower
        try:
            for scheduler, group in self._by_chain(lower, range(len(growing)), growing):
                drafted = scheduler.emit_batch(0, [(growing[i].run, list(growing[i].stream.tokens), 1) for i in group])
                for i, block in zip(group, drafted):
                    tokens, rows = block.tokens, block.draft_rows
                    seq, stream = growing[i], growing[i].stream
                    if not tokens:
                        self._ahead_done(seq)
                        continue
                    stream.extend(tokens, rows)
                    seq.cond.notify_all()
        except TierUnavailableError as exc:
            self._lower_failed(lower, exc)
            for seq in growing:
                self._ahead_done(seq)


class _BatchRecorder:
    """The recorder of a worker's batched chain: each verification round becomes a stage report
    of its sequence, sent up with the call's reply."""

    def __init__(self, sequence_of, index: int, lower: RemoteTier) -> None:
        self.sequence_of, self.index, self.lower = sequence_of, index, lower

    def observe(self, observation) -> None:
        if not isinstance(observation, RoundObservation):
            return
        seq = self.sequence_of(observation.seq_id)
        if seq is not None:
            seq.reports.append(tier_pb2.StageReport(tier=self.index, drafter=self.lower.index, length=observation.length,
                                                    proposed=observation.proposed, accepted=observation.accepted,
                                                    seconds=observation.seconds, ahead=drafting_ahead()))

