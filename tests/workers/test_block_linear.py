"""The oneDNN move of large projections (workers/tiers/block_linear.py): same numbers up to rounding."""

import pytest
import torch
import torch.nn.functional as F

from polyspec.workers.tiers import block_linear


@pytest.fixture
def large_linear():
    torch.manual_seed(0)
    module = torch.nn.Linear(2048, block_linear.MIN_ELEMENTS // 2048, bias=True)  # exactly the size threshold
    return module, module.weight.detach().clone(), module.bias.detach().clone()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_a_forced_move_keeps_the_products_up_to_rounding(large_linear, monkeypatch):
    module, weight, bias = large_linear
    monkeypatch.setenv("POLYSPEC_BLOCK_LINEAR", "onednn")
    block_linear.pack(module)
    assert getattr(module, block_linear.PACKED) is not None and module.weight.numel() == 0  # the dense copy is released
    linear = block_linear.linear_of(module)
    for rows in (1, 6, 40):  # one token, a block, a prefill
        x = torch.randn(1, rows, 2048)
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_blas_mode_and_small_weights_keep_f_linear(large_linear, monkeypatch):
    module, weight, bias = large_linear
    monkeypatch.setenv("POLYSPEC_BLOCK_LINEAR", "blas")
    block_linear.pack(module)
    assert getattr(module, block_linear.PACKED, None) is None and module.weight.shape == weight.shape
    small = torch.nn.Linear(64, 64)
    monkeypatch.setenv("POLYSPEC_BLOCK_LINEAR", "onednn")
    block_linear.pack(small)  # below MIN_ELEMENTS: never moved, whatever the mode
    assert getattr(small, block_linear.PACKED, None) is None
    x = torch.randn(3, 64)
    assert torch.equal(block_linear.linear_of(small)(x), F.linear(x, small.weight, small.bias))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_a_tied_head_keeps_its_dense_weight(large_linear, monkeypatch):
    module, weight, _ = large_linear
    monkeypatch.setenv("POLYSPEC_BLOCK_LINEAR", "onednn")
    block_linear.pack(module, keep_dense=True)
    assert torch.equal(module.weight, weight)
