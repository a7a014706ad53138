"""The CLI a first-time user meets: a chain named by flags (-m / --draft / --ngram) instead of
YAML, overrides of every model tier, prompts from stdin or a file, stop strings, `chat`,
`--version`, and mistakes reported before torch is imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from polyspec import __version__
from polyspec.harness.zoo_fetch import MODELS
from polyspec.orchestrator.chain_args import chain_config
from polyspec.orchestrator.cli import build_parser, main
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.tiers.model_cache import ZOO_GGUF, ZOO_NAMES, resolve_zoo_reference

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyspec", *args], capture_output=True, text=True, input=stdin, timeout=300)


def flags(*args: str):
    return build_parser().parse_args(["generate", *args, "-p", "x"])


@pytest.fixture(scope="module")
def chat_target(tiny_family, tmp_path_factory):
    target = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_family["target"], target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    return str(target)


# ---------------------------------------------------------------- fast, right errors


@pytest.mark.parametrize("config, args, message", [
    ({"tiers": [{"name": "t", "model": "x", "dtyp": "float32"}]}, [], "unknown config key 'tiers[0].dtyp' (did you mean 'dtype'? known keys: device, dtype, group_size, max_ngram,"),
    ({"tiers": [{"name": "t", "model": "zoo:qwen2.5-coder-7b"}]}, [],
     "unknown zoo model 'qwen2.5-coder-7b' (known: smollm2, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"),
    ({"tiers": [{"name": "t", "model": "./no/such/folder"}]}, [], "model path"),
    (None, ["-m", "zoo:nope"], "unknown zoo model 'nope'"),
    (None, ["-m", "/no/such/model", "--ngram"], "tier 'target': model path '/no/such/model' does not exist"),
    (None, [], "no chain given: -c CONFIG (YAML) or -m MODEL"),
    (None, ["-m", "ngram"], "add a prompt-lookup drafter with --ngram"),
    (None, ["-m", "/x", "--lengths", "4,x"], "--lengths must be auto or integers separated by commas, got '4,x'"),
    (None, ["-m", "/no/such/model", "--draft", "/no/such/model", "--lengths", "4,4"], "--lengths: needs one length per verifying tier"),
])
def test_mistakes_are_one_line_before_torch_is_imported(tmp_path, config, args, message):
    if config is not None:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(config))
        args = ["-c", str(path), *args]
    # in a fresh interpreter: the error comes before torch or transformers is imported
    code = ("import sys, time; from polyspec.orchestrator.cli import main; start = time.perf_counter(); "
            f"rc = main({['generate', *args, '-p', 'x']!r}); "
            "print(rc, time.perf_counter() - start, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    rc, _, torch_loaded, transformers_loaded = proc.stdout.split()
    assert (rc, torch_loaded, transformers_loaded) == ("2", "False", "False"), proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polyspec: error: ") and message in err[0], err


def test_the_zoo_names_configs_know_are_the_ones_zoo_fetch_can_fetch():
    assert set(ZOO_NAMES) == set(MODELS)
    assert ZOO_GGUF == {name: model.gguf_file for name, model in MODELS.items()}
    assert resolve_zoo_reference("zoo:qwen2.5-coder-1.5b.gguf").endswith("/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def test_a_missing_zoo_model_names_a_fetch_command_that_works(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSPEC_MODEL_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="fetch it first: polyspec zoo fetch smollm2$"):
        chain_config(flags("-m", "zoo:smollm2"))
    args = build_parser().parse_args(["zoo", "fetch", "smollm2"])  # the suggested command parses, and the name resolves
    from polyspec.harness.zoo_fetch import resolve_names

    assert [model.name for model in resolve_names(args.name)] == ["smollm2"]


def test_chat_flag_on_a_model_without_a_template_speaks_of_the_flag(tiny_family, capsys):
    assert main(["generate", "-m", tiny_family["target"], "-p", "hi", "--chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat: the target model" in err[0] and "has no chat template" in err[0]
    assert "drop --chat" in err[0] and "messages" not in err[0]


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"polyspec {__version__}"


# ---------------------------------------------------------------- a chain without YAML


def test_models_on_the_command_line_build_the_chain_a_config_would(tiny_family):
    config = chain_config(flags("-m", tiny_family["target"], "--draft", tiny_family["mid"], "--draft", tiny_family["small"],
                                "--ngram", "--dtype", "bfloat16", "--threads", "2", "--device", "cpu"))
    assert [(t.name, t.model) for t in config.tiers] == [
        ("target", tiny_family["target"]), ("draft1", tiny_family["mid"]), ("draft2", tiny_family["small"]), ("ngram", "ngram")]
    assert all((t.dtype, t.threads, t.device) == ("bfloat16", 2, "cpu") for t in config.tiers[:3])
    assert config.tiers[3].threads is None  # the n-gram tier has no model to override
    with pytest.raises(ConfigError, match="not both"):
        chain_config(flags("-c", "x.yaml", "-m", tiny_family["target"]))
    with pytest.raises(ConfigError, match="--draft and --ngram build a chain with -m"):
        chain_config(flags("-c", "x.yaml", "--ngram"))


def test_overrides_apply_to_a_config_too(tiny_family, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"tiers": [{"name": "t", "model": tiny_family["target"], "threads": 1, "dtype": "float32"},
                                              {"name": "n", "model": "ngram"}]}))
    config = chain_config(flags("-c", str(path), "--threads", "3", "--dtype", "bfloat16"))
    assert (config.tiers[0].threads, config.tiers[0].dtype) == (3, "bfloat16")


def test_quantize_applies_to_the_target_only(tiny_family):
    config = chain_config(flags("-m", tiny_family["target"], "--draft", tiny_family["small"], "--quantize", "int4"))
    assert [t.quantize for t in config.tiers] == ["int4", None]
    with pytest.raises(ConfigError, match="--quantize: quantize: gguf loads a .gguf file's own quantized blocks"):
        chain_config(flags("-m", tiny_family["target"], "--quantize", "gguf"))


def test_generate_with_models_from_a_pipe_equals_the_target_alone(tiny_family, capsys):
    chain = run_cli("generate", "-m", tiny_family["target"], "--draft", tiny_family["mid"], "--ngram", "-p", "-",
                    "-n", "12", "--json", stdin="def f(x):")
    assert chain.returncode == 0, chain.stderr
    assert main(["generate", "-m", tiny_family["target"], "-p", "def f(x):", "-n", "12", "--json"]) == 0  # (in this process)
    result = json.loads(chain.stdout)
    assert result["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert [s["tier"] + "<-" + s["drafter"] for s in result["stats"]["stages"]] == ["target<-draft", "draft<-ngram"]


def test_prompt_from_a_file_and_the_prompt_flags_checked(tiny_family, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("import os")
    assert main(["generate", "-m", tiny_family["target"], "-f", str(prompt), "-n", "5", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["generate", "-m", tiny_family["target"], "-p", "import os", "-n", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == from_file["token_ids"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, message in ((["-p", "x", "-f", str(prompt)], "not both"), ([], "give the prompt as -p TEXT"),
                          (["-f", str(tmp_path / "missing.txt")], "cannot read the prompt file"),
                          (["-f", str(empty)], f"the prompt file {empty} is empty"), (["-p", ""], "prompt is empty")):
        assert main(["generate", "-m", tiny_family["target"], *args]) == 2
        err = capsys.readouterr().err.splitlines()  # one line, before any model loads
        assert len(err) == 1 and err[0].startswith("polyspec: error: ") and message in err[0], err
    piped = run_cli("generate", "-m", tiny_family["target"], "-p", "-", stdin="")
    assert piped.returncode == 2 and piped.stderr.splitlines() == ["polyspec: error: -p -: stdin held no prompt"]


# ---------------------------------------------------------------- stop strings


def test_stop_ends_generation_before_the_stop_text(tiny_family, capsys):
    base = ["generate", "-m", tiny_family["target"], "--draft", tiny_family["mid"], "-p", "import os", "-n", "24", "--json"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    stop = free["text"][5:8]
    assert len(stop) == 3 and free["text"].find(stop) == 5, free["text"]
    assert main([*base, "--stop", stop, "--stop", "never-there"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["text"] == free["text"][:5] and stopped["finish_reason"] == "stop"
    # the tokens up to the one that completed the stop string, a prefix of the free run's
    assert stopped["token_ids"] == free["token_ids"][: len(stopped["token_ids"])]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_family["target"])
    assert stop in tokenizer.decode(stopped["token_ids"]) and stop not in tokenizer.decode(stopped["token_ids"][:-1])


# ---------------------------------------------------------------- chat


def test_chat_holds_a_conversation(chat_target, tiny_family):
    # bytes, not text mode: a random model's replies hold \r, which universal newlines would rewrite
    proc = subprocess.run([sys.executable, "-m", "polyspec", "chat", "-m", chat_target, "--draft", tiny_family["mid"], "-n", "6",
                           "--system", "Be brief."], input=b"hello\nand then?\n/reset\nonce more\n", capture_output=True, timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    # each turn sees the whole conversation so far: the second reply is the model's answer to
    # system + hello + its own first reply + "and then?"; /reset forgets all but the system message
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(parse_config({"tiers": [{"name": "t", "model": chat_target}]}))
    system = {"role": "system", "content": "Be brief."}
    first = engine.generate(engine.parse_request({"messages": [system, {"role": "user", "content": "hello"}], "max_new_tokens": 6}))
    history = [system, {"role": "user", "content": "hello"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "and then?"}]
    second = engine.generate(engine.parse_request({"messages": history, "max_new_tokens": 6}))
    after_reset = engine.generate(engine.parse_request({"messages": [system, {"role": "user", "content": "once more"}],
                                                        "max_new_tokens": 6}))
    assert proc.stdout.decode() == "".join(reply["text"] + "\n" for reply in (first, second, after_reset))


CHAT_TURNS = ("hello", "and then?", "one more thing")


def _chat(engine, turns=CHAT_TURNS, max_new_tokens: int = 8) -> list[dict]:
    """Each turn's result and prompt ids, the conversation growing as `polyspec chat` grows it."""
    messages, results = [{"role": "system", "content": "Be brief."}], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        request = engine.parse_request({"messages": messages, "max_new_tokens": max_new_tokens, "temperature": 0})
        result = engine.generate(request)
        results.append({**result, "prompt_ids": list(request.prompt_ids)})
        messages.append({"role": "assistant", "content": result["text"]})
    return results


