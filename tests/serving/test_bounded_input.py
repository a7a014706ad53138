"""Issue 56 in process, without a server: client JSON measured before it is parsed, job items
stored without the payload that made them invalid, per-tenant quotas and retention, fair
admission between tenants, one server per state dir."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from polyspec.orchestrator.serving.bounded_json import MAX_CONTAINERS, JsonRefused, loads_bounded, without_strings
from polyspec.orchestrator.serving.jobs import JobStore, LimitExceeded, Quota
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.request_loop import QueueFull, RoundScheduler, Work
from polyspec.orchestrator.serving.security import Tenants
from polyspec.orchestrator.serving.serve_options import StateDirLock
from polyspec.orchestrator.serving.server import MAX_OPTIONS_JSON_BYTES, request_dict
from polyspec.protos.polyspec.v1 import polyspec_pb2 as pb
from polyspec.workers.core.errors import ConfigError, RequestError


def nested_arrays(depth: int, total_bytes: int) -> bytes:
    """A JSON array of `depth`-deep empty arrays, about `total_bytes` long (the issue's hostile `stop`)."""
    unit = "[" * depth + "]" * depth
    return ("[" + ",".join([unit] * (total_bytes // (2 * depth + 1))) + "]").encode()


# ------------------------------------------------------------------ bounded JSON


def test_millions_of_nested_arrays_are_refused_before_parsing():
    with pytest.raises(JsonRefused) as caught:
        loads_bounded(b'{"prompt": "x", "stop": ' + nested_arrays(30, 8 << 20) + b"}", "the request body", 9 << 20)
    assert caught.value.status == 413 and f"at most {MAX_CONTAINERS}" in str(caught.value)


def test_a_million_keys_or_numbers_are_refused_before_parsing():
    keys = b'{"logit_bias": {' + b",".join(b'"%d": 1' % i for i in range(20_000)) + b"}}"
    numbers = b'{"prompt": [' + b",".join([b"1.5"] * 600_000) + b"]}"
    with pytest.raises(JsonRefused, match="20001 object members \\(at most 10000\\)"):
        loads_bounded(keys, "the body", 8 << 20)
    with pytest.raises(JsonRefused, match="600000 JSON values \\(at most 500000\\)"):
        loads_bounded(numbers, "the body", 8 << 20)
    assert len(loads_bounded(b'{"prompt": [' + b",".join([b"7"] * 400_000) + b"]}", "the body", 8 << 20)["prompt"]) == 400_000


@pytest.mark.parametrize("raw, status, message", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested deeper than 32"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, 400, "nested deeper than 32"),
    (b'{"a": "x"}' + b" " * 100, 413, "has 110 bytes (at most 100)"),
    (b'{"a": "\\ud800"}', 400, "lone surrogate"),
    (b'{"a": "\xff"}', 400, "not valid UTF-8"),
    (b'{"a": 1', 400, "malformed JSON"),
])
def test_refusals_are_one_line_with_their_status(raw, status, message):
    with pytest.raises(JsonRefused) as caught:
        loads_bounded(raw, "the body", 100 if status == 413 else 1 << 20)
    assert caught.value.status == status and message in str(caught.value) and "\n" not in str(caught.value)


def test_brackets_and_escapes_inside_strings_are_text():
    value = {"prompt": 'a[[{"\\' * 5_000, "stop": ["]]", "\\\\"], "approximate": {"mode": "bild"}}
    raw = json.dumps(value).encode()
    assert without_strings(raw).translate(None, b" :,") == b"{[]{}}"  # what measure() counts and nests
    assert loads_bounded(raw, "the body", 1 << 20) == value
    assert loads_bounded(b'{"a": "\\\\ud800"}', "the body", 100) == {"a": "\\ud800"}  # an escaped backslash, no surrogate


def test_approximate_json_has_an_options_sized_limit_and_is_invalid_argument():
    for hostile, message in [("[" * 100_000 + "]" * 100_000, f"at most {MAX_OPTIONS_JSON_BYTES}"),
                             ("[" * 5_000 + "]" * 5_000, "nested deeper than 32"),
                             ('{"mode": ' * 20 + '"x"' + "}" * 20, "")]:
        request = pb.GenerateRequest(prompt="x", approximate_json=hostile)
        if message:
            with pytest.raises(RequestError, match=message):
                request_dict(request)
    assert request_dict(pb.GenerateRequest(prompt="x", approximate_json='{"mode": "bild"}'))["approximate"] == {"mode": "bild"}


# ------------------------------------------------------------------------ jobs


def test_an_invalid_item_is_stored_without_its_request(tmp_path):
    store = JobStore(tmp_path)
    secret = "s3cret-" + "x" * 10_000
    job = store.create([("ok", {"prompt": "fine"}, None), ("bad", {"prompt": secret, "top_p": 2}, "request 2: top_p " + "y" * 5000)])
    assert (job.state, job.total, job.failed) == ("queued", 2, 1)
    [(_, result)] = store.results_after(job.job_id, 0)
    assert result.id == "bad" and result.error.startswith("request 2: top_p") and len(result.error) <= 300
    store.close()
    assert secret.encode() not in b"".join(path.read_bytes() for path in tmp_path.glob("jobs.sqlite3*"))


def test_tenant_quotas_name_their_flag_and_leave_other_tenants_room(tmp_path):
    store = JobStore(tmp_path)
    quota = Quota(max_live_jobs=10, tenant_live_jobs=2, tenant_pending_items=3, tenant_store_bytes=2_000)
    store.create([("a", {"prompt": "x"}, None)], "alice", quota=quota)
    store.create([("a", {"prompt": "x"}, None)], "alice", quota=quota)
    with pytest.raises(LimitExceeded, match="its share of --max-live-jobs is 2"):
        store.create([("a", {"prompt": "x"}, None)], "alice", quota=quota)
    with pytest.raises(LimitExceeded, match="its share of --max-pending-items"):
        store.create([(f"b{i}", {"prompt": "x"}, None) for i in range(4)], "bob", quota=quota)
    with pytest.raises(LimitExceeded, match="its share of --max-store-bytes"):
        store.create([("b", {"prompt": "x" * 3_000}, None)], "bob", quota=quota)
    # jobs that failed whole at once are stored, and count against the bytes quota
    failing = [(f"f{i}", {}, "request: top_p must be in (0, 1] " + "z" * 200) for i in range(3)]
    for _ in range(2):  # about 700 bytes each (the errors; no request kept)
        assert store.create(failing, "carol", quota=quota).state == "failed"
    with pytest.raises(LimitExceeded, match="--max-store-bytes"):
        store.create(failing, "carol", quota=quota)
    assert store.create([("b", {"prompt": "x"}, None)], "bob", quota=quota).state == "queued"  # bob: his own share


def test_retention_deletes_jobs_that_ended_before_the_cutoff(tmp_path):
    store = JobStore(tmp_path)
    over = store.create([("a", {}, "invalid")], "alice")
    live = store.create([("a", {"prompt": "x"}, None)], "alice")
    assert store.purge(over.finished_at - 1) == 0
    assert store.purge(over.finished_at + 1) == 1
    assert store.get(over.job_id) is None and store.results_after(over.job_id, 0) == []
    assert store.get(live.job_id).state == "queued"  # a job not over is never deleted


def test_job_items_are_handed_out_round_robin_between_tenants(tmp_path):
    store = JobStore(tmp_path)
    big = store.create([(f"a{i}", {"prompt": "x"}, None) for i in range(50)], "alice")
    small = store.create([(f"b{i}", {"prompt": "x"}, None) for i in range(2)], "bob")
    first = store.pending_items(4, set())
    assert [item.job_id for item in first].count(small.job_id) == 2  # bob's items are not behind alice's 50
    in_flight = {(item.job_id, item.idx) for item in first}
    assert {item.job_id for item in store.pending_items(4, in_flight)} == {big.job_id}


# ------------------------------------------------------------------ tenants


def test_tenants_file_weights_and_shares(tmp_path):
    path = tmp_path / "tenants.txt"
    path.write_text("alice alice-token-0123456789 3\nbob bob-token-0123456789ab\n")
    tenants = Tenants.from_files(None, str(path))
    assert (tenants.share("alice", 100), tenants.share("bob", 100), tenants.share("", 100)) == (75, 25, 100)
    assert Tenants({}).share("", 7) == 7
    path.write_text("alice alice-token-0123456789 -1\n")
    with pytest.raises(ConfigError, match="line 1: the weight must be a number above 0"):
        Tenants.from_files(None, str(path))


def _scheduler(tenants: Tenants, slots: int, max_queue: int) -> RoundScheduler:
    engine = types.SimpleNamespace(max_requests=slots, batched=True, scheduler=types.SimpleNamespace())
    return RoundScheduler(engine, None, Metrics(), max_queue, tenants=tenants)  # never started: its admission alone


def test_a_flooding_tenant_fills_only_its_share_of_the_queue():
    loop = _scheduler(Tenants({"a-token-0123456789": "alice", "b-token-0123456789": "bob"}), slots=4, max_queue=8)
    loop.submit_all([Work(None, tenant="alice") for _ in range(4)])  # n = 4: four requests of her share of 4
    with pytest.raises(QueueFull, match="this tenant's share of the server queue is full"):
        loop.submit_all([Work(None, tenant="alice")])
    loop.submit_all([Work(None, tenant="bob") for _ in range(4)])


def test_admission_goes_to_the_tenant_with_the_fewest_running():
    loop = _scheduler(Tenants({"a-token-0123456789": "alice", "b-token-0123456789": "bob"}), slots=4, max_queue=64)
    flood = [Work(None, tenant="alice") for _ in range(20)]
    loop.submit_all(flood)
    loop._active = loop._admit(4)
    assert [work.tenant for work in loop._active] == ["alice"] * 3  # one slot kept for bob
    late = Work(None, tenant="bob")
    loop.submit_all([late])
    assert loop._admit(1) == [late]  # bob's request goes first, though alice's 17 came before it
    loop._active.append(late)
    assert loop._admit(1) == []  # while bob has work, alice gets no slot past her share (2 of 4)


# ------------------------------------------------------------- the state dir


def test_a_second_lock_on_a_state_dir_is_refused_and_sigkill_releases_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from polyspec.orchestrator.serving.serve_options import StateDirLock
        lock = StateDirLock({str(tmp_path)!r})
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"in use by another polyspec serve \\(process {holder.pid}\\)"):
            StateDirLock(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    StateDirLock(str(tmp_path)).release()  # the kernel dropped the dead process's lock


def test_the_body_budget_refuses_past_its_total_and_gives_back_what_a_body_held():
    from polyspec.orchestrator.serving.http import BodyBudget
    from polyspec.orchestrator.serving.openai_request import ApiError

    budget = BodyBudget(100)
    with budget.ticket() as first:
        first(60)
        with pytest.raises(ApiError) as refused, budget.ticket() as second:
            second(30)
            second(30)  # 120 of 100
        assert refused.value.status == 429 and budget.used == 60  # the refused body's 30 given back
    assert budget.used == 0
