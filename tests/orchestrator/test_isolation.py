"""One bad request never fails the others (issue: failure isolation in the batched engine).

- Numerically extreme but legal sampling parameters have a defined answer: a temperature
  below `GREEDY_BELOW_TEMPERATURE` decodes greedily, a top_p below float32's range keeps the
  top token, and every warp is a finite row summing to 1.
- An exception raised for one request's row in a batched step (here: the target's forward
  raising whenever that request's context is in the batch) fails that request alone, in
  `polyspec batch`'s loop (`run_requests`) and in the server's request loop with job items;
  every other request produces exactly the tokens it produces in a run without the bad one
  (greedy and seeded sampling). So does a round of an engine that is not batched, whose
  requests take their rounds in turn in the same loop.
"""

from __future__ import annotations

import time

import pytest
import torch

from family_chains import tier_specs
from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.serving.jobs import JobStore
from polyspec.orchestrator.serving.metrics import Metrics
from polyspec.orchestrator.serving.request_loop import INTERNAL_REASON, RoundScheduler
from polyspec.workers.core.sampling import GREEDY_BELOW_TEMPERATURE, SMALLEST_TOP_P, SamplingParams, warp_logits

POISON_TOKEN = 7  # a prompt holding this token id makes the injected target fault raise
GOOD = [
    {"id": "g0", "prompt_ids": [11, 12, 13, 14], "max_new_tokens": 12},
    {"id": "g1", "prompt_ids": [21, 22, 23], "max_new_tokens": 9, "temperature": 0.9, "top_k": 20, "seed": 5},
    {"id": "g2", "prompt_ids": [31, 32, 33, 34, 35, 36], "max_new_tokens": 14},
    {"id": "g3", "prompt_ids": [41, 42], "max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 123},
]
POISON = {"id": "bad", "prompt_ids": [POISON_TOKEN, 3, 4], "max_new_tokens": 12}


# ------------------------------------------------------------------ extreme parameters


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (1e-45, 1.0, 0), (5e-324, 1.0, 0), (1e-40, 1.0, 0), (GREEDY_BELOW_TEMPERATURE / 2, 1.0, 0),
    (0.7, 1e-300, 0), (1.0, 5e-324, 0), (1e-30, 1e-300, 3), (1000.0, 1.0, 0), (2e-5, 0.5, 1), (1.0, 1.0, 10**9),
])
def test_extreme_sampling_parameters_warp_to_a_defined_row(temperature, top_p, top_k):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 8  # [rows, V]
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # an exact tie at the top
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    probs = warp_logits(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    if temperature < GREEDY_BELOW_TEMPERATURE:  # documented: greedy
        assert params.greedy and params.temperature == 0.0
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(4))
    if top_p < SMALLEST_TOP_P:  # keeps only the top token (both tied tokens share the top: the first kept)
        assert params.top_p == SMALLEST_TOP_P and torch.equal((probs > 0).sum(-1), torch.ones(4, dtype=torch.long))


def test_tiny_but_representable_temperature_still_samples():
    """Just above the greedy threshold the warp is the exact softmax (max-shifted), not forced one-hot."""
    logits = torch.tensor([[0.0, 1e-5, -1.0]])
    probs = warp_logits(logits, SamplingParams(temperature=2e-5))
    expected = torch.softmax(torch.tensor([[-1e-5, 0.0, -1.0 - 1e-5]]) / 2e-5, dim=-1)
    assert torch.allclose(probs, expected) and 0.3 < probs[0, 0] < 0.4


# -------------------------------------------------------------- a fault on one row


def _engine(tiny_family, names=("target", "mid", "ngram"), lengths=(3, 2), round_kind="ragged", batched: bool = True) -> Engine:
    raw = {"tiers": tier_specs(tiny_family, list(names)), "speculation": {"lengths": list(lengths)},
           "batching": {"enabled": batched, "max_requests": 8, "round": round_kind, "max_context": 256}}
    return Engine(parse_config(raw), batched=True)


