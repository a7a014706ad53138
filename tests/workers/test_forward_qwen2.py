"""The one forward gives a Qwen2 model's transformers logits (q / k / v biases, tied and untied LM heads,
float32 / bfloat16 / int8), through every cache operation (tests/workers/test_forward.py's script)."""

from __future__ import annotations

import pytest
import torch

from polyspec.orchestrator.config import TierConfig
from polyspec.workers.tiers.batched_llama import BatchedLlama
from polyspec.workers.tiers.loading import load_model_tier

from tests.workers.test_forward import compare


def make_qwen2(path, tied: bool, sliding: bool = False) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=tied,
        use_sliding_window=sliding,
        sliding_window=16 if sliding else None,
        max_window_layers=0,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases: the default init zeroes them, which would hide a dropped bias
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    return {tied: make_qwen2(root / f"tied-{tied}", tied) for tied in (True, False)}


def test_the_random_biases_reach_the_logits(qwen2_dirs):
    """Zeroing the q / k / v biases changes the logits: the bit-equality below covers them."""
    tier = load_model_tier(TierConfig(name="t", model=qwen2_dirs[True]))
    prompt = list(range(3, 30))
    with_bias = tier.model(torch.tensor([prompt])).logits
    with torch.no_grad():
        for layer in tier.model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert not torch.allclose(with_bias, tier.model(torch.tensor([prompt])).logits, atol=1e-3)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype,quantize,atol", [("float32", None, 1e-5), ("bfloat16", None, 2e-2), ("float32", "int8", 5e-2)])
def test_the_forward_matches_transformers_on_qwen2(qwen2_dirs, tied, dtype, quantize, atol):
    if tied and quantize is None:
        tier = load_model_tier(TierConfig(name="t", model=qwen2_dirs[tied], dtype=dtype))
        assert type(tier.model).__name__ == "Qwen2ForCausalLM"
        assert tier.model.lm_head.weight is tier.model.model.embed_tokens.weight
    compare(qwen2_dirs[tied], dtype, quantize, atol)


def test_qwen2_sliding_window_layers_run_on_the_one_forward(tmp_path):
    """(Greedy equality across the window, chains and trees: tests/workers/test_sliding_window.py.)"""
    tier = load_model_tier(TierConfig(name="t", model=make_qwen2(tmp_path / "sliding", tied=True, sliding=True)))
    assert BatchedLlama(tier.model).windows == [16, 16]


def test_an_untied_copy_of_the_embedding_is_tied_again(tmp_path):
    """A converted GGUF stores the LM head as a separate copy of the embedding: loading ties it back."""
    from transformers import AutoModelForCausalLM

    path = make_qwen2(tmp_path / "untied-copy", tied=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(path)
    reference = model(torch.tensor([list(range(3, 30))])).logits
    tier = load_model_tier(TierConfig(name="t", model=path))
    assert tier.model.lm_head.weight is tier.model.model.embed_tokens.weight
    assert torch.equal(tier.model(torch.tensor([list(range(3, 30))])).logits, reference)
    untouched = load_model_tier(TierConfig(name="u", model=make_qwen2(tmp_path / "untied", tied=False)))
    assert untouched.model.lm_head.weight is not untouched.model.model.embed_tokens.weight
