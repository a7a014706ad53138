"""Prompts keep the tokenizer's special tokens (a BOS-dependent model gets its BOS), chats go
through the chat template, and the template's end-of-turn token stops generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import EOS, make_model, make_tokenizer
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import TextStream, encode_chat, encode_prompt, end_of_turn_ids, stop_token_ids
from polyspec.workers.core.errors import RequestError

BOS, END_OF_TURN = "<s>", "<|end|>"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + END_OF_TURN + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def bos_chat_tokenizer():
    """The byte-level test tokenizer plus a BOS it prepends to every text and a chat template
    whose end-of-turn token is not the EOS (as in Llama-3 or Phi-3)."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"bos_token": BOS, "additional_special_tokens": [END_OF_TURN]})
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    tokenizer = bos_chat_tokenizer()
    path = tmp_path_factory.mktemp("bos") / "target"
    make_model(path, tokenizer, hidden=32, layers=1, seed=5)
    return str(path)


def test_a_prompt_keeps_the_tokenizers_bos():
    tokenizer = bos_chat_tokenizer()
    ids = encode_prompt(tokenizer, "def f(x):")
    assert ids[0] == tokenizer.convert_tokens_to_ids(BOS) and ids[1:] == tokenizer("def f(x):", add_special_tokens=False)["input_ids"]


def test_a_chat_is_the_template_with_the_assistant_turn_opened():
    tokenizer = bos_chat_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    ids = encode_chat(tokenizer, messages)
    assert tokenizer.decode(ids) == "<|system|>Be brief." + END_OF_TURN + "<|user|>Hi" + END_OF_TURN + "<|assistant|>"
    # the template's own text: no second BOS prepended by the tokenizer
    assert tokenizer.convert_tokens_to_ids(BOS) not in ids


def test_the_end_of_turn_token_stops_generation_besides_eos():
    tokenizer = bos_chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert end_of_turn_ids(tokenizer) == {end}
    assert stop_token_ids(tokenizer, [7]) == tuple(sorted({7, end, tokenizer.convert_tokens_to_ids(EOS)}))
    assert end_of_turn_ids(make_tokenizer()) == set()  # no template, nothing added


