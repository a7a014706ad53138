"""Chains and draft trees on models with sliding-window attention layers.

The windows here (8 positions) are far shorter than the prompts plus generations, so every
rollback crosses a window boundary: the speculative output must still equal the model's
own greedy `generate`, token for token, which uses transformers' windowed cache.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import make_tokenizer
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine

WINDOW = 8
PROMPTS = ["def add(a, b):\n    return a + b\n\nprint(add(", "for i in range(10):\n    print(i)\nfor i in"]
MAX_NEW = 25  # whole rounds of 4 drafted + 1 for the self-drafting chain


def _save(model, tokenizer, path) -> str:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory):
    """{'qwen2': mixed full + sliding layers, 'mistral': every layer sliding} -> (target, drafter) folders."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("sliding")
    tokenizer = make_tokenizer()
    common = dict(vocab_size=len(tokenizer), intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, sliding_window=WINDOW, initializer_range=0.2,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    folders = {}
    for name, config_cls, model_cls, extra in (
        ("qwen2", Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "max_window_layers": 1}),
        ("mistral", MistralConfig, MistralForCausalLM, {}),
    ):
        pair = []
        for role, hidden, layers, seed in (("target", 64, 3, 1), ("drafter", 32, 2, 2)):
            torch.manual_seed(seed)
            config = config_cls(hidden_size=hidden, num_hidden_layers=layers, **common, **extra)
            pair.append(_save(model_cls(config), tokenizer, root / f"{name}-{role}"))
        folders[name] = tuple(pair)
    return folders


def test_the_fixture_models_really_slide(windowed_models):
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(windowed_models["qwen2"][0])
    assert qwen.layer_types == ["full_attention", "sliding_attention", "sliding_attention"] and qwen.sliding_window == WINDOW
    assert AutoConfig.from_pretrained(windowed_models["mistral"][0]).sliding_window == WINDOW


@pytest.fixture(scope="module")
def references(windowed_models):
    return {name: _reference(folders[0]) for name, folders in windowed_models.items()}


def _reference(folder: str) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out[prompt] = generated[0, len(ids):].tolist()
    return out


CHAINS = {
    "target+drafter": ({"lengths": [4]}, False),
    "target+copy tree": ({"tree_width": 2, "lengths": [4]}, True),  # the target drafting for itself: deep accepted paths
    "tree:target+drafter+ngram": ({"tree_width": 3, "lengths": [3, 2]}, False),
}


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_greedy_equals_generate_across_the_window(windowed_models, references, architecture, chain):
    target, drafter = windowed_models[architecture]
    speculation, self_draft = CHAINS[chain]
    tiers = [{"name": "target", "model": target}, {"name": "draft", "model": target if self_draft else drafter}]
    if "ngram" in chain:
        tiers.append({"name": "ng", "model": "ngram"})
    engine = Engine(parse_config({"tiers": tiers, "speculation": speculation}))
    engine.scheduler.eos_token_ids = frozenset()
    reference = references[architecture]
    for prompt in PROMPTS:
        result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": MAX_NEW}))
        assert len(engine.parse_request({"prompt": prompt}).prompt_ids) > WINDOW
        assert result["token_ids"] == reference[prompt], (architecture, chain, prompt)
    if self_draft:  # the tree's accepted paths were kept by position, past the window
        stage = result["stats"]["stages"][0]
        assert stage["blocks"] > 0 and stage["accepted"] == 4 * stage["blocks"]

