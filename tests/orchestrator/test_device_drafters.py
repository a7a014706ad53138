"""The trained drafters as device tiers (polyspec.workers.tiers.static_tier), run on the CPU.

Early exit (Kangaroo: the target's first layer, shared, and an adapter; tests/conftest.py `tiny_drafters`):
- greedy: target <- early exit on device tiers gives the target's own greedy `generate` for every request of a
  ragged batch (chains and trees, with and without an exit threshold);
- a device draft is the ragged tier's (`BatchedModelTier`, the same model) for the same contexts: greedy tokens
  bit for bit on float32, the blocks an exit threshold cuts included, and trees; sampled rows within 1e-5;
- its draft step and tree steps with the exit's confidence compile whole (`fullgraph`), once a bucket;
- `batching.round: device` builds it in the engine, whose greedy tokens are the ragged round's.
Sampling's exactness is the target's verify step, the one every device chain shares (test_device_round.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from core_helpers import CompiledGraphs, greedy_references
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.device_step import draft_step, tree_level_step, tree_root_step
from polyspec.workers.tiers.drafters import load_early_exit
from polyspec.workers.tiers.batched_llama import BatchedLlama, step_unsupported
from polyspec.workers.tiers.static_tier import StaticModelTier, misfit
from polyspec.workers.tiers.tier import ModelTier

from tests.orchestrator.test_device_round import MAX_NEW, PROMPTS, _run

NOISY = "early_exit_noisy"  # an adapter that disagrees with the target now and then


@pytest.fixture(scope="module")
def target(tiny_drafters):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def early(target, tiny_drafters):
    """The early-exit model over `target` (its first layer shared)."""
    model, _ = load_early_exit(tiny_drafters[NOISY], target, 1, "test")
    return model


@pytest.fixture(scope="module")
def reference(target):
    return greedy_references(target, PROMPTS, MAX_NEW)


def _tier(name, model, threshold=None) -> ModelTier:
    tier = ModelTier(name, model, model.config.vocab_size, model.device)
    tier.exit_threshold = threshold
    return tier


@pytest.mark.parametrize("threshold,tree_width", [(None, 1), (0.3, 1), (0.6, 2), (None, 2)])
def test_greedy_target_early_exit_chain_equals_the_targets_generate(target, early, reference, threshold, tree_width):
    tiers = [_tier("target", target), _tier("early", early, threshold)]
    assert misfit(tiers, [4], tree_width) is None
    scheduler = ChainScheduler([StaticModelTier(tier, 8) for tier in tiers], [4], tree_width=tree_width)
    results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], (threshold, tree_width, i)
    stage = results[0].stats["stages"][0]
    assert stage["blocks"] > 0 and 0 < stage["accepted"] <= stage["proposed"]
    assert not any(tier.open_sequences for tier in scheduler.tiers), "every slot is released"


def test_the_early_exit_pool_is_its_own_and_its_weights_the_targets(target, early):
    device_target, device_early = StaticModelTier(_tier("target", target), 2), StaticModelTier(_tier("early", early), 2)
    assert len(device_early.pool.keys) == 2 and device_early.pool.keys[0] is not device_target.pool.keys[0]
    early_model, target_model = device_early.tier.model, device_target.tier.model
    shared = (model.model.layers[0].self_attn.q_proj.weight for model in (early_model, target_model))  # layer 0's q projection
    assert len({weight.data_ptr() for weight in shared}) == 1, "the first layer is the target's, not a copy"
    assert early_model.lm_head.weight.data_ptr() == target_model.lm_head.weight.data_ptr()
    assert device_early.model.embed.data_ptr() == device_target.model.embed.data_ptr()


@pytest.mark.parametrize("threshold", [None, 0.5, 1.0])
def test_a_device_early_exit_draft_is_the_ragged_tiers(early, threshold):
    """Greedy blocks bit for bit (float32), after an exit threshold too (1.0: every block stops after its first token);
    sampled (T 0.8, top-k 50): a seeded request's rows are the model's own, within 1e-5, whatever it drew."""
    from polyspec.orchestrator.decode.contract import seeded_generator
    from polyspec.workers.core.sampling import warp_logits
    from polyspec.workers.tiers.batched import BatchedModelTier

    contexts, counts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [6, 3, 5]
    device_tier = StaticModelTier(_tier("early", early, threshold), 4)
    ragged = BatchedModelTier(_tier("early", early, threshold))
    greedy = [SamplingParams()] * 3
    drafted = device_tier.draft_batch([0, 1, 2], contexts, counts, greedy, [None] * 3)
    expected = ragged.draft_batch([0, 1, 2], contexts, counts, greedy, [None] * 3)
    assert [tokens for tokens, _ in drafted] == [tokens for tokens, _ in expected]
    if threshold == 1.0:
        assert all(len(tokens) == 1 for tokens, _ in drafted)
    elif threshold is None:
        assert [len(tokens) for tokens, _ in drafted] == counts
    params = SamplingParams(temperature=0.8, top_k=50)
    sampled = device_tier.draft_batch([0, 1, 2], contexts, counts, [params] * 3, [seeded_generator(s) for s in (1, 2, 3)])
    for context, (tokens, rows) in zip(contexts, sampled):
        assert rows.shape == (len(tokens), early.config.vocab_size)
        with torch.inference_mode():
            logits = early(torch.tensor([context + tokens])).logits[0, len(context) - 1:]
        assert torch.allclose(rows, warp_logits(logits[: len(tokens)], params), atol=1e-5)


@pytest.mark.parametrize("threshold", [None, 0.6, 1.0])
def test_a_device_early_exit_tree_is_the_ragged_tiers(early, threshold):
    """`ModelTier.draft_tree`'s exit on the device: a tree ends below the first level none of whose rows was sure."""
    from polyspec.workers.tiers.batched import BatchedModelTier

    contexts, depths, width = [PROMPTS[0], PROMPTS[3], PROMPTS[4]], [4, 2, 5], 2
    device_tier = StaticModelTier(_tier("early", early, threshold), 4)
    ragged = BatchedModelTier(_tier("early", early, threshold))
    greedy = [SamplingParams()] * 3
    trees = device_tier.draft_tree_batch([0, 1, 2], contexts, width, depths, greedy, "specinfer", [None] * 3)
    expected = ragged.draft_tree_batch([0, 1, 2], contexts, width, depths, greedy, "specinfer", [None] * 3)
    for tree, other in zip(trees, expected):
        assert (tree.tokens, tree.parents) == (other.tokens, other.parents)
    if threshold == 1.0:
        assert all(len(tree) == width for tree in trees)


