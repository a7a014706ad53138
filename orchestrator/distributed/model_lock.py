"""A tier worker's model: one forward at a time, and the model seconds each call spent.

The worker's gRPC server runs a thread per call, and its draft-ahead loop one more;
`ModelLock` lets one forward run at a time, calls a verifier waits on before draft-ahead
work. `LockedBatched` puts a local batched tier behind the lock, so the scheduler code stays
unaware of threads; `LockedTiers` makes the batched tiers of the tiers one process serves
behind one lock (a target and its trained drafters) together. Each thread keeps the model
seconds of its current call (`model_seconds`), which the worker reports up so the driver can
tell transport overhead from model time.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

from polyspec.workers.tiers.batched import BatchedTier, batched_tiers
from polyspec.workers.tiers.tier import Tier

_local = threading.local()  # per thread: model seconds of the current call, lock priority


def model_seconds() -> float:
    """Model seconds of this thread's current call so far."""
    return getattr(_local, "model_s", 0.0)


def set_model_seconds(seconds: float) -> None:
    _local.model_s = seconds


def drafting_ahead() -> bool:
    """This thread drafts ahead (its forwards yield to the calls a verifier waits on)."""
    return getattr(_local, "ahead", False)


def set_drafting_ahead(ahead: bool) -> None:
    _local.ahead = ahead


class ModelLock:
    """One forward at a time; calls a verifier waits on go before draft-ahead work."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._urgent_waiting = 0

    @contextlib.contextmanager
    def hold(self):
        urgent = not drafting_ahead()
        with self._cond:
            if urgent:
                self._urgent_waiting += 1
            while self._busy or (not urgent and self._urgent_waiting):
                self._cond.wait()
            if urgent:
                self._urgent_waiting -= 1
            self._busy = True
        started = time.perf_counter()
        try:
            yield
        finally:
            set_model_seconds(model_seconds() + time.perf_counter() - started)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


class LockedBatched:
    """A batched tier (polyspec.workers.tiers.batched) behind the worker's ModelLock: the calls
    a verifier waits on and the draft-ahead steps take turns on its one slot cache. The calls
    that run a forward or change the cache take the lock; everything else is the inner tier's."""

    LOCKED = ("prefill", "draft_batch", "draft_tree_batch", "score_batch", "verify_batch", "accept_path", "truncate", "release")

    def __init__(self, tier: BatchedTier, lock: ModelLock) -> None:
        self.inner = tier
        self.lock = lock
        for name in self.LOCKED:
            setattr(self, name, self._locked(getattr(tier, name)))

    def _locked(self, method):
        @functools.wraps(method)
        def call(*args, **options):
            with self.lock.hold():
                return method(*args, **options)

        return call

    def __getattr__(self, name: str):  # only for what __init__ did not set
        return getattr(self.inner, name)


class LockedTiers:
    """The batched tiers of the tiers one process serves behind one `ModelLock` (a target and its
    trained drafters, in one Ray actor), each behind that lock, made together on first use: a
    feature head then reads its target's hidden states from the target's slot cache, which the
    target's own batched forwards fill (`batched_tiers`). `device_slots[i]` > 0: tier i decodes in static steps
    (`BatchedModelTier`'s `steps`) on a pool of that many requests of its own."""

    def __init__(self, tiers: list[Tier], lock: ModelLock | None = None, device_slots: list[int] | None = None,
                 device_context: int | None = None, ragged_slots: int | None = None) -> None:
        self.tiers = list(tiers)
        self.ragged_slots = ragged_slots  # the slots of a ragged tier's KV pool (None: batched_llama.DEFAULT_SLOTS)
        self.lock = lock or ModelLock()
        self.device_slots = list(device_slots) if device_slots is not None else [0] * len(self.tiers)
        self.device_context = device_context
        self._made: list[LockedBatched] | None = None
        self._making = threading.Lock()

    def of(self, tier: Tier) -> LockedBatched:
        """`tier`'s batched tier (made, with every sibling's, after the chain's vocabulary is set)."""
        with self._making:
            if self._made is None:
                from polyspec.workers.tiers.batched import BatchedModelTier

                ragged = iter(batched_tiers([t for t, slots in zip(self.tiers, self.device_slots) if not slots], self.ragged_slots))
                made = [BatchedModelTier(t, slots, steps=True, context=self.device_context) if slots else next(ragged)
                        for t, slots in zip(self.tiers, self.device_slots)]
                self._made = [LockedBatched(batched, self.lock) for batched in made]
            return self._made[next(i for i, t in enumerate(self.tiers) if t is tier)]

    def made(self, tier: Tier) -> LockedBatched | None:
        """`tier`'s batched tier if it has been made (None: nothing of it to release)."""
        with self._making:
            return None if self._made is None else self._made[next(i for i, t in enumerate(self.tiers) if t is tier)]

    def reset(self) -> None:
        """Make them again on next use (the chain's vocabulary changed)."""
        with self._making:
            self._made = None
