"""The driver of a distributed chain: requests in, verified tokens out.

`DistributedChain` is a decoder (`polyspec.orchestrator.decode.contract.Decoder`: start /
step / finish / cancel), so the engine, the batch runner and the server drive a distributed
chain exactly as an embedded one. A step is one `VerifyBatch` call to the target's worker
(polyspec.orchestrator.distributed.worker), a batch of one for `step`; the
target pulls its block from the tier below, which pulls from the tier below it: the driver
never relays blocks. The driver keeps each request's committed tokens, so a request
survives any tier's death: a step that failed committed nothing and is simply redone.
With `keep_finished` (a chat) a finished request's caches stay in every worker (`Release` with
`keep_caches`) and a next turn extending its tokens runs under its sequence id, as embedded.
A round sends the target only the tokens committed since its last one (transport.SentContexts);
a target that lost them (a restart) refuses, and the round goes again with the whole context.

Where the workers live is a `Membership`: `polyspec.orchestrator.distributed.ray_runtime.RayMembership`
for Ray actors, which also restarts and rewires tiers (the tests' in-process chains have one of
their own).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from concurrent import futures

import grpc
import torch

from polyspec.orchestrator.distributed import cluster_auth
from polyspec.orchestrator.decode.contract import (
    NO_LIMIT,
    DraftObservation,
    GenerationOutput,
    KeptSequences,
    RequestState,
    RoundObservation,
    StepInput,
    StepObservation,
    StageStats,
    commit,
    finish_if_full,
    mark_cancelled,
    note_plan,
    note_round,
    output,
    plan_records,
    remaining,
    tier_seeds,
)
from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc
from polyspec.workers.core.grammar import grammar_of, wire_form
from polyspec.workers.core.sampling import SamplingParams
from polyspec.orchestrator.distributed.transport import (
    CHANNEL_OPTIONS,
    Counters,
    SentContexts,
    TierUnavailableError,
    call_tier,
    call_with_contexts,
    decode_rows,
    health,
)

VERIFY_TIMEOUT_S = 300.0


class ChainUnavailableError(RuntimeError):
    """No target tier is reachable (it did not come back within the restart timeout)."""


@dataclasses.dataclass
class TierView:
    """What the driver knows of a remote tier (the engine and server read `name` and `busy_s`)."""

    name: str
    index: int
    vocab_size: int = 0
    max_context: int | None = None
    address: str = ""
    up: bool = True
    busy_s: float = 0.0
    can_verify: bool = True
    forward_log: tuple = ()  # (its forwards are logged, and fold into the planner's tables, in its own process)


class Membership:
    """Where the tiers are; what to do when one fails."""

    views: list[TierView]
    events: tuple | list = ()  # membership changes, when it records them (RayMembership)

    def target_address(self) -> str:
        raise NotImplementedError

    def target_failed(self, exc: Exception) -> None:
        """Block until a target is back, or raise ChainUnavailableError."""
        raise ChainUnavailableError(str(exc))

    def degraded(self, reason: str) -> None:
        """A tier below the target was unreachable: rewire when it is back (non-blocking)."""

    def health(self) -> list[tier_pb2.HealthReply | None]:
        # (no address: never started, a drafter the chain started without)
        return [health(view.address, 5.0) if view.address else None for view in self.views]

    def close(self) -> None:
        pass


@dataclasses.dataclass
class RemoteRun:
    """What the driver keeps of one request besides its tokens (`RequestState.run`)."""

    header: tier_pb2.SequenceHeader  # sent with every round: sampling, seeds, lengths, limit
    stages: dict[tuple[int, int], StageStats] = dataclasses.field(default_factory=dict)  # (tier, drafter) -> stats
    rounds: int = 0
    overhead_s: float = 0.0  # round trips not spent in model forwards on the critical path


@dataclasses.dataclass
class _Target:
    address: str
    channel: grpc.Channel
    stub: tier_pb2_grpc.TierStub


class DistributedChain:
    def __init__(self, membership: Membership, lengths: list[int], *, tree_width: int = 1, scheme: str = "specinfer",
                 eos_token_ids: tuple[int, ...] = (), max_context: int | None = None, pipeline: bool = False,
                 keep_finished: int = 0) -> None:
        """`keep_finished`: how many finished requests keep their caches in every tier for a later prompt that
        extends them (prefix reuse, as the embedded chain's: `contract.KeptSequences`)."""
        self.membership = membership
        self.tiers = membership.views
        self.vocab_size = min((view.vocab_size for view in self.tiers), default=0)  # (set again once the tiers report theirs)
        self.lengths = list(lengths)
        self.active = tuple(range(len(self.tiers)))
        self.tree_width = tree_width
        self.scheme = scheme
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.pipeline = pipeline
        # lengths: auto: the goodput planner (BatchPlanner over plans that run every tier or none: Engine.make_planner)
        # sets every step's lengths from the stage reports the tiers send up
        self.planner = None
        self._planner_lock = threading.Lock()  # steps of concurrent requests plan and report under it
        self.counters = Counters()
        self.failovers = 0
        self.degraded_rounds = 0
        self._target: _Target | None = None
        self._target_lock = threading.Lock()
        self._sent_target = SentContexts()  # what the target keeps of each request's context (made anew with a new target)
        self._sent_drafter = SentContexts()  # the same for tier 1 (an approximate step's `sub_chain_block`)
        self.context_resends = 0  # calls a tier refused for a context base it lacked, sent again whole
        self._seq_ids = itertools.count(random.getrandbits(40) << 20)
        self._releases = futures.ThreadPoolExecutor(1, thread_name_prefix="polyspec-release")
        self.kept = KeptSequences(keep_finished, self._release, lambda: next(self._seq_ids))
        # continuous batching: the engine steps every running request in one `step_all` (one VerifyBatch);
        # otherwise requests step one at a time, concurrently (each a VerifyBatch of one)
        self.batched = False
        self.last_step: dict = {}  # batched: batch size, tokens, seconds of the latest step

    # ----------------------------------------------------------------- target

    def _stub(self) -> _Target:
        with self._target_lock:
            address = self.membership.target_address()
            if self._target is None or self._target.address != address:
                if self._target is not None:
                    self._target.channel.close()
                    self._sent_target = SentContexts()
                channel = cluster_auth.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._target = _Target(address, channel, tier_pb2_grpc.TierStub(channel))
            return self._target

    def _call_target(self, method: str, request):
        """Call the target; on a dead target wait for its restart and call again. Returns the reply and
        the seconds the last call took."""
        while True:
            target = self._stub()
            started = time.perf_counter()
            try:
                reply = call_tier(target.stub, method, request, VERIFY_TIMEOUT_S, self.counters, self.tiers[0].name)
                return reply, time.perf_counter() - started
            except TierUnavailableError as exc:
                self.failovers += 1
                self.membership.target_failed(exc)

    # -------------------------------------------------------------------- API

    @property
    def concurrent_steps(self) -> bool:
        """Steps of different requests may run at once (the server overlaps them), unless batched."""
        return not self.batched

    def start(self, prompt_ids, max_new_tokens, params: SamplingParams, seed=None) -> RequestState:
        header = tier_pb2.SequenceHeader(
            seq_id=self.kept.sequence_for(list(prompt_ids)), temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seeds=tier_seeds(seed, len(self.tiers)), lengths=self.lengths, pipeline=self.pipeline, scheme=self.scheme,
            tree_width=self.tree_width, limit=self.max_context or 0,
        )
        if grammar_of(params) is not None:  # structured output: each tier compiles it and restricts its own rows
            header.constraint_json = wire_form(params.grammar)
        return RequestState(seq_id=header.seq_id, params=params, committed=list(prompt_ids), max_new_tokens=max_new_tokens,
                            limit=self.max_context or NO_LIMIT, run=RemoteRun(header), tier_busy_s=[0.0] * len(self.tiers))

    def step(self, state: RequestState) -> list[int]:
        """One target round of one request: a batch of one (`step_all`)."""
        return self.step_all([state])[0]

    def prefill(self, states: list[RequestState], budget: int | None = None) -> int:
        """Batched: each tier caches a joining request's prompt at its first round (in a forward of its own)."""
        return 0

    def ready(self, state: RequestState) -> bool:
        return True

    def step_all(self, states: list[RequestState]) -> list[list[int]]:
        """One target round of every request in `states`, in one VerifyBatch: each tier scores every
        request's block in one forward (polyspec.orchestrator.distributed.worker). A planner
        plans the step and hears its stage reports as typed observations (`round_observations`)."""
        started = time.perf_counter()
        out: list[list[int]] = [[] for _ in states]
        live = [i for i, state in enumerate(states) if not finish_if_full(state)]
        if not live:
            return out
        planner = self.planner
        running = [states[i] for i in live]
        lengths, active, predicted = self._plan(running)

        def batch(deltas) -> tier_pb2.VerifyBatchRequest:
            return tier_pb2.VerifyBatchRequest(requests=[self._round_request(state, lengths, sending)
                                                         for state, sending in zip(running, deltas)])

        reply, wall = call_with_contexts(lambda request: self._call_target("VerifyBatch", request), batch, self._sent_target,
                                         [state.seq_id for state in running], [state.committed for state in running],
                                         self._resent)
        if len(reply.replies) != len(live):
            raise RuntimeError(f"tier {self.tiers[0].name!r}: VerifyBatch answered {len(reply.replies)} of {len(live)} requests")
        heard = []
        for i, state, one in zip(live, running, reply.replies):
            if planner is not None:
                heard += round_observations(one.stages, state.params, len(state.committed), state.seq_id)
            out[i] = self._round_reply(state, one, wall)
        seconds = time.perf_counter() - started
        committed = tuple(tuple(out[i]) for i in live)
        if planner is not None:  # each request's round, under the plan it ran: its tokens in the step's wall time
            for state, tokens in zip(running, committed):
                note_round(state.plans, len(tokens), seconds, predicted)
        self.last_step = {"batch": len(live), "tokens": sum(map(len, committed)), "seconds": seconds, "tiers": list(active),
                          "lengths": list(lengths)}
        if planner is not None:
            heard.append(StepObservation(committed, seconds, tuple(lengths), tuple(active)))
            with self._planner_lock:  # the planner that planned the step hears it
                for observation in heard:
                    planner.observe(observation)
        return out

    def _plan(self, states: list[RequestState]) -> tuple[list[int], tuple[int, ...], float | None]:
        """The step's lengths and tiers: the planner's, else the chain's own; and the planner's predicted
        tokens/s of each request under them (None: no planner)."""
        planner = self.planner
        if planner is None:
            return list(self.lengths), self.active, None
        with self._planner_lock:
            lengths, active = planner.plan(StepInput(
                tuple(state.params for state in states), tuple(len(state.committed) for state in states),
                remaining=tuple(min(remaining(state), state.limit - len(state.committed)) for state in states)))
            predicted = planner.predicted_tokens_per_s
        for state in states:
            note_plan(state.plans, len(state.new_tokens), lengths, [self.tiers[t].name for t in active])
        self.lengths, self.active = list(lengths), tuple(active)  # the plan in use (the server's speculation_length gauge)
        return self.lengths, self.active, predicted

    def _round_request(self, state: RequestState, lengths: list[int], sending) -> tier_pb2.VerifyRequest:
        """The request's next Verify, with the step's lengths; `sending`: (the committed tokens the target
        lacks, the ContextDelta they extend)."""
        header = state.run.header
        del header.lengths[:]
        header.lengths.extend(lengths)
        tail, delta = sending
        return tier_pb2.VerifyRequest(header=header, context=tail, delta=delta, max_tokens=remaining(state))

    def _resent(self) -> None:
        self.context_resends += 1

    def _round_reply(self, state: RequestState, reply: tier_pb2.VerifyReply, wall: float) -> list[int]:
        """Fold one round's reply into the request: stats and the committed tokens."""
        run: RemoteRun = state.run
        run.overhead_s += max(0.0, wall - reply.model_s)
        run.rounds += 1
        self._record(run, reply.stages)
        # a round on a shortened chain: one that found a tier dead, or one run while a tier is
        # bypassed (the repair loop may have rewired before any round failed; a drafter left
        # out at start-up never fails one)
        if reply.degraded or not all(view.up for view in self.tiers):
            self.degraded_rounds += 1
        if reply.degraded:
            self.membership.degraded(reply.degraded_reason)
        return commit(state, list(reply.tokens), self.eos_token_ids)

    def _record(self, run: RemoteRun, reports) -> None:
        for report in reports:
            if report.drafter == report.tier:
                continue  # a bottom tier's proposal, not a verification round
            key = (report.tier, report.drafter)
            stage = run.stages.get(key)
            if stage is None:
                names = [v.name for v in self.tiers]
                stage = run.stages[key] = StageStats(names[report.tier], names[report.drafter] if report.drafter < len(names) else "?")
            stage.record(report.proposed, report.accepted, report.length, report.seconds)

    def finish(self, state: RequestState) -> GenerationOutput:
        run: RemoteRun = state.run
        if self.kept.put(state.seq_id, state.committed):
            self._release(state.seq_id, keep_caches=True)
        extra = {"rounds": run.rounds, "overhead_s": round(run.overhead_s, 6)}
        if state.plans:
            extra["plans"] = plan_records(state.plans)
        return output(state, [stage for _, stage in sorted(run.stages.items())], **extra)

    def cancel(self, state: RequestState) -> GenerationOutput:
        mark_cancelled(state)
        return self.finish(state)

    def _release(self, seq_id: int, keep_caches: bool = False) -> None:
        """Free a sequence in every tier (in the background), or only its state, its caches kept for a next
        request under its id (`keep_caches`: answered once every tier has, so that request never meets the old state)."""
        self._sent_target.forget(seq_id)
        self._sent_drafter.forget(seq_id)

        def release() -> None:
            try:
                stub.Release(tier_pb2.ReleaseRequest(seq_id=seq_id, keep_caches=keep_caches), timeout=10.0)
            except (grpc.RpcError, ValueError):
                pass  # the target is gone: its caches went with it

        try:
            stub = self._stub().stub
        except Exception:  # noqa: BLE001 - no target to release at (it is down): its caches went with it
            return
        release() if keep_caches else self._releases.submit(release)

    # ------------------------------------------------------- approximate modes

    def set_approximate(self, state: RequestState, approximate_json: str) -> None:
        """Carry a request's approximate mode in its header (polyspec.orchestrator.decode.approximate.header_json):
        the target's worker checks its blocks by the mode's rule, the drafters' workers stop a BiLD block at
        the first unsure token (approximate.worker_hooks)."""
        state.run.header.approximate_json = approximate_json

    def sub_chain_block(self, state: RequestState, context: list[int], need: int) -> list[int]:
        """At least `need` tokens after `context` from tier 1's worker (its own rounds over the tiers below):
        an approximate step driver's small model."""
        header = tier_pb2.SequenceHeader()
        header.CopyFrom(state.run.header)
        header.pipeline = False  # a block asked for directly: no draft-ahead bet on it
        view = self.tiers[1]

        def draft(request: tier_pb2.DraftRequest) -> tier_pb2.DraftReply:
            with cluster_auth.insecure_channel(view.address, options=CHANNEL_OPTIONS) as channel:
                return call_tier(tier_pb2_grpc.TierStub(channel), "Draft", request, VERIFY_TIMEOUT_S, self.counters, view.name)

        def one(deltas) -> tier_pb2.DraftRequest:
            (tail, delta), = deltas
            return tier_pb2.DraftRequest(header=header, context=tail, delta=delta, num_tokens=need, caller=0)

        reply = call_with_contexts(draft, one, self._sent_drafter, [state.seq_id], [context], self._resent)
        return list(reply.tokens)

    def target_distribution(self, prompt_ids: list[int], seq_id=None) -> torch.Tensor:
        """The target's own distribution (temperature 1) after `prompt_ids` [V], from its worker; with the
        request's `seq_id` the worker keeps the scored KV until the request is released (ChainScheduler's)."""
        if not seq_id:
            reply, _ = self._call_target("Score", tier_pb2.ScoreRequest(context=prompt_ids, temperature=1.0))
            return decode_rows(reply.rows)[0]

        def one(deltas) -> tier_pb2.ScoreRequest:
            (tail, delta), = deltas
            return tier_pb2.ScoreRequest(context=tail, delta=delta, temperature=1.0, seq_id=seq_id)

        reply, _ = call_with_contexts(lambda request: self._call_target("Score", request), one, self._sent_target, [seq_id],
                                      [prompt_ids], self._resent)
        return decode_rows(reply.rows)[0]

    def runtime_stats(self) -> dict:
        """Messages and bytes per transport, busy / idle time per tier, draft-ahead hits."""
        tiers = []
        for view, reply in zip(self.tiers, self.membership.health()):
            if reply is None:
                tiers.append({"tier": view.name, "up": False})
                continue
            view.busy_s = reply.busy_s
            tiers.append({
                "tier": reply.tier, "up": True, "address": view.address, "device": reply.device,
                "busy_s": round(reply.busy_s, 4), "idle_s": round(max(0.0, reply.uptime_s - reply.busy_s), 4),
                "forwards": reply.forwards, "lower": reply.lower,
                "sent": {c.transport: {"messages": c.messages, "bytes": c.bytes} for c in reply.sent},
                "draft_ahead": {"hits": reply.ahead_hits, "misses": reply.ahead_misses, "dropped_tokens": reply.ahead_dropped_tokens},
                # context bases this tier lacked (its callers resent those contexts whole) / its calls the tier below refused
                "contexts": {"refused": reply.stale_contexts, "resent": reply.context_resends},
            })
        return {
            "driver_sent": {t: {"messages": self.counters.messages[t], "bytes": self.counters.bytes[t]} for t in self.counters.messages},
            "failovers": self.failovers,
            "context_resends": self.context_resends,
            "degraded_rounds": self.degraded_rounds,
            "tiers": tiers,
            # drafters left out at start-up, bypassed, wired (back) in: when and why (RayMembership)
            "tier_events": list(self.membership.events),
        }

    def close(self) -> None:
        self._releases.shutdown(wait=True)
        if self._target is not None:
            self._target.channel.close()
        self.membership.close()


def round_observations(reports, params: SamplingParams, context_len: int, seq_id: int) -> list:
    """A request's round as its stage reports (protos tier.proto StageReport) tell it, as a planner's
    typed observations, in the order reported: verification rounds (`RoundObservation`), the bottom
    tier's proposals and, pipelined, the blocks drafted ahead (`DraftObservation`, with `proposed`)."""
    observations = []
    for report in reports:
        if report.drafter == report.tier:
            ahead = report.block_seconds > 0
            observations.append(DraftObservation(report.tier, report.length, context_len, None,
                                                 report.block_seconds if ahead else report.seconds, report.proposed, ahead))
        else:
            observations.append(RoundObservation(report.tier, report.drafter, report.length, report.proposed, report.accepted,
                                                 report.seconds, params.greedy, context_len, seq_id, ahead=report.ahead))
    return observations


def profile_grid_remote(chain: DistributedChain, max_batch: int, repeats: int = 2):
    """Each tier's batched forward on the (batch, width) grid, measured in its own process (the
    Profile RPC with `max_batch`), as `polyspec.orchestrator.tuning.profiler.profile_batched`
    measures an embedded chain. Returns (tables, lookup_ms), one entry per tier."""
    from polyspec.orchestrator.tuning.batch_model import ForwardTable

    tables, lookup = [], []
    for view in chain.tiers:
        request = tier_pb2.ProfileRequest(max_batch=max_batch, repeats=repeats)
        with cluster_auth.insecure_channel(view.address, options=CHANNEL_OPTIONS) as channel:  # (before any request)
            try:
                reply = tier_pb2_grpc.TierStub(channel).Profile(request, timeout=VERIFY_TIMEOUT_S)
            except grpc.RpcError as exc:
                raise TierUnavailableError(view.name, f"Profile: {exc.details() or exc.code().name.lower()}") from None
        view.can_verify = reply.can_verify
        grid = {(cell.batch, cell.width): cell.ms for cell in reply.batched}
        tables.append(ForwardTable(grid, reply.catch_up_ms if reply.catch_up_ms >= 0 else None) if grid else None)
        lookup.append(reply.lookup_ms)
    return tables, lookup

