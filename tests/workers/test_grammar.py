"""polyspec.workers.core.grammar's pure parts: request fields checked before compiling, the bitmask unpacked as
xgrammar's own kernel reads it, tree prefixes, the lookup cut, an unsatisfiable grammar, the compile bound.
The chains' losslessness under a grammar: tests/orchestrator/test_structured_output.py."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from polyspec.workers.core import grammar
from polyspec.workers.core.errors import RequestError
from polyspec.workers.core.grammar import GrammarBook, constraint_from_fields, cut_at_disallowed, tree_prefixes, unpack_bitmask
from tiny_models import make_tokenizer


def test_unpack_bitmask_matches_xgrammar():
    generator = torch.Generator().manual_seed(0)
    vocab = 100
    bitmask = torch.randint(-(1 << 31), 1 << 31, (1, 4), dtype=torch.int64, generator=generator).to(torch.int32)
    logits = torch.zeros(1, vocab)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(unpack_bitmask(bitmask[0], vocab), logits[0] == 0)


def test_request_fields_are_checked_before_compiling():
    deep: object = 1
    for _ in range(70):  # past MAX_SCHEMA_DEPTH (64)
        deep = [deep]
    assert constraint_from_fields({"prompt": "x"}) is None
    assert constraint_from_fields({"json_schema": '{"type": "object"}'}).source == '{"type": "object"}'
    for raw, message in [({"json_schema": {}, "regex": "a"}, "not several"), ({"json_schema": "{"}, "not valid JSON"),
                         ({"json_schema": [1]}, "must be a JSON object"), ({"regex": 3}, "must be a string"),
                         ({"grammar": ""}, "is empty"), ({"regex": "a" * 70000}, "at most"),
                         ({"json_schema": "[" * 5000 + "]" * 5000}, "nests deeper"),  # past Python's recursion limit
                         ({"json_schema": {"default": deep}}, "nests deeper")]:
        with pytest.raises(RequestError, match=message):
            constraint_from_fields(raw)


def test_tree_prefixes_follow_each_nodes_path():
    assert tree_prefixes([9], [1, 2, 3], [-1, 0, -1]) == [[9], [9, 1], [9, 1, 2], [9, 3]]


class _OnlyEven:
    def accepts(self, context, token):
        return token % 2 == 0


def test_lookup_proposals_are_cut_at_the_first_disallowed_token():
    assert cut_at_disallowed(_OnlyEven(), [1], [2, 4, 5, 6]) == [2, 4]
    assert cut_at_disallowed(None, [1], [5]) == [5]


def test_unsatisfiable_grammar_allows_only_the_end_and_says_so():
    """A vocabulary that cannot spell what the grammar needs (a word-level one without "c"): the mask allows only
    the stop token, and a request that ends there is marked (the engine's finish reason "grammar")."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token="<eos>")),
                                        eos_token="<eos>")
    book = GrammarBook(tokenizer, 3, (2,))
    state = book.start(book.compile(constraint_from_fields({"grammar": 'root ::= "a" "c"'})), prompt_len=1)
    assert state.allowed([1]).tolist() == [True, False, False]
    assert state.allowed([1, 0]).tolist() == [False, False, True]
    assert state.ended_unsatisfiable([0, 2]) and not state.ended_unsatisfiable([2])


def test_compiling_is_bounded_in_time(monkeypatch):
    """A grammar still compiling after the bound is refused in one line (its thread finishes in the background),
    and the book goes on serving."""
    import time

    tokenizer = make_tokenizer()
    book = GrammarBook(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    compile_now = grammar._compile
    monkeypatch.setattr(grammar, "_compile", lambda compiler, spec: time.sleep(0.5) or compile_now(compiler, spec))
    with pytest.raises(RequestError, match="took longer than 0.05 s to compile"):
        book.compile(constraint_from_fields({"regex": "[a-z]+"}), timeout_s=0.05)
    monkeypatch.setattr(grammar, "_compile", compile_now)
    assert book.compile(constraint_from_fields({"regex": "[0-9]+"})).compiled is not None


def test_unpack_bitmask_rows_and_the_shift_path_agree():
    """The numpy unpack (CPU) and the torch shifts (any device) give the same rows."""
    generator = torch.Generator().manual_seed(1)
    words = torch.randint(-(1 << 31), 1 << 31, (3, 5), dtype=torch.int64, generator=generator).to(torch.int32)
    assert torch.equal(unpack_bitmask(words, 150), grammar.unpack_by_shifts(words, 150))
    assert torch.equal(unpack_bitmask(words[0], 150), grammar.unpack_by_shifts(words, 150)[0])
    assert grammar._bit(31) == -(1 << 31) and grammar._bit(33) == 2  # token 31: the sign bit of its int32 word


def test_slow_compiles_make_no_other_wait_and_are_bounded_in_number(monkeypatch):
    """Each compile runs on its own thread: one stuck past its bound delays no other; past MAX_COMPILING running,
    a new one is refused at once."""
    import threading

    tokenizer = make_tokenizer()
    book = GrammarBook(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    release = threading.Event()
    compile_now = grammar._compile
    monkeypatch.setattr(grammar, "_compile", lambda compiler, spec: release.wait(5) and compile_now(compiler, spec)
                        if spec.source == "[a-z]+" else compile_now(compiler, spec))
    monkeypatch.setattr(grammar, "MAX_COMPILING", 3)
    for _ in range(2):
        with pytest.raises(RequestError, match="took longer"):
            book.compile(constraint_from_fields({"regex": "[a-z]+"}), timeout_s=0.05)
    assert book.compile(constraint_from_fields({"regex": "[0-9]+"}), timeout_s=5).compiled is not None  # not behind them
    with pytest.raises(RequestError, match="took longer"):
        book.compile(constraint_from_fields({"regex": "[a-z]+"}), timeout_s=0.05)
    with pytest.raises(RequestError, match="3 grammars are compiling already"):
        book.compile(constraint_from_fields({"regex": "[0-9]+"}))
    release.set()
