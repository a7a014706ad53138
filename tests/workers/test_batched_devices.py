"""The batched tier on each device and dtype it serves: CPU in float32 and bfloat16, and CUDA
in float32, bfloat16 and float16 where a GPU is present (these cases are skipped elsewhere;
run them there with `pytest tests/workers/test_batched_devices.py`).

- The tier really is batched there (not served row by row): its slot cache sits on the
  model's device, and one forward mixes ragged chains, trees, gaps between slots and
  rollbacks, whose rows match the one-request `ModelTier`'s (`score`, `draft`,
  `draft_tree`) within the dtype's rounding.
- A batched engine of that device and dtype (fixed lengths, draft trees, and the goodput
  planner with its start-up profile) gives every greedy request the target's own greedy
  output, except where the target's top-two logit gap is within the dtype's rounding.
- A prefill of prompts of different lengths is cut where they end (`prefill_cuts`: the cheapest
  cuts, checked against trying every subset of the chunks' ends) and pads no row where the ends
  are far apart; the rows scored after it match the one-request tier's.
- `grouped_attention` (each group's queries stacked on their key / value head) matches the
  copying form transformers uses (`repeat_kv`, then SDPA) under causal and tree masks, in float32
  within 1e-5 (measured: 5e-7) and bfloat16 within 8e-3 (one last-place unit at 1; measured: 5e-4):
  a taller query block may be summed in another order; without groups it is the same call, bit for bit.
- Without a GPU, device mixing is caught on the meta device (shapes without data), where
  an operation between a meta and a CPU tensor raises: the batched forward and its cache
  must make every tensor on the model's device.

The one-request tier on CUDA runs transformers' forward and the batched tier its own
(`BatchedLlama`): the same operations through different kernels, so rows agree to the
dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from core_helpers import keep_last_child_path
from family_chains import tier_specs
from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree, tree_allowed
from polyspec.workers.tiers.batched import FORWARD_COST_TOKENS, BatchedModelTier, batched_tiers, prefill_cuts
from polyspec.workers.tiers.batched_llama import INITIAL_CAPACITY, BatchedLlama, RowLayout, grouped_attention
from polyspec.workers.tiers.tier import ModelTier
from reference_tier import ReferenceTier

CPU_DEVICE = torch.device("cpu")
CASES = [("cpu", "float32"), ("cpu", "bfloat16")]
if torch.cuda.is_available():
    CASES += [("cuda", "float32"), ("cuda", "bfloat16"), ("cuda", "float16")]
# probability rows: what a few last-place units of the logits move a probability by (on a GPU the
# two tiers' kernels differ; a wrong mask, position or cache entry moves rows by far more)
ROW_TOLERANCE = {("cpu", "float32"): 1e-5, ("cuda", "float32"): 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# a greedy divergence is a rounding flip only where the target's top-two logit gap is this small:
GAP_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.06}  # logits ~4-8: 8 last-place units of bf16, 16 of fp16
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in",
           "x = [1, 2, 3]\ny = [", "class A:\n    def __init__(self):\n        self.", "# a comment\n"]


ATTENTION_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}  # grouped_attention against the copying form, values ~1


def row_tolerance(device: str, dtype: str) -> float:
    return ROW_TOLERANCE.get((device, dtype), ROW_TOLERANCE.get(dtype))


def load(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval().to(device)


@pytest.mark.parametrize("device,dtype", CASES)
def test_batched_tier_on_device_matches_one_request_tier(tiny_family, device, dtype):
    def tier(name):
        return ModelTier(name, load(tiny_family[name], device, dtype), 257, torch.device(device))

    # the one-sequence reference: transformers' forward (on the device, in the dtype), request by request
    target, drafter = (ReferenceTier(load(tiny_family[name], device, dtype), 257) for name in ("target", "small"))
    batched_target, batched_drafter = batched_tiers([tier("target"), tier("small")], max_slots=16)
    for batched in (batched_target, batched_drafter):
        assert isinstance(batched, BatchedModelTier)  # one shared forward, not the row-by-row fallback
        for pad in range(13):  # requests 0-3 in slots 0, 1, 5, 12: gather, span and view forwards
            batched.cache.slot(f"pad{pad}")
        for pad in (0, 1, 5, 12):
            batched.cache.release(f"pad{pad}")
        assert [batched.cache.slot(r) for r in range(4)] == [0, 1, 5, 12]
    tolerance = row_tolerance(device, dtype)
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (7, 19, 4, 12)]
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=30),
              SamplingParams(temperature=1.0)]
    for step in range(3):  # draft, verify and keep a path, then again on the longer contexts
        counts = [3, 2, 4, 1]
        chains = batched_drafter.draft_batch(list(range(4)), contexts, counts, params, [torch.Generator().manual_seed(r) for r in range(4)])
        for r, chain in enumerate(chains):
            tokens, rows = chain.tokens, chain.draft_rows
            assert len(tokens) == counts[r] and rows.device.type == "cpu" and rows.dtype == torch.float32
            expected = drafter.score_batch([r], [contexts[r]], Blocks.of([DraftTree.chain(tokens[:-1], None)]), [params[r]])[0]  # the rows each token was drawn from
            assert torch.allclose(rows, expected, atol=tolerance), (r, (rows - expected).abs().max())
        trees = batched_drafter.draft_tree_batch(list(range(4)), contexts, 3, [3, 2, 3, 0], params, "specinfer",
                                                 [torch.Generator().manual_seed(10 * step + r) for r in range(4)])
        assert [len(t) > 0 for t in trees] == [True, True, True, False]
        blocks = list(trees)
        blocks[1] = DraftTree.chain(chains[1].tokens, None)  # a chain row beside the tree rows
        blocks[3] = DraftTree.chain(chains[3].tokens, None)
        rows = batched_target.score_batch(list(range(4)), contexts, Blocks.of(blocks), params)
        expected = [target.score_batch([r], [c], [b], [p])[0] for r, (c, b, p) in enumerate(zip(contexts, blocks, params))]
        for r, (one, many) in enumerate(zip(expected, rows)):
            assert many.device.type == "cpu" and many.shape == one.shape
            assert torch.allclose(many, one, atol=tolerance), (r, (many - one).abs().max())
        for r, block in enumerate(blocks):
            if block.is_chain():
                contexts[r] = contexts[r] + block.tokens[:1] + [7 + step]  # the block's rows roll back at the next call
                continue
            pairs = ((target, batched_target), (drafter, batched_drafter))
            contexts[r] = contexts[r] + keep_last_child_path(r, block, pairs, batched_target, contexts[r]) + [5 + step]
    for batched in (batched_target, batched_drafter):
        keys = batched.cache.keys[0]
        assert keys.device.type == device and keys.dtype == getattr(torch, dtype)


def greedy_reference(model, prompt_ids: list[int], count: int) -> tuple[list[int], list[float]]:
    """The target's own greedy continuation (on its device, in its dtype) and its top-two logit gap at each step."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=count, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    gaps = [float(top[0] - top[1]) for top in (torch.topk(score[0].float(), 2).values for score in out.scores)]
    return tokens, gaps


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("names,speculation", [
    (["target", "mid", "ngram"], {"lengths": [4, 2]}),
    (["target", "mid", "small"], {"lengths": [3, 2], "tree_width": 2}),
    (["target", "mid"], {"lengths": "auto"}),  # the goodput planner, profiled on this device
])
def test_greedy_batched_engine_on_device_equals_target_alone(tiny_family, device, dtype, names, speculation):
    tiers = [{**spec, "device": device, "dtype": dtype} if spec["model"] != "ngram" else spec for spec in tier_specs(tiny_family, names)]
    engine = Engine(parse_config({"tiers": tiers, "speculation": speculation, "batching": {"max_requests": 4, "max_batched_tokens": 64}}),
                    batched=True)
    assert engine.batched and all(isinstance(t, BatchedModelTier) for t in engine.scheduler.tiers if t.has_weights)
    assert (engine.scheduler.planner is not None) == (speculation["lengths"] == "auto")
    engine.scheduler.eos_token_ids = frozenset()
    requests, greedy = [], []
    for index, prompt in enumerate(PROMPTS * 2):
        count = 10 + 5 * (index % 3)
        sampled = index % 4 == 3  # sampling requests share the batch with the greedy ones
        raw = {"prompt": prompt, "max_new_tokens": count, "id": str(index), **({"temperature": 1.0, "seed": index} if sampled else {})}
        requests.append(engine.parse_request(raw))
        if not sampled:
            greedy.append((str(index), encode_prompt(engine.tokenizer, prompt), count))
    results = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result))  # 4 at a time, joining as others finish
    assert set(results) == {r.id for r in requests}
    assert all(len(r["token_ids"]) == int(r["id"]) % 3 * 5 + 10 for r in results.values())
    model = load(tiny_family["target"], device, dtype)
    for request_id, prompt_ids, count in greedy:
        expected, gaps = greedy_reference(model, prompt_ids, count)
        output = results[request_id]["token_ids"]
        diverged = next((j for j, (a, b) in enumerate(zip(output, expected)) if a != b), None)
        if diverged is not None:  # only a near-tie may flip under other kernels or summation orders
            assert gaps[diverged] < GAP_TOLERANCE[dtype], f"request {request_id} diverged at {diverged} with logit gap {gaps[diverged]}"