@pytest.mark.parametrize("mode", ["greedy", "truncated"])
def test_the_early_exit_steps_compile_whole_and_once_per_bucket(early, mode):
    """The early-exit model's draft step and tree steps, with the exit's confidence as an output, are one graph a bucket."""
    static = BatchedLlama(early)
    pool = static.new_pool(slots=4, max_tokens=8)
    drafting = CompiledGraphs(functools.partial(draft_step, confidence=True))
    rooting = CompiledGraphs(functools.partial(tree_root_step, confidence=True))
    growing = CompiledGraphs(functools.partial(tree_level_step, confidence=True))
    slots, width = torch.tensor([0, 1, 2, pool.scratch_slot]), 2
    sampling = (torch.tensor([0.0, 0.8, 1.0, 0.0]), torch.tensor([0, 20, 0, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0]),
                torch.tensor([mode == "greedy", False, False, True]))
    generator = torch.Generator().manual_seed(0)
    for step_index in range(3):  # one bucket (4 rows, span 64), new values every step
        seeds, counters = torch.tensor([1, 2, 3, 0]), torch.full((4,), step_index)
        ids = torch.randint(1, 200, (4, 1), generator=generator)
        positions = torch.tensor([[5], [9], [2], [0]]) + step_index
        tokens, rows, confident = drafting(static, pool, ids, positions, slots, 64, mode, *sampling, seeds, counters)
        assert tokens.shape == confident.shape == (4,) and bool(((confident > 0) & (confident <= 1)).all())
        tree_ids = torch.randint(1, 200, (4, 2), generator=generator)
        start = torch.tensor([6, 10, 3, 1]) + step_index
        tokens, valid, _, confident = rooting(static, pool, tree_ids, torch.stack([start - 2, start - 1], 1), slots, 64, mode,
                                              width, False, *sampling, seeds, counters)
        assert tokens.shape == valid.shape == (4, width) and confident.shape == (4,)
        ancestors = (torch.arange(width) == torch.arange(width)[:, None]).expand(4, width, width)
        children, _, confident = growing(static, pool, tokens, start[:, None].expand(4, width), slots, 64, mode, ancestors, start,
                                         *sampling, seeds, counters + 1)
        assert children.shape == (4, width) and confident.shape == (4,)
    for step in (drafting, rooting, growing):
        assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
        step.close()


def test_the_engine_runs_an_early_exit_chain_on_the_device(tiny_drafters):
    """`batching.round: device` puts target <- early exit on device tiers; its greedy tokens are the ragged round's."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs

    def engine(round_kind):
        return Engine(parse_config({"tiers": tier_specs(tiny_drafters, ["target", NOISY]), "speculation": {"lengths": [4]},
                                    "batching": {"round": round_kind, "max_requests": 4, "max_context": 128}}), batched=True)

    raws = [{"id": str(i), "prompt_ids": p, "max_new_tokens": 16} for i, p in enumerate(PROMPTS)]
    results = {}
    for round_kind in ("device", "ragged"):
        chosen = engine(round_kind)
        if round_kind == "device":
            assert all(isinstance(t, StaticModelTier) for t in chosen.scheduler.tiers)
            assert chosen.scheduler.tiers[1].tier.exit_threshold == 0.3
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[round_kind] = out
    assert all(results["device"][r["id"]]["token_ids"] == results["ragged"][r["id"]]["token_ids"] for r in raws)
    assert results["device"]["0"]["stats"]["stages"][0]["proposed"] > 0
