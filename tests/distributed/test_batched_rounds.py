"""The distributed chain, batched: one VerifyBatch per step carries every running request, and
each tier worker scores all their blocks in one forward (DraftBatch to the tier below).
TierWorkers in this process over gRPC on loopback, as tests/distributed/test_grpc_chain.py.

Per request a batched round is the one-request round (same blocks, same rule, same draws
from the request's generators), so greedy output is the target's own and a seeded request
samples the same tokens in a batch as alone."""

from __future__ import annotations

import collections

import pytest

from family_chains import tier_specs
from inprocess_chain import in_process_chain
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.loading import load_tiers
from core_helpers import generate_alone

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in"]
MAX_NEW = 40
EOS = (256,)  # the byte-level test tokenizer's end of text


def chain_config(family, names, **speculation):
    return parse_config({"tiers": tier_specs(family, names), "speculation": speculation})


def batched_chain(family, names, lengths, pipeline, tree_width=1, eos=EOS, device_slots=0):
    config = chain_config(family, names, lengths=lengths, tree_width=tree_width)
    tiers, tokenizer = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, config.speculation_lengths(), tree_width=tree_width, pipeline=pipeline, eos_token_ids=eos,
                                      device_slots=device_slots)
    chain.batched = True
    return chain, workers, tokenizer


def stop(chain, workers) -> None:
    chain.close()
    for worker in workers:
        worker.stop()


def run_batch(chain, jobs, max_running: int = 8):
    """Continuous batching over `chain`: (prompt_ids, max_new, params, seed) jobs, at most
    `max_running` at once, joining as others finish; the outputs in job order and the batch sizes stepped."""
    waiting = collections.deque(enumerate(jobs))
    running, outputs, sizes = [], {}, []
    while waiting or running:
        while waiting and len(running) < max_running:
            index, job = waiting.popleft()
            running.append((index, chain.start(*job)))
        chain.step_all([state for _, state in running])
        sizes.append(chain.last_step.get("batch", 0))
        for index, state in [r for r in running if r[1].done]:
            outputs[index] = chain.finish(state)
        running = [r for r in running if not r[1].done]
    return [outputs[i] for i in range(len(jobs))], sizes


@pytest.fixture(scope="module")
def embedded(tiny_family):
    engine = Engine(chain_config(tiny_family, ["target"]))
    outputs = {}
    for prompt in PROMPTS:
        ids = encode_prompt(engine.tokenizer, prompt)
        outputs[prompt] = (ids, generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids)
    return outputs


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("names,lengths,tree_width", [
    (["target", "mid"], [4], 1),
    (["target", "mid", "small"], [4, 3], 1),
    (["target", "int8", "ngram"], [5, 2], 1),
    (["target", "mid"], [3], 2),
], ids=["target+mid", "target+mid+small", "target+int8+ngram", "tree:target+mid"])
def test_batched_greedy_equals_target(tiny_family, embedded, names, lengths, tree_width, pipeline):
    chain, workers, _ = batched_chain(tiny_family, names, lengths, pipeline, tree_width)
    try:
        jobs = [(ids, MAX_NEW, SamplingParams(temperature=0.0), None) for ids, _ in embedded.values()] * 3
        outputs, sizes = run_batch(chain, jobs, max_running=5)
        for out, (ids, expected) in zip(outputs, list(embedded.values()) * 3):
            assert out.token_ids == expected
            assert out.stats["stages"], "the chain verified blocks"
        assert max(sizes) == 5, "the driver stepped five requests at once"
        # the target scored many requests' blocks in one forward, the tier below drafted them in one call
        target_rows = [rows for rows, _, _ in workers[0].batched_tier().inner.forward_log]
        assert max(target_rows) >= 4, target_rows
        for worker in workers[1:]:  # each drafting model tier drafted several requests' blocks per forward too
            tier = worker.batched_tier().inner  # (pipelined, a drafter mostly serves blocks drafted ahead one request at a time)
            if not pipeline and worker.tier.has_weights and hasattr(tier, "cache"):
                assert max(rows for rows, _, _ in tier.forward_log) >= 2, worker.tier.name
        stats = chain.runtime_stats()
        assert stats["driver_sent"]["grpc"]["messages"] <= len(sizes) + 1, "one VerifyBatch per step (plus the health check)"
        if pipeline and tree_width == 1:
            assert sum(t["draft_ahead"]["hits"] for t in stats["tiers"]) > 0, "drafters served blocks drafted ahead"
    finally:
        stop(chain, workers)


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_batched_rounds_on_device_tiers_give_the_targets_output(tiny_family, embedded, pipeline):
    """Each worker's model tier as a device tier (`batching.round: device` on a Ray actor): its batched
    calls are static-shape steps with verification on the device, and the output stays the target's."""
    chain, workers, _ = batched_chain(tiny_family, ["target", "mid", "small"], [4, 3], pipeline, device_slots=8)
    try:
        jobs = [(ids, MAX_NEW, SamplingParams(temperature=0.0), None) for ids, _ in embedded.values()] * 2
        outputs, sizes = run_batch(chain, jobs, max_running=5)
        for out, (ids, expected) in zip(outputs, list(embedded.values()) * 2):
            assert out.token_ids == expected
        assert all(worker.batched_tier().inner.steps for worker in workers)
        assert max(rows for rows, _, _ in workers[0].batched_tier().inner.forward_log) >= 4, "several requests per step"
    finally:
        stop(chain, workers)


