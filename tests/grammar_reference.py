"""The reference for structured output's losslessness, independent of polyspec's grammar code: the target model
through transformers, one token per forward, its logits masked by xgrammar's own matcher and bitmask kernel
(`xgrammar.apply_token_bitmask_inplace`), then the argmax (greedy) or the exact restricted, renormalised joint of
the first two tokens (sampling)."""

from __future__ import annotations

import json

import torch
import xgrammar

from polyspec.workers.core.sampling import SamplingParams, warp_logits


def matcher_for(tokenizer, vocab_size: int, stop_token_ids: list[int], raw: dict):
    """xgrammar's matcher for `raw`'s constraint (json_schema / regex / grammar), built here, not by polyspec."""
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    if "json_schema" in raw:
        compiled = compiler.compile_json_schema(json.dumps(raw["json_schema"]), any_whitespace=False)
    elif "regex" in raw:
        compiled = compiler.compile_regex(raw["regex"])
    else:
        compiled = compiler.compile_grammar(raw["grammar"])
    return xgrammar.GrammarMatcher(compiled)


def masked(logits: torch.Tensor, matcher) -> torch.Tensor:
    """[V] logits with what `matcher` disallows at -inf (xgrammar's own kernel)."""
    bitmask = xgrammar.allocate_token_bitmask(1, logits.shape[-1])
    matcher.fill_next_token_bitmask(bitmask)
    row = logits.float().clone()[None]
    xgrammar.apply_token_bitmask_inplace(row, bitmask)
    return row[0]


def constrained_greedy(model, vocab: int, prompt_ids: list[int], count: int, eos: set[int], matcher) -> list[int]:
    """The target's own constrained greedy decode: one token per forward (the whole context each time)."""
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < count:
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1, :vocab]
            token = int(masked(logits, matcher).argmax())
            out.append(token)
            if token in eos:
                break
            assert matcher.accept_token(token)
    return out


def restricted_two_token_probs(model, vocab: int, prompt_ids: list[int], params: SamplingParams, matcher) -> torch.Tensor:
    """[V, V] joint of the first two tokens under the target's warped distribution restricted by the grammar."""
    with torch.inference_mode():
        first = warp_logits(masked(model(torch.tensor([prompt_ids])).logits[0, -1, :vocab], matcher), params)  # [V]
        joint = torch.zeros(vocab, vocab)
        for x in first.nonzero().flatten().tolist():
            assert matcher.accept_token(x)
            second = warp_logits(masked(model(torch.tensor([prompt_ids + [x]])).logits[0, -1, :vocab], matcher), params)
            matcher.rollback(1)
            joint[x] = first[x] * second
    return joint