@pytest.mark.parametrize("messages, message", [
    ([], "messages must be a non-empty list"),
    ("hi", "messages must be a non-empty list"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role must be one of"),
    ([{"role": "user"}], "messages[0] has no 'content'"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string"),
])
def test_bad_messages_are_one_line(messages, message):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        encode_chat(bos_chat_tokenizer(), messages)


def test_a_tokenizer_without_a_template_refuses_messages():
    with pytest.raises(RequestError, match="no chat template"):
        encode_chat(make_tokenizer(), [{"role": "user", "content": "hi"}])


def test_the_engine_tokenizes_like_the_model_expects(bos_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = Engine(parse_config({"tiers": [{"name": "target", "model": bos_model}, {"name": "ng", "model": "ngram"}]}))
    tokenizer = AutoTokenizer.from_pretrained(bos_model)
    request = engine.parse_request({"prompt": "import os", "max_new_tokens": 12})
    assert list(request.prompt_ids) == tokenizer("import os")["input_ids"] and request.prompt_ids[0] == tokenizer.bos_token_id
    chat = engine.parse_request({"messages": [{"role": "user", "content": "hi"}]})
    assert list(chat.prompt_ids) == encode_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN) in engine.scheduler.eos_token_ids
    with pytest.raises(RequestError, match="give one of 'prompt', 'prompt_ids' or 'messages'"):
        engine.parse_request({"prompt": "x", "messages": [{"role": "user", "content": "hi"}]})
    # greedy output equals the model's own generate on the same (BOS-led) ids
    engine.scheduler.eos_token_ids = frozenset()
    model = AutoModelForCausalLM.from_pretrained(bos_model).eval()
    reference = model.generate(torch.tensor([request.prompt_ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert engine.generate(request)["token_ids"] == reference[0, len(request.prompt_ids):].tolist()


def test_the_batched_engine_stops_at_the_end_of_turn_token_too(bos_model):
    tokenizer = bos_chat_tokenizer()
    engine = Engine(parse_config({"tiers": [{"name": "target", "model": bos_model}, {"name": "ng", "model": "ngram"}]}), batched=True)
    assert engine.batched
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN) in engine.scheduler.eos_token_ids


def test_generate_chat_and_batch_messages(bos_model, tmp_path, capsys):
    import json

    import yaml

    from polyspec.orchestrator.cli import main

    config = tmp_path / "chain.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"name": "target", "model": bos_model}]}))
    assert main(["generate", "-c", str(config), "--chat", "--system", "Be brief.", "-p", "hi", "-n", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 1 <= len(result["token_ids"]) <= 3
    assert main(["generate", "-c", str(config), "--system", "x", "-p", "hi"]) == 2
    assert capsys.readouterr().err == "polyspec: error: --system needs --chat\n"
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 3}) + "\n"
                        + json.dumps({"id": "bad", "messages": [{"role": "user"}]}) + "\n")
    assert main(["batch", "-c", str(config), "-i", str(requests), "-o", str(tmp_path / "out.jsonl")]) == 0
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert results["c"]["token_ids"]
    assert results["bad"] == {"id": "bad", "error": "line 2: messages[0] has no 'content'"}


def test_the_sdk_sends_messages_the_server_reads():
    from polyspec.client import request_message
    from polyspec.orchestrator.serving.server import request_dict

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert request_dict(request_message({"id": "a", "messages": messages, "max_new_tokens": 5})) == {
        "id": "a", "messages": messages, "max_new_tokens": 5}


def test_a_text_stream_never_shows_text_past_a_stop():
    stream = TextStream("".join, ["END", "\n\n"])  # (tokens here are strings: decode joins them)
    shown = [stream.push([delta]) for delta in ["ab", "cE", "N", "x", "yE", "ND zz"]]
    assert shown == ["ab", "c", "", "ENx", "y", ""] and stream.stopped and stream.finish() == ""
    assert stream.text == "abcENxy" and len(stream.token_ids) == 6
    stream = TextStream("".join, ["abc"])
    assert [stream.push([delta]) for delta in ["xa", "bd", "ab"]] == ["x", "abd", ""]
    assert stream.finish() == "ab" and not stream.stopped and stream.text == "xabdab"  # held text comes out at the end
    stream = TextStream("".join, ["é!"])  # text, not bytes: a cut never falls inside a character
    assert stream.push(["aé"]) == "a" and stream.push(["!b"]) == "" and stream.stopped


def test_the_token_that_completes_a_stop_string_ends_the_text_stream():
    stream = TextStream("".join, ["END"])
    assert stream.push(list("abEN")) == "ab" and stream.push(list("Dxyz")) == "" and stream.stopped
    assert stream.token_ids == list("abEND") and stream.text == "ab"  # cut after "D", though the round committed "xyz" too
    assert stream.push(["more"]) == "" and stream.token_ids == list("abEND")


def test_a_text_stream_shows_only_the_new_text_and_waits_for_a_whole_character():
    def decode(ids):  # a byte-level tokenizer: each id one byte, a partial character decodes to U+FFFD
        return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    encoded = list("hé!".encode())
    assert stream.push(encoded[:1]) == "h" and stream.push(encoded[1:2]) == ""  # "é" is two bytes: wait for the second
    assert stream.push(encoded[2:]) == "é!" and stream.text == "hé!"
    cut = TextStream(decode)
    assert cut.push(encoded[:2], final=True) == "h\ufffd"  # the request ended there: what it has is shown


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: a word's leading space is "▁", and a decode strips
    the space of its first token), the case where decoding a window mid-text differs from the whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["▁def", "▁return", "▁x", "▁y", "(", ")", ":", "▁é", "é", "▁", "+"]
    tokenizer = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words + ["[UNK]"])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return lambda ids: tokenizer.decode(ids), len(words)


@pytest.mark.parametrize("kind", ["demo", "metaspace"])
def test_a_text_stream_equals_the_whole_decode_and_decodes_only_a_window(kind):
    import random

    if kind == "demo":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models/stdlib/small")
        whole = lambda ids: tokenizer.decode(ids)  # noqa: E731
        ids = tokenizer("def f(x):\n    return x + 'é🙂' # ünïcode\n" * 20)["input_ids"]
    else:
        whole, vocab = _metaspace_tokenizer()
        ids = [random.Random(1).randrange(vocab) for _ in range(400)]
    windows = []

    def decode(part):
        windows.append(len(part))
        return whole(part)

    rng = random.Random(0)
    stream, start, shown = TextStream(decode), 0, ""
    while start < len(ids):
        size = rng.randint(1, 8)
        windows.clear()
        shown += stream.push(ids[start : start + size], final=start + size >= len(ids))
        # this round's tokens, the round before, and rounds held while a character is incomplete: never the whole text
        assert max(windows) <= 4 * 8 < len(ids) // 10
        start += size
    assert shown == stream.text == whole(ids)
