"""Batched speculative decoding: the slot cache and ragged forward, losslessness under batching, admission bounds.

Greedy: every request's output equals the target's own greedy `generate` alone, whatever
else is in the batch (requests of other lengths and sampling requests join and leave
mid-run). Where a batched forward's last-bit rounding flips a near-tie, the test checks
that the target's top-two logit gap at the divergence is at float-rounding size.
Sampling: a chi-square test of the first two tokens against the exact target
distribution, with every sample drawn inside a batch of other requests.
Draft trees (`tree_width > 1`): the same three checks on tree chains, plus the batched
tier's tree rows, trees, kept paths and recorded features against the one-sequence tier's,
and `lengths: auto` planning tree depths. A feature head batched runs no target forward of
its own (it reads the batched target's recorded features).
"""

from __future__ import annotations

import collections

import pytest
import torch

from core_helpers import keep_last_child_path
from family_chains import tier_specs
from lossless_stats import ALPHA, chi_square_p_value, exact_two_token_probs
from polyspec.orchestrator.batch_runner import ContinuousBatch, run_requests
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.decode.contract import Decoder
from polyspec.orchestrator.engine import Engine, requests_within_memory
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.batched_llama import BatchedLlama

ROUNDING_GAP = 1e-3  # a top-two logit gap this small can flip under a different summation order (fp32)
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in",
           "x = [1, 2, 3]\ny = [", "class A:\n    def __init__(self):\n        self.", "# a comment\n"]


def build(family, names, speculation, batching=None) -> Engine:
    raw = {"tiers": tier_specs(family, names), "speculation": speculation}
    if batching is not None:
        raw["batching"] = batching
    return Engine(parse_config(raw), batched=True)


