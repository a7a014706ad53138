"""The one round over device tiers (polyspec.workers.tiers.static_tier), run on the CPU.

- greedy: the target alone and target <- drafter give, for every request of a ragged batch
  (prompts of different lengths joining at different steps), the target's own greedy
  `generate` (transformers, the tokenizer's defaults, no EOS);
- sampling: a seeded request draws the same tokens alone or in any batch; a chi-square test
  (1,200 samples, alpha 1e-3) of the first two tokens against the exact target distribution,
  every sample drawn inside a batch of 48 requests;
- the target's step (forward + warp + verification) compiles whole (`fullgraph`), once for every
  step of a bucket: the check of CUDA-graph capturability that needs no GPU.
- draft trees (`tree_width > 1`): the tree steps (a drafter's root and level, the verifier's) compile whole, once
  a bucket; greedy trees give the target's own greedy `generate` (target <- mid and
  target <- mid <- small, ragged joins); a device drafter's greedy tree is the ragged drafter's, and its
  rows are the model's own (float32, 1e-5); a seeded request draws the same alone or batched; a
  chi-square test of the first two tokens (1,200 samples in batches of 48, alpha 1e-3) for specinfer
  and rsd (drawn without replacement); after a tree verdict both tiers' caches hold the accepted path
  as a fresh prefill of it would (1e-5); `polyspec batch` with trees gives the ragged round's tokens.
"""

from __future__ import annotations

import collections

import pytest
import torch

from core_helpers import CompiledGraphs, greedy_references

from lossless_stats import ALPHA, chi_square_p_value, exact_two_token_probs
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.workers.tiers.device_ngram import DeviceNGramTier
from polyspec.workers.tiers.device_step import draft_step, target_step, target_tree_step, tree_level_step, tree_root_step
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched_llama import BatchedLlama, step_unsupported
from polyspec.workers.tiers.static_tier import StaticModelTier
from polyspec.workers.tiers.tier import ModelTier

PROMPTS = [[5, 9, 23, 41, 7], [100, 3], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87], [12], [200, 150, 90]]
MAX_NEW = 24


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tiny_family):
    return {name: _model(tiny_family[name]) for name in ("target", "mid", "small")}


@pytest.fixture(scope="module")
def reference(models):
    return greedy_references(models["target"], PROMPTS, MAX_NEW)


def _scheduler(models, names, lengths, max_requests=8, tree_width=1, scheme="specinfer") -> ChainScheduler:
    """The one round over device tiers of `names` (each tier's pool holds `max_requests` requests); the bottom
    tier proposes trees of `tree_width` chains, verified by `scheme`, when `tree_width` > 1."""
    tiers = [_device_tier(models, name, max_requests) for name in names]
    return ChainScheduler(tiers, lengths, tree_width=tree_width, scheme=scheme)


def _device_tier(models, name, max_requests=8) -> StaticModelTier:
    model = models[name]
    tier = ModelTier(name, model, model.config.vocab_size, model.device)
    return StaticModelTier(tier, max_requests)


def _run(scheduler: ChainScheduler, requests, join_every: int = 1):
    """Drive requests as the continuous-batching loop does, a new one joining every `join_every` steps."""
    waiting = list(requests)
    running, results, steps = [], {}, 0
    while waiting or running:
        if waiting and steps % join_every == 0:
            key, prompt, max_new, params, seed = waiting.pop(0)
            state = scheduler.start(prompt, max_new, params, seed)
            running.append((key, state))
        scheduler.prefill([s for _, s in running])
        ready = [(k, s) for k, s in running if scheduler.ready(s)]
        scheduler.step_all([s for _, s in ready])
        for key, state in [(k, s) for k, s in running if s.done]:
            results[key] = scheduler.finish(state)
            running.remove((key, state))
        steps += 1
    return results


@pytest.mark.parametrize("names,lengths", [(["target"], []), (["target", "mid"], [4]), (["target", "small"], [3]),
                                           (["target", "mid"], [1]), (["target", "mid", "small"], [4, 2]),
                                           (["target", "mid", "small"], [12, 10])])  # the middle tier overshoots: blocks past 16
