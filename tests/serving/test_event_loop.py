"""Blocking work (tokenizing a prompt, SQLite) never runs on the server's event loop.

PolyspecService over a fake engine and a fake job store whose calls block until the test
releases them: while one blocks, a coroutine on the same loop must still run. If the call
ran on the loop, the loop would stall and the blocked call would time out on its own
(recorded as `stalled`), so the test fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from polyspec.orchestrator.engine import GenerationRequest
from polyspec.orchestrator.serving.jobs import JobRecord
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.server import PolyspecService
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.workers.core.sampling import SamplingParams

BLOCK_S = 5.0


class Gate:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stalled = False

    def block(self) -> None:
        self.entered.set()
        if not self.release.wait(BLOCK_S):
            self.stalled = True


class FakeEngine:
    tokenizer = None

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def parse_request(self, raw, tokenizer=None):
        self.gate.block()
        return GenerationRequest((1,), 1, SamplingParams(temperature=0.0))


class FakeScheduler:
    def submit(self, work) -> None:
        work.on_event("done", ({"finish_reason": "length", "token_ids": [], "stats": {}}, {"queue_s": 0.0, "first_token_s": 0.0}))

    def submit_all(self, works) -> None:
        for work in works:
            self.submit(work)

    def cancel(self, work) -> None:
        pass


class FakeStore:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def get(self, job_id, tenant=None):
        self.gate.block()
        return JobRecord(job_id, "queued", 1, 0, 0, 0.0, 0.0)


class FakeContext:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


async def _loop_stays_free(gate: Gate, call) -> object:
    task = asyncio.ensure_future(call())
    while not gate.entered.is_set():  # this coroutine runs: the loop is free while the call blocks
        await asyncio.sleep(0.01)
    assert not task.done()
    gate.release.set()
    return await asyncio.wait_for(task, 30)


@pytest.mark.parametrize("what", ["tokenizing a Generate prompt", "a job store read"])
def test_blocking_work_runs_off_the_event_loop(what):
    gate = Gate()

    async def main():
        service = PolyspecService(FakeStore(gate), Metrics(), 8)
        service.attach(FakeEngine(gate), FakeScheduler())
        if what.startswith("tokenizing"):
            stream = service.Generate(pb.GenerateRequest(prompt="x" * 1000), FakeContext())
            return await _loop_stays_free(gate, lambda: stream.__anext__())
        return await _loop_stays_free(gate, lambda: service.GetJob(pb.GetJobRequest(job_id="job-1"), FakeContext()))

    reply = asyncio.run(main())
    assert not gate.stalled, f"{what} blocked the event loop"
    assert reply is not None


def test_a_long_prompt_does_not_hold_up_another_requests_tokenizing():
    gate = Gate()

    class Engine(FakeEngine):
        def parse_request(self, raw, tokenizer=None):
            if raw["prompt"] == "long":
                self.gate.block()
            return ("parsed", raw["prompt"])

    async def main():
        service = PolyspecService(FakeStore(gate), Metrics(), 8)
        service.attach(Engine(gate), FakeScheduler())
        long = threading.Thread(target=service.parse_now, args=({"prompt": "long"},))
        long.start()
        assert gate.entered.wait(10)
        short = await asyncio.to_thread(service.parse_now, {"prompt": "short"})  # while "long" is still tokenizing
        gate.release.set()
        long.join(10)
        return short

    assert asyncio.run(main()) == ("parsed", "short")
    assert not gate.stalled, "a short prompt waited for a long one's tokenizing"


def test_sizes_are_checked_before_tokenizing():
    from polyspec.orchestrator.serving.jobs import LimitExceeded
    from polyspec.orchestrator.serving.security import Limits
    from polyspec.workers.core.errors import RequestError

    async def main():
        return PolyspecService(FakeStore(Gate()), Metrics(), 8, limits=Limits(max_prompt_bytes=2000))

    service = asyncio.run(main())
    service.check_sizes({"prompt": "x" * 2000, "messages": [{"role": "user", "content": "y" * 2000}]})  # at the limit
    for raw in ({"prompt": "é" * 1001}, {"messages": [{"role": "user", "content": "y" * 1500}, {"role": "user", "content": "z" * 600}]},
                {"prompt_ids": [1] * 501}):
        with pytest.raises(LimitExceeded):
            service.check_sizes(raw)
    with pytest.raises(RequestError, match="id has 257 characters"):
        service.check_sizes({"id": "i" * 257, "prompt": "x"})