def test_batched_forward_makes_its_tensors_on_the_model_device(tiny_family):
    """The model on the meta device: prefill forwards (no logits) that grow the cache, chains and
    a tree row in every attention mode (a slot range, a span with idle slots, far-apart slots)
    and a kept path run through only if no operation meets a CPU tensor; a forward that wants
    logits then stops at their one copy to the CPU, which meta tensors cannot give."""
    batched = BatchedLlama(load(tiny_family["target"], "cpu", "bfloat16").to("meta"))
    cache = batched.new_cache()
    assert batched.device.type == "meta" and cache.device.type == "meta" and batched.cos.device.type == "meta"
    slots = [cache.slot(r) for r in range(9)]
    prompts = [[1 + r] * (INITIAL_CAPACITY + 5 if r == 0 else 3 + r) for r in range(9)]
    fed = batched.forward(cache, slots, prompts, [len(p) for p in prompts])
    assert [tuple(t.shape) for t in fed] == [(0, 0)] * 9 and all(t.device.type == "cpu" for t in fed)
    assert cache.keys[0].device.type == "meta" and cache.capacity > INITIAL_CAPACITY and cache.slots >= 9
    for rows in ([0, 1, 2, 3], [0, 2, 3], [0, 8]):
        length = cache.length(slots[rows[1]])  # the second row is a tree: two roots, a child of the first
        allowed = tree_allowed([-1, -1, 0], {0: length, 1: length + 1, 2: length + 2}, [0, 1, 2], length, 0, length + 3)
        layouts = [RowLayout([length, length, length + 1], allowed) if j == 1 else None for j in range(len(rows))]
        feeds = [[5, 6, 7] if j == 1 else [5, 6][: 1 + j % 2] for j in range(len(rows))]
        with pytest.raises(NotImplementedError, match="meta"):
            batched.forward(cache, [slots[r] for r in rows], feeds, [0] * len(rows), layouts)
        assert cache.length(slots[rows[1]]) == length + 3
        cache.keep(slots[rows[1]], list(range(length)) + [length, length + 2])  # the path root 0 -> node 2
        assert cache.length(slots[rows[1]]) == length + 2