def test_greedy_equals_the_targets_generate(models, reference, names, lengths):
    scheduler = _scheduler(models, names, lengths)
    requests = [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)]
    results = _run(scheduler, requests, join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], (names, i)
    if len(names) > 1:
        stage = results[0].stats["stages"][0]
        assert stage["blocks"] > 0 and 0 <= stage["accepted"] <= stage["proposed"]
    assert not any(tier.open_sequences for tier in scheduler.tiers), "every slot is released"


def test_device_tiers_run_weights_moved_to_onednn(tiny_family, reference, monkeypatch):
    """On the CPU the one forward moves large fp32 weights to oneDNN (block_linear), releasing the dense ones;
    a device tier's steps compute through the moved weights."""
    import torch.backends.mkldnn

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    from polyspec.workers.tiers import block_linear

    monkeypatch.setattr(block_linear, "MIN_ELEMENTS", 1)  # every projection of the tiny model counts as large
    monkeypatch.setenv("POLYSPEC_BLOCK_LINEAR", "onednn")
    model = _model(tiny_family["target"])
    tier = StaticModelTier(ModelTier("target", model, model.config.vocab_size, model.device), 8)  # its forward packs the weights
    assert getattr(model.model.layers[0].self_attn.q_proj, block_linear.PACKED, None) is not None
    scheduler = ChainScheduler([tier], [])
    results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], i


@pytest.mark.parametrize("names,lengths", [(["target", "mid"], [3]), (["target", "mid", "small"], [3, 2])])
def test_seeded_requests_draw_the_same_alone_or_batched(models, names, lengths):
    params = SamplingParams(temperature=0.9, top_k=40)
    seeded = ("x", PROMPTS[0], 16, params, 1234)
    alone = _run(_scheduler(models, names, lengths), [seeded])["x"].token_ids
    others = [(i, p, 10 + i, SamplingParams(temperature=1.0), None) for i, p in enumerate(PROMPTS[1:])]
    batched = _run(_scheduler(models, names, lengths), others[:2] + [seeded] + others[2:])["x"].token_ids
    assert alone == batched and len(alone) == 16
    other_seed = _run(_scheduler(models, names, lengths), [("x", PROMPTS[0], 16, params, 1235)])["x"].token_ids
    assert other_seed != alone


def _first_two_tokens(scheduler, prompt, params, samples: int, per_batch: int, new_tokens: int = 2) -> collections.Counter:
    """The first two tokens of `samples` seeded requests (seeds 0 ..), each drawn inside a batch of `per_batch`."""
    counts: collections.Counter = collections.Counter()
    for first in range(0, samples, per_batch):
        states = [scheduler.start(prompt, new_tokens, params, seed) for seed in range(first, first + per_batch)]
        scheduler.prefill(states)
        while not all(s.done for s in states):
            scheduler.step_all([s for s in states if not s.done])
        for state in states:
            counts[tuple(scheduler.finish(state).token_ids[:2])] += 1
    assert sum(counts.values()) == samples
    return counts


@pytest.mark.parametrize("names,lengths", [(["target", "small"], [2]), (["target", "mid", "small"], [2, 2])])
def test_sampling_is_lossless(models, names, lengths):
    """1,200 samples of the first two tokens, each drawn inside a batch of 48 requests, against the
    target's exact distribution (alpha 1e-3); with three tiers the middle tier's rows, passed up on
    the device, are what the target verifies against."""
    params = SamplingParams(temperature=1.0)
    prompt = PROMPTS[0]
    vocab = models["target"].config.vocab_size
    joint = exact_two_token_probs(models["target"], vocab, prompt, params)
    samples, per_batch = 1200, 48
    scheduler = _scheduler(models, names, lengths, max_requests=per_batch)
    counts = _first_two_tokens(scheduler, prompt, params, samples, per_batch)
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {samples} samples"


@pytest.mark.parametrize("names,lengths", [(["target", "mid"], [4]), (["target", "mid", "small"], [3, 3])])
def test_greedy_trees_equal_the_targets_generate(models, reference, names, lengths):
    scheduler = _scheduler(models, names, lengths, tree_width=2)
    results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference[tuple(prompt)], (names, i)
    stage = results[0].stats["stages"][-1]  # the stage whose blocks are trees
    assert stage["proposed"] >= 2 * stage["blocks"] and stage["accepted"] > 0
    assert not any(tier.open_sequences for tier in scheduler.tiers), "every slot is released"


