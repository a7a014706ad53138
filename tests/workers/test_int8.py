"""int8 Linears (workers/int8.py): close to the float layer, and a row's output independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch

from orchestrator.config import TierConfig
from workers.int8 import Int8Linear, quantize_linears
from workers.loading import load_model_tier
from workers.sampling import SamplingParams
from workers.tree import DraftTree


def test_weights_are_int8_with_a_scale_per_output_channel():
    linear = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[0.5, -1.0, 0.25], [100.0, 0.0, -50.0]]))
    layer = Int8Linear.from_float(linear)
    assert layer.weight.dtype == torch.int8
    assert layer.weight.tolist() == [[64, -127, 32], [127, 0, -64]]  # round(0.5 * 127), round(-50 / 100 * 127)
    assert torch.allclose(layer.weight_scale, torch.tensor([1.0 / 127, 100.0 / 127]))
    zero = layer(torch.zeros(2, 3))  # an all-zero row: no division by zero
    assert torch.equal(zero, torch.zeros(2, 2))


def test_int8_linear_is_close_to_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    x = torch.randn(5, 3, 96)
    got, want = Int8Linear.from_float(linear)(x), linear(x).detach()
    assert got.shape == want.shape == (5, 3, 40)
    # int8 weights per output channel x 7-bit activations per row: ~1.5 % relative error on random data
    relative = (got - want).norm() / want.norm()
    assert relative < 0.03, relative


def test_a_rows_output_does_not_depend_on_the_other_rows():
    """What torch's dynamic quantization (one activation scale per tensor) did not give: the
    drafter's logits for a token changed with the size of the block it was verified in."""
    torch.manual_seed(1)
    layer = Int8Linear.from_float(torch.nn.Linear(64, 32))
    row = torch.randn(1, 64)
    alone = layer(row)
    for others in (1, 4, 9):
        for scale in (0.01, 1.0, 100.0):  # rows far smaller and far larger than this one
            batch = torch.cat([torch.randn(others, 64) * scale, row, torch.randn(2, 64) * scale])
            assert torch.equal(layer(batch)[others], alone[0])


def test_concat_is_bit_for_bit_the_separate_layers():
    torch.manual_seed(2)
    layers = [Int8Linear.from_float(torch.nn.Linear(48, n, bias=bias)) for n, bias in ((16, False), (24, True), (8, False))]
    fused = Int8Linear.concat(layers)
    x = torch.randn(7, 48)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_quantize_linears_replaces_every_linear_and_keeps_the_embedding_float(tiny_family):
    tier = load_model_tier(TierConfig(name="t", model=tiny_family["target"], dtype="float32"))
    model = quantize_linears(tier.model)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 1 + 7 * len(model.model.layers)


@pytest.mark.parametrize("lean", [True, False])
def test_an_int8_tiers_logits_do_not_depend_on_the_block_size(tiny_family, lean):
    """The int8 tier scores the same context with blocks of 2..7 tokens (the demo chain's
    verification forwards at lengths 1..6): the rows the blocks share are the same logits. The
    float parts (attention) of a forward can differ in the last bits between block sizes, and
    an int8 rounding can turn that into a visible change, so the test compares sizes whose
    float forwards agree bit for bit on this model, and asserts that they do."""
    tier = load_model_tier(TierConfig(name="q", model=tiny_family["target"], quantize="int8"))
    if not lean:
        tier._lean = None
    prompt = [(5 * i + 2) % 90 for i in range(30)]
    block = [11, 3, 27, 8, 15, 40, 2]
    tier.score(1, prompt, DraftTree([], [], None), SamplingParams())
    captured = []
    forward = tier._forward

    def spy(*args, **kwargs):
        captured.append(forward(*args, **kwargs))
        return captured[-1]

    tier._forward = spy
    try:
        for n in range(2, len(block) + 1):
            tier.score(1, prompt + [4], DraftTree.chain(block[:n], None), SamplingParams())
    finally:
        del tier._forward
    first = captured[0]
    for logits in captured[1:]:
        assert torch.equal(logits[: first.shape[0]], first)