@pytest.fixture(scope="module")
def target_model(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()


def transformers_logits(model, tokens: list[int]) -> torch.Tensor:
    """The slow, obvious reference: transformers' forward over the whole sequence, no cache; [T, V]."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def test_batched_forward_matches_one_sequence_forward(target_model):
    """Ragged rows in every attention mode (slot range, slots with gaps, far-apart slots) and rollback."""
    batched = BatchedLlama(target_model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (5, 17, 9, 30, 3, 11, 8, 2, 6, 4)]
    blocks = [torch.randint(1, 200, (k,), generator=generator).tolist() for k in (3, 1, 6, 2, 4, 1, 2, 5, 1, 3)]

    def alone(tokens: list[int]) -> torch.Tensor:
        return transformers_logits(target_model, tokens)  # [T, V]

    cache = batched.new_cache()
    slots = [cache.slot(i) for i in range(len(prompts))]
    assert slots == list(range(len(prompts)))
    outs = batched.forward(cache, slots, prompts, [len(p) - 1 for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert torch.allclose(out, alone(prompt)[-1:], atol=1e-4)
    for rows in ([0, 1, 2, 3], [2, 0, 3], [0, 9], [9, 4, 5, 6, 7, 8]):  # view, span with an idle slot, gather, view
        before = {r: cache.length(slots[r]) for r in rows}
        outs = batched.forward(cache, [slots[r] for r in rows], [blocks[r] for r in rows], [0] * len(rows))
        for r, out in zip(rows, outs):
            expected = alone(prompts[r] + blocks[r])[-len(blocks[r]):]
            assert torch.allclose(out, expected, atol=1e-4), (rows, r, (out - expected).abs().max())
        for r in rows:  # exact per-request rollback: drop the block again
            cache.truncate(slots[r], before[r])
    cache.release(1)
    assert cache.slot("new") == 1  # the lowest free slot is reused
    assert cache.length(1) == 0


def _greedy_reference(model, prompt_ids: list[int], count: int) -> tuple[list[int], list[float]]:
    """The target's own greedy continuation and the top-two logit gap at each step."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=count, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    gaps = [float(top[0] - top[1]) for top in (torch.topk(score[0], 2).values for score in out.scores)]
    return tokens, gaps


def _check_greedy(model, prompt_ids, output, count):
    expected, gaps = _greedy_reference(model, prompt_ids, count)
    diverged = next((j for j, (a, b) in enumerate(zip(output, expected)) if a != b), None)
    if diverged is None:
        assert output == expected[: len(output)] and len(output) == count
    else:  # only a near-tie may flip under batched arithmetic
        assert gaps[diverged] < ROUNDING_GAP, f"diverged at {diverged} with logit gap {gaps[diverged]}"


def mixed_requests(engine, prompts: list[str], count_of) -> tuple[list, list[tuple[str, list[int], int]]]:
    """Requests for `prompts` (`count_of(index)` new tokens each), every third one sampling beside the
    greedy ones; and (id, prompt ids, count) of the greedy ones, to check against the target."""
    requests, greedy = [], []
    for index, prompt in enumerate(prompts):
        count = count_of(index)
        sampled = index % 3 == 2  # sampling requests share the batch with the greedy ones
        raw = {"prompt": prompt, "max_new_tokens": count, "id": str(index)}
        if sampled:
            raw.update(temperature=1.0, seed=index)
        requests.append(engine.parse_request(raw))
        if not sampled:
            greedy.append((str(index), encode_prompt(engine.tokenizer, prompt), count))
    return requests, greedy


def test_slot_cache_is_one_pool_allocated_once(target_model):
    """The ragged tier's KV pool is made once, at the first forward: its buffers never move while
    requests come and go (no copy to grow), it holds `max_slots` slots of the whole model context,
    a row at the context's end padded to a wider row's block writes its padding to the junk column
    (its logits as alone), and a fourth request or a context past the model's is refused in one line."""
    batched = BatchedLlama(target_model)
    limit = batched.limit
    cache = batched.new_cache(max_slots=3)
    assert not cache.keys  # nothing before the first forward
    first = [cache.slot(i) for i in range(2)]
    batched.forward(cache, first, [[5, 6, 7], [8, 9]], [3, 2])
    pointers = [t.data_ptr() for t in cache.keys + cache.values]
    assert cache.slots == 3 and cache.capacity == limit + 1
    assert len(cache._mappings) == 2 * len(batched.layers)  # CPU: anonymous mappings, backed as written
    near = [(i * 7) % 200 + 1 for i in range(limit - 1)]
    cache.release(0)
    slot = cache.slot("near")
    batched.forward(cache, [slot], [near[:-1]], [len(near) - 1])
    rows = batched.forward(cache, [slot, first[1]], [near[-1:], [1, 2, 3, 4, 5]], [0, 0])  # row 0's padding runs past the context
    expected = transformers_logits(target_model, near)[-1:]
    assert torch.allclose(rows[0], expected, atol=1e-4)
    assert [t.data_ptr() for t in cache.keys + cache.values] == pointers
    cache.slot("third")
    with pytest.raises(RuntimeError, match="all 3 cache slots are in use"):
        cache.slot("fourth")
    with pytest.raises(RuntimeError, match=f"does not fit the model's {limit} positions"):
        batched.forward(cache, [slot], [[1, 2]], [2])


@pytest.mark.parametrize("names,speculation", [
    (["target", "mid", "ngram"], {"lengths": [5, 2]}),
    (["target", "small"], {"lengths": [3]}),
    (["target", "mid"], {"lengths": "auto"}),
])
def test_greedy_batched_equals_target_alone(tiny_family, target_model, names, speculation):
    engine = build(tiny_family, names, speculation, {"max_requests": 4, "max_batched_tokens": 64})
    engine.scheduler.eos_token_ids = frozenset()
    requests, greedy = mixed_requests(engine, PROMPTS * 2, lambda index: 12 + 5 * (index % 4))
    results = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result))  # 4 at a time, joining as others finish
    assert set(results) == {r.id for r in requests}
    for request_id, prompt_ids, count in greedy:
        _check_greedy(target_model, prompt_ids, results[request_id]["token_ids"], count)


@pytest.mark.slow
def test_batched_sampling_matches_target_distribution(tiny_family):
    """1200 seeded samples of the first two tokens, drawn 48 at a time beside greedy and other-prompt requests."""
    engine = build(tiny_family, ["target", "mid", "ngram"], {"lengths": [3, 2]}, {"max_requests": 64})
    engine.scheduler.eos_token_ids = frozenset()
    params = SamplingParams(temperature=1.0)
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[0])
    joint = exact_two_token_probs(engine.tiers[0].model, engine.vocab_size, prompt_ids, params)
    samples, per_batch = 1200, 48
    counts: collections.Counter = collections.Counter()
    for first in range(0, samples, per_batch):
        requests = [engine.parse_request({"prompt_ids": prompt_ids, "max_new_tokens": 3, "temperature": 1.0, "seed": seed, "id": f"s{seed}"})
                    for seed in range(first, first + per_batch)]
        requests += [engine.parse_request({"prompt": p, "max_new_tokens": 6, "id": f"o{j}"}) for j, p in enumerate(PROMPTS[1:4])]
        results = []
        run_requests(engine, requests, results.append)
        for result in results:
            if result["id"].startswith("s"):
                counts[tuple(result["token_ids"][:2])] += 1
    assert sum(counts.values()) == samples
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {samples} samples"