@pytest.mark.parametrize("scheme", ["specinfer", "rsd"])
def test_a_device_drafters_tree_is_the_ragged_drafters(models, scheme):
    """Greedy: the same tokens and parents as `BatchedModelTier.draft_tree_batch` (the top candidates at the root,
    then each chain's argmax), for requests of different depths in one batch. Sampled: each node's row is the
    model's warped row after the node's parent (the root candidates': after the context), float32 within 1e-5."""
    from polyspec.orchestrator.decode.contract import seeded_generator
    from polyspec.workers.core.sampling import warp_logits
    from polyspec.workers.core.tree import DraftTree
    from polyspec.workers.tiers.batched import BatchedModelTier

    contexts, depths, width = [PROMPTS[0], PROMPTS[1], PROMPTS[3]], [4, 2, 5], 3
    device_tier = _device_tier(models, "mid")
    ragged = BatchedModelTier(ModelTier("mid", models["mid"], models["mid"].config.vocab_size, models["mid"].device))
    greedy = [SamplingParams()] * 3
    trees = device_tier.draft_tree_batch([0, 1, 2], contexts, width, depths, greedy, scheme, [None] * 3)
    expected = ragged.draft_tree_batch([0, 1, 2], contexts, width, depths, greedy, scheme, [None] * 3)
    for tree, other, depth in zip(trees, expected, depths):
        assert (tree.tokens, tree.parents, tree.draft_rows) == (other.tokens, other.parents, None)
        assert len(tree) == width * depth
    params = SamplingParams(temperature=0.8, top_k=50)
    generators = [seeded_generator(seed) for seed in (1, 2, 3)]
    trees = device_tier.draft_tree_batch([0, 1, 2], contexts, width, depths, [params] * 3, scheme, generators)
    for context, tree in zip(contexts, trees):
        assert isinstance(tree, DraftTree) and tree.draft_rows.shape == (len(tree), models["mid"].config.vocab_size)
        for node, parent in enumerate(tree.parents):
            above, ancestor = [], parent
            while ancestor >= 0:
                above.insert(0, tree.tokens[ancestor])
                ancestor = tree.parents[ancestor]
            with torch.inference_mode():
                logits = models["mid"](torch.tensor([context + above])).logits[0, -1]
            assert torch.allclose(tree.draft_rows[node], warp_logits(logits, params), atol=1e-5), node
            assert tree.draft_rows[node, tree.tokens[node]] > 0
        if scheme == "rsd":  # drawn without replacement: the root's candidates are distinct
            roots = [t for t, p in zip(tree.tokens, tree.parents) if p < 0]
            assert len(set(roots)) == len(roots)


@pytest.mark.parametrize("scheme", ["specinfer", "spectr"])
def test_seeded_tree_requests_draw_the_same_alone_or_batched(models, scheme):
    names, lengths = ["target", "mid", "small"], [3, 2]
    params = SamplingParams(temperature=0.9, top_k=40)
    seeded = ("x", PROMPTS[0], 16, params, 1234)
    alone = _run(_scheduler(models, names, lengths, tree_width=2, scheme=scheme), [seeded])["x"].token_ids
    others = [(i, p, 10 + i, SamplingParams(temperature=1.0) if i % 2 else SamplingParams(), None)  # greedy ones beside it too
              for i, p in enumerate(PROMPTS[1:])]
    batched = _run(_scheduler(models, names, lengths, tree_width=2, scheme=scheme), others[:2] + [seeded] + others[2:])
    assert alone == batched["x"].token_ids and len(alone) == 16
    other_seed = _run(_scheduler(models, names, lengths, tree_width=2, scheme=scheme), [("x", PROMPTS[0], 16, params, 1235)])
    assert other_seed["x"].token_ids != alone


@pytest.mark.parametrize("names,lengths,scheme", [(["target", "small"], [2], "rsd"),
                                                  (["target", "mid", "small"], [2, 2], "specinfer")])
