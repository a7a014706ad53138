"""Transport between distributed tiers: the gRPC proxy of a remote tier, and
how dense probability rows travel.

`RemoteTier` implements the batched tier (`polyspec.workers.tiers.batched.BatchedTier`) on top of
the tier-to-tier protocol (protos/polyspec/v1/tier.proto), so a verifier runs the very same
round (`polyspec.orchestrator.decode.scheduler.ChainScheduler`) whether the tier below it is an
object in this process or an actor on another node.

Rows (only sampling needs them: greedy blocks are token ids):

- NONE    greedy;
- SPARSE  top-k / top-p rows, when at most SPARSE_FRACTION of the entries are non-zero
          (8 bytes per non-zero instead of 4 per vocabulary entry);
- INLINE  float32 bytes inside the gRPC message;
- DIST    torch.distributed point-to-point, the gRPC message carrying only the tag: under
          NCCL (tiers on distinct GPUs) every block, dense, from one GPU's memory to the other's
          (the rows never visit the host); under gloo the blocks above DIST_MIN_BYTES.

Which one, by measurement (benchmarks/transport.py, two processes on loopback, vocabulary
32000; its table: benchmarks/transport.md): protobuf copies inline bytes several times, so
an inline round trip grows with the rows (about ten times slower for a k=8 block of 1 MB than
with no rows), while a gloo send/recv of the same block costs about one extra gRPC call on
top of the call that carries its tag. The crossover is near 256 KB (DIST_MIN_BYTES): below
it inline wins, above it gloo does, by 3-5x at 1-16 MB. `tensor_transport: auto` still keeps CPU rows inline:
a torch.distributed group is fixed at start-up and a restarted tier cannot rejoin it, so
inline is what survives failover; the demo vocabulary's blocks (k x 4096 x 4 bytes) stay
under the crossover anyway. Ask for `gloo` to trade that for speed on big vocabularies;
`auto` picks NCCL between tiers on distinct GPUs (GPU memory to GPU memory, no host copy).

Contexts never cross twice: a caller keeps, per sequence, what it last sent its callee
(`SentContexts`) and sends only the tokens past the prefix the callee still keeps under that
version (`ContextDelta`); the callee keeps the last few versions per sequence (`KeptContexts`) and
refuses a call whose base it lacks (`StaleContextError`, FAILED_PRECONDITION on the wire), after
which the caller sends the whole contexts once. A 2,000-token prompt crosses each hop once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import random
import threading
from concurrent import futures
from typing import Callable

import grpc
import torch

from polyspec.orchestrator.distributed import cluster_auth
from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc
from polyspec.workers.core.tree import Blocks, DraftTree, common_prefix
from polyspec.workers.tiers.batched import BatchedTier

SPARSE_FRACTION = 0.25
DIST_MIN_BYTES = int(os.environ.get("POLYSPEC_DIST_MIN_BYTES", 256 << 10))  # gloo beats inline above this (measured)
MAX_MESSAGE_BYTES = 512 << 20
RPC_TIMEOUT_S = 120.0
UNAVAILABLE_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
]


class TierUnavailableError(RuntimeError):
    """A tier's actor (or its node) cannot be reached; the chain goes on without it."""

    def __init__(self, tier: str, detail: str) -> None:
        super().__init__(f"tier {tier!r} is unavailable: {detail}")
        self.tier = tier


STALE_CONTEXT = "stale context"  # the detail of a refusal for a base the callee lacks (FAILED_PRECONDITION)
KEPT_VERSIONS = 4  # contexts a callee keeps per sequence: one per caller of it, and a call whose reply was lost

log = logging.getLogger(__name__)


class StaleContextError(RuntimeError):
    """A call named a context version the callee does not keep (a lost message, a restart): send it whole."""