def test_seeded_sampling_is_the_same_batched_or_alone(tiny_family):
    """Per request, the round and its draws are the serial scheduler's: same seed, same tokens."""
    engine = build(tiny_family, ["target", "mid", "ngram"], {"lengths": [4, 2]})
    assert isinstance(engine.scheduler, Decoder)
    serial = Engine(parse_config({"tiers": tier_specs(tiny_family, ["target", "mid", "ngram"]), "speculation": {"lengths": [4, 2]}}))
    raw = {"prompt": PROMPTS[2], "max_new_tokens": 16, "temperature": 0.8, "top_k": 20, "seed": 11, "id": "x"}
    alone = serial.generate(serial.parse_request(raw))["token_ids"]
    results = {}
    others = [engine.parse_request({"prompt": p, "max_new_tokens": 10, "id": str(j)}) for j, p in enumerate(PROMPTS)]
    run_requests(engine, [engine.parse_request(raw)] + others, lambda r: results.__setitem__(r["id"], r))
    assert results["x"]["token_ids"] == alone


def test_continuous_batch_admits_up_to_max_requests_and_prefills_in_chunks(tiny_family):
    engine = build(tiny_family, ["target", "mid"], {"lengths": [3]}, {"max_requests": 3, "max_batched_tokens": 8})
    finished = []
    batch = ContinuousBatch(engine, on_result=lambda state, result: finished.append(state))
    assert batch.max_requests == 3 and engine.scheduler.prefill_budget == 5
    long_prompt = engine.parse_request({"prompt": PROMPTS[4] * 2, "max_new_tokens": 4})
    short = engine.parse_request({"prompt": "ab", "max_new_tokens": 8})
    running = batch.admit(short)
    batch.step()
    assert len(running.new_tokens) > 0
    joining = batch.admit(long_prompt)
    stepped = dict((id(s), tokens) for s, tokens in batch.step().advanced)
    # the long prompt is cached 5 tokens per step; the running request goes on meanwhile
    assert id(running) in stepped and id(joining) not in stepped
    assert engine.scheduler.tiers[0].cached(joining.run.seq_id) == 5
    while not joining.done or not running.done:
        batch.step()
    assert {id(s) for s in finished} == {id(running), id(joining)} and batch.room == 3


def test_a_drafter_a_token_behind_catches_up_in_its_draft_not_in_a_prefill(tiny_family):
    """target <- an exact copy of it: greedy blocks are accepted whole, which leaves the drafter one
    token behind after every round; the drafter's prefill runs for the prompt only (the token is fed
    by its next draft's first forward), and the output is still the target's own."""
    specs = tier_specs(tiny_family, ["target"]) + [{"name": "copy", "model": tiny_family["target"]}]
    engine = Engine(parse_config({"tiers": specs, "speculation": {"lengths": [3]}}), batched=True)
    serial = Engine(parse_config({"tiers": tier_specs(tiny_family, ["target"]), "speculation": {"lengths": []}}))
    raw = {"prompt": PROMPTS[2], "max_new_tokens": 16}
    drafter = engine.scheduler.tiers[1]
    fed, prefill = [], drafter.prefill
    drafter.prefill = lambda *args, **kwargs: fed.append(prefill(*args, **kwargs)) or fed[-1]
    batch = ContinuousBatch(engine)
    state = batch.admit(engine.parse_request(raw))
    behind = 0
    while not state.done:
        batch.step()
        behind += drafter.cached(state.run.seq_id) < len(state.committed) - 1
    assert behind > 0 and fed[0] == len(encode_prompt(engine.tokenizer, raw["prompt"])) - 1 and sum(fed[1:]) == 0
    assert state.new_tokens == serial.generate(serial.parse_request(raw))["token_ids"]


def test_batching_config_errors():
    tiers = [{"name": "target", "model": "some/model"}]
    for batching, message in [
        ({"max_requests": 0}, "batching.max_requests' must be >= 1"),
        ({"max_requests": "many"}, "batching.max_requests' must be an integer"),
        ({"max_requests": 8, "max_batched_tokens": 4}, "max_batched_tokens (4) must be >= batching.max_requests (8)"),
        ({"kv_memory_mb": -1}, "batching.kv_memory_mb' must be >= 1"),
        ({"enabled": "yes"}, "batching.enabled' must be true or false"),
        ({"slots": 3}, "unknown config key 'batching.slots'"),
    ]:
        with pytest.raises(ConfigError, match=__import__("re").escape(message)):
            parse_config({"tiers": tiers, "batching": batching})
    config = parse_config({"tiers": tiers, "batching": {"max_requests": 8, "kv_memory_mb": 100}})
    assert config.batching.max_requests == 8 and config.batching.kv_memory_mb == 100