def test_seeded_request_samples_the_same_in_a_batch_as_alone(tiny_family):
    """T = 1, serial: a seeded request's tokens do not depend on the other requests of its batch
    (nor on batching: the one-request distributed chain samples the embedded tokens, test_grpc_chain)."""
    config = chain_config(tiny_family, ["target", "mid", "small"], lengths=[3, 2])
    tiers, tokenizer = load_tiers(config.tiers)
    alone, alone_workers = in_process_chain(tiers, [3, 2], eos_token_ids=EOS)
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0)
    jobs = [(prompts[i % 3], 24, params, seed) for i, seed in enumerate(range(11, 17))]
    try:
        expected = [generate_alone(alone, *job).token_ids for job in jobs]
    finally:
        stop(alone, alone_workers)
    chain, workers, _ = batched_chain(tiny_family, ["target", "mid", "small"], [3, 2], pipeline=False)
    try:
        outputs, sizes = run_batch(chain, jobs, max_running=6)
        assert max(sizes) == 6
        assert [out.token_ids for out in outputs] == expected
    finally:
        stop(chain, workers)


@pytest.mark.parametrize("names,tree_width", [(["target", "int8", "ngram"], 1), (["target", "mid"], 2)], ids=["chain", "tree"])
def test_goodput_planner_sets_the_lengths_of_batched_rounds(tiny_family, embedded, names, tree_width, monkeypatch):
    """`lengths: auto`, batched: each tier profiles its batched forward in its own worker, the
    planner measures speculation off first, then a plan running every tier; greedy output stays the target's.
    Whether a speculating plan is worth measuring is the planner's judgement of the timings (tested on
    given costs in tests/orchestrator/test_batch_model.py); here its floors are 0, so that one is measured
    whatever this machine's load made of the profile (a loaded CI run once measured off alone)."""
    from polyspec.orchestrator.distributed.driver import profile_grid_remote
    from polyspec.orchestrator.tuning import batch_model
    from polyspec.orchestrator.tuning.batch_model import BatchPlanner
    from tests.orchestrator.test_plan_stats import check_plans

    for floor in ("EXPLORE_FLOOR", "SEED_FLOOR", "EXPLORE_BEST_SHARE"):
        monkeypatch.setattr(batch_model, floor, 0.0)

    chain, workers, _ = batched_chain(tiny_family, names, [2] * (len(names) - 1), pipeline=True, tree_width=tree_width)
    try:  # as Engine.make_planner builds it for a batched Ray chain
        tables, lookup = profile_grid_remote(chain, max_batch=4)
        chain.planner = planner = BatchPlanner(chain.tiers, tables, lookup, tree_width=tree_width, allow_bypass=False)
        assert planner.tables[0] is not None and (planner.tables[-1] is None) == (names[-1] == "ngram")
        assert {p.active for p in planner.plans} == {(0,), tuple(range(len(names)))}, "no plan skips a tier"
        jobs = [(ids, MAX_NEW, SamplingParams(temperature=0.0), None) for ids, _ in embedded.values()] * 4
        outputs, _ = run_batch(chain, jobs, max_running=4)
        assert [out.token_ids for out in outputs] == [expected for _, expected in embedded.values()] * 4
        for out in outputs:  # each plan with the planner's predicted and the measured tokens/s
            check_plans({"token_ids": out.token_ids, "stats": out.stats})
        plans = [plan for out in outputs for plan in out.stats["plans"]]
        assert {tuple(p["lengths"]) for p in plans} >= {(0,) * (len(names) - 1)}, "speculation off was measured"
        assert any(p["lengths"][0] > 0 for p in plans), "a speculating plan was measured"
        arms = planner.describe()["ab"]
        assert any(len(arm["tokens_per_s"]) >= 2 for arm in arms.values()), arms
    finally:
        stop(chain, workers)


