"""`quantize: int4` is torch's weight-only int4 (group-wise) on the CPU and on a CUDA GPU: the one forward calls its
kernels (tests/workers/test_weight_only.py checks them against a dequantized reference)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyspec.orchestrator.config import parse_config
from polyspec.workers.tiers import loading
from polyspec.workers.core.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[2]
TARGET = str(REPO / "models/stdlib/target")


def tier(**extra):
    return parse_config({"tiers": [{"name": "mid", "model": TARGET, **extra}]}).tiers[0]


def test_int4_on_cpu_takes_the_weight_only_kernels(monkeypatch):
    """On the CPU `quantize: int4` is torch's weight-only int4 (tests/workers/test_weight_only.py)."""
    from polyspec.workers.tiers.weight_only import WeightOnlyLinear

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = loading.load_model(tier(quantize="int4", device="auto", group_size=32))
    assert any(isinstance(module, WeightOnlyLinear) for module in model.modules())


def test_the_int8_path_still_loads_on_cpu():
    model_tier = loading.load_model_tier(tier(quantize="int8", device="cpu", threads=1))
    assert model_tier.device.type == "cpu"
    assert any("quantized" in type(m).__module__ for m in model_tier.model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_loads_on_a_gpu_with_the_weight_only_kernels():
    from polyspec.workers.tiers.weight_only import WeightOnlyLinear

    model_tier = loading.load_model_tier(tier(quantize="int4", dtype="bfloat16", group_size=64))
    assert model_tier.device.type == "cuda"
    assert any(isinstance(m, WeightOnlyLinear) for m in model_tier.model.modules())