class Counters:
    """Messages and bytes per transport (grpc | gloo | nccl), counted by the caller: a gRPC
    call is one message with its request and reply bytes. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def add(self, transport: str, nbytes: int) -> None:
        with self._lock:
            self.messages[transport] = self.messages.get(transport, 0) + 1
            self.bytes[transport] = self.bytes.get(transport, 0) + int(nbytes)

    def as_proto(self) -> list[tier_pb2.TransportCounters]:
        with self._lock:
            return [tier_pb2.TransportCounters(transport=t, messages=self.messages[t], bytes=self.bytes[t]) for t in sorted(self.messages)]


# ------------------------------------------------------------------------- contexts


class SentContexts:
    """The caller's side, for one callee: per sequence, the context it last sent and its version.

    Versions count up from a random 62-bit number per caller, so two callers of one tier (or a
    caller and its restarted self) practically never name one sequence's contexts alike.
    Thread-safe; a caller sends one sequence's calls one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[int, tuple[int, list[int]]] = {}
        self._versions = itertools.count(random.getrandbits(62) + 1)

    def delta(self, seq_id: int, context: list[int], whole: bool = False) -> tuple[list[int], tier_pb2.ContextDelta]:
        """What to send for `context`: the tokens the callee lacks and how they extend its kept version
        (`whole`: all of them, on no base)."""
        with self._lock:
            version = next(self._versions)
            sent = None if whole else self._sent.get(seq_id)
        if sent is None:
            return list(context), tier_pb2.ContextDelta(version=version)
        base_version, kept = sent
        base_len = common_prefix(kept, context)  # all that was sent, unless the context rolled back past it
        return list(context[base_len:]), tier_pb2.ContextDelta(version=version, base_version=base_version, base_len=base_len)

    def sent(self, seq_id: int, delta: tier_pb2.ContextDelta, context: list[int]) -> None:
        """The callee answered a call carrying `delta`: it keeps `context` under its version."""
        with self._lock:
            self._sent[seq_id] = (delta.version, list(context))

    def forget(self, seq_id: int) -> None:
        with self._lock:
            self._sent.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._sent)


class KeptContexts:
    """The callee's side: per sequence, the last KEPT_VERSIONS contexts its callers sent, by version
    (a version names one context for good, so any kept one is a safe base). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, collections.OrderedDict[int, list[int]]] = {}
        self.stale = 0  # sequences refused for a base not kept here (each one's caller resent it whole)

    def resolve(self, seq_id: int, tail, delta: tier_pb2.ContextDelta) -> list[int] | None:
        """The whole context a call names (None: its base is not kept here), kept under the call's version."""
        tail = list(tail)
        with self._lock:
            versions = self._kept.get(seq_id)
            if delta.base_version:
                base = versions.get(delta.base_version) if versions is not None else None
                if base is None or delta.base_len > len(base):
                    self.stale += 1
                    return None
                context = base[: delta.base_len] + tail
            else:
                context = tail
            if delta.version:  # a copy: the caller of resolve may change its list
                versions = self._kept.setdefault(seq_id, collections.OrderedDict())
                versions[delta.version] = list(context)
                while len(versions) > KEPT_VERSIONS:
                    versions.popitem(last=False)
        return context

    def resolve_all(self, seq_ids, tails, deltas) -> list[list[int]]:
        """Every context of a batch, or StaleContextError naming the sequences whose base is not kept here."""
        contexts = [self.resolve(s, t, d) for s, t, d in zip(seq_ids, tails, deltas)]
        stale = [s for s, c in zip(seq_ids, contexts) if c is None]
        if stale:
            log.debug("refused stale contexts of sequences %s (their callers resend them whole)", stale)
            raise StaleContextError(f"{STALE_CONTEXT}: sequences {stale} are not kept at the versions named")
        return contexts

    def drop(self, seq_id: int) -> None:
        with self._lock:
            self._kept.pop(seq_id, None)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)