def test_kv_memory_bound_lowers_max_requests(tiny_family):
    engine = build(tiny_family, ["target", "mid"], {"lengths": [3]}, {"max_requests": 64, "kv_memory_mb": 1})
    per_request = sum(t.bytes_per_request() for t in engine.scheduler.tiers)
    assert engine.max_requests == (2**20) // per_request < 64
    assert all(t.cache.max_slots == engine.max_requests for t in engine.scheduler.tiers)
    assert requests_within_memory(64, None, 10**6) == 64
    assert requests_within_memory(64, 10, 2**20) == 10
    with pytest.raises(ConfigError, match=r"batching.kv_memory_mb \(1\) holds no request: one request's KV caches at the full model context take 2.0 MB"):
        requests_within_memory(64, 1, 2 * 2**20)


# ----------------------------------------------------------------- draft trees, batched


def test_batched_tree_tier_matches_one_sequence_tier(tiny_family):
    """Trees beside chains in one forward: the same rows as transformers' one-sequence forward (the reference
    tier), the same trees (same seeds), and `accept_path` leaves the same cache behind, recorded features
    (`keep_features`, what a feature drafter reads) included."""
    from transformers import AutoModelForCausalLM

    from polyspec.workers.core.tree import Blocks, DraftTree
    from polyspec.workers.tiers.batched import BatchedModelTier
    from polyspec.workers.tiers.tier import ModelTier
    from reference_tier import ReferenceTier, hidden_states

    def model(name):
        return AutoModelForCausalLM.from_pretrained(tiny_family[name], dtype=torch.float32).eval()

    target, drafter = ReferenceTier(model("target"), 257), ReferenceTier(model("small"), 257)
    batched_target = BatchedModelTier(ModelTier("target", model("target"), 257, torch.device("cpu")))
    batched_drafter = BatchedModelTier(ModelTier("small", model("small"), 257, torch.device("cpu")))
    batched_target.keep_features = True
    for batched in (batched_target, batched_drafter):  # requests 0-3 in slots 0, 1, 5, 12: gather, span and view forwards
        for pad in range(13):
            batched.cache.slot(f"pad{pad}")
        for pad in (0, 1, 5, 12):
            batched.cache.release(f"pad{pad}")
        assert [batched.cache.slot(r) for r in range(4)] == [0, 1, 5, 12]
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (7, 19, 4, 12)]
    params = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7, top_k=30), SamplingParams(temperature=1.0)]
    depths = [3, 2, 4, 0]
    for step in range(3):  # drafting, verifying and keeping a path, then again on the longer contexts
        alone = [drafter.draft_tree_batch([r], [c], 3, [d], [p], "specinfer", [torch.Generator().manual_seed(10 * step + r)])[0]
                 for r, (c, d, p) in enumerate(zip(contexts, depths, params))]
        trees = batched_drafter.draft_tree_batch(list(range(4)), contexts, 3, depths, params, "specinfer",
                                                 [torch.Generator().manual_seed(10 * step + r) for r in range(4)])
        for one, many in zip(alone, trees):
            assert many.tokens == one.tokens and many.parents == one.parents
            assert (many.draft_rows is None) == (one.draft_rows is None)
            if one.draft_rows is not None:
                assert torch.allclose(many.draft_rows, one.draft_rows, atol=1e-5)
        blocks = list(trees)
        blocks[1] = DraftTree.chain(trees[1].tokens[:2], None)  # a chain row beside the tree rows
        expected = [target.score_batch([r], [c], [b], [p])[0] for r, (c, b, p) in enumerate(zip(contexts, blocks, params))]
        rows = batched_target.score_batch(list(range(4)), contexts, Blocks.of(blocks), params)
        for one, many in zip(expected, rows):
            assert many.shape == one.shape and torch.allclose(many, one, atol=1e-5), (many - one).abs().max()
        for r, block in enumerate(blocks):
            if block.is_chain():
                continue
            pairs = ((target, batched_target), (drafter, batched_drafter))
            contexts[r] = contexts[r] + keep_last_child_path(r, block, pairs, batched_target, contexts[r]) + [5 + step]
        for r in range(4):  # the features of what each cache holds: context and kept path, or context and chain block
            got = batched_target.features(r, contexts[r], len(contexts[r]))
            want = hidden_states(target.model, contexts[r])[: got.shape[0]]
            assert got.shape[0] >= len(contexts[r]) - 1
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    new = torch.randint(1, 200, (9,), generator=generator).tolist()  # a sequence the tier has not seen: computed on demand ...
    got = batched_target.features("new", new, 8, compute=True)
    assert torch.allclose(got, hidden_states(target.model, new[:8]), atol=1e-4) and batched_target.cached("new") == 8
    forwards = batched_target.tier.forwards
    batched_target.score_batch(["new"], [new], Blocks.empty(1), [SamplingParams()])
    assert batched_target.tier.forwards == forwards + 1
    assert batched_target.forward_log[-1][1] == 1  # ... and the score finds it cached: one new position


