"""Structured output on a distributed chain (TierWorkers in this process over gRPC on loopback, as
tests/distributed/test_batched_rounds.py): the driver sends the constraint in the sequence header
(`constraint_json`), each tier compiles it over the target's tokenizer and restricts its own rows, so no
mask crosses the wire. Greedy replies, batched beside free requests, serial and pipelined, equal the
target's own constrained decode (tests/grammar_reference.py)."""

from __future__ import annotations

import dataclasses

import pytest

from grammar_reference import constrained_greedy, matcher_for
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.grammar import GrammarBook, constraint_from_fields
from polyspec.workers.core.sampling import SamplingParams
from test_batched_rounds import EOS, PROMPTS, batched_chain, run_batch, stop

REGEX = {"regex": "[a-z]{2,6}(, [a-z]{2,6}){1,3}"}
MAX_NEW = 24


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("names,lengths", [(["target", "mid"], [4]), (["target", "int8", "ngram"], [4, 2])],
                         ids=["target+mid", "target+int8+ngram"])
def test_distributed_greedy_equals_the_targets_constrained_decode(tiny_family, names, lengths, pipeline, monkeypatch):
    from polyspec.orchestrator.distributed import worker as worker_module

    made = []  # (the tier's vocabulary) for each request's matcher a tier made from its header
    original = worker_module.from_wire
    monkeypatch.setattr(worker_module, "from_wire",
                        lambda text, vocab, stops, load: made.append(vocab) or original(text, vocab, stops, load))
    chain, workers, tokenizer = batched_chain(tiny_family, names, lengths, pipeline)
    try:
        vocab = workers[0].tier.vocab_size
        book = GrammarBook(tokenizer, vocab, EOS, tokenizer_source=tiny_family["target"])
        spec = book.compile(constraint_from_fields(REGEX))
        prompts = [encode_prompt(tokenizer, prompt) for prompt in PROMPTS]
        greedy = SamplingParams(temperature=0.0)
        jobs = [(ids, MAX_NEW, dataclasses.replace(greedy, grammar=book.start(spec, len(ids))), None) for ids in prompts]
        jobs += [(prompts[0], MAX_NEW, greedy, None)]  # a free request beside them
        outputs, _ = run_batch(chain, jobs, max_running=4)
        model = workers[0].tier.model
        for ids, out in zip(prompts, outputs):
            expected = constrained_greedy(model, vocab, ids, MAX_NEW, set(EOS), matcher_for(tokenizer, vocab, list(EOS), REGEX))
            assert out.token_ids == expected
        free = constrained_greedy(model, vocab, prompts[0], MAX_NEW, set(EOS), _Free())
        assert outputs[-1].token_ids == free
        assert len(made) >= len(prompts) * len(names), "every tier made each constrained request's matcher"
    finally:
        stop(chain, workers)


class _Free:
    """A matcher that allows everything (the free request's reference)."""

    def fill_next_token_bitmask(self, bitmask) -> None:
        bitmask.fill_(-1)

    def accept_token(self, token: int) -> bool:
        return True