def _inject_fault(engine: Engine) -> list[int]:
    """The target's batched forward raises whenever a context holding POISON_TOKEN is in it; returns a
    list that counts the faults."""
    target = engine.scheduler.tiers[0]
    name = "score_batch"
    forward = getattr(target, name)
    faults = []

    def faulty(seq_ids, contexts, *args, **kwargs):
        if any(POISON_TOKEN in context for context in contexts):
            faults.append(len(contexts))
            raise RuntimeError("injected fault in the target's forward")
        return forward(seq_ids, contexts, *args, **kwargs)

    setattr(target, name, faulty)
    return faults


def _run(engine: Engine, raws: list[dict], max_requests: int | None = None) -> tuple[dict, dict]:
    results, errors = {}, {}
    run_requests(engine, [engine.parse_request(raw) for raw in raws], lambda r: results.__setitem__(r["id"], r),
                 on_error=lambda request, exc: errors.__setitem__(request.id, exc), max_requests=max_requests)
    return results, errors


@pytest.mark.parametrize("round_kind", ["ragged", "device"])
def test_a_row_that_raises_fails_its_request_alone(tiny_family, round_kind):
    """Device tiers too: their draws are counter-based, and the retried step puts the counters back."""
    engine = _engine(tiny_family, round_kind=round_kind)
    reference, errors = _run(engine, GOOD)
    assert not errors and set(reference) == {r["id"] for r in GOOD}
    faults = _inject_fault(engine)
    results, errors = _run(engine, GOOD[:2] + [POISON] + GOOD[2:])
    assert set(errors) == {"bad"} and "injected fault" in str(errors["bad"])
    assert faults and max(faults) > 1, "the fault must have hit a batched step with other requests in it"
    for raw in GOOD:  # greedy token-equal, seeded samples identical
        assert results[raw["id"]]["token_ids"] == reference[raw["id"]]["token_ids"], raw["id"]
    assert not any(t.cache.slot_of for t in engine.scheduler.tiers if hasattr(t, "cache")), "every slot is freed"
    assert not any(t.cache.open_sequences for t in engine.scheduler.tiers if t.has_weights), "every slot is freed"


def test_rounds_taken_in_turn_fail_alone_too(tiny_family):
    """An engine that is not batched takes the running requests' rounds one after the other (the
    server lets many hold caches at once): the poison request fails alone there as well."""
    engine = _engine(tiny_family, batched=False)
    assert not engine.batched
    reference, errors = _run(engine, GOOD)
    assert not errors
    faults = _inject_fault(engine)
    results, errors = _run(engine, GOOD[:2] + [POISON] + GOOD[2:], max_requests=len(GOOD) + 1)
    assert set(errors) == {"bad"} and "injected fault" in str(errors["bad"]) and faults
    for raw in GOOD:
        assert results[raw["id"]]["token_ids"] == reference[raw["id"]]["token_ids"], raw["id"]


def test_without_on_error_the_run_stops_and_frees_every_slot(tiny_family):
    engine = _engine(tiny_family, ("target", "ngram"), (3,))
    _inject_fault(engine)
    with pytest.raises(RuntimeError, match="injected fault"):
        run_requests(engine, [engine.parse_request(raw) for raw in GOOD + [POISON]], lambda r: None)
    assert not engine.scheduler.tiers[0].cache.slot_of


