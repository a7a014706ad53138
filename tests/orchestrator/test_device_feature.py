"""A feature head (EAGLE / FSPAD) as a device tier under a device target (polyspec.workers.tiers.static_feature), on the CPU.

- greedy: target <- feature head on device tiers gives the target's own greedy `generate` for every request of a
  ragged batch (prompts joining at different steps);
- a device draft is a fresh ragged `FeatureTier`'s for the same context (one that never saw the history, its
  target's features computed for the whole context): greedy tokens bit for bit on float32, round after round
  of accepted drafts, corrections and contexts the target has not seen; sampled rows within 1e-5;
- the head's draft step and the target's step that writes the features compile whole (`fullgraph`), once a bucket;
- `batching.round: device` builds the head's device tier in the engine (greedy tokens: the ragged round's), and
  the chains it cannot run (a head drafting trees, or with a tier below it) are named in one line.
Sampling's exactness is the target's verify step, the one every device chain shares (test_device_round.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from core_helpers import CompiledGraphs, greedy_references
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import DraftTree
from polyspec.workers.tiers.device_step import target_step
from polyspec.workers.tiers.drafters import load_feature_head
from polyspec.workers.tiers.batched import batched_tiers
from polyspec.workers.tiers.feature_tier import FeatureTier
from polyspec.workers.tiers.static_feature import StaticFeatureHead, StaticFeatureTier, feature_draft_step
from polyspec.workers.tiers.batched_llama import BatchedLlama, step_unsupported
from polyspec.workers.tiers.static_tier import StaticModelTier, misfit
from polyspec.workers.tiers.tier import ModelTier

from tests.orchestrator.test_device_round import MAX_NEW, PROMPTS, _run


@pytest.fixture(scope="module")
def target(tiny_drafters):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head(target, tiny_drafters):
    head, _ = load_feature_head(tiny_drafters["feature"], target, "test")
    return head


@pytest.fixture(scope="module")
def reference(target):
    return greedy_references(target, PROMPTS, MAX_NEW)


def _ragged(target, head) -> tuple[ModelTier, FeatureTier]:
    # its weights as the one forward reads them
    source = ModelTier("target", target, target.config.vocab_size, target.device)
    return source, FeatureTier("feature", head, source)


def _runtime(target, head):
    """(target, head): the ragged runtime tiers of a fresh target and head (polyspec.workers.tiers.batched)."""
    return tuple(batched_tiers(list(_ragged(target, head)), 4))


def _device(target, head, slots=8) -> tuple[StaticModelTier, StaticFeatureTier]:
    source, feature = _ragged(target, head)
    device_target = StaticModelTier(source, slots)
    return device_target, StaticFeatureTier(feature, device_target, slots)


@pytest.mark.parametrize("length", [3, 6])
def test_greedy_target_feature_chain_equals_the_targets_generate(target, head, reference, length):
    scheduler = ChainScheduler(list(_device(target, head)), [length])
    results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], (length, i)
    stages = [results[i].stats["stages"][0] for i in range(len(PROMPTS))]
    assert all(s["blocks"] > 0 for s in stages)
    assert sum(s["accepted"] for s in stages) > 0, "some drafts were accepted: tails re-fed"
    assert not any(tier.open_sequences for tier in scheduler.tiers), "every slot is released"


def test_a_device_feature_draft_is_a_fresh_ragged_heads(target, head):
    """Three requests side by side (one a prompt longer than the widest first step), eight rounds each: every round's
    context keeps some of the drafted tokens (0 to 4:
    a tail of verified drafts the head re-feeds from the target's features) and a correction; every other round the
    target verifies the block first (its features then come from its verify step, else from its prefill on demand).
    Greedy blocks equal a fresh ragged head's bit for bit; sampled rows (T 0.8, top-k 50) its rows within 1e-5, and so
    do the rows `score_batch` gives for the blocks drafted."""
    from polyspec.orchestrator.decode.contract import seeded_generator

    device_target, device_head = _device(target, head, slots=4)
    contexts = [list(PROMPTS[0]), list(PROMPTS[1]), PROMPTS[2] * 4]  # 44 tokens, none cached: a tail past MAX_TAIL
    greedy = SamplingParams()
    for round_index in range(8):
        drafted = device_head.draft_batch([0, 1, 2], contexts, [5, 3, 4], [greedy] * 3, [None] * 3)
        for context, (tokens, _) in zip(contexts, drafted):
            _, fresh = _runtime(target, head)
            assert tokens == fresh.draft_batch(["x"], [context], [len(tokens)], [greedy], [None])[0][0], round_index
        if round_index % 2:
            blocks = [DraftTree.chain(tokens, None) for tokens, _ in drafted]
            device_target.verify_batch([0, 1, 2], contexts, blocks, [greedy] * 3, [None] * 3)
        for r, (tokens, _) in enumerate(drafted):
            kept = (round_index + r) % 5
            contexts[r] = contexts[r] + tokens[:kept] + [(17 * round_index + r) % 250]
    params = SamplingParams(temperature=0.8, top_k=50)
    sampled = device_head.draft_batch([0, 1, 2], contexts, [4, 4, 2], [params] * 3, [seeded_generator(s) for s in (1, 2, 3)])
    for context, (tokens, rows) in zip(contexts, sampled):
        _, fresh = _runtime(target, head)
        expected = fresh.score_batch(["x"], [context], [DraftTree.chain(tokens[:-1], None)], [params])[0]  # the rows after each drafted prefix
        assert rows.shape == expected.shape and torch.allclose(rows, expected, atol=1e-5)
    blocks = [DraftTree.chain(tokens, None) for tokens, _ in sampled]
    for context, block, rows in zip(contexts, blocks, device_head.score_batch([0, 1, 2], contexts, blocks, [params] * 3)):
        _, fresh = _runtime(target, head)  # the start-up profile's call: the block's tokens fed one a step
        assert torch.allclose(rows, fresh.score_batch(["x"], [context], [block], [params])[0], atol=1e-5)


def test_the_feature_steps_compile_whole_and_once_per_bucket(target, head):
    """The head's draft step (its features gathered from the target's and its own buffers, then a draw) and the target's
    step writing the features are one graph a bucket each, like every step of the round."""
    static = BatchedLlama(target)
    static_head = StaticFeatureHead(head, static)
    pool, head_pool = static.new_pool(slots=4, max_tokens=8), static_head.new_pool(slots=4, max_tokens=8)
    features = torch.zeros(5, pool.capacity, static.hidden_size)
    predicted = torch.zeros(5, head_pool.capacity, static.hidden_size)
    drafting = CompiledGraphs(functools.partial(feature_draft_step, real_features=features, predicted=predicted))
    verifying = CompiledGraphs(functools.partial(target_step, features=features))
    slots, rows, vocab = torch.tensor([0, 1, 2, pool.scratch_slot]), 4, static.vocab_size
    sampling = (torch.tensor([0.0, 0.8, 1.0, 0.0]), torch.tensor([0, 20, 0, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0]),
                torch.tensor([True, False, False, True]))
    generator = torch.Generator().manual_seed(0)
    for step_index in range(3):  # one bucket (4 rows, a 4-token tail / 3-token block, span 64), new values every step
        seeds, counters = torch.tensor([1, 2, 3, 0]), torch.full((rows,), step_index)
        ids = torch.randint(1, 200, (rows, 4), generator=generator)
        positions = (torch.tensor([5, 9, 2, 0]) + step_index)[:, None] + torch.arange(4)[None]
        tokens, _ = drafting(static_head, head_pool, ids, positions, slots, 64, "truncated", *sampling, seeds, counters,
                             torch.tensor([3, 1, 2, 0]), positions[:, 2], slots)
        assert tokens.shape == (rows,)
        draft_probs = torch.softmax(torch.randn(rows, 3, vocab, generator=generator), -1)
        emitted, _, _ = verifying(static, pool, ids, positions, slots, 64, "truncated", *sampling, ids[:, 1:], draft_probs,
                                  torch.tensor([3, 2, 3, 0]), seeds, counters)
        assert emitted.shape == (rows, 4)
    for step in (drafting, verifying):
        assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
        step.close()


def test_the_target_writes_the_features_a_head_reads(target, head):
    """After a prefill and a verify step, the target's feature buffer holds at each position of the context the
    hidden state the ragged target keeps there (`BatchedModelTier.features`), within 1e-5."""
    device_target, _ = _device(target, head, slots=2)
    context = list(PROMPTS[2])
    device_target.prefill([0], [context], 1 << 20)
    (verdict,) = device_target.verify_batch([0], [context], [DraftTree.chain([1, 2, 3], None)], [SamplingParams()], [None])
    context = context + [[1, 2, 3][j] for j in verdict.path] + [verdict.next_token]
    source, _ = _runtime(target, head)
    expected = source.features("x", context, len(context) - 1, compute=True)
    slot = device_target.slot_table.slot_of[0]
    assert torch.allclose(device_target.features[slot, : len(context) - 1], expected, atol=1e-5)


def test_the_chains_a_device_feature_head_cannot_run_are_named(target, head, tiny_drafters):
    from transformers import AutoModelForCausalLM

    source, feature = _ragged(target, head)
    assert misfit([source, feature], [4], 1) is None and misfit([source, feature], "auto", 1) is None
    assert misfit([source, feature], [4], 2) == ("tier 'feature' is a feature head: on the device it drafts chains "
                                                 "(tree_width 1) at the bottom of the chain")
    small_model = AutoModelForCausalLM.from_pretrained(tiny_drafters["small"], dtype=torch.float32).eval()
    small = ModelTier("small", small_model, small_model.config.vocab_size, small_model.device)
    assert "at the bottom of the chain" in misfit([source, feature, small], [4, 2], 1)
    other_source, _ = _ragged(target, head)
    assert misfit([other_source, feature], [4], 1) == "tier 'feature' is a feature head over another tier than the target"


@pytest.mark.parametrize("lengths", [[4], "auto"])
def test_the_engine_runs_a_feature_head_on_the_device(tiny_drafters, lengths):
    """`batching.round: device` puts target <- feature head on device tiers; its greedy tokens are the ragged round's
    (with `lengths: auto` the goodput planner, its profile timing the head's steps, sets each step's plan)."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs

    def engine(round_kind):
        return Engine(parse_config({"tiers": tier_specs(tiny_drafters, ["target", "feature"]), "speculation": {"lengths": lengths},
                                    "batching": {"round": round_kind, "max_requests": 4, "max_context": 128}}), batched=True)

    raws = [{"id": str(i), "prompt_ids": p, "max_new_tokens": 16} for i, p in enumerate(PROMPTS)]
    results = {}
    for round_kind in ("device", "ragged"):
        chosen = engine(round_kind)
        if round_kind == "device":
            assert [type(t) for t in chosen.scheduler.tiers] == [StaticModelTier, StaticFeatureTier]
            assert (chosen.scheduler.planner is not None) == (lengths == "auto")
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[round_kind] = out
    assert all(results["device"][r["id"]]["token_ids"] == results["ragged"][r["id"]]["token_ids"] for r in raws)
    if lengths != "auto":  # (the planner may keep speculation off for a head this cheap to beat)
        assert results["device"]["0"]["stats"]["stages"][0]["proposed"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_rounds_with_trained_drafters_give_the_targets_greedy_output(tiny_drafters):
    """On CUDA (float32) every step is captured once a bucket and replayed: target <- feature head and target <- early
    exit (exit threshold 0.3) give the target's own greedy `generate` on the device, ragged joins included."""
    from transformers import AutoModelForCausalLM

    from polyspec.workers.tiers.drafters import load_early_exit

    target = AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).to("cuda").eval()
    expected = greedy_references(target, PROMPTS, MAX_NEW)
    head, _ = load_feature_head(tiny_drafters["feature"], target, "test")
    early, _ = load_early_exit(tiny_drafters["early_exit_noisy"], target, 1, "test")
    early_tier = ModelTier("early", early, early.config.vocab_size, torch.device("cuda"))
    early_tier.exit_threshold = 0.3
    target_tier = ModelTier("target", target, target.config.vocab_size, torch.device("cuda"))
    for tiers in (list(_device(target, head)), [StaticModelTier(target_tier, 8), StaticModelTier(early_tier, 8)]):
        scheduler = ChainScheduler(tiers, [4])
        assert all(t.graphs.enabled for t in tiers)
        results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
        for i, prompt in enumerate(PROMPTS):
            assert results[i].token_ids == expected[tuple(prompt)], (type(tiers[1]).__name__, i)
        assert tiers[1].graphs.graphs, "no drafting step was captured"
    # the ragged feature tier on CUDA too (its inputs and kept features on the target's device)
    scheduler = ChainScheduler(list(_runtime(target, head)), [4])
    for prompt in PROMPTS:
        assert scheduler.generate(prompt, MAX_NEW, SamplingParams()).token_ids == expected[tuple(prompt)]
