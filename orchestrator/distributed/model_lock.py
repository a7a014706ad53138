"""A tier worker's model: one forward at a time, and the model seconds each call spent.

The worker's gRPC server runs a thread per call, and its draft-ahead pool more threads;
`ModelLock` lets one forward run at a time, calls a verifier waits on before draft-ahead
work. `LockedTier` puts a local tier behind the lock, so the scheduler code stays unaware of
threads. Each thread keeps the model seconds of its current call (`model_seconds`), which
the worker reports up so the driver can tell transport overhead from model time.
"""

from __future__ import annotations

import contextlib
import threading
import time

from polyspec.workers.tiers.batched import BatchedTier
from polyspec.workers.tiers.tier import Tier

_local = threading.local()  # per thread: model seconds of the current call, lock priority


def model_seconds() -> float:
    """Model seconds of this thread's current call so far."""
    return getattr(_local, "model_s", 0.0)


def set_model_seconds(seconds: float) -> None:
    _local.model_s = seconds


def add_model_seconds(seconds: float) -> None:
    _local.model_s = model_seconds() + seconds


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
            add_model_seconds(time.perf_counter() - started)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


class LockedTier(Tier):
    """A local tier behind the worker's ModelLock (the scheduler code stays unaware of threads)."""

    def __init__(self, tier: Tier, lock: ModelLock) -> None:
        self.inner = tier
        self.lock = lock
        for name in ("name", "vocab_size", "max_context", "can_verify", "deterministic_drafts"):
            setattr(self, name, getattr(tier, name))

    @property
    def busy_s(self) -> float:
        return self.inner.busy_s

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def draft(self, *args, **kwargs):
        with self.lock.hold():
            return self.inner.draft(*args, **kwargs)

    def draft_tree(self, *args, **kwargs):
        with self.lock.hold():
            return self.inner.draft_tree(*args, **kwargs)

    def score(self, *args, **kwargs):
        with self.lock.hold():
            return self.inner.score(*args, **kwargs)

    def accept_path(self, *args, **kwargs):
        with self.lock.hold():
            return self.inner.accept_path(*args, **kwargs)

    def release(self, seq_id):
        with self.lock.hold():
            return self.inner.release(seq_id)

    def truncate(self, seq_id, length):
        with self.lock.hold():
            return self.inner.truncate(seq_id, length)


class LockedBatched(BatchedTier):
    """A batched tier (polyspec.workers.tiers.batched) behind the worker's ModelLock: the batched
    calls and the draft-ahead rounds of single sequences take turns on its one slot cache."""

    def __init__(self, tier, lock: ModelLock) -> None:  # (no BatchedTier.__init__: every field is the inner tier's)
        self.inner = tier
        self.lock = lock
        for name in ("tier", "name", "vocab_size", "max_context", "can_verify", "has_weights", "caches_prompts"):
            setattr(self, name, getattr(tier, name))

    @property
    def busy_s(self) -> float:
        return self.inner.busy_s

    @property
    def forward_log(self) -> list:
        return self.inner.forward_log

    def cached(self, seq_id) -> int:
        return self.inner.cached(seq_id)

    def continues_past(self, seq_id) -> bool:
        return False

    def verdict(self, *args) -> None:
        pass

    def score_batch(self, *args):
        with self.lock.hold():
            return self.inner.score_batch(*args)

    def draft_batch(self, *args):
        with self.lock.hold():
            return self.inner.draft_batch(*args)

    def verify_batch(self, *args, **options):
        with self.lock.hold():
            return self.inner.verify_batch(*args, **options)

    def draft_tree_batch(self, *args):
        with self.lock.hold():
            return self.inner.draft_tree_batch(*args)

    def prefill(self, *args) -> int:
        with self.lock.hold():
            return self.inner.prefill(*args)

    def accept_path(self, seq_id, path) -> None:
        with self.lock.hold():
            self.inner.accept_path(seq_id, path)

    def truncate(self, seq_id, length: int) -> None:
        with self.lock.hold():
            self.inner.truncate(seq_id, length)

    def release(self, seq_id) -> None:
        with self.lock.hold():
            self.inner.release(seq_id)