def copying_attention(q, key, value, mask, scaling):
    """The slow, obvious form: every key / value head copied once per query head of its group (transformers' repeat_kv)."""
    rows, heads, _, head_dim = q.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    key = key[:, :, None].expand(rows, kv_heads, groups, length, head_dim).reshape(rows, heads, length, head_dim)
    value = value[:, :, None].expand(rows, kv_heads, groups, length, head_dim).reshape(rows, heads, length, head_dim)
    return torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (12, 2)])
@pytest.mark.parametrize("width,length", [(1, 301), (5, 305), (17, 40), (3, 1100)])
def test_grouped_attention_matches_copying_every_key_value_head(dtype, heads, kv_heads, width, length):
    generator = torch.Generator().manual_seed(width * length + heads)
    rows, head_dim = 4, 32
    q = torch.randn(rows, heads, width, head_dim, generator=generator).to(dtype)  # [B, heads, T, D]
    key = torch.randn(rows, kv_heads, length, head_dim, generator=generator).to(dtype)  # [B, kv_heads, S, D]
    value = torch.randn(rows, kv_heads, length, head_dim, generator=generator).to(dtype)
    starts = torch.randint(0, length - width + 1, (rows,), generator=generator)  # ragged rows: each its own cached length
    mask = (torch.arange(length)[None, None, :] <= (starts[:, None] + torch.arange(width))[:, :, None])[:, None]  # [B, 1, T, S]
    mask[1, 0, :, -width:] = torch.rand(width, width, generator=generator) < 0.5  # a tree row: any pattern over its new columns
    mask[1, 0, :, 0] = True
    expected = copying_attention(q, key, value, mask, head_dim**-0.5)
    got = grouped_attention(q, key, value, mask, head_dim**-0.5)
    assert got.shape == expected.shape and got.dtype == dtype
    if heads == kv_heads:
        assert torch.equal(got, expected)
    else:
        assert (got.float() - expected.float()).abs().max().item() <= ATTENTION_TOLERANCE[dtype]


