"""One round for every mode: `ChainScheduler.round_batch` is the only code that verifies a
block, whether the engine runs one request (`generate`), a batch (`polyspec batch`, jobs,
`serve`), its tiers are device tiers (`batching.round: device`: static-shape steps, verification
on the device) or the chain is distributed (each tier worker runs it over [its tier, the tier
below], one sequence or a batch per call; TierWorkers in this process over gRPC on loopback,
the same worker code a Ray actor runs). Counted by wrapping that one method."""

from __future__ import annotations

import collections

import pytest

from family_chains import tier_specs
from inprocess_chain import in_process_chain
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.orchestrator.engine import Engine, GenerationRequest
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.loading import load_tiers
from core_helpers import generate_alone

PROMPT = "def add(a, b):\n    return"
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def counted(monkeypatch):
    """Calls of the round per verifying tier index, and the batch sizes it saw."""
    calls = []
    original = ChainScheduler.round_batch

    def round_batch(self, level, items, **options):
        calls.append((self.tiers[level].name, len(items)))
        return original(self, level, items, **options)

    monkeypatch.setattr(ChainScheduler, "round_batch", round_batch)
    return calls


def config_of(family, names, lengths):
    return parse_config({"tiers": tier_specs(family, names), "speculation": {"lengths": lengths}})


def test_embedded_single_batched_and_distributed_rounds_are_one_code(tiny_family, counted):
    names, lengths = ["target", "mid", "small"], [4, 3]
    config = config_of(tiny_family, names, lengths)

    alone = Engine(config)  # generate: requests take turns, a batch of one each
    ids = encode_prompt(alone.tokenizer, PROMPT)
    single = alone.generate(GenerationRequest(tuple(ids), MAX_NEW, GREEDY))["token_ids"]
    assert counted and {name for name, _ in counted} == {"target", "mid"} and all(size == 1 for _, size in counted)
    alone.close()

    counted.clear()
    batched = Engine(config, batched=True)
    states = [batched.start(GenerationRequest(tuple(ids), MAX_NEW, GREEDY)) for _ in range(3)]
    while not all(s.done for s in states):
        batched.scheduler.prefill(states)
        batched.step_all([s for s in states if not s.done])
    assert [batched.finish(s)["token_ids"] for s in states] == [single] * 3
    assert max(size for name, size in counted if name == "target") == 3, counted
    batched.close()

    counted.clear()
    device = Engine(parse_config({"tiers": tier_specs(tiny_family, names), "speculation": {"lengths": lengths},
                                  "batching": {"round": "device", "max_requests": 4, "max_context": 256}}), batched=True)
    assert type(device.scheduler) is ChainScheduler and device.scheduler.tiers[1].steps
    states = [device.start(GenerationRequest(tuple(ids), MAX_NEW, GREEDY)) for _ in range(3)]
    while not all(s.done for s in states):
        device.scheduler.prefill(states)
        device.step_all([s for s in states if not s.done])
    assert [device.finish(s)["token_ids"] for s in states] == [single] * 3
    assert {name for name, _ in counted} == {"target", "mid"} and max(size for _, size in counted) == 3, counted

    counted.clear()
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, lengths, pipeline=False, eos_token_ids=())
    try:
        out = generate_alone(chain, ids, MAX_NEW, GREEDY)
        assert out.token_ids == single
        # the target worker verifies the middle tier's blocks, the middle worker the small tier's: both by the round
        assert {"target", "mid"} <= {name for name, _ in counted}, counted
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_a_distributed_step_is_a_verify_batch_of_one_and_each_worker_keeps_its_chain(tiny_family, monkeypatch, pipeline):
    """A request stepped alone goes to the target as a VerifyBatch of one, and each tier below is
    asked by DraftBatch (never the one-sequence Verify / Draft); each worker builds its chain
    ([its tier, the tier below], or its tier alone at the bottom) once and runs every round of
    every request on it, draft-ahead included."""
    from polyspec.orchestrator.distributed.worker import TierWorker

    names, lengths = ["target", "mid", "small"], [4, 3]
    config = config_of(tiny_family, names, lengths)
    embedded = Engine(config)
    ids = encode_prompt(embedded.tokenizer, PROMPT)
    expected = embedded.generate(GenerationRequest(tuple(ids), MAX_NEW, GREEDY))["token_ids"]
    embedded.close()

    built, rounds = [], []  # (tier names) of each scheduler made; (verifying tier, scheduler) of each round
    make, run_round = ChainScheduler.__init__, ChainScheduler.round_batch

    def init(self, tiers, *args, **options):
        make(self, tiers, *args, **options)
        built.append(tuple(t.name for t in self.tiers))

    def round_batch(self, level, items, **options):
        rounds.append((self.tiers[level].name, self))
        return run_round(self, level, items, **options)

    monkeypatch.setattr(ChainScheduler, "__init__", init)
    monkeypatch.setattr(ChainScheduler, "round_batch", round_batch)
    served = collections.Counter()
    for method in ("Verify", "Draft", "VerifyBatch", "DraftBatch"):
        def counted(self, request, *args, _method=method, _original=getattr(TierWorker, method)):
            served[_method, len(getattr(request, "requests", [request]))] += 1
            return _original(self, request, *args)
        monkeypatch.setattr(TierWorker, method, counted)

    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, lengths, pipeline=pipeline, eos_token_ids=())
    try:
        outs = [generate_alone(chain, ids, MAX_NEW, GREEDY) for _ in range(2)]
        assert [out.token_ids for out in outs] == [expected] * 2
    finally:
        chain.close()
        for worker in workers:
            worker.stop()
    steps = sum(out.stats["rounds"] for out in outs)
    assert served[("VerifyBatch", 1)] == steps and served[("DraftBatch", 1)] > 0, served
    assert set(served) == {("VerifyBatch", 1), ("DraftBatch", 1)}, served
    assert sorted(built) == [("mid", "small"), ("small",), ("target", "mid")], built
    for name in ("target", "mid"):
        chains = {id(scheduler) for tier, scheduler in rounds if tier == name}
        assert len(chains) == 1, f"tier {name!r} ran its rounds on {len(chains)} schedulers"
