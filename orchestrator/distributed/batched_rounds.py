"""A tier worker's rounds: VerifyBatch and DraftBatch, the only calls that run the round.

The driver sends one VerifyBatch per step with every running sequence (a batch of one for a
request stepped alone). The target worker runs the embedded round
(polyspec.orchestrator.decode.scheduler) over its own two-tier chain [its batched tier, the
tier below]: the tier below is a `RemoteTier`, so every sequence's block comes from ONE
DraftBatch call, the target scores all the blocks in ONE forward, and each sequence is
verified with its own generator. A middle tier answers DraftBatch the same way (its rounds
batched, its own DraftBatch to the tier below); the bottom tier drafts every sequence's block
with one forward per position. So each tier runs one forward per round for the whole batch,
as embedded. A worker keeps its chains (`_scheduler`) from call to call.

Draft-ahead stays per sequence: a drafter first serves each sequence of a DraftBatch from
its draft-ahead stream (tokens drafted past the last block, `TierWorker.stream_hit`);
only the misses, and the streams still short of their block, are drafted, together. After
the reply each sequence's stream grows on its own bet (`ahead_until`), but the growing is
batched: one thread per worker extends every stream that wants tokens by one token per
forward (`_ahead_loop`), yielding the model to calls a verifier waits on, and skipping a
sequence whose call is being served.

This class is a part of `TierWorker` (worker.py), kept in its own module for size: it uses
the worker's sequences, locks and draft-ahead streams as the worker's own methods do.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from polyspec.orchestrator.decode.contract import RoundObservation, first_eos
from polyspec.orchestrator.decode.scheduler import CATCH_UP_GAP, ChainScheduler
from polyspec.orchestrator.distributed.model_lock import LockedBatched, drafting_ahead, model_seconds, set_drafting_ahead, set_model_seconds
from polyspec.orchestrator.distributed.transport import RemoteTier, TierUnavailableError, encode_rows
from polyspec.protos.polyspec.v1 import tier_pb2
from polyspec.workers.tiers.tier import scratch_score



class BatchedRounds:
    """VerifyBatch / DraftBatch for `TierWorker` (which mixes this class in)."""

    _ahead_thread: threading.Thread | None = None
    _ahead_stopping = False
    IDLE_POLL_S = 0.001  # every wanting sequence busy in a call: look again this soon

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

    def _by_shape(self, indices, seqs) -> dict[tuple, list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i in indices:
            groups.setdefault(self._shape(seqs[i]), []).append(i)
        return groups

    def _catch_up(self, seqs, contexts) -> None:
        """Cache, in one forward, the contexts this tier is far behind on (a joining sequence's
        prompt), so the round's forward does not pad every row to that prompt's length."""
        own = self.batched_tier()
        if not own.caches_prompts:
            return
        behind = [i for i, (s, c) in enumerate(zip(seqs, contexts)) if len(c) - 1 - own.cached(s.run.seq_id) > CATCH_UP_GAP]
        if behind:
            own.prefill([seqs[i].run.seq_id for i in behind], [contexts[i] for i in behind], sum(len(contexts[i]) for i in behind))

    # ------------------------------------------------------------------- verify

    def verify_batch(self, request: tier_pb2.VerifyBatchRequest) -> tier_pb2.VerifyBatchReply:
        seqs = [self._sequence(r.header) for r in request.requests]
        self._distinct(seqs, "VerifyBatch")
        set_model_seconds(0.0)
        with self._holding(seqs):
            for seq in seqs:
                seq.reset_call()
            contexts = [list(r.context) for r in request.requests]
            self._catch_up(seqs, contexts)

            def one_round(lower):
                emitted: list[list[int]] = [[] for _ in seqs]
                for shape, group in self._by_shape(range(len(seqs)), seqs).items():
                    scheduler = self._scheduler(lower, shape)
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

    def draft_batch(self, request: tier_pb2.DraftBatchRequest, dst_rank: int | None) -> tier_pb2.DraftBatchReply:
        requests = list(request.requests)
        seqs = [self._sequence(r.header) for r in requests]
        self._distinct(seqs, "DraftBatch")
        started = time.perf_counter()
        with self._holding(seqs):
            # waiting for draft-ahead steps to finish is this tier's model time on the caller's critical path
            set_model_seconds(time.perf_counter() - started)
            for seq in seqs:
                seq.reset_call()
            contexts = [list(r.context) for r in requests]
            trees = [i for i, r in enumerate(requests) if r.tree]
            # what each stream holds now, without waiting on it: streams still short are topped up
            # below in the misses' forwards (one wait per sequence would grow them one at a time)
            hits = {i: self.stream_hit(seqs[i], contexts[i], requests[i]) for i in range(len(requests)) if not requests[i].tree}
            misses = [i for i, hit in hits.items() if hit is None]
            short = [i for i, hit in hits.items() if hit is not None and len(hit[0]) < requests[i].num_tokens
                     and first_eos(hit[0], self.eos_token_ids) is None]
            if misses or trees:
                self._catch_up([seqs[i] for i in misses + trees], [contexts[i] for i in misses + trees])
            drafted: dict[int, tuple] = {}
            if misses or short:
                def emit(lower):
                    out = {}
                    for shape, group in self._by_shape(misses + short, seqs).items():
                        scheduler = self._scheduler(lower, shape)
                        items = [(seqs[i].run, contexts[i] + (hits[i][0] if hits[i] else []),
                                  requests[i].num_tokens - (len(hits[i][0]) if hits[i] else 0)) for i in group]
                        out.update(zip(group, scheduler.emit_batch(0, items)))
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

    def score(self, request: tier_pb2.ScoreRequest) -> tier_pb2.ScoreReply:
        """This tier's distribution after the context, on a sequence of its own (SpecReason's utility score:
        `tier.scratch_score`; a request's scored prompt stays until `release`)."""
        batched = self.siblings.of(self.tier)
        with self.lock.hold():
            row = scratch_score(batched.inner, list(request.context), request.seq_id or None, request.temperature or 1.0)
        return tier_pb2.ScoreReply(rows=encode_rows(row[None], self.counters))  # [1, V]

    # --------------------------------------------------------------- profile

    def profile_grid(self, request: tier_pb2.ProfileRequest) -> tier_pb2.ProfileReply:
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
            for shape, group in self._by_shape(range(len(growing)), growing).items():
                scheduler = self._scheduler(lower, shape)
                drafted = scheduler.emit_batch(0, [(growing[i].run, list(growing[i].stream.tokens), 1) for i in group])
                for i, (tokens, rows) in zip(group, drafted):
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
