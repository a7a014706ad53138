"""`quantize: int4` is the GPU middle tier (bitsandbytes 4-bit). Where it cannot run the
error is one line that says what to do, raised before any weights are read."""

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


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_int4_on_cpu_is_one_clear_line(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError) as caught:
        loading.load_model_tier(tier(quantize="int4", device=device))
    message = str(caught.value)
    assert "int4" in message and "CUDA GPU only" in message and "use quantize: int8" in message
    assert "\n" not in message


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