def _shared(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("round_kind", ["ragged", "device"])
def test_a_chat_reuses_its_caches_and_says_the_same(chat_target, tiny_family, round_kind):
    """Device tiers keep a finished turn's slot too (`batching.round: device`, one slot on top)."""
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    config = parse_config({"tiers": [{"name": "t", "model": chat_target}, {"name": "mid", "model": tiny_family["mid"]},
                                     {"name": "ng", "model": "ngram"}], "speculation": {"lengths": [3, 2]},
                           "batching": {"round": round_kind, "max_context": 512}})
    fresh = _chat(Engine(config))
    reusing = Engine(config, reuse_prefix=True)
    assert reusing.scheduler.kept.keep == 1 and Engine(config).scheduler.kept.keep == 0
    kept = _chat(reusing)
    assert [r["token_ids"] for r in kept] == [r["token_ids"] for r in fresh]  # greedy: lossless
    assert [r["text"] for r in kept] == [r["text"] for r in fresh]
    for before, turn, again in zip(fresh, fresh[1:], kept[1:]):
        shared = _shared(before["prompt_ids"] + before["token_ids"], turn["prompt_ids"])
        assert shared >= len(before["prompt_ids"])  # the whole previous prompt at least is a prefix of the next
        for tier in (0, 1):  # each model tier forwards fewer tokens by what it had cached
            saved = turn["stats"]["tiers"][tier]["forwarded_tokens"] - again["stats"]["tiers"][tier]["forwarded_tokens"]
            assert saved >= len(before["prompt_ids"]) - 1, (tier, saved)


def test_a_chat_turn_prefills_only_its_new_tokens(chat_target):
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    config = parse_config({"tiers": [{"name": "t", "model": chat_target}]})
    for reuse in (True, False):
        engine = Engine(config, reuse_prefix=reuse)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
        first_request = engine.parse_request({"messages": messages, "max_new_tokens": 8, "temperature": 0})
        first = engine.generate(first_request)
        messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "and then?"}]
        second = engine.parse_request({"messages": messages, "max_new_tokens": 4, "temperature": 0})
        target = engine.tiers[0]
        before = target.forwarded_tokens
        state = engine.start(second)
        engine.step(state)  # the first round: the prompt's prefill (a target alone drafts nothing)
        prefill = target.forwarded_tokens - before
        engine.finish(state)
        prompt = list(second.prompt_ids)
        shared = _shared(list(first_request.prompt_ids) + first["token_ids"], prompt)
        assert shared >= len(first_request.prompt_ids)
        # a tier always forwards the context's last token: its row predicts the first new one
        assert prefill == (len(prompt) - min(shared, len(prompt) - 1) if reuse else len(prompt)), (reuse, prefill, shared)


