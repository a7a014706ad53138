"""The static-shape step of the one forward over a KV pool allocated once (`BatchedLlama.step`).

Its logits match transformers' forward (float32, tolerance 1e-4: batched matrix products may
round differently in the last bits) for ragged prompts prefilled in one padded batch, single
tokens, blocks, and blocks rolled back and rewritten; padding rows and columns leave the other
slots untouched; tree rows (a `mask` from `tree_allowed`) match the ragged tree forward (`BatchedLlama`,
`RowLayout`); and a decode step compiles whole (`fullgraph`), once for every step of a bucket.
"""

from __future__ import annotations

import pytest
import torch

from core_helpers import CompiledGraphs

from polyspec.workers.tiers.batched_llama import BatchedLlama, step_unsupported

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    if request.param == "llama":
        path = tiny_family["target"]
    else:
        from tests.workers.test_forward_qwen2 import make_qwen2

        path = make_qwen2(tmp_path_factory.mktemp("qwen2") / "m", tied=False)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # [T, V]


def run(static, pool, ids, positions, slots, span, mask=None) -> torch.Tensor:
    """The step's logits, each token written at its rotary position (a chain's)."""
    return static.step(pool, ids, positions, positions, slots, span, mask)[0]


def step_pool(static, slots: int, margin: int):
    pool = static.new_cache(slots, margin=margin, scratch=True)
    pool.allocate()
    return pool


def padded(rows: list[list[int]], starts: list[int], width: int):
    """ids and positions [B, width]: row r's tokens at starts[r].., padding continuing past them."""
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    positions = torch.tensor([[start + j for j in range(width)] for start in starts])
    return ids, positions


def test_static_forward_matches_transformers(model):
    static = BatchedLlama(model)
    assert step_unsupported(model, torch.device("cpu")) is None
    pool = step_pool(static, 4, 8)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (5, 12, 1)]
    slots = torch.tensor([2, 0, 3])  # any slots, in any order
    ids, positions = padded(prompts, [0, 0, 0], 12)
    logits = run(static, pool, ids, positions, slots, span=32)
    for r, prompt in enumerate(prompts):
        assert torch.allclose(logits[r, : len(prompt)], reference(model, prompt), atol=TOLERANCE)
    # a block per request, then a rollback of request 0 (host bookkeeping only) and another block written over it
    blocks = [[7, 8, 9], [10], [11, 12, 13]]
    ids, positions = padded(blocks, [len(p) for p in prompts], 3)
    logits = run(static, pool, ids, positions, slots, span=32)
    for r, (prompt, block) in enumerate(zip(prompts, blocks)):
        assert torch.allclose(logits[r, : len(block)], reference(model, prompt + block)[-len(block):], atol=TOLERANCE)
    kept = prompts[0] + [7]  # request 0 keeps one token of its block
    ids, positions = padded([[40, 41]], [len(kept)], 2)
    logits = run(static, pool, ids, positions, slots[:1], span=32)
    assert torch.allclose(logits[0], reference(model, kept + [40, 41])[-2:], atol=TOLERANCE)
    # a padding row writes to the scratch slot only: request 1 is untouched
    ids, positions = padded([[50], [0]], [len(kept) + 2, 0], 1)
    run(static, pool, ids, positions, torch.tensor([2, pool.scratch_slot]), span=32)
    ids, positions = padded([[60]], [len(prompts[1]) + 1], 1)
    logits = run(static, pool, ids, positions, torch.tensor([0]), span=32)
    assert torch.allclose(logits[0], reference(model, prompts[1] + [10, 60])[-1:], atol=TOLERANCE)