def test_tree_sampling_is_lossless(models, names, lengths, scheme):
    """1,200 samples of the first two tokens, each drawn inside a batch of 48 requests, against the target's
    exact distribution (alpha 1e-3), for trees of 3 chains: rsd's candidates drawn without replacement and
    verified by the target, specinfer's i.i.d. and verified by the middle tier, whose rows the target checks.
    Each request asks for 3 tokens, so its first round's tree is 2 levels deep (with 2, 1 level)."""
    params = SamplingParams(temperature=1.0)
    prompt = PROMPTS[0]
    vocab = models["target"].config.vocab_size
    joint = exact_two_token_probs(models["target"], vocab, prompt, params)
    samples, per_batch = 1200, 48
    scheduler = _scheduler(models, names, lengths, max_requests=per_batch, tree_width=3, scheme=scheme)
    counts = _first_two_tokens(scheduler, prompt, params, samples, per_batch, new_tokens=3)
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {samples} samples"


def _slot_kv(tier: StaticModelTier, seq_id, length: int) -> list[torch.Tensor]:
    slot = tier.slot_table.slot_of[seq_id]
    return [buffer[slot, :, :length] for buffer in tier.pool.keys + tier.pool.values]


def test_an_accepted_tree_path_is_cached_as_a_prefill_of_it(models):
    """After a tree verdict the verifier's slot (compacted in `verify_batch`) and the drafter's (compacted before its
    next step, `accept_path`) hold keys and values, at every position, equal to a fresh prefill of the accepted
    context (float32, within 1e-5: the same arithmetic in other batch shapes)."""
    target, drafter = _device_tier(models, "target", 4), _device_tier(models, "mid", 4)
    context, params, deep_paths = list(PROMPTS[2]), SamplingParams(), 0
    for _ in range(5):
        for tier in (target, drafter):
            tier.prefill([0], [context], 1 << 20)
        (tree,) = drafter.draft_tree_batch([0], [context], 2, [4], [params], "specinfer", [None])
        (verdict,) = target.verify_batch([0], [context], [tree], [params], [None], scheme="specinfer", below=drafter)
        accepted = context + [tree.tokens[j] for j in verdict.path]
        assert target.cached(0) == len(accepted) and drafter.cached(0) <= len(accepted)
        for tier in (target, drafter):
            kept = tier.cached(0)
            assert tier.prefill(["fresh"], [accepted[:kept] + [0]], 1 << 20) == kept  # (makes the drafter's pending moves first)
            for got, fresh in zip(_slot_kv(tier, 0, kept), _slot_kv(tier, "fresh", kept)):
                assert torch.allclose(got, fresh, atol=1e-5)
            tier.release("fresh")
        deep_paths += len(verdict.path) >= 2
        context = accepted + [verdict.next_token]
    assert deep_paths, "no verdict accepted a path whose nodes had to move"


def test_the_target_step_compiles_whole_and_once_per_bucket(models):
    static = BatchedLlama(models["target"])
    pool = static.new_pool(slots=4, max_tokens=8)
    step = CompiledGraphs(target_step)
    rows, block, vocab = 4, 3, static.vocab_size
    generator = torch.Generator().manual_seed(0)
    for step_index in range(3):  # one bucket (4 rows, 3-token blocks, span 64), new values every step
        ids = torch.randint(1, 200, (rows, block + 1), generator=generator)
        positions = (torch.tensor([5, 9, 2, 0]) + step_index)[:, None] + torch.arange(block + 1)[None]
        draft_probs = torch.softmax(torch.randn(rows, block, vocab, generator=generator), -1)
        args = (static, pool, ids, positions, torch.tensor([0, 1, 2, pool.scratch_slot]), 64, "truncated", torch.tensor([0.0, 0.8, 1.0, 0.0]),
                torch.tensor([0, 20, 0, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0]), torch.tensor([True, False, False, True]),
                ids[:, 1:], draft_probs, torch.tensor([3, 2, 3, 0]), torch.tensor([1, 2, 3, 0]), torch.full((rows,), step_index))
        tokens, accepted, target_rows = step(*args)
        assert tokens.shape == (rows, block + 1) and bool((accepted <= torch.tensor([3, 2, 3, 0])).all())
        assert target_rows.shape == (rows, block + 1, vocab)
    assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
    step.close()


