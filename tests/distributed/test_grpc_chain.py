"""The tier-to-tier protocol without Ray: TierWorkers in this process, wired over gRPC on
loopback. Same scheduler code as embedded mode, so greedy output must match it token for
token, serial and pipelined (draft-ahead, no bonus token on a fully accepted block)."""

from __future__ import annotations

import collections

import pytest

from family_chains import tier_specs
from polyspec.orchestrator.config import parse_config
from inprocess_chain import in_process_chain
from polyspec.orchestrator.engine import Engine
from polyspec.workers.tiers.loading import load_tiers
from polyspec.workers.core.sampling import SamplingParams
from polyspec.orchestrator.tokenization import encode_prompt
from core_helpers import generate_alone, generate_each

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in"]
MAX_NEW = 40


EOS = (256,)  # the byte-level test tokenizer's end of text


def chain_config(family, names, **speculation):
    return parse_config({"tiers": tier_specs(family, names), "speculation": speculation})


@pytest.fixture(scope="module")
def embedded(tiny_family):
    engine = Engine(chain_config(tiny_family, ["target"]))
    assert tuple(engine.scheduler.eos_token_ids) == EOS
    tokenizer = engine.tokenizer
    outputs = {}
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        outputs[prompt] = (ids, generate_alone(engine.scheduler, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids)
    return outputs


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("names,speculation", [
    (["target", "mid"], {"lengths": [4]}),
    (["target", "mid", "small"], {"lengths": [4, 3]}),
    (["target", "int8", "ngram"], {"lengths": [5, 2]}),
    (["target", "mid"], {"lengths": [3], "tree_width": 2}),
], ids=["target+mid", "target+mid+small", "target+int8+ngram", "tree:target+mid"])
def test_greedy_equals_target(tiny_family, embedded, names, speculation, pipeline):
    config = chain_config(tiny_family, names, **speculation)
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, config.speculation_lengths(), tree_width=config.speculation.tree_width,
                                      pipeline=pipeline, eos_token_ids=EOS)
    try:
        for prompt, (ids, expected) in embedded.items():
            out = generate_alone(chain, ids, MAX_NEW, SamplingParams(temperature=0.0))
            assert out.token_ids == expected, prompt
            assert out.stats["stages"], "the chain verified blocks"
        stats = chain.runtime_stats()
        assert all(t["up"] for t in stats["tiers"])
        assert stats["tiers"][0]["sent"]["grpc"]["messages"] > 0  # the target called its drafter directly
        if pipeline and config.speculation.tree_width == 1:  # trees are not drafted ahead
            hits = sum(t["draft_ahead"]["hits"] for t in stats["tiers"])
            assert hits > 0, "pipelined drafters served blocks drafted ahead"
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


def test_concurrent_requests_match_one_at_a_time(tiny_family, embedded):
    """Many requests in flight at once (the tiers overlap them) give the same greedy tokens."""
    config = chain_config(tiny_family, ["target", "mid", "small"], lengths=[4, 2])
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, [4, 2], pipeline=True, eos_token_ids=EOS)
    try:
        jobs = [(ids, MAX_NEW, SamplingParams(temperature=0.0), None) for ids, _ in embedded.values()] * 3
        results = {}
        generate_each(chain, jobs, concurrency=6, on_done=lambda i, out: results.__setitem__(i, out))
        expected = [tokens for _, tokens in embedded.values()] * 3
        assert [results[i].token_ids for i in range(len(jobs))] == expected
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_the_goodput_planner_sets_lengths_of_a_distributed_chain(tiny_family, embedded, pipeline):
    """lengths: auto on a distributed chain: every tier profiles itself (Profile RPC), the driver's planner
    (the goodput planner, its plans on every tier or none) hears each round's stage reports as typed
    observations and sets the lengths sent with the next round; concurrent requests report safely; the
    output is still the target's greedy text."""
    from polyspec.harness.tune_measure import Pinned
    from polyspec.orchestrator.distributed.driver import profile_grid_remote
    from polyspec.orchestrator.tuning.batch_model import BatchPlanner, Plan
    from tests.orchestrator.test_plan_stats import check_plans

    config = chain_config(tiny_family, ["target", "mid", "small"], lengths=[1, 1])
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, [1, 1], pipeline=pipeline, eos_token_ids=EOS)
    try:
        tables, lookup = profile_grid_remote(chain, 1, repeats=1)
        assert all(table is not None and table.ms for table in tables) and lookup == [0.0, 0.0, 0.0]
        planner = BatchPlanner(chain.tiers, tables, lookup, max_length=4, allow_bypass=False)
        assert {plan.active for plan in planner.plans} == {(0,), (0, 1, 2)}
        chain.planner = planner
        jobs = [(ids, MAX_NEW, SamplingParams(temperature=0.0), None) for ids, _ in embedded.values()] * 2
        results = {}
        generate_each(chain, jobs, concurrency=3, on_done=lambda i, out: results.__setitem__(i, out))
        assert [results[i].token_ids for i in range(len(jobs))] == [tokens for _, tokens in embedded.values()] * 2
        assert planner.history and planner.arms  # it planned steps and measured them
        for out in results.values():  # each request ran plans the planner chose, with its predicted and measured tokens/s
            assert out.stats["plans"]
            check_plans({"token_ids": out.token_ids, "stats": out.stats})
        chain.planner = Pinned(Plan((0, 1, 2), (3, 2)), planner)  # the driver sends the plan's lengths with every round
        ids, expected = next(iter(embedded.values()))
        out = generate_alone(chain, ids, MAX_NEW, SamplingParams(temperature=0.0))
        assert out.token_ids == expected
        assert [stage["lengths"][0] for stage in out.stats["stages"]] == [3, 2]  # (then clipped near max_new_tokens)
        assert {(0, 1, True), (1, 2, True)} <= set(planner.acceptance.pairs())  # both stages' rounds heard
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