def call_tier(stub, method: str, request, timeout: float, counters: Counters, tier: str, where: str = ""):
    """`stub.<method>(request)`, counted (one gRPC message: its request and reply bytes). A failed call raises what
    its caller handles: StaleContextError (the callee refused a context base it lacks: send the contexts whole),
    TierUnavailableError (tier `tier`, or its node, cannot be reached; `where`: said after the status), else a
    RuntimeError naming the tier, the call and the callee's details."""
    try:
        reply = getattr(stub, method)(request, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code == grpc.StatusCode.FAILED_PRECONDITION and STALE_CONTEXT in (details or ""):
            raise StaleContextError(details) from None
        if code in UNAVAILABLE_CODES:
            raise TierUnavailableError(tier, f"{method}: {code.name.lower()}{where}") from None
        raise RuntimeError(f"tier {tier!r}: {method} failed: {details}") from None
    counters.add("grpc", request.ByteSize() + reply.ByteSize())
    return reply


def health(address: str, timeout: float) -> tier_pb2.HealthReply | None:
    """The Health reply of the tier at `address`, on a channel of its own (None: it does not answer)."""
    try:
        with cluster_auth.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            return tier_pb2_grpc.TierStub(channel).Health(tier_pb2.HealthRequest(), timeout=timeout)
    except grpc.RpcError:
        return None


def call_with_contexts(call, build, sent: SentContexts, seq_ids, contexts, on_resend: Callable[[], None]):
    """`call(build(deltas))`, `deltas` one (tail, ContextDelta) per sequence: each sequence sends only
    what the callee lacks; if the callee refuses a base (StaleContextError), the call goes once more
    with whole contexts. What was sent is recorded once the callee answered."""
    deltas = [sent.delta(s, c) for s, c in zip(seq_ids, contexts)]
    try:
        reply = call(build(deltas))
    except StaleContextError as exc:
        on_resend()
        log.debug("resending whole contexts: %s", exc)
        deltas = [sent.delta(s, c, whole=True) for s, c in zip(seq_ids, contexts)]
        reply = call(build(deltas))  # whole contexts name no base: never refused
    for seq_id, context, (_, delta) in zip(seq_ids, contexts, deltas):
        sent.sent(seq_id, delta, context)
    return reply


# ----------------------------------------------------------------------------- rows


class DistChannel:
    """torch.distributed point-to-point between the tiers of one chain (rank = tier index).

    Joined once, by every tier at start-up; a tier restarted later cannot rejoin the same
    process group, so its neighbours send it rows inline from then on (`usable`).
    """

    def __init__(self, backend: str, rank: int, world_size: int, init_method: str, timeout_s: float = 60.0,
                 min_bytes: int | None = None) -> None:
        import datetime

        import torch.distributed as dist

        self.backend = backend
        self.rank = rank
        self.min_bytes = DIST_MIN_BYTES if min_bytes is None else min_bytes  # gloo: dense rows this big go out of band
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._dist = dist
        self._tags = itertools.count(1)
        self._recv_lock = threading.Lock()
        self._pending: list = []
        self._pending_lock = threading.Lock()
        self.peers: set[int] = set(range(world_size)) - {rank}

    def send(self, rows: torch.Tensor, dst: int, counters: Counters) -> int:
        tag = next(self._tags) % (1 << 30)
        # a copy: rows may be a captured step's output buffer, which the tier's next replay overwrites
        # while an NCCL send is still queued on its own stream (a GPU tensor never visits the host)
        tensor = rows.detach().to(self.device, torch.float32, copy=True).contiguous()
        work = self._dist.isend(tensor, dst=dst, tag=tag)
        with self._pending_lock:  # keep the tensor alive until the send completes
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()] + [(work, tensor)]
        counters.add(self.backend, tensor.numel() * tensor.element_size())
        return tag

    def recv(self, num_rows: int, vocab: int, src: int, tag: int) -> torch.Tensor:
        """The rows on this channel's device: GPU memory under NCCL (the verifier's device), the host under gloo."""
        buffer = torch.empty((num_rows, vocab), dtype=torch.float32, device=self.device)
        with self._recv_lock:
            self._dist.recv(buffer, src=src, tag=tag)
        return buffer