@pytest.mark.parametrize("mode", ["greedy", "truncated"])
def test_the_draft_step_compiles_whole_and_once_per_bucket(models, mode):
    """A drafter's step (forward of one token per request, warp, one counter-based draw each) is one
    graph per bucket too: every tier's step of the round is capturable."""
    static = BatchedLlama(models["small"])
    pool = static.new_pool(slots=4, max_tokens=8)
    step = CompiledGraphs(draft_step)
    generator = torch.Generator().manual_seed(0)
    for step_index in range(3):  # one bucket (4 rows, 1 token, span 64), new values every step
        ids = torch.randint(1, 200, (4, 1), generator=generator)
        positions = torch.tensor([[5], [9], [2], [0]]) + step_index
        tokens, rows = step(static, pool, ids, positions, torch.tensor([0, 1, 2, pool.scratch_slot]), 64, mode,
                            torch.tensor([0.0, 0.8, 1.0, 0.0]), torch.tensor([0, 20, 0, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0]),
                            torch.tensor([True, False, False, True]), torch.tensor([1, 2, 3, 0]), torch.full((4,), step_index))
        assert tokens.shape == (4,) and rows.shape == (4, static.vocab_size)
    assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
    step.close()


@pytest.mark.parametrize("mode,scheme", [("greedy", "specinfer"), ("truncated", "rsd"), ("plain", "spectr")])
def test_the_tree_steps_compile_whole_and_once_per_bucket(models, mode, scheme):
    """A drafter's tree steps (the root's candidates, then a level) and the verifier's tree step (forward with tree
    attention, warp, `verify_trees`) are one graph per bucket each, like the chain steps."""
    from polyspec.workers.core.device_tree_verify import pack_trees
    from polyspec.workers.core.tree import DraftTree, tree_allowed

    static = BatchedLlama(models["target"])
    pool = static.new_pool(slots=2, max_tokens=8)
    root_step, level_step, verify_step = (CompiledGraphs(step) for step in (tree_root_step, tree_level_step, target_tree_step))
    slots, width = torch.tensor([0, pool.scratch_slot]), 2
    sampling = (torch.tensor([0.8, 0.0]), torch.tensor([20 if mode == "truncated" else 0, 0]), torch.tensor([1.0, 1.0]),
                torch.tensor([mode == "greedy", True]))
    tree = DraftTree([7, 8, 9, 10], [-1, -1, 0, 1], None)
    allowed = tree_allowed(tree.parents, [1, 2, 3, 4], [0, 1, 2, 3], 0, 1, 5)
    for step_index in range(2):  # one bucket, new values every step
        start = 6 + step_index
        seeds, counters = torch.tensor([5, 0]), torch.full((2,), step_index)
        ids, positions = torch.tensor([[3, 4], [0, 0]]) + step_index, torch.tensor([[start - 2, start - 1], [0, 1]])
        tokens, valid, _ = root_step(static, pool, ids, positions, slots, 64, mode, width, scheme == "rsd", *sampling, seeds,
                                     counters)
        assert tokens.shape == valid.shape == (2, width)
        prefix = torch.tensor([start, 0])
        ancestors = (torch.arange(width) == torch.arange(width)[:, None]).expand(2, width, width)
        children, _ = level_step(static, pool, tokens, prefix[:, None].expand(2, width), slots, 64, mode, ancestors, prefix,
                                 *sampling, seeds, counters + 1)
        assert children.shape == (2, width)
        vocab = 1 if mode == "greedy" else static.vocab_size
        node_tokens, parents, num_nodes, draft_probs = pack_trees([tree, DraftTree([], [], None)], 4, vocab)
        if mode != "greedy":
            draft_probs[0] = torch.softmax(torch.randn(4, vocab, generator=torch.Generator().manual_seed(step_index)), dim=-1)
        tree_positions = torch.tensor([[start - 1, start, start, start + 1, start + 1], list(range(5))])  # the root, then depth
        tree_ids = torch.tensor([[2, 7, 8, 9, 10], [0] * 5])
        tree_ancestors = torch.stack([allowed, torch.eye(5, dtype=torch.bool)])
        verdicts, _ = verify_step(static, pool, tree_ids, tree_positions, slots, 64, mode, scheme, 2, 2, *sampling,
                                  tree_ancestors, node_tokens, parents, num_nodes, draft_probs, seeds, counters)
        assert verdicts.shape == (2, 2 + 2)
    for step in (root_step, level_step, verify_step):
        assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
        step.close()