def test_drafter_death_falls_back_to_the_target(tiny_family, embedded):
    """The drafter's server stops mid-run: rounds go on with the target alone, output unchanged."""
    config = chain_config(tiny_family, ["target", "mid"], lengths=[4])
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, [4], pipeline=True, eos_token_ids=EOS)
    try:
        (ids, expected), *rest = embedded.values()
        state = chain.start(ids, MAX_NEW, SamplingParams(temperature=0.0))
        chain.step(state)
        workers[1].stop()
        while not state.done:
            chain.step(state)
        assert chain.finish(state).token_ids == expected
        assert chain.degraded_rounds > 0
        for ids, expected in rest:
            assert generate_alone(chain, ids, MAX_NEW, SamplingParams(temperature=0.0)).token_ids == expected
    finally:
        chain.close()
        workers[0].stop()


def test_seeded_sampling_matches_embedded(tiny_family):
    """Same seeds, same chain: the distributed serial chain samples exactly the embedded tokens."""
    config = chain_config(tiny_family, ["target", "mid", "small"], lengths=[3, 2])
    engine = Engine(config)
    ids = encode_prompt(engine.tokenizer, "def f(x):")
    params = SamplingParams(temperature=1.0)
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, [3, 2], pipeline=False, eos_token_ids=EOS)
    try:
        for seed in (1, 2, 3):
            local = generate_alone(engine.scheduler, ids, 24, params, seed=seed).token_ids
            assert generate_alone(chain, ids, 24, params, seed=seed).token_ids == local
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


@pytest.mark.slow
@pytest.mark.parametrize("names,lengths,samples", [
    (["target", "mid"], [1], 1000),
    pytest.param(["target", "mid", "small"], [1, 2], 800, marks=pytest.mark.extended),
], ids=["2-tier k=1", "3-tier k=1,2"])
def test_pipelined_sampling_is_lossless(tiny_family, names, lengths, samples):
    """Temperature 1 through the pipelined distributed chain: the first two tokens follow the
    target's exact joint distribution (chi-square, alpha 1e-3, sample size in the ids).
    With k=1 at the target, the second token comes from the draft-ahead continuation
    whenever the first block is accepted (no bonus token): that path is exercised often."""
    from lossless_stats import ALPHA, chi_square_p_value, exact_two_token_probs

    config = chain_config(tiny_family, names)
    tiers, tokenizer = load_tiers(config.tiers)
    prompt_ids = tokenizer("def f(x):\n    return x +")["input_ids"]
    params = SamplingParams(temperature=1.0)
    joint = exact_two_token_probs(tiers[0].model, tiers[0].vocab_size, prompt_ids, params)
    chain, workers = in_process_chain(tiers, lengths, pipeline=True)  # no EOS: always two tokens
    try:
        outputs = {}
        jobs = [(prompt_ids, 3, params, seed) for seed in range(samples)]  # round 2 has a block to draft ahead
        generate_each(chain, jobs, concurrency=4, on_done=lambda i, out: outputs.__setitem__(i, out))
        counts = collections.Counter(tuple(outputs[i].token_ids[:2]) for i in range(samples))
        hits = sum(t["draft_ahead"]["hits"] for t in chain.runtime_stats()["tiers"])
    finally:
        chain.close()
        for worker in workers:
            worker.stop()
    assert hits > samples // 10, f"the draft-ahead path ran too rarely to be tested ({hits} hits)"
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {samples} samples"


