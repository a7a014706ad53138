"""A start-up step that runs long says so: no silence longer than a few seconds.

Free of torch and transformers, so the CLI can use it while it imports them.
"""

from __future__ import annotations

import contextlib
import threading
import time

HEARTBEAT_S = 3.0  # a start-up step that runs longer says so this often: no silence reaches 5 s, even where a step holds the GIL a while


@contextlib.contextmanager
def heartbeat(log, what: str, every_s: float = HEARTBEAT_S):
    """While the block runs, `log` '<what>: still at it after N s' every `every_s` seconds
    (a 1.5B model takes 25-50 s to load: a start-up that says nothing that long looks hung)."""
    if log is None:
        yield
        return
    done = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            log(f"{what}: still at it after {time.perf_counter() - started:.0f}s")

    beating = threading.Thread(target=beat, daemon=True, name="polyspec-heartbeat")
    beating.start()
    try:
        yield
    finally:
        done.set()
        beating.join()