def test_batched_drafter_death_falls_back_to_the_target(tiny_family, embedded):
    """The drafter's server stops mid-batch: rounds go on with the target alone, outputs unchanged."""
    chain, workers, _ = batched_chain(tiny_family, ["target", "mid"], [4], pipeline=True)
    try:
        pairs = list(embedded.values())
        states = [chain.start(ids, MAX_NEW, SamplingParams(temperature=0.0)) for ids, _ in pairs]
        chain.step_all(states)
        workers[1].stop()
        while not all(s.done for s in states):
            chain.step_all(states)
        assert [chain.finish(s).token_ids for s in states] == [expected for _, expected in pairs]
        assert chain.degraded_rounds > 0
    finally:
        stop(chain, workers[:1])


def test_a_batch_naming_one_sequence_twice_is_refused(tiny_family, embedded):
    from polyspec.protos.polyspec.v1 import tier_pb2

    chain, workers, _ = batched_chain(tiny_family, ["target", "mid"], [4], pipeline=False)
    try:
        ids, _ = next(iter(embedded.values()))
        state = chain.start(ids, MAX_NEW, SamplingParams(temperature=0.0))
        request = tier_pb2.VerifyRequest(header=state.run.header, context=ids, max_tokens=4)
        with pytest.raises(RuntimeError, match="appears twice"):
            chain._call_target("VerifyBatch", tier_pb2.VerifyBatchRequest(requests=[request, request]))
    finally:
        stop(chain, workers)


@pytest.mark.extended
@pytest.mark.slow
def test_batched_pipelined_sampling_is_lossless(tiny_family):
    """Temperature 1 through the batched, pipelined 3-tier chain (8 requests a step, joining as
    others end): the first two tokens follow the target's exact joint distribution
    (chi-square, alpha 1e-3, 800 samples)."""
    from lossless_stats import ALPHA, chi_square_p_value, exact_two_token_probs

    samples = 800
    chain, workers, tokenizer = batched_chain(tiny_family, ["target", "mid", "small"], [1, 2], pipeline=True, eos=())
    try:
        tiers_target = load_tiers(chain_config(tiny_family, ["target"]).tiers)[0][0]
        prompt_ids = tokenizer("def f(x):\n    return x +")["input_ids"]
        params = SamplingParams(temperature=1.0)
        joint = exact_two_token_probs(tiers_target.model, tiers_target.vocab_size, prompt_ids, params)
        outputs, sizes = run_batch(chain, [(prompt_ids, 3, params, seed) for seed in range(samples)], max_running=8)
    finally:
        stop(chain, workers)
    assert max(sizes) == 8
    counts = collections.Counter(tuple(out.token_ids[:2]) for out in outputs)
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {samples} samples"