@pytest.mark.parametrize("names,speculation", [
    (["target", "mid", "small"], {"lengths": [3, 2], "tree_width": 2}),
    (["target", "small"], {"lengths": [3], "tree_width": 3, "verifier": "rsd"}),
    (["target", "int8", "small"], {"lengths": [4, 3], "tree_width": 3}),
    (["target", "mid", "ngram"], {"lengths": [3, 3], "tree_width": 3}),  # the lookup's trees, one request after the other
])
def test_greedy_batched_trees_equal_target_alone(tiny_family, target_model, names, speculation):
    engine = build(tiny_family, names, speculation, {"max_requests": 4, "max_batched_tokens": 64})
    assert engine.batched and engine.scheduler.tree_width == speculation["tree_width"]
    engine.scheduler.eos_token_ids = frozenset()
    requests, greedy = mixed_requests(engine, PROMPTS, lambda index: 10 + 5 * (index % 3))
    results = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result))
    assert set(results) == {r.id for r in requests}
    for request_id, prompt_ids, count in greedy:
        _check_greedy(target_model, prompt_ids, results[request_id]["token_ids"], count)
    stages = [s for r in results.values() for s in r["stats"]["stages"] if s["drafter"] == engine.tiers[-1].name]
    # a model drafter's blocks have more nodes than the depth: trees, not chains; and forwards of more than one request
    assert names[-1] == "ngram" or sum(s["proposed"] for s in stages) > speculation["lengths"][-1] * sum(s["blocks"] for s in stages)
    assert max(rows for rows, _, _ in engine.scheduler.tiers[-2].forward_log) > 1


@pytest.mark.parametrize("scheme", ["specinfer", "rsd"])
def test_seeded_tree_sampling_is_the_same_batched_or_alone(tiny_family, scheme):
    """A tree chain's request: the batched round's draws are the serial scheduler's (same seed, same tokens)."""
    names, speculation = ["target", "mid", "small"], {"lengths": [3, 2], "tree_width": 3, "verifier": scheme}
    engine = build(tiny_family, names, speculation)
    serial = Engine(parse_config({"tiers": tier_specs(tiny_family, names), "speculation": speculation}))
    assert engine.batched and not serial.batched
    for seed in (11, 12):
        raw = {"prompt": PROMPTS[2], "max_new_tokens": 16, "temperature": 0.8, "top_k": 20, "seed": seed, "id": "x"}
        alone = serial.generate(serial.parse_request(raw))["token_ids"]
        results = {}
        others = [engine.parse_request({"prompt": p, "max_new_tokens": 10, "id": str(j), **({"temperature": 1.0, "seed": j} if j % 2 else {})})
                  for j, p in enumerate(PROMPTS)]
        run_requests(engine, [engine.parse_request(raw)] + others, lambda r: results.__setitem__(r["id"], r))
        assert results["x"]["token_ids"] == alone
        batched_alone = engine.generate(engine.parse_request(raw))["token_ids"]
        assert batched_alone == alone


def test_batched_tree_sampling_matches_target_distribution(tiny_family):
    """1200 seeded samples of the first two tokens from a batched tree chain at T=1, drawn 60 at a time.
    The drafter is close to the target, so most tokens are accepted drafts and the draft rows
    (drawn level by level in the batched forwards) decide them."""
    engine = build(tiny_family, ["target", "mid"], {"lengths": [2], "tree_width": 3}, {"max_requests": 64})
    engine.scheduler.eos_token_ids = frozenset()
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[0])
    joint = exact_two_token_probs(engine.tiers[0].model, engine.vocab_size, prompt_ids, SamplingParams(temperature=1.0))
    samples, per_batch = 1200, 60
    counts: collections.Counter = collections.Counter()
    for first in range(0, samples, per_batch):
        requests = [engine.parse_request({"prompt_ids": prompt_ids, "max_new_tokens": 2, "temperature": 1.0, "seed": seed, "id": f"s{seed}"})
                    for seed in range(first, first + per_batch)]
        results = []
        run_requests(engine, requests, results.append)
        for result in results:
            counts[tuple(result["token_ids"][:2])] += 1
    assert sum(counts.values()) == samples
    p_value = chi_square_p_value(counts, joint, samples)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {samples} samples"


