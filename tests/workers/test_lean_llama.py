"""The lean Llama forward gives the transformers forward's logits bit for bit, through every cache operation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyspec.orchestrator.config import TierConfig
from polyspec.workers.tiers.loading import load_model_tier
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.tier import ModelTier
from polyspec.workers.core.tree import DraftTree

DEMO = Path(__file__).resolve().parents[2] / "models" / "stdlib" / "target"


def pair(path: str, quantize: str | None = None) -> tuple[ModelTier, ModelTier]:
    lean = load_model_tier(TierConfig(name="lean", model=path, dtype="float32", quantize=quantize))
    plain = ModelTier("plain", lean.model, lean.vocab_size, lean.device, lean.threads, lean=False)
    return lean, plain


def logits_of(tier: ModelTier, seq, context, tree):
    """Raw logits (not a one-hot warp) of `score`: the tier's forward through a spy."""
    captured = {}
    forward = tier._forward

    def spy(*args, **kwargs):
        captured["logits"] = forward(*args, **kwargs)
        return captured["logits"]

    tier._forward = spy
    try:
        tier.score(seq, context, tree, SamplingParams())
    finally:
        del tier._forward
    return captured["logits"]


def script(tier: ModelTier) -> list[torch.Tensor]:
    """Prefill, single tokens, blocks, rollbacks, a tree with a kept path, drafting after it."""
    prompt = [(7 * i + 3) % 200 for i in range(40)]
    out = [logits_of(tier, 1, prompt, DraftTree([], [], None))]
    out.append(logits_of(tier, 1, prompt + [5], DraftTree([], [], None)))  # one new token
    out.append(logits_of(tier, 1, prompt + [5], DraftTree.chain([9, 11, 13, 17], None)))  # a block
    out.append(logits_of(tier, 1, prompt + [5, 9], DraftTree.chain([1, 2], None)))  # rollback to a shorter context
    tree = DraftTree([4, 6, 8, 10, 12], [-1, -1, 0, 1, 2], None)
    out.append(logits_of(tier, 1, prompt + [5, 9, 1], tree))
    tier.accept_path(1, [1, 3])
    out.append(logits_of(tier, 1, prompt + [5, 9, 1, 6, 10, 20], DraftTree.chain([21, 22], None)))
    tokens, _ = tier.draft(1, prompt + [5, 9, 1, 6, 10, 20, 21], 6, SamplingParams(), None)
    out.append(torch.tensor(tokens, dtype=torch.float32))
    out.append(logits_of(tier, 2, prompt[:1], DraftTree([], [], None)))  # a one-token prompt
    return out


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_lean_matches_transformers_on_a_gqa_model(tiny_family, quantize):
    lean, plain = pair(tiny_family["target"], quantize)
    assert lean._lean is not None and plain._lean is None
    assert lean._lean.groups == 2  # the tiny family uses grouped-query attention
    for got, want in zip(script(lean), script(plain), strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(not DEMO.exists(), reason="the stdlib demo family is not in this checkout")
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_lean_matches_transformers_on_the_demo_target(quantize):
    lean, plain = pair(str(DEMO), quantize)
    assert lean._lean is not None
    for got, want in zip(script(lean), script(plain), strict=True):
        assert torch.equal(got, want)


def test_unsupported_models_keep_the_transformers_forward(tiny_family):
    tier = load_model_tier(TierConfig(name="t", model=tiny_family["target"]))
    tier.model.config.attention_bias = True  # something the lean path does not implement
    from polyspec.workers.tiers.lean_llama import LeanLlama

    assert not LeanLlama.supports(tier.model, tier.device)
