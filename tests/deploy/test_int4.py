"""`quantize: int4` is bitsandbytes 4-bit on a CUDA GPU and torch's weight-only int4 on the CPU. Where it
cannot run the error is one line that says what to do, raised before any weights are read."""

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
    """On the CPU `quantize: int4` is torch's weight-only int4 (tests/workers/test_weight_only.py), not bitsandbytes."""
    from polyspec.workers.tiers.weight_only import WeightOnlyLinear

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = loading.load_model(tier(quantize="int4", device="auto", group_size=32))
    assert any(isinstance(module, WeightOnlyLinear) for module in model.modules())


def test_a_group_size_on_a_gpu_int4_tier_is_one_line():
    with pytest.raises(ModelLoadError, match="group_size applies to the CPU int4 kernels"):
        loading.load_model(tier(quantize="int4", device="cuda", group_size=64))


def test_int4_without_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    with pytest.raises(ModelLoadError, match="pip install bitsandbytes"):
        loading.int4_quantization_config(tier(quantize="int4", dtype="float16"), torch.device("cuda"))


def test_int4_config_computes_in_the_tier_dtype(monkeypatch):
    pytest.importorskip("bitsandbytes")
    config = loading.int4_quantization_config(tier(quantize="int4", dtype="bfloat16"), torch.device("cuda"))
    assert config.load_in_4bit and config.bnb_4bit_compute_dtype == torch.bfloat16


def test_the_int8_path_still_loads_on_cpu():
    model_tier = loading.load_model_tier(tier(quantize="int8", device="cpu", threads=1))
    assert model_tier.device.type == "cpu"
    assert any("quantized" in type(m).__module__ for m in model_tier.model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_loads_on_a_gpu():
    pytest.importorskip("bitsandbytes")
    model_tier = loading.load_model_tier(tier(quantize="int4", dtype="float16"))
    assert any("Linear4bit" in type(m).__name__ for m in model_tier.model.modules())