def test_tree_chain_with_auto_lengths_plans_tree_depths(tiny_family, target_model):
    """`lengths: auto` with tree_width 2: the planner prices tree blocks (docs/serving.md) and moves
    the plan (off measured first, then trees of the depth it picked); each request records the
    plans it ran, the tree rounds feed the per-depth acceptance, and every request equals the
    target's own greedy output."""
    engine = build(tiny_family, ["target", "mid"], {"lengths": "auto", "tree_width": 2}, {"max_requests": 4})
    planner = engine.scheduler.planner
    assert engine.batched and planner is not None and planner.tree_width == 2 and engine.scheduler.tree_width == 2
    engine.scheduler.eos_token_ids = frozenset()
    requests = [engine.parse_request({"prompt": p, "max_new_tokens": 24, "id": str(i)}) for i, p in enumerate(PROMPTS)]
    results = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result))
    assert set(results) == {r.id for r in requests}
    for index, prompt in enumerate(PROMPTS):
        _check_greedy(target_model, encode_prompt(engine.tokenizer, prompt), results[str(index)]["token_ids"], 24)
    plans = [results[str(i)]["stats"]["plans"] for i in range(len(PROMPTS))]
    assert plans[0][0]["tiers"] == ["target"]  # the first load measures speculation off first ...
    assert any(len(p) > 1 for p in plans)  # ... and a request's plan moved from there
    ran = [p for request_plans in plans for p in request_plans if p["tiers"] == ["target", "mid"]]
    assert ran and all(p["lengths"][0] in planner.lengths_grid for p in ran)  # trees of a depth on the planner's grid
    assert planner.lengths_grid == (3, 6, 8)  # (cut at tuning.max_length, 8 by default)
    reached = planner.acceptance.reached[(0, 1, True)]  # tree rounds were observed per depth
    assert reached[0] > 0 and len(reached) >= min(p["lengths"][0] for p in ran)
    assert "tree_depth_rates" in planner.describe()


