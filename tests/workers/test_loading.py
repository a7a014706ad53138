"""Loading tiers with from_pretrained: models saved without a tokenizer, vocabulary checks, int8."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from polyspec.orchestrator.config import TierConfig, parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import ModelLoadError, RequestError
from polyspec.workers.tiers.batched_llama import BatchedLlama
from polyspec.workers.tiers.loading import load_model_tier, quantize_int8


def bare_model(path, vocab_size: int, seed: int, hidden: int = 32):
    """A random Llama saved WITHOUT tokenizer files (as a quick `save_pretrained` leaves it)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


def test_models_without_tokenizer_take_prompt_ids(tmp_path):
    target = bare_model(tmp_path / "t", 300, seed=1)
    draft = bare_model(tmp_path / "d", 300, seed=2, hidden=16)
    engine = Engine(parse_config({"tiers": [{"name": "t", "model": target}, {"name": "d", "model": draft}]}))
    baseline = Engine(engine.config, speculative=False)
    request = {"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 20}
    result = engine.generate(engine.parse_request(request))
    assert result["token_ids"] == baseline.generate(baseline.parse_request(request))["token_ids"]
    assert result["text"] == ""
    with pytest.raises(RequestError, match="no tokenizer; send 'prompt_ids'"):
        engine.parse_request({"prompt": "hello"})


def test_vocabulary_size_mismatch_without_tokenizers_names_both_tiers(tmp_path):
    target = bare_model(tmp_path / "t", 300, seed=1)
    draft = bare_model(tmp_path / "d", 320, seed=2)
    with pytest.raises(ModelLoadError, match=r"tiers 't' and 'd' do not share a vocabulary \(300 vs 320 tokens\)"):
        Engine(parse_config({"tiers": [{"name": "t", "model": target}, {"name": "d", "model": draft}]}))


def test_int8_tier_is_a_quantized_copy(tiny_family):
    engine = Engine(parse_config({"tiers": [{"name": "t", "model": tiny_family["target"]},
                                            {"name": "q", "model": tiny_family["target"], "quantize": "int8"}]}))
    quantized = engine.tiers[1].model
    linears = [m for m in quantized.modules() if type(m).__name__ == "Linear"]
    assert linears and all("quantized.dynamic" in type(m).__module__ for m in linears)


def test_int8_tier_equals_torch_quantize_dynamic_of_the_whole_model(tiny_family):
    """The reference: torch's `quantize_dynamic` of the whole model at once, from the bfloat16 weights the tier loads.
    quantize_int8 quantizes a module at a time and frees as it goes; the logits must not change by a bit."""
    from torch.ao.quantization import quantize_dynamic

    tier = load_model_tier(TierConfig(name="q", model=tiny_family["target"], quantize="int8", device="cpu", threads=1))
    reference = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.bfloat16).float().eval()
    reference = quantize_dynamic(reference, {torch.nn.Linear}, dtype=torch.qint8)
    prompt = torch.tensor([[10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]])  # [1, T]
    with torch.inference_mode():
        assert torch.equal(tier.model(prompt).logits, reference(prompt).logits)
        one = BatchedLlama(tier.model)  # the one forward, over the same int8 modules
        cache = one.new_cache(1)
        logits = one.forward(cache, [cache.slot("s")], [prompt[0].tolist()], [0])[0]  # [T, V]
        assert torch.equal(logits, reference(prompt).logits[0])


def test_int8_quantization_frees_each_float_linear_at_once(tiny_family):
    """`quantize_dynamic` leaves every float Linear it replaces in a reference cycle (the observer constructors
    of the qconfig it sets close over the module), so their float32 weights lived on until the cyclic garbage
    collector ran: 5.0 of the 7.7 GB resident after loading Qwen2.5-Coder-1.5B's int8 copy. They must be freed
    as each module is quantized, without a collection (disabled here, as it may not run for a long time)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.bfloat16).eval()
    float_linears = [weakref.ref(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gc.collect()
    gc.disable()
    try:
        quantize_int8(model)
        still_alive = sum(ref() is not None for ref in float_linears)
    finally:
        gc.enable()
    assert float_linears and still_alive == 0, f"{still_alive} of {len(float_linears)} float Linears outlived quantize_int8"


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(parse_config({"tiers": [{"name": "t", "model": str(tmp_path / "nothing")}]}))