def test_a_decode_step_compiles_whole_and_once_per_bucket(model):
    static = BatchedLlama(model)
    pool = step_pool(static, 4, 4)
    step = CompiledGraphs(static.step)
    prompt = [3, 4, 5, 6]
    ids, positions = padded([prompt], [0], 4)
    run(static, pool, ids, positions, torch.tensor([1]), span=16)
    tokens = list(prompt)
    for step_index in range(3):  # the same bucket (1 row, 1 token, span 16), new values each step
        ids = torch.tensor([[tokens[-1]]])
        positions = torch.tensor([[len(tokens) - 1]])
        eager = reference(model, tokens)[-1]
        out, _ = step(pool, ids, positions, positions, torch.tensor([1]), 16)
        assert torch.allclose(out[0, 0], eager, atol=TOLERANCE)
        tokens.append(int(out[0, 0].argmax()) if step_index else 9)
    assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
    step.close()


def test_tree_rows_match_the_ragged_tree_forward(model):
    """`ancestors`: tree rows (two trees, any node order that is parents-first) beside a chain row
    and a padding row, against `BatchedLlama`'s tree rows (`RowLayout` with `tree_allowed`); the
    chain written as its lower triangle gives the chain path's logits bit for bit."""
    from polyspec.workers.core.tree import DraftTree, tree_allowed
    from polyspec.workers.tiers.batched_llama import BatchedLlama, RowLayout

    static, batched = BatchedLlama(model), BatchedLlama(model)
    pool, cache = step_pool(static, 3, 8), batched.new_cache()
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2]]
    trees = [DraftTree([20, 21, 22, 23, 24, 25], [-1, -1, 0, 1, 2, 0], None), DraftTree([30, 31, 32, 33], [-1, 0, -1, 2], None),
             DraftTree.chain([40, 41, 42], None)]
    slots = torch.tensor([0, 1, 2, pool.scratch_slot])  # the last row is padding
    width, span = 6, 16
    ids, positions = padded(prompts + [[0]], [0, 0, 0, 0], width)
    run(static, pool, ids, positions, slots, span)
    cache_slots = [cache.slot(r) for r in range(3)]
    batched.forward(cache, cache_slots, prompts, [len(p) for p in prompts])

    layouts = []
    write_at = torch.tensor([len(p) for p in prompts] + [1])[:, None] + torch.arange(width)[None]  # [B, T]
    mask = (torch.arange(span)[None, None, :] <= write_at[:, :, None])[:, None].clone()  # [B, 1, T, span] causal
    tree_positions = write_at.clone()
    for r, (prompt, tree) in enumerate(zip(prompts, trees)):
        prefix, depths = len(prompt), tree.depths()
        cached_at = list(range(prefix, prefix + len(tree)))
        allowed = tree_allowed(tree.parents, cached_at, list(range(len(tree))), prefix, 0, prefix + len(tree))
        layouts.append(RowLayout([prefix + d for d in depths], allowed))
        mask[r, 0, : len(tree)] = False
        mask[r, 0, : len(tree), : prefix + len(tree)] = allowed
        tree_positions[r, : len(tree)] = torch.tensor([prefix + d for d in depths])
    ids = torch.tensor([tree.tokens + [0] * (width - len(tree)) for tree in trees] + [[0] * width])
    logits = static.step(pool, ids, tree_positions, write_at, slots, span, mask)[0]
    expected = batched.forward(cache, cache_slots, [tree.tokens for tree in trees], [0, 0, 0], layouts)
    for r, tree in enumerate(trees):
        assert torch.allclose(logits[r, : len(tree)], expected[r], atol=TOLERANCE), r
    chain_row = slots[2:3]
    chain_ids, chain_positions = padded([trees[2].tokens], [len(prompts[2])], 3)
    as_chain = run(static, pool, chain_ids, chain_positions, chain_row, span)
    causal = (torch.arange(span)[None, None, :] <= chain_positions[:, :, None])[:, None]
    as_tree = run(static, pool, chain_ids, chain_positions, chain_row, span, causal)
    assert torch.equal(as_chain, as_tree)
    assert torch.allclose(as_chain[0], reference(model, prompts[2] + trees[2].tokens)[-3:], atol=TOLERANCE)