@pytest.mark.parametrize("names,speculation", [
    (["target", "feature"], {"lengths": [3], "tree_width": 3}),
    (["target", "feature"], {"lengths": [3]}),  # a tier served row by row does not hold a joining request back
    (["target", "feature"], {"lengths": "auto", "tree_width": 2}),  # the planner, its profile reading features too
    (["target", "early_exit_noisy"], {"lengths": [3], "tree_width": 2}),
])
def test_greedy_batched_trained_drafters_equal_target_alone(tiny_drafters, names, speculation):
    """Greedy equality; and every forward of the target is a batched one: a feature head reads the
    features the batched target's forwards recorded, no target forward runs for it alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()
    engine = build(tiny_drafters, names, speculation, {"max_requests": 4, "max_batched_tokens": 64})
    assert engine.batched
    engine.scheduler.eos_token_ids = frozenset()
    target, planner = engine.scheduler.tiers[0], engine.scheduler.planner
    if planner is not None:  # the head catches up inside its own calls: its per-token catch-up was measured
        assert planner.tables[1].catch_up_ms > 0 and planner.tables[0].catch_up_ms is None
        assert target.cache.open_sequences == 0  # the head's profile opened target sequences; all closed again
    batched_forward, calls = target.model.forward, []
    target.model.forward = lambda *args, **kwargs: calls.append(1) or batched_forward(*args, **kwargs)
    forwards_before = target.tier.forwards  # the wrapped tier counts every forward, batched or its own
    requests = [engine.parse_request({"prompt": p, "max_new_tokens": 12, "id": str(i)}) for i, p in enumerate(PROMPTS)]
    results = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result))
    assert set(results) == {r.id for r in requests}
    assert calls and target.tier.forwards - forwards_before == len(calls)
    for index, prompt in enumerate(PROMPTS):
        _check_greedy(model, encode_prompt(engine.tokenizer, prompt), results[str(index)]["token_ids"], 12)


@pytest.mark.parametrize("threshold", [None, 1.1, "median"])
def test_batched_draft_stops_where_the_one_request_tier_stops(tiny_family, threshold):
    """`exit_threshold` (early exit): the batched chain draft ends each request's block where the
    one-sequence reference ends it, with the same tokens and rows (same seeds)."""
    from transformers import AutoModelForCausalLM

    from polyspec.workers.tiers.batched import BatchedModelTier
    from polyspec.workers.core.device_verify import confidence
    from polyspec.workers.tiers.tier import ModelTier
    from reference_tier import ReferenceTier

    def model():
        return AutoModelForCausalLM.from_pretrained(tiny_family["small"], dtype=torch.float32).eval()

    alone, batched = ReferenceTier(model(), 257), BatchedModelTier(ModelTier("small", model(), 257, torch.device("cpu")))
    generator = torch.Generator().manual_seed(1)
    contexts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (9, 3, 14, 6)]
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.0)]
    if threshold == "median":  # between the confidences the drafts meet: some blocks stop early, some do not
        with torch.inference_mode():
            logits = AutoModelForCausalLM.from_pretrained(tiny_family["small"]).eval()(torch.tensor([contexts[0]])).logits[0]
        threshold = float(torch.stack([confidence(row) for row in logits]).median())
    alone.exit_threshold = batched.tier.exit_threshold = threshold
    counts = [6, 6, 4, 6]
    expected = [alone.draft_batch([r], [c], [n], [p], [torch.Generator().manual_seed(r)])[0]
                for r, (c, n, p) in enumerate(zip(contexts, counts, params))]
    got = batched.draft_batch(list(range(4)), contexts, counts, params, [torch.Generator().manual_seed(r) for r in range(4)])
    for want, chain in zip(expected, got):
        want_tokens, want_rows, tokens, rows = want.tokens, want.draft_rows, chain.tokens, chain.draft_rows
        assert tokens == want_tokens
        assert (rows is None) == (want_rows is None) and (rows is None or torch.allclose(rows, want_rows, atol=1e-5))
    if threshold == 1.1:
        assert got.lengths == [1] * 4  # no draft is ever that sure: every block stops at once
    elif threshold is None:
        assert got.lengths == counts


class RecordingPlanner:
    """A planner that runs the plan it is given every step and records what it is told."""

    predicted_tokens_per_s = None

    def __init__(self, active: tuple[int, ...], shadows: bool = True, drafters=None, lengths=(4,)) -> None:
        self.active, self.shadows, self.heard, self.lengths = active, shadows, [], list(lengths)
        self.override = drafters  # per step: per request, the tier drafting its block (None: the plan's)
        self.steps: list = []

    def plan(self, step):
        self.steps.append(step)
        return self.lengths, self.active

    def drafters(self, step):
        return self.override(step) if self.override else ()

    def observe(self, observation) -> None:
        self.heard.append(observation)


def test_a_lookup_left_out_of_a_step_is_asked_what_it_would_have_proposed(tiny_family, target_model):
    """The target alone runs (one token a step), and the n-gram tier, left out, is asked each step what it would
    have proposed at the request's context: the planner hears, per step, the match of that proposal with the token
    the step committed, as an independent index over the same context says (a mismatch is a rejection; a match,
    cut at the one committed token, is not). The output is the target's own greedy text; with the n-gram tier
    drafting for the target, or a planner that does not take shadows (`tuning.shadow: false`), nothing is shadowed."""
    from polyspec.orchestrator.decode.contract import RoundObservation, ShadowObservation
    from polyspec.workers.tiers.batched import NGramIndex

    engine = build(tiny_family, ["target", "ngram"], {"lengths": [4]})
    scheduler = engine.scheduler
    scheduler.eos_token_ids = frozenset()
    prompt = encode_prompt(engine.tokenizer, PROMPTS[0])  # its text repeats once in the tiny target's 48 tokens
    for active, takes, shadowed in (((0,), True, True), ((0, 1), True, False), ((0,), False, False)):
        planner = scheduler.planner = RecordingPlanner(active, takes)
        state = scheduler.start(prompt, 48, SamplingParams(), seed=0)
        while not state.done:
            scheduler.step_all([state])
        output = scheduler.finish(state).token_ids
        _check_greedy(target_model, prompt, output, 48)
        shadows = [o for o in planner.heard if isinstance(o, ShadowObservation)]
        if not shadowed:
            assert not shadows and (not takes or any(isinstance(o, RoundObservation) and o.drafter == 1 for o in planner.heard))
            continue
        lookup = scheduler.tiers[1].tier
        expected = []
        for t, token in enumerate(output):
            index = NGramIndex(lookup.min_ngram, lookup.max_ngram)
            index.sync(prompt + output[:t])
            proposal = index.lookup(5)  # the step's block of 4, and its bonus
            expected.append(((1, 1) if proposal[0] == token else (len(proposal), 0)) if proposal else (0, 0))  # (0, 0): a miss
        assert [(o.drafter, o.proposed, o.accepted, o.greedy) for o in shadows] == [(1, p, a, True) for p, a in expected]
        assert {(1, 1), (0, 0)} <= set(expected) and any(p > 1 for p, _ in expected), expected  # every outcome was checked


def test_a_lookup_left_out_under_a_model_drafter_is_matched_against_its_drafts(tiny_family, target_model):
    """target <- mid runs, the n-gram tier left out: each time the mid model drafts a block, the planner also hears
    how far the n-gram tier's proposal at the same context matched that block (a ShadowObservation at level 1: what
    the mid model verifying the lookup's block would have accepted), as an independent index over the same context
    says; the target's shadows (level 0) go on as before. The output is the target's own greedy text; with the
    lookup under the mid model in the plan, no level-1 shadow is heard (it is measured)."""
    from polyspec.orchestrator.decode.contract import DraftObservation, ShadowObservation
    from polyspec.workers.tiers.batched import NGramIndex

    engine = build(tiny_family, ["target", "mid", "ngram"], {"lengths": [4, 2]})
    scheduler = engine.scheduler
    scheduler.eos_token_ids = frozenset()
    prompt = encode_prompt(engine.tokenizer, PROMPTS[2])  # a loop written twice: the lookup has text to copy
    lookup = scheduler.tiers[2].tier
    for active in ((0, 1), (0, 1, 2)):
        planner = scheduler.planner = RecordingPlanner(active, lengths=(4, 2))
        state = scheduler.start(prompt, 48, SamplingParams(), seed=0)
        while not state.done:
            scheduler.step_all([state])
        output = scheduler.finish(state).token_ids
        _check_greedy(target_model, prompt, output, 48)
        shadows = [o for o in planner.heard if isinstance(o, ShadowObservation) and o.level == 1]
        if active == (0, 1, 2):
            assert not shadows
            continue
        drafts = [o for o in planner.heard if isinstance(o, DraftObservation) and o.tier == 1]
        expected = []
        for draft in drafts:
            index = NGramIndex(lookup.min_ngram, lookup.max_ngram)
            index.sync((prompt + output)[: draft.context_len])
            proposal, block = index.lookup(draft.length), list(draft.tokens)
            if not proposal:
                expected.append((0, 0))
                continue
            compared = min(len(proposal), len(block))
            matched = next((i for i in range(compared) if proposal[i] != block[i]), compared)
            expected.append((len(proposal) if matched < compared else matched, matched))
        assert [(o.drafter, o.proposed, o.accepted, o.greedy) for o in shadows] == [(2, p, a, True) for p, a in expected]
        assert any(a > 0 for _, a in expected) and any(p > a for p, a in expected), expected  # matches and rejections


def test_requests_of_one_step_may_draft_with_different_tiers(tiny_family, target_model):
    """A planner that has request 0 and 2 of a step draft with the n-gram tier while 1 and 3 draft with the mid
    model (the target verifies all four blocks in one forward): every output is the target's own greedy text,
    each request's stats show the pair it ran, and its plans record it."""
    engine = build(tiny_family, ["target", "mid", "ngram"], {"lengths": [4, 2]}, {"max_requests": 4})
    scheduler = engine.scheduler
    scheduler.eos_token_ids = frozenset()
    scheduler.planner = RecordingPlanner((0, 1), shadows=False, drafters=lambda step: tuple(
        2 if int(seq_id) % 2 == 0 else 1 for seq_id in step.seq_ids))
    prompts = [encode_prompt(engine.tokenizer, p) for p in PROMPTS[:4]]
    states = [scheduler.start(prompt, 24, SamplingParams(), seed=0) for prompt in prompts]
    while not all(state.done for state in states):
        scheduler.step_all([state for state in states if not state.done])
    for prompt, state in zip(prompts, states):
        result = scheduler.finish(state)
        _check_greedy(target_model, prompt, result.token_ids, 24)
        lookup = int(state.run.seq_id) % 2 == 0
        pairs = {(stage["tier"], stage["drafter"]) for stage in result.stats["stages"] if stage.get("blocks")}
        assert pairs == ({("target", "ng")} if lookup else {("target", "mid")}), (state.run.seq_id, result.stats["stages"])
        assert {tuple(p["tiers"]) for p in result.stats["plans"]} == {("target", "ng") if lookup else ("target", "mid")}
