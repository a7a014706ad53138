"""The one round over model tiers that decode in static steps (`BatchedModelTier(steps=True)`: what CUDA runs as
graphs, `batching.round: device`), run on the CPU.

- greedy: the target alone and target <- drafter give, for every request of a ragged batch
  (prompts of different lengths joining at different steps), the target's own greedy
  `generate` (transformers, the tokenizer's defaults, no EOS);
- sampling: a seeded request draws the same tokens alone or in any batch; a chi-square test
  (1,200 samples, alpha 1e-3) of the first two tokens against the exact target distribution,
  every sample drawn inside a batch of 48 requests;
- the step (`BatchedLlama.step`, chains and tree masks) compiles whole (`fullgraph`), once for every
  step of a bucket: the check of CUDA-graph capturability that needs no GPU.
- draft trees (`tree_width > 1`): greedy trees give the target's own greedy `generate` (target <- mid and
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
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched import BatchedModelTier, BatchedNGramTier
from polyspec.workers.tiers.batched_llama import BatchedLlama
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


def _device_tier(models, name, max_requests=8) -> BatchedModelTier:
    model = models[name]
    tier = BatchedModelTier(ModelTier(name, model, model.config.vocab_size, model.device), max_requests, steps=True)
    assert tier.steps
    return tier


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
    assert not any(tier.cache.open_sequences for tier in scheduler.tiers), "every slot is released"


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
    tier = BatchedModelTier(ModelTier("target", model, model.config.vocab_size, model.device), 8, steps=True)  # packs the weights
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
    assert not any(tier.cache.open_sequences for tier in scheduler.tiers), "every slot is released"


@pytest.mark.parametrize("scheme", ["specinfer", "rsd"])
def test_a_device_drafters_tree_is_the_ragged_drafters(models, scheme):
    """Greedy: the same tokens and parents as `BatchedModelTier.draft_tree_batch` (the top candidates at the root,
    then each chain's argmax), for requests of different depths in one batch. Sampled: each node's row is the
    model's warped row after the node's parent (the root candidates': after the context), float32 within 1e-5."""
    from polyspec.workers.core.sampling import RandomStream
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
    generators = [RandomStream(seed) for seed in (1, 2, 3)]
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


def _slot_kv(tier: BatchedModelTier, seq_id, length: int) -> list[torch.Tensor]:
    slot = tier.cache.slot_of[seq_id]
    return [buffer[slot, :, :length] for buffer in tier.cache.keys + tier.cache.values]


def test_an_accepted_tree_path_is_cached_as_a_prefill_of_it(models):
    """After a tree verdict the verifier's slot (compacted in `verify_batch`) and the drafter's (compacted before its
    next step, `accept_path`) hold keys and values, at every position, equal to a fresh prefill of the accepted
    context (float32, within 1e-5: the same arithmetic in other batch shapes)."""
    target, drafter = _device_tier(models, "target", 4), _device_tier(models, "mid", 4)
    context, params, deep_paths = list(PROMPTS[2]), SamplingParams(), 0
    for _ in range(5):
        for tier in (target, drafter):
            tier.prefill([0], [context], 1 << 20)
        trees = drafter.draft_tree_batch([0], [context], 2, [4], [params], "specinfer", [None])
        (verdict,) = target.verify_batch([0], [context], trees, [params], [None], scheme="specinfer", below=drafter)
        tree = trees[0]
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


@pytest.mark.parametrize("trees", [False, True])
def test_the_step_compiles_whole_and_once_per_bucket(models, trees):
    """`BatchedLlama.step` (chains: the causal mask made inside; trees: a mask given) is one graph per bucket
    (4 rows, 4 tokens, span 64), new values every call: what a CUDA graph captures."""
    static = BatchedLlama(models["target"])
    pool = static.new_cache(4, margin=8, scratch=True)
    pool.allocate()
    step = CompiledGraphs(static.step)
    rows, width = 4, 4
    generator = torch.Generator().manual_seed(0)
    for index in range(3):
        ids = torch.randint(1, 200, (rows, width), generator=generator)
        write_at = (torch.tensor([5, 9, 2, 0]) + index)[:, None] + torch.arange(width)[None]
        mask = (torch.arange(64)[None, None, :] <= write_at[:, :, None])[:, None] if trees else None
        args = (pool, ids, write_at, write_at, torch.tensor([0, 1, 2, pool.scratch_slot]), 64) + ((mask,) if trees else ())
        logits, normed = step(*args)
        assert logits.shape == (rows, width, static.vocab_size) and normed.shape == (rows, width, static.hidden_size)
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

    from polyspec.orchestrator.cli import main  # (in this process: an interpreter start less per run)

    requests = [{"id": f"g{i}", "prompt_ids": p, "max_new_tokens": 12} for i, p in enumerate(PROMPTS)]
    requests.append({"id": "s", "prompt_ids": PROMPTS[0], "max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 9})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    outputs = {}
    for round_kind in ("device", "ragged"):
        config = _config(tmp_path, tiny_family, ["target", "mid"], [3], round_kind)
        assert main(["batch", "-c", config, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / f"{round_kind}.jsonl")]) == 0
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

    from polyspec.orchestrator.cli import main  # (in this process: an interpreter start less per run)

    requests = [{"id": f"g{i}", "prompt_ids": p, "max_new_tokens": 12} for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    outputs = {}
    for round_kind in ("device", "ragged"):
        config = _config(tmp_path, tiny_family, ["target", "mid"], [3], round_kind, tree_width=2)
        assert main(["batch", "-c", config, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / f"{round_kind}.jsonl")]) == 0
        outputs[round_kind] = {r["id"]: r for r in map(json.loads, (tmp_path / f"{round_kind}.jsonl").read_text().splitlines())}
    for request in requests:
        assert outputs["device"][request["id"]]["token_ids"] == outputs["ragged"][request["id"]]["token_ids"], request["id"]
    assert outputs["device"]["g0"]["stats"]["stages"][0]["proposed"] > 0


def test_blocks_wider_than_a_step_run_through_the_ragged_forward(tiny_family, tmp_path):
    """A chain whose top block (20 + 13 tokens) exceeds what a step carries (MAX_STEP_TOKENS) still runs on
    `batching.round: device`: such a block goes through the ragged forward, with the ragged round's greedy tokens."""
    import json

    from polyspec.orchestrator.cli import main  # (in this process: an interpreter start less per run)

    requests = [{"id": f"g{i}", "prompt_ids": p, "max_new_tokens": 30} for i, p in enumerate(PROMPTS[:2])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    outputs = {}
    for round_kind in ("device", "ragged"):
        config = _config(tmp_path, tiny_family, ["target", "mid", "small"], [20, 13], round_kind)
        assert main(["batch", "-c", config, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / f"{round_kind}.jsonl")]) == 0
        outputs[round_kind] = [r["token_ids"] for r in map(json.loads, (tmp_path / f"{round_kind}.jsonl").read_text().splitlines())]
    assert outputs["device"] == outputs["ragged"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_ngram_drafter_in_the_device_round(tiny_family, temperature):
    """target <- n-gram: the lookup's proposals (`BatchedNGramTier`) verified by a stepping target as one-hot
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
            assert chosen.scheduler.tiers[0].steps and isinstance(chosen.scheduler.tiers[1], BatchedNGramTier)
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
    picks each step's plan (speculation off among the candidates); greedy output stays the target's."""
    from polyspec.orchestrator.batch_runner import run_requests
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    from family_chains import tier_specs
    from tests.orchestrator.test_plan_stats import check_plans

    def engine(names, lengths, width=1):
        return Engine(parse_config({"tiers": tier_specs(tiny_family, names), "speculation": {"lengths": lengths, "tree_width": width},
                                    "batching": {"round": "device", "max_requests": 4, "max_context": 128}}), batched=True)

    auto = engine(["target", drafter], "auto", tree_width)
    assert auto.scheduler.planner is not None
    alone = engine(["target"], [])
    raws = [{"id": str(i), "prompt_ids": p * 3, "max_new_tokens": 20} for i, p in enumerate(PROMPTS)]
    results = {}
    for chosen in (auto, alone):
        out = {}
        run_requests(chosen, [chosen.parse_request(r) for r in raws], lambda r: out.__setitem__(r["id"], r))
        results[id(chosen)] = out
    for raw in raws:
        assert results[id(auto)][raw["id"]]["token_ids"] == results[id(alone)][raw["id"]]["token_ids"], raw["id"]
        check_plans(results[id(auto)][raw["id"]])  # each plan run with its predicted and measured tokens/s
    described = auto.scheduler.planner.describe()
    assert described, "the planner reports its decisions"