def test_a_tier_actor_serves_its_tier_as_a_device_tier_where_batching_round_says(tiny_family):
    """`device_slots`, what a Ray tier actor passes its worker: device puts a model tier on the device
    (its pool holds max_requests and a profile's sequence), auto only on CUDA, ragged never; a lookup never."""
    import dataclasses

    from polyspec.orchestrator.config import BatchingConfig
    from polyspec.orchestrator.distributed.ray_runtime import device_slots

    tiers, _ = load_tiers(chain_config(tiny_family, ["target", "ngram"], lengths=[3]).tiers)
    batching = BatchingConfig(max_requests=4)
    assert device_slots(tiers[0], dataclasses.replace(batching, round="device")) == 5
    assert device_slots(tiers[0], dataclasses.replace(batching, round="auto")) == 0  # a CPU tier
    assert device_slots(tiers[0], dataclasses.replace(batching, round="ragged")) == 0
    assert device_slots(tiers[1], dataclasses.replace(batching, round="device")) == 0


@pytest.mark.parametrize("pipeline,device_slots", [(False, 8), (True, 8), (False, 0)], ids=["serial", "pipelined", "ragged"])
def test_batched_rounds_run_an_early_exit_drafter_as_a_device_tier(tiny_drafters, embedded, pipeline, device_slots):
    """target <- early exit (its first layer shared), each a device tier of its worker, as in the target's Ray actor (or
    each a ragged batched tier): the output stays the target's (the exit threshold shortens some drafter's blocks)."""
    from polyspec.workers.tiers.batched import BatchedModelTier

    chain, workers, _ = batched_chain(tiny_drafters, ["target", "early_exit_noisy"], [4], pipeline, device_slots=device_slots)
    try:
        jobs = [(ids, MAX_NEW, SamplingParams(temperature=0.0), None) for ids, _ in embedded.values()] * 2
        outputs, _ = run_batch(chain, jobs, max_running=5)
        for out, (ids, expected) in zip(outputs, list(embedded.values()) * 2):
            assert out.token_ids == expected
        assert all(isinstance(worker.batched_tier().inner, BatchedModelTier) for worker in workers)
        assert all(worker.batched_tier().inner.steps == bool(device_slots) for worker in workers)
        assert workers[1].batched_tier().inner.tier.exit_threshold == 0.3
        assert sum(stage["proposed"] for out in outputs for stage in out.stats["stages"]) > 0
    finally:
        stop(chain, workers)


def test_an_actor_serves_an_early_exit_drafter_on_the_device_beside_its_target(tiny_drafters):
    """`actor_device_slots`: the target's actor puts an early-exit drafter on the device with its target (a pool each);
    one hosting a feature head serves its tiers ragged (the head reads its target's ragged cache)."""
    import dataclasses

    from polyspec.orchestrator.config import BatchingConfig
    from polyspec.orchestrator.distributed.ray_runtime import actor_device_slots

    batching = dataclasses.replace(BatchingConfig(max_requests=4), round="device")
    tiers, _ = load_tiers(chain_config(tiny_drafters, ["target", "early_exit_noisy"], lengths=[3]).tiers)
    assert actor_device_slots(tiers, batching) == [5, 5]
    assert actor_device_slots(tiers, dataclasses.replace(batching, round="ragged")) == [0, 0]
    tiers, _ = load_tiers(chain_config(tiny_drafters, ["target", "feature"], lengths=[3]).tiers)
    assert actor_device_slots(tiers, batching) == [0, 0]


def test_the_tiers_of_one_process_are_made_batched_together(tiny_family):
    """`LockedTiers`: the tiers one process serves behind one model lock, each as its own device tier
    where it has slots, the others batched together on first use (made again after `reset`)."""
    from polyspec.orchestrator.distributed.model_lock import LockedTiers
    from polyspec.workers.tiers.batched import BatchedModelTier

    tiers, _ = load_tiers(chain_config(tiny_family, ["target", "mid", "small"], lengths=[3, 2]).tiers)
    siblings = LockedTiers(tiers, device_slots=[4, 0, 0], device_context=128)
    made = [siblings.of(tier) for tier in tiers]
    assert all(type(m.inner) is BatchedModelTier for m in made) and [m.inner.steps for m in made] == [True, False, False]
    assert all(m.lock is siblings.lock for m in made) and siblings.of(tiers[1]) is made[1]
    siblings.reset()
    assert siblings.made(tiers[0]) is None and siblings.of(tiers[0]) is not made[0]