def _config(tmp_path, tiny_family, names, lengths, round_kind, tree_width=1) -> str:
    import yaml

    from family_chains import tier_specs

    path = tmp_path / f"{round_kind}-{'-'.join(names)}-w{tree_width}.yaml"
    speculation = {"lengths": lengths, "tree_width": tree_width}
    path.write_text(yaml.safe_dump({"tiers": tier_specs(tiny_family, names), "speculation": speculation,
                                    "batching": {"round": round_kind, "max_requests": 4, "max_context": 128}}))
    return str(path)


def test_polyspec_batch_through_the_device_round(tiny_family, tmp_path):
    """End to end through the CLI: `batching.round: device` gives the ragged round's greedy tokens for every
    request of a continuous batch (4 at a time), and the seeded request draws the same tokens alone."""
    import json

    from tests.orchestrator.test_cli import run_cli

    requests = [{"id": f"g{i}", "prompt_ids": p, "max_new_tokens": 12} for i, p in enumerate(PROMPTS)]
    requests.append({"id": "s", "prompt_ids": PROMPTS[0], "max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 9})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    outputs = {}
    for round_kind in ("device", "ragged"):
        config = _config(tmp_path, tiny_family, ["target", "mid"], [3], round_kind)
        done = run_cli("batch", "-c", config, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / f"{round_kind}.jsonl"))
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[round_kind] = {r["id"]: r for r in map(json.loads, (tmp_path / f"{round_kind}.jsonl").read_text().splitlines())}
    for request in requests[:-1]:
        assert outputs["device"][request["id"]]["token_ids"] == outputs["ragged"][request["id"]]["token_ids"], request["id"]
    # the seeded request, alone in this process, draws what it drew in the CLI's batch
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(load_config(_config(tmp_path, tiny_family, ["target", "mid"], [3], "device")))
    assert engine.generate(engine.parse_request(requests[-1]))["token_ids"] == outputs["device"]["s"]["token_ids"]


def test_polyspec_batch_runs_draft_trees_through_the_device_round(tiny_family, tmp_path):
    """End to end through the CLI with `speculation.tree_width: 2`: the device round's greedy tokens are the ragged round's."""
    import json

    from tests.orchestrator.test_cli import run_cli

    requests = [{"id": f"g{i}", "prompt_ids": p, "max_new_tokens": 12} for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    outputs = {}
    for round_kind in ("device", "ragged"):
        config = _config(tmp_path, tiny_family, ["target", "mid"], [3], round_kind, tree_width=2)
        done = run_cli("batch", "-c", config, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / f"{round_kind}.jsonl"))
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[round_kind] = {r["id"]: r for r in map(json.loads, (tmp_path / f"{round_kind}.jsonl").read_text().splitlines())}
    for request in requests:
        assert outputs["device"][request["id"]]["token_ids"] == outputs["ragged"][request["id"]]["token_ids"], request["id"]
    assert outputs["device"]["g0"]["stats"]["stages"][0]["proposed"] > 0


def test_trees_the_device_round_cannot_run_are_named(models):
    """A tree is one block: tree_width x the bottom length must fit MAX_BLOCK_TOKENS; with auto lengths the planner
    keeps its trees inside (`longest_length`)."""
    from polyspec.workers.tiers.static_tier import misfit

    tiers = [ModelTier(name, models[name], models[name].config.vocab_size, models[name].device) for name in ("target", "mid")]
    assert misfit(tiers, [16], 2) is None
    assert misfit(tiers, [11], 3) == "its draft trees hold at most 32 nodes; tree_width 3 x length 11 makes 33"
    assert misfit(tiers, "auto", 2) is None and misfit(tiers, "auto", 1) is None and "fewer than one level" in misfit(tiers, "auto", 33)


def test_a_chain_the_device_round_cannot_run_is_one_line(tiny_family, tmp_path):
    from tests.orchestrator.test_cli import run_cli

    # (an int8 copy of the target runs there on the CPU since the static step takes quantized tiers: tests/workers/test_quantized_forward.py)
    done = run_cli("generate", "-c", _config(tmp_path, tiny_family, ["target", "mid", "small"], [20, 13], "device"), "-p", "x", "-n", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.strip().splitlines() if line.startswith("polyspec: error:")]  # after the start-up lines
    assert errors == ["polyspec: error: batching.round: device cannot run this chain: its blocks hold at most 32 tokens, "
                      "and a chain's lengths add up in its top block: 33"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_ngram_drafter_in_the_device_round(tiny_family, temperature):
    """target <- n-gram: the lookup runs on the device too (DeviceNGramTier), its proposals verified as one-hot
    rows; greedy tokens equal the ragged round's, and seeded samples are the same alone or beside other requests."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs

    def engine(round_kind):
        return Engine(parse_config({"tiers": tier_specs(tiny_family, ["target", "ngram"]), "speculation": {"lengths": [5]},
                                    "batching": {"round": round_kind, "max_requests": 4, "max_context": 128}}), batched=True)

    repetitive = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # the lookup finds continuations
    raws = [{"id": str(i), "prompt_ids": p, "max_new_tokens": 16, "temperature": temperature, "seed": i}
            for i, p in enumerate([repetitive] + PROMPTS)]
    results = {}
    for round_kind in ("device", "ragged"):
        chosen = engine(round_kind)
        if round_kind == "device":
            assert isinstance(chosen.scheduler.tiers[1], DeviceNGramTier)
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[round_kind] = out
    stage = results["device"]["0"]["stats"]["stages"][0]
    assert stage["proposed"] > 0
    if temperature == 0.0:
        assert all(results["device"][r["id"]]["token_ids"] == results["ragged"][r["id"]]["token_ids"] for r in raws)
    else:
        alone = engine("device")
        single = alone.generate(alone.parse_request(raws[0]))
        assert single["token_ids"] == results["device"]["0"]["token_ids"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_round_gives_the_targets_greedy_output(tiny_family, dtype):
    """On CUDA each step is captured once per bucket and replayed; greedy output equals the target's own
    `generate` on the same device and dtype (target alone, target <- drafter with chains and with trees, ragged joins)."""
    from transformers import AutoModelForCausalLM

    models = {name: AutoModelForCausalLM.from_pretrained(tiny_family[name], dtype=dtype).to("cuda").eval() for name in ("target", "mid")}
    expected = greedy_references(models["target"], PROMPTS, MAX_NEW)
    for names, lengths, tree_width in ((["target"], [], 1), (["target", "mid"], [4], 1), (["target", "mid"], [4], 2)):
        scheduler = _scheduler(models, names, lengths, tree_width=tree_width)
        assert all(t.graphs.enabled for t in scheduler.tiers)
        results = _run(scheduler, [(i, p, MAX_NEW, SamplingParams(), None) for i, p in enumerate(PROMPTS)], join_every=2)
        for i, prompt in enumerate(PROMPTS):
            assert results[i].token_ids == expected[tuple(prompt)], (names, tree_width, dtype, i)
        assert scheduler.tiers[0].graphs.graphs, "no step was captured"


@pytest.mark.parametrize("drafter,tree_width", [("mid", 1), ("ngram", 1), ("mid", 3)])
def test_lengths_auto_plans_the_device_round(tiny_family, drafter, tree_width):
    """`lengths: auto` on the device round: the goodput planner, fed with the round's own step costs,
    picks each step's plan (speculation off among the candidates); greedy output stays the target's.
    With draft trees its lengths stay within a block (3 x 10 nodes of at most 32)."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs

    def engine(names, lengths, width=1):
        return Engine(parse_config({"tiers": tier_specs(tiny_family, names), "speculation": {"lengths": lengths, "tree_width": width},
                                    "batching": {"round": "device", "max_requests": 4, "max_context": 128}}), batched=True)

    auto = engine(["target", drafter], "auto", tree_width)
    assert auto.scheduler.planner is not None
    assert all(tree_width * max(p.lengths) <= 32 for p in auto.scheduler.planner.plans)
    alone = engine(["target"], [])
    raws = [{"id": str(i), "prompt_ids": p * 3, "max_new_tokens": 20} for i, p in enumerate(PROMPTS)]
    results = {}
    for chosen in (auto, alone):
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[id(chosen)] = out
    for raw in raws:
        assert results[id(auto)][raw["id"]]["token_ids"] == results[id(alone)][raw["id"]]["token_ids"], raw["id"]
    described = auto.scheduler.planner.describe()
    assert described, "the planner reports its decisions"