def encode_rows(rows: torch.Tensor | None, counters: Counters, dist: DistChannel | None = None, dst: int | None = None) -> tier_pb2.Rows:
    """Rows [n, V] float32 -> a Rows message (see the module docstring for the choice)."""
    if rows is None or rows.numel() == 0:
        return tier_pb2.Rows(encoding=tier_pb2.Rows.NONE)
    if dist is not None and dist.backend == "nccl" and dst is not None and dst in dist.peers:
        # GPU to GPU: dense, straight from the tier's device (sparse encoding would need the host)
        num_rows, vocab = rows.shape
        tag = dist.send(rows, dst, counters)
        return tier_pb2.Rows(encoding=tier_pb2.Rows.DIST, num_rows=num_rows, vocab=vocab, dist_tag=tag, dist_src=dist.rank)
    rows = rows.float().cpu().contiguous()
    num_rows, vocab = rows.shape
    nonzero = rows != 0
    if int(nonzero.sum()) <= SPARSE_FRACTION * rows.numel():
        counts = nonzero.sum(dim=1).tolist()
        indices = nonzero.nonzero()[:, 1].to(torch.int32)
        values = rows[nonzero]
        return tier_pb2.Rows(encoding=tier_pb2.Rows.SPARSE, num_rows=num_rows, vocab=vocab, counts=counts,
                             indices=indices.tolist(), values=values.tolist())
    nbytes = rows.numel() * 4
    if dist is not None and dst is not None and dst in dist.peers and nbytes >= dist.min_bytes:
        tag = dist.send(rows, dst, counters)
        return tier_pb2.Rows(encoding=tier_pb2.Rows.DIST, num_rows=num_rows, vocab=vocab, dist_tag=tag, dist_src=dist.rank)
    return tier_pb2.Rows(encoding=tier_pb2.Rows.INLINE, num_rows=num_rows, vocab=vocab, dense=rows.numpy().tobytes())


def decode_rows(message: tier_pb2.Rows, dist: DistChannel | None = None) -> torch.Tensor | None:
    if message.encoding == tier_pb2.Rows.NONE:
        return None
    shape = (message.num_rows, message.vocab)
    if message.encoding == tier_pb2.Rows.INLINE:
        return torch.frombuffer(bytearray(message.dense), dtype=torch.float32).reshape(shape)
    if message.encoding == tier_pb2.Rows.SPARSE:
        rows = torch.zeros(shape, dtype=torch.float32)
        row_index = torch.repeat_interleave(torch.arange(message.num_rows), torch.tensor(list(message.counts), dtype=torch.long))
        rows[row_index, torch.tensor(list(message.indices), dtype=torch.long)] = torch.tensor(list(message.values), dtype=torch.float32)
        return rows
    if dist is None:
        raise RuntimeError("rows were sent over torch.distributed but this tier has no process group")
    return dist.recv(message.num_rows, message.vocab, message.dist_src, message.dist_tag)


# ------------------------------------------------------------------------ the proxy


