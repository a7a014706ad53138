"""A real pretrained model, SmolLM2-135M-Instruct, with its int8 copy and an n-gram tier.

Greedy: every chain's output equals the model's own `generate` on the tokenizer's defaults
(chat template for a chat, BOS where the tokenizer adds one), token for token.
Sampling: the first two tokens through the chain are distributed as the target's (chi-square
against the exact probabilities, top-k warp so the reference is k forwards, not 49k).
"""

from __future__ import annotations

import collections

import pytest
import torch

from lossless_stats import ALPHA, chi_square_p_value_sparse, exact_two_token_probs_top_k
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import encode_chat, encode_prompt, stop_token_ids
from polyspec.workers.core.sampling import SamplingParams
from core_helpers import generate_alone

MAX_NEW = 32
CHAT = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "The capital of France is"]

CHAINS = {
    "target+int8+ngram": (["target", "int8", "ngram"], {"lengths": [4, 4]}),
    "target+ngram": (["target", "ngram"], {"lengths": [4]}),
    "tree:target+int8": (["target", "int8"], {"lengths": [3], "tree_width": 2}),
}


def tiers(folder: str, names) -> list[dict]:
    specs = {"target": {"name": "target", "model": folder}, "int8": {"name": "int8", "model": folder, "quantize": "int8"},
             "ngram": {"name": "ng", "model": "ngram"}}
    return [specs[name] for name in names]


@pytest.fixture(scope="module")
def model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """(prompt ids, the model's own greedy continuation) per prompt; the chat stops at its end of turn."""
    out = {}
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    configured = model.generation_config.eos_token_id  # one id, or (a zoo folder's upstream config) several
    configured = [configured] if isinstance(configured, int) else list(configured)
    cases = [("chat", list(chat_ids), list(stop_token_ids(tokenizer, configured)))]
    cases += [(prompt, tokenizer(prompt)["input_ids"], None) for prompt in PROMPTS]
    for key, ids, eos in cases:
        generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                                   pad_token_id=tokenizer.eos_token_id)
        out[key] = (ids, generated[0, len(ids):].tolist())
    return out


def test_tokenization_is_the_models_own(tokenizer, reference):
    assert encode_chat(tokenizer, CHAT) == reference["chat"][0]
    assert encode_prompt(tokenizer, PROMPTS[0]) == tokenizer(PROMPTS[0])["input_ids"]
    # the template closes a turn with <|im_end|>, which stops generation
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tokenizer)


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_greedy_equals_the_models_generate(smollm2, reference, chain):
    names, speculation = CHAINS[chain]
    engine = Engine(parse_config({"tiers": tiers(smollm2, names), "speculation": speculation}))
    chat = engine.generate(engine.parse_request({"messages": CHAT, "max_new_tokens": MAX_NEW}))
    assert chat["token_ids"] == reference["chat"][1], chain
    engine.scheduler.eos_token_ids = frozenset()  # the plain prompts: full-length continuations
    for prompt in PROMPTS:
        result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": MAX_NEW}))
        assert result["token_ids"] == reference[prompt][1], (chain, prompt)
    assert all(s["accepted"] <= s["proposed"] for s in result["stats"]["stages"])


# 300 draws of the first two tokens at T = 1, top-k 4 (at most 16 pairs): a correct chain
# fails with probability ALPHA = 1e-3; the instrument test below shows this sample size
# tells T = 1.6 from T = 1 apart on this prompt.
SAMPLES = 300
PARAMS = SamplingParams(temperature=1.0, top_k=4)
SAMPLING_PROMPT = "My favourite colour is"


@pytest.mark.extended
@pytest.mark.slow
def test_sampling_through_the_chain_is_the_targets_distribution(smollm2, model, tokenizer):
    engine = Engine(parse_config({"tiers": tiers(smollm2, ["target", "int8", "ngram"]), "speculation": {"lengths": [2, 2]}}))
    engine.scheduler.eos_token_ids = frozenset()
    prompt_ids = encode_prompt(tokenizer, SAMPLING_PROMPT)
    joint = exact_two_token_probs_top_k(model, engine.vocab_size, prompt_ids, PARAMS)
    counts: collections.Counter = collections.Counter()
    proposed = accepted = 0
    for seed in range(SAMPLES):
        out = generate_alone(engine.scheduler, prompt_ids, 2, PARAMS, seed=seed)
        counts[tuple(out.token_ids[:2])] += 1
        proposed += out.stats["stages"][0]["proposed"]
        accepted += out.stats["stages"][0]["accepted"]
    p_value = chi_square_p_value_sparse(counts, joint, SAMPLES)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} over {SAMPLES} samples; counts {counts.most_common(6)}"
    assert 0 < accepted < proposed  # drafts were both accepted and rejected: the residual path was sampled too


def test_the_chi_square_rejects_a_wrong_sampler(model, tokenizer):
    """The instrument on this model: draws from T = 1.3 are told apart from T = 1 at this sample size."""
    prompt_ids = encode_prompt(tokenizer, SAMPLING_PROMPT)
    vocab = model.config.vocab_size
    joint = exact_two_token_probs_top_k(model, vocab, prompt_ids, PARAMS)
    wrong = exact_two_token_probs_top_k(model, vocab, prompt_ids, SamplingParams(temperature=1.6, top_k=4))
    pairs = list(wrong)
    draws = torch.multinomial(torch.tensor([wrong[p] for p in pairs]), SAMPLES, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = collections.Counter(pairs[int(d)] for d in draws)
    assert chi_square_p_value_sparse(counts, joint, SAMPLES) < ALPHA


@pytest.mark.real_models  # dequantizing at every load and building the tokenizer from GGUF metadata take minutes
def test_a_tier_can_name_the_gguf_file_itself(smollm2, reference, tmp_path, capsys):
    """`model: file.gguf` dequantizes at load to the same weights the zoo folder holds."""
    import yaml

    from polyspec.harness.zoo_fetch import MODELS
    from polyspec.orchestrator.cli import main
    from polyspec.workers.tiers.model_cache import model_cache_dir

    gguf = model_cache_dir() / "gguf" / MODELS["smollm2"].gguf_file
    engine = Engine(parse_config({"tiers": [{"name": "target", "model": str(gguf)}, {"name": "ng", "model": "ngram"}]}))
    engine.scheduler.eos_token_ids = frozenset()
    result = engine.generate(engine.parse_request({"prompt": PROMPTS[1], "max_new_tokens": MAX_NEW}))
    assert result["token_ids"] == reference[PROMPTS[1]][1]
    config = tmp_path / "gguf.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"name": "target", "model": str(gguf)}, {"name": "int8", "model": str(gguf), "quantize": "int8"}]}))
    assert main(["validate", "-c", str(config)]) == 0
    assert "134.5M params, GGUF header" in capsys.readouterr().out