def test_a_poison_job_item_fails_alone_beside_other_jobs(tiny_family, tmp_path):
    """The server's request loop: one item of one job raises; the other items of that job and another
    tenant's job complete with the tokens they have without it."""
    engine = _engine(tiny_family)
    reference, _ = _run(engine, GOOD)
    _inject_fault(engine)
    store = JobStore(tmp_path / "state")
    loop = RoundScheduler(engine, store, Metrics(), max_queue=64)
    own = store.create([(raw["id"], raw, None) for raw in GOOD[:2] + [POISON]], tenant="a")
    other = store.create([(raw["id"], raw, None) for raw in GOOD[2:]], tenant="b")
    loop.start()
    try:
        deadline = time.monotonic() + 120
        while not (store.get(own.job_id).finished and store.get(other.job_id).finished):
            assert time.monotonic() < deadline, "the jobs did not finish"
            time.sleep(0.05)
    finally:
        loop.stop()
        loop.join(30)
    results = {item.id: item for job in (own, other) for _, item in store.results_after(job.job_id, -1)}
    store.close()
    # the client reads a fixed line; the exception's own text stays in the server's log
    assert results["bad"].result is None and results["bad"].error == INTERNAL_REASON
    for raw in GOOD:
        assert results[raw["id"]].error in ("", None) and results[raw["id"]].result["token_ids"] == reference[raw["id"]]["token_ids"]


def test_a_request_at_the_context_limit_leaves_the_shared_cache_usable(tiny_family):
    """A request at the end of the model context pads a batched forward past the limit (its row is as
    wide as the widest block); the slot buffers grew to hold that, and a later growth in slots (more
    requests joining) once shrank them below it and failed every request from then on."""
    engine = _engine(tiny_family)
    limit = engine.scheduler.max_context
    near_limit = {"id": "long", "prompt_ids": [(i % 200) + 1 for i in range(limit - 6)], "max_new_tokens": 40}
    first, errors = _run(engine, [near_limit] + GOOD[:2])
    assert not errors and first["long"]["finish_reason"] == "length"
    cache = engine.scheduler.tiers[0].cache
    assert cache.capacity > limit  # the padding columns went past the limit
    more = [{**raw, "id": f"{raw['id']}-{n}"} for n in range(3) for raw in GOOD]  # more slots than before
    results, errors = _run(engine, [near_limit] + more)
    assert not errors and len(results) == len(more) + 1


def test_polyspec_batch_with_the_hostile_runs_extreme_values(tiny_family, tmp_path):
    """Through the CLI: the poison rows of the hostile run (temperature 1e-45 and 5e-324, top_p 1e-300)
    in one continuous batch beside ordinary requests: every line gets a result, the extreme ones the
    greedy tokens, the others what they get in a batch without them."""
    import json

    import yaml

    from polyspec.orchestrator.cli import main  # (in this process: an interpreter start less per run)

    config = tmp_path / "chain.yaml"
    config.write_text(yaml.safe_dump({"tiers": tier_specs(tiny_family, ["target", "mid", "ngram"]), "speculation": {"lengths": [3, 2]}}))
    extreme = [{"id": "t45", "prompt_ids": [11, 12, 13, 14], "max_new_tokens": 12, "temperature": 1e-45},
               {"id": "t324", "prompt_ids": [11, 12, 13, 14], "max_new_tokens": 12, "temperature": 5e-324, "seed": 3},
               {"id": "p300", "prompt_ids": [11, 12, 13, 14], "max_new_tokens": 12, "temperature": 0.9, "top_p": 1e-300}]
    outputs = {}
    for name, lines in (("mixed", GOOD[:2] + extreme + GOOD[2:]), ("plain", GOOD)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert main(["batch", "-c", str(config), "-i", str(tmp_path / f"{name}.jsonl"), "-o", str(tmp_path / f"{name}.out")]) == 0
        outputs[name] = {r["id"]: r for r in map(json.loads, (tmp_path / f"{name}.out").read_text().splitlines())}
    assert not any("error" in r for r in outputs["mixed"].values())
    assert outputs["mixed"]["t45"]["token_ids"] == outputs["mixed"]["t324"]["token_ids"] == outputs["mixed"]["p300"]["token_ids"]
    assert outputs["mixed"]["t45"]["token_ids"] == outputs["mixed"]["g0"]["token_ids"][:12]  # the same prompt, greedy
    for raw in GOOD:
        assert outputs["mixed"][raw["id"]]["token_ids"] == outputs["plain"][raw["id"]]["token_ids"], raw["id"]