class RemoteTier(BatchedTier):
    """The tier below, reached over gRPC, behind the batched seam (polyspec.workers.tiers.batched):
    every sequence of a round asks for its block in one DraftBatch call, which the tier below
    answers with one batched forward per drafted position (or per round of its own).

    `sequence(seq_id)` returns the caller's per-sequence state, which supplies the header
    sent down (`header_for_lower()`) and absorbs what comes back (`absorb(reply)`): stage
    reports, model time, degraded flags. `sent` holds what the tier below was last sent of each
    sequence's context: a DraftBatch carries only the tokens past it (`call_with_contexts`).
    """

    # the tier below runs its forwards and keeps its caches in its own process: it times, counts and catches them up there
    busy_s = 0.0
    forwards = 0
    forwarded_tokens = 0
    timed_here = False
    has_weights = False
    caches_prompts = False

    def __init__(self, address: str, sequence: Callable, counters: Counters, dist: DistChannel | None = None, caller: int = 0,
                 on_resend: Callable[[], None] | None = None) -> None:  # (no BatchedTier.__init__: no local tier)
        """`on_resend`: called when the tier below refused a call's context bases and the call went again whole."""
        self.caller = caller
        self.address = address
        self._sequence = sequence
        self.counters = counters
        self.dist = dist
        self._channel = cluster_auth.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = tier_pb2_grpc.TierStub(self._channel)
        self.sent = SentContexts()  # what this caller last sent the tier below, per sequence
        self._on_resend = on_resend or (lambda: None)
        self._casts = futures.ThreadPoolExecutor(1, thread_name_prefix="tier-casts")
        info = self._call("Health", tier_pb2.HealthRequest(), timeout=10.0, name=address)
        self.info = info
        self.name = info.tier
        self.index = info.index
        self.vocab_size = info.vocab_size
        self.max_context = info.max_context or None
        self.can_verify = info.can_verify
        self.deterministic_drafts = info.deterministic_drafts
        self.forward_log: list = []

    def close(self) -> None:
        self._casts.shutdown(wait=False, cancel_futures=True)
        self._channel.close()

    def _call(self, method: str, request, timeout: float | None = None, name: str | None = None):
        return call_tier(self._stub, method, request, timeout or RPC_TIMEOUT_S, self.counters, name or self.name, f" ({self.address})")

    def _cast(self, method: str, request) -> None:
        """Fire and forget (verdicts, releases): a lost one costs a re-sync, never a wrong token.
        Sent in order by one background thread (grpc's `.future()` starts a thread per call,
        ~2 ms here: more than the call itself)."""

        def send() -> None:
            try:
                self._call(method, request, timeout=10.0)
            except (RuntimeError, ValueError):  # the tier is gone or being replaced (TierUnavailableError is a RuntimeError)
                pass

        try:
            self._casts.submit(send)
        except RuntimeError:  # closed
            pass

    def _draft_request(self, seq_id, sending, num_tokens: int, tree: bool) -> tier_pb2.DraftRequest:
        """`sending`: (the context tokens the tier below lacks, the ContextDelta they extend)."""
        seq = self._sequence(seq_id)
        tail, delta = sending
        return tier_pb2.DraftRequest(header=seq.header_for_lower(), context=tail, delta=delta, num_tokens=num_tokens, tree=tree,
                                     caller=self.caller, accept_dist=self.dist is not None)

    def _absorb(self, seq_id, reply: tier_pb2.DraftReply, tree: bool) -> DraftTree:
        """The block (a chain) or tree of one sequence's reply; its reports go to the caller's sequence."""
        rows = decode_rows(reply.rows, self.dist)
        seq = self._sequence(seq_id)
        seq.absorb(reply)
        if tree:
            return DraftTree(list(reply.tokens), list(reply.parents), rows)
        seq.lower_continues = reply.continues
        return DraftTree.chain(list(reply.tokens), rows)

    def _draft_many(self, seq_ids, contexts, counts, tree: bool) -> Blocks:
        """Every sequence's block (or tree) in one DraftBatch call."""
        def batch(deltas):
            return tier_pb2.DraftBatchRequest(requests=[self._draft_request(s, d, n, tree)
                                                        for s, d, n in zip(seq_ids, deltas, counts)])

        reply = call_with_contexts(lambda request: self._call("DraftBatch", request), batch, self.sent, seq_ids, contexts,
                                   self._on_resend)
        if len(reply.replies) != len(seq_ids):
            raise RuntimeError(f"tier {self.name!r}: DraftBatch answered {len(reply.replies)} of {len(seq_ids)} sequences")
        return Blocks.of([self._absorb(s, r, tree) for s, r in zip(seq_ids, reply.replies)])

    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        return self._draft_many(seq_ids, contexts, counts, tree=False)

    def draft_tree_batch(self, seq_ids, contexts, width, depths, params, scheme, generators):
        return self._draft_many(seq_ids, contexts, depths, tree=True)

    def continues_past(self, seq_id) -> bool:
        seq = self._sequence(seq_id)
        return seq.header.pipeline and seq.lower_continues

    def accept_path(self, seq_id, path):
        seq = self._sequence(seq_id)
        self._cast("Verdict", tier_pb2.VerdictRequest(seq_id=seq_id, epoch=seq.epoch_below, tree=True, path=path))

    def verdict(self, seq_id, base_len, proposed, accepted, correction):
        seq = self._sequence(seq_id)
        if correction is None or not seq.header.pipeline:
            return  # fully accepted and continued (or no draft-ahead): nothing is stale
        seq.epoch_below += 1  # everything drafted past the correction is stale from now on
        self._cast("Verdict", tier_pb2.VerdictRequest(seq_id=seq_id, epoch=seq.epoch_below, base_len=base_len,
                                                      proposed=proposed, accepted=accepted, correction=correction))

    def release(self, seq_id, keep_caches: bool = False):
        """Free the sequence below (fire and forget); `keep_caches`: only its state, answered (prefix reuse)."""
        self.sent.forget(seq_id)
        if not keep_caches:
            self._cast("Release", tier_pb2.ReleaseRequest(seq_id=seq_id))
            return
        try:
            self._call("Release", tier_pb2.ReleaseRequest(seq_id=seq_id, keep_caches=True), timeout=10.0)
        except (TierUnavailableError, RuntimeError):
            pass  # the tier is gone: its caches went with it