def test_chat_on_a_model_without_a_template_says_so(tiny_family):
    proc = run_cli("chat", "-m", tiny_family["target"], stdin="hi\n")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"polyspec: error: polyspec chat: the target model {tiny_family['target']!r} has no chat template, so it cannot take "
        "a conversation; use polyspec generate -p TEXT"]


def test_a_reader_that_leaves_early_gets_no_traceback(monkeypatch, capsys):
    """`polyspec zoo list | head -1`: a closed pipe ends the command quietly with 141 (128 + SIGPIPE), as cat does."""
    import polyspec.orchestrator.cli as cli

    def closed_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.COMMANDS, "zoo", closed_pipe)
    assert main(["zoo", "list"]) == 141
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "/no/such/cert"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/no/such/cert", "--tls-key", "/no/such/key"], "cannot read TLS key /no/such/key"),
    (["--auth-token-file", "/no/such/tokens"], "cannot read auth token file /no/such/tokens"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
])
def test_serve_flag_mistakes_are_one_line_before_torch_is_imported(tmp_path, flags, message):
    """serve's own flags (TLS, tokens, names, the job store, the port) are checked before any model loads."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"name": "t", "model": str(tmp_path)}]}))
    code = ("import sys; from polyspec.orchestrator.cli import main; "
            f"rc = main({['serve', '-c', str(config), '--port', '0', '--state-dir', str(tmp_path / 'state'), *flags]!r}); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_serve_on_a_busy_port_is_one_line_before_torch_is_imported(tmp_path):
    import socket

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"name": "t", "model": str(tmp_path)}]}))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = ("import sys; from polyspec.orchestrator.cli import main; "
                f"rc = main({['serve', '-c', str(config), '--port', str(port), '--state-dir', str(tmp_path / 'state')]!r}); "
                "print(rc, 'torch' in sys.modules)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
