"""Loading tiers with from_pretrained: models saved without a tokenizer, vocabulary checks, int8."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import ModelLoadError, RequestError


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


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(parse_config({"tiers": [{"name": "t", "model": str(tmp_path / "nothing")}]}))
