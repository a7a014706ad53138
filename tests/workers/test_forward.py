"""The one forward (polyspec.workers.tiers.batched_llama) against transformers' own forward, through every cache
operation a tier makes: prefill, single tokens, blocks, rollbacks, a draft tree, its kept path, drafting after it.

The reference (tests/reference_tier.py) runs transformers' forward on its DynamicCache with the same feeds. The
one forward stacks a grouped-query head's queries instead of copying its keys and values, so a kernel may sum
in another order: probabilities are compared within 1e-5 (float32; 2e-2 for bfloat16; 5e-2 for int8, whose dynamic
activation scale follows the rows a forward holds, and the reference recomputes a kept tree path from scratch),
drafted greedy tokens exactly (float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyspec.orchestrator.config import TierConfig
from polyspec.workers.core.errors import ModelLoadError
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree
from polyspec.workers.tiers.batched import BatchedModelTier
from polyspec.workers.tiers.batched_llama import rms_norm, rotary
from polyspec.workers.tiers.loading import load_model_tier
from reference_tier import ReferenceTier

DEMO = Path(__file__).resolve().parents[2] / "models" / "stdlib" / "target"
SAMPLED = SamplingParams(temperature=1.0)
TOKEN_STEPS = (6, 7)  # the script's drafted chain and tree (tokens, not rows)


def script(tier) -> list[torch.Tensor]:
    """The rows each step scores (temperature 1) and the tokens it drafts, for any tier with the runtime calls."""
    prompt = [(7 * i + 3) % 200 for i in range(40)]

    def score(seq, context, block):
        return tier.score_batch([seq], [context], Blocks.of([block]), [SAMPLED])[0]

    out = [score(1, prompt, DraftTree([], [], None))]
    out.append(score(1, prompt + [5], DraftTree([], [], None)))  # one new token
    out.append(score(1, prompt + [5], DraftTree.chain([9, 11, 13, 17], None)))  # a block
    out.append(score(1, prompt + [5, 9], DraftTree.chain([1, 2], None)))  # rollback to a shorter context
    out.append(score(1, prompt + [5, 9, 1], DraftTree([4, 6, 8, 10, 12], [-1, -1, 0, 1, 2], None)))  # a tree
    tier.accept_path(1, [1, 3])
    out.append(score(1, prompt + [5, 9, 1, 6, 10, 20], DraftTree.chain([21, 22], None)))
    (chain,) = tier.draft_batch([1], [prompt + [5, 9, 1, 6, 10, 20, 21]], [6], [SamplingParams()], [None])
    out.append(torch.tensor(chain.tokens, dtype=torch.float32))
    tree, = tier.draft_tree_batch([3], [prompt[:20]], 2, [3], [SamplingParams()], "specinfer", [None])
    out.append(torch.tensor(tree.tokens + tree.parents, dtype=torch.float32))
    out.append(score(2, prompt[:1], DraftTree([], [], None)))  # a one-token prompt
    return out


def compare(path: str, dtype: str = "float32", quantize: str | None = None, atol: float = 1e-5) -> None:
    loaded = load_model_tier(TierConfig(name="t", model=path, dtype=dtype, quantize=quantize))
    runtime = script(BatchedModelTier(loaded, max_slots=4))
    reference = script(ReferenceTier(loaded.model, loaded.vocab_size))
    exact = dtype == "float32" and quantize is None
    for step, (got, want) in enumerate(zip(runtime, reference, strict=True)):
        if step in TOKEN_STEPS and not exact:
            continue  # a greedy draft follows any rounding at a near-tie: only float32's tokens are compared
        assert got.shape == want.shape, step
        assert torch.allclose(got, want, atol=atol), (step, (got - want).abs().max())


def slow_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def slow_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor, rotate_half and all."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_norm_and_the_rotation_are_transformers_bit_for_bit(dtype):
    # 3 widths x 3 row counts x 3 scales per dtype; the fused forms may not round differently anywhere
    generator = torch.Generator().manual_seed(0)
    for width in (64, 320, 896):
        for rows in (1, 5, 13):
            for scale in (1e-3, 1.0, 50.0):
                x = (torch.randn(rows, 3, width, generator=generator) * scale).to(dtype)
                weight = torch.randn(width, generator=generator).to(dtype)
                assert torch.equal(rms_norm(x, weight, 1e-6), slow_rms_norm(x, weight, 1e-6)), (width, rows, scale)
                angles = torch.randn(rows, 1, width, generator=generator)
                cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
                folded = torch.cat((-sin[..., : width // 2], sin[..., width // 2:]), dim=-1)
                assert torch.equal(rotary(x, cos, folded), slow_rotary(x, cos, sin)), (width, rows, scale)


@pytest.mark.parametrize("dtype,quantize,atol", [("float32", None, 1e-5), ("bfloat16", None, 2e-2), ("float32", "int8", 5e-2)])
def test_the_forward_matches_transformers_on_a_gqa_model(tiny_family, dtype, quantize, atol):
    compare(tiny_family["target"], dtype, quantize, atol)


@pytest.mark.skipif(not DEMO.exists(), reason="the stdlib demo family is not in this checkout")
def test_the_forward_matches_transformers_on_the_demo_target():
    compare(str(DEMO))


def test_models_the_forward_does_not_cover_are_refused_in_one_line(tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    model.config.hidden_act = "gelu"  # something the forward does not implement
    model.save_pretrained(tmp_path / "gelu")
    with pytest.raises(ModelLoadError, match="gelu activation is not supported"):
        load_model_tier(TierConfig(name="t", model=str(tmp_path / "gelu")))
