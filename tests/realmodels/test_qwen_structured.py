"""Structured output on the real Qwen2.5-Coder chain (1.5B <- 0.5B <- n-gram, 151,936-token vocabulary): a greedy
JSON-schema reply (nested object, array, enum) equals the 1.5B's own constrained decode (tests/grammar_reference.py:
transformers and xgrammar's own matcher and kernel) and validates. Opt-in (`-m real_models`), as test_qwen_pair.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from grammar_reference import constrained_greedy, matcher_for
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine

pytestmark = pytest.mark.real_models

MAX_NEW = 64
CHAT = [{"role": "user", "content": "Describe a Python module that parses CSV files, as JSON."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "language": {"enum": ["python", "c", "rust"]},
    "functions": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                                               "args": {"type": "integer", "minimum": 0, "maximum": 9}},
                                             "required": ["name", "args"]}, "maxItems": 3}},
    "required": ["name", "language", "functions"]}


def test_json_schema_reply_equals_the_targets_constrained_decode(qwen_pair):
    from transformers import AutoModelForCausalLM

    target, small = qwen_pair
    engine = Engine(parse_config({"tiers": [{"name": "target", "model": target}, {"name": "small", "model": small},
                                            {"name": "ng", "model": "ngram"}], "speculation": {"lengths": [4, 4]}}))
    request = engine.parse_request({"messages": CHAT, "max_new_tokens": MAX_NEW, "temperature": 0, "json_schema": SCHEMA})
    result = engine.generate(request)
    eos = sorted(engine.scheduler.eos_token_ids)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    expected = constrained_greedy(model, engine.vocab_size, list(request.prompt_ids), MAX_NEW, set(eos),
                                  matcher_for(engine.tokenizer, engine.vocab_size, eos, {"json_schema": SCHEMA}))
    assert result["token_ids"] == expected
    if result["finish_reason"] == "eos":
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