def test_prefill_rollback_and_profile_rpcs(tiny_family, embedded):
    """Prefill warms a cache, Rollback cuts one back mid-request, Profile times forwards:
    the request still ends with the target's own greedy tokens (every call names its whole context, kept by its callee)."""
    from polyspec.orchestrator.distributed import cluster_auth
    from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc

    config = chain_config(tiny_family, ["target", "mid"], lengths=[4])
    tiers, _ = load_tiers(config.tiers)
    chain, workers = in_process_chain(tiers, [4], pipeline=True, eos_token_ids=EOS)
    stubs = [tier_pb2_grpc.TierStub(cluster_auth.insecure_channel(w.address)) for w in workers]
    try:
        (ids, expected), *_ = embedded.values()
        state = chain.start(ids, MAX_NEW, SamplingParams(temperature=0.0))
        target = workers[0].batched_tier()  # every sequence lives in the worker's batched cache
        stubs[0].Prefill(tier_pb2.PrefillRequest(header=state.run.header, context=ids))
        assert target.cached(state.seq_id) == len(ids) - 1  # the prompt is cached (all but its last token: a round feeds it)
        chain.step(state)
        chain.step(state)
        for stub in stubs:
            stub.Rollback(tier_pb2.RollbackRequest(seq_id=state.seq_id, length=3))
        assert target.cached(state.seq_id) == 3
        while not state.done:
            chain.step(state)
        assert chain.finish(state).token_ids == expected
        grid = stubs[0].Profile(tier_pb2.ProfileRequest(max_batch=1, repeats=1)).batched
        assert (1, 1) in {(cell.batch, cell.width) for cell in grid} and all(cell.ms > 0 for cell in grid)
    finally:
        chain.close()
        for worker in workers:
            worker.stop()


def test_trained_drafters_in_their_targets_process_sample_as_embedded(tiny_drafters):
    """target <- feature head <- early exit, the two trained drafters served by workers beside the
    target's, sharing its model lock and made batched together (as in the target's Ray actor): the
    feature head reads the target's hidden states from the target worker's batched cache. T = 1 with
    per-tier seeds draws exactly the embedded chain's tokens (3 seeds, 24 tokens each)."""
    from inprocess_chain import StaticMembership
    from polyspec.orchestrator.distributed.driver import DistributedChain
    from polyspec.orchestrator.distributed.model_lock import LockedTiers
    from polyspec.orchestrator.distributed.worker import TierWorker

    raw = {"tiers": [{"name": "target", "model": tiny_drafters["target"]},
                     {"name": "feature", "model": {"feature_head": tiny_drafters["feature"]}},
                     {"name": "early", "model": {"early_exit": tiny_drafters["early_exit_noisy"], "layers": 1,
                                                 "exit_threshold": 0.3}}],
           "speculation": {"lengths": [3, 2]}}
    local = Engine(parse_config(raw))
    ids = encode_prompt(local.tokenizer, "def add(a, b):\n    return")
    eos = tuple(local.scheduler.eos_token_ids)
    tiers, _ = load_tiers(parse_config(raw).tiers)
    siblings = LockedTiers(tiers)
    workers = [TierWorker(tier, i, eos_token_ids=eos, siblings=siblings) for i, tier in enumerate(tiers)]
    workers[0].connect(workers[1].address)
    workers[1].connect(workers[2].address)
    membership = StaticMembership([w.address for w in workers], [t.name for t in tiers])
    chain = DistributedChain(membership, [3, 2], eos_token_ids=eos, max_context=tiers[0].max_context)
    try:
        params = SamplingParams(temperature=1.0)
        for seed in (1, 2, 3):
            expected = generate_alone(local.scheduler, ids, 24, params, seed=seed).token_ids
            assert generate_alone(chain, ids, 24, params, seed=seed).token_ids == expected
        assert siblings.of(tiers[1]).inner.source is siblings.of(tiers[0]).inner, "the head reads the batched target"
    finally:
        chain.close()
        local.close()
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_a_next_turn_reuses_the_workers_caches_and_says_the_same(tiny_family, embedded, pipeline):
    """Prefix reuse on a distributed chain (`keep_finished`, as `polyspec chat` asks for on every chain): a
    finished request's caches stay in every worker; the next request, whose prompt extends its tokens, runs
    under its sequence id, each model tier forwarding only what it had not cached, and says what a fresh chain says."""
    config = chain_config(tiny_family, ["target", "mid", "small"], lengths=[3, 2])
    tiers, _ = load_tiers(config.tiers)
    greedy = SamplingParams(temperature=0.0)
    (first, _), (second, _) = list(embedded.values())[:2]
    forwarded, outputs = {}, {}
    for keep in (0, 1):
        chain, workers = in_process_chain(tiers, [3, 2], pipeline=pipeline, eos_token_ids=EOS, keep_finished=keep)
        try:
            turn = generate_alone(chain, first, 12, greedy).token_ids
            model_tiers = [w.siblings.of(w.tier) for w in workers[:2]]
            before = [t.forwarded_tokens for t in model_tiers]
            outputs[keep] = (turn, generate_alone(chain, first + turn + second, 12, greedy).token_ids)
            forwarded[keep] = [t.forwarded_tokens - b for t, b in zip(model_tiers, before)]
        finally:
            chain.close()
            for worker in workers:
                worker.stop()
    assert outputs[1] == outputs[0]  # greedy: lossless either way
    # pipelined, the mid tier also forwards what it drafts ahead, which moves with the threads' timing by a few tokens
    # either way (measured: 120 fresh against 100 reused, where the prompt alone is 24): only the target is compared there
    compared = forwarded[0][:1] if pipeline else forwarded[0]
    for tier, (fresh, reused) in enumerate(zip(compared, forwarded[1])):
        assert fresh - reused >= len(first) - 1, (tier, fresh, reused)  # the previous turn's prompt, at least, was cached