def cuts_cost(lengths: list[int], cuts: list[int]) -> int:
    """Positions computed (every row padded to its forward's widest) plus FORWARD_COST_TOKENS per forward."""
    cost, start = 0, 0
    for end in cuts:
        cost += FORWARD_COST_TOKENS + sum(length > start for length in lengths) * (end - start)
        start = end
    return cost


@pytest.mark.parametrize("seed", range(6))
def test_prefill_cuts_are_the_cheapest_subset_of_the_chunk_ends(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (int(torch.randint(1, 8, (1,), generator=generator)),), generator=generator).tolist()
    ends = sorted(set(lengths))
    every = [list(inner) + [ends[-1]] for n in range(len(ends)) for inner in itertools.combinations(ends[:-1], n)]
    cuts = prefill_cuts(lengths)
    assert cuts in every and cuts_cost(lengths, cuts) == min(cuts_cost(lengths, c) for c in every)
    assert prefill_cuts([86, 167, 254, 117]) == [86, 117, 167, 254]  # the benchmark's HumanEval prompts: nothing padded
    assert prefill_cuts([100, 110]) == [110] and prefill_cuts([]) == []  # ten padded positions cost less than a forward


def test_prefill_of_ragged_prompts_pads_nothing_and_scores_as_one_request(tiny_family):
    alone = ReferenceTier(load(tiny_family["target"], "cpu", "float32"), 257)
    batched = BatchedModelTier(ModelTier("target", load(tiny_family["target"], "cpu", "float32"), 257, CPU_DEVICE))
    generator = torch.Generator().manual_seed(1)
    contexts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (40, 3, 100, 70)]
    fed = batched.prefill(list(range(4)), contexts, budget=1000)
    assert fed == sum(len(c) - 1 for c in contexts) and [batched.cached(r) for r in range(4)] == [len(c) - 1 for c in contexts]
    assert sum(rows * width for rows, width, _ in batched.forward_log) == fed  # every position computed is a prompt's
    params = [SamplingParams(temperature=1.0)] * 4
    blocks = [DraftTree.chain([5, 6], None)] * 4
    for r, (one, many) in enumerate(zip((alone.score_batch([r], [c], [b], [p])[0] for r, (c, b, p) in enumerate(zip(contexts, blocks, params))),
                                        batched.score_batch(list(range(4)), contexts, Blocks.of(blocks), params))):
        assert torch.allclose(many, one, atol=row_tolerance("cpu", "float32")), (r, (many - one).abs().max())
