"""The real CLI: generate, batch, and one clear line (exit 2) for every user mistake."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from polyspec.orchestrator.cli import main


def polyspec_command() -> list[str]:
    # this interpreter's polyspec, not whichever `polyspec` script comes first on PATH (another
    # checkout's install would test other code)
    return [sys.executable, "-m", "polyspec"]


@pytest.fixture(scope="module")
def config_path(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "chain.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"name": "target", "model": tiny_family["target"]},
                    {"name": "mid", "model": tiny_family["mid"]},
                    {"name": "ng", "model": "ngram"},
                ],
                "speculation": {"lengths": [4, 2]},
                "sampling": {"max_new_tokens": 12},
            }
        )
    )
    return str(path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(polyspec_command() + list(args), capture_output=True, text=True, timeout=300, env=None)


def test_generate_json_through_the_installed_command(config_path):
    spec = run_cli("generate", "-c", config_path, "-p", "def f(x):", "-n", "10", "--json")
    base = run_cli("generate", "-c", config_path, "-p", "def f(x):", "-n", "10", "--json", "--no-speculation")
    assert spec.returncode == 0 and base.returncode == 0, spec.stderr + base.stderr
    result, baseline = json.loads(spec.stdout), json.loads(base.stdout)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert result["token_ids"] == baseline["token_ids"]  # greedy: identical to the target alone
    assert result["finish_reason"] in ("length", "eos")
    stats = result["stats"]
    assert stats["tokens_per_s"] > 0 and len(stats["stages"]) == 2
    for stage in stats["stages"]:
        assert {"tier", "blocks", "proposed", "accepted", "mean_accepted_length", "lengths", "time_s"} <= set(stage)
    assert stats["stages"][0]["tier"] == "target"


def test_user_mistake_is_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: t, model: /does/not/exist}\n")
    proc = run_cli("generate", "-c", str(bad), "-p", "x")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["polyspec: error: tier 't': model path '/does/not/exist' does not exist"]


def test_same_seed_same_output(config_path, capsys):
    outputs = []
    for _ in range(2):
        assert main(["generate", "-c", config_path, "-p", "import os", "--temperature", "1", "--seed", "7", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1]
    assert main(["generate", "-c", config_path, "-p", "import os", "--temperature", "1", "--seed", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] != outputs[0]


def test_plain_generate_streams_text(config_path, capsys):
    assert main(["generate", "-c", config_path, "-p", "import os", "-n", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and "tok/s" in captured.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-p", ""], "prompt is empty"),
        (["-p", "x", "-n", "0"], "max_new_tokens must be > 0"),
        (["-p", "x", "--temperature", "-0.5"], "temperature must be >= 0"),
        (["-p", "x", "--top-p", "-0.5"], "top_p must be in [0, 1]"),
        (["-p", "x", "--top-p", "1.01"], "top_p must be in [0, 1]"),
        (["-p", "x", "--top-k", "-2"], "top_k must be an integer >= 0"),
        (["-p", "y" * 300], "prompt has 300 tokens but the model context holds 256"),
    ],
)
def test_bad_requests(config_path, capsys, flags, message):
    assert main(["generate", "-c", config_path] + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # after the start-up lines (the prompt is checked against the loaded tokenizer), one error line
    assert [line for line in err if "error" in line] == [err[-1]] and err[-1].startswith("polyspec: error: ") and message in err[-1]
    assert all(line.startswith("polyspec: ") for line in err[:-1]), err  # start-up lines


@pytest.mark.parametrize(
    "config, message",
    [
        ({"tiers": [{"name": "t", "model": "TARGET"}], "speculaton": {}}, "unknown config key 'speculaton'"),
        ({"tiers": [{"name": "t", "model": "TARGET", "dtyp": "float32"}]}, "unknown config key 'tiers[0].dtyp'"),
        ({"tiers": [{"name": "t", "model": "TARGET"}, {"name": "o", "model": "OTHER"}]}, "tiers 't' and 'o' do not share a vocabulary"),
        ({"tiers": [{"name": "t", "model": "TARGET"}, {"name": "s", "model": "SMALL"}], "speculation": {"lengths": [1, 2]}}, "one length per verifying tier"),
        ({"tiers": [{"name": "n", "model": "ngram"}]}, "must be a model, not 'ngram'"),
        ({"tiers": [{"name": "t", "model": "TARGET"}], "speculation": {"verifier": "best"}}, "speculation.verifier must be one of"),
        ({"tiers": [{"name": "t", "model": "TARGET", "dtype": "int3"}]}, "dtype must be one of"),
        ({"tiers": []}, "non-empty 'tiers' list"),
    ],
)
def test_bad_configs(tiny_family, tmp_path, capsys, config, message):
    text = yaml.safe_dump(config)
    for key, name in (("TARGET", "target"), ("OTHER", "other_vocab"), ("SMALL", "small")):
        text = text.replace(key, tiny_family[name])
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["generate", "-c", str(path), "-p", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # one error line, last (a vocabulary mismatch shows after the start-up line that loads transformers)
    assert [line for line in err if "error" in line] == [err[-1]] and message in err[-1], err


def test_batch_bad_lines_get_errors_and_the_rest_go_on(config_path, tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "prompt": "def f(x):", "max_new_tokens": 5}),
                "{not json",
                json.dumps({"id": "b", "prompt": "", "max_new_tokens": 5}),
                json.dumps({"id": "c", "prompt_ids": [10, 20, 30], "max_new_tokens": 4, "temperature": 1.0, "seed": 3}),
                json.dumps({"id": "d", "prompt": "x", "max_tokens": 5}),
                json.dumps({"id": "e", "prompt": "x", "top_p": 2}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", "-c", config_path, "-i", str(requests), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {"a", "line-2", "b", "c", "d", "e"}
    assert results["a"]["finish_reason"] in ("length", "eos") and len(results["a"]["token_ids"]) <= 5
    assert set(results["a"]) == {"id", "text", "token_ids", "finish_reason", "stats"}
    assert len(results["c"]["token_ids"]) <= 4
    assert "malformed JSON" in results["line-2"]["error"]
    assert "prompt is empty" in results["b"]["error"]
    assert "unknown request field 'max_tokens'" in results["d"]["error"]
    assert "top_p" in results["e"]["error"]

    # --resume keeps finished results and only redoes what is missing
    kept = [line for line in out.read_text().splitlines() if json.loads(line)["id"] != "c"]
    out.write_text("\n".join(kept) + "\n" + '{"id": "c", "tok')  # a line torn by a crash
    assert main(["batch", "-c", config_path, "-i", str(requests), "-o", str(out), "--resume"]) == 0
    lines = out.read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert sorted(ids) == sorted(results) and ids[-1] == "c"
    assert json.loads(lines[-1])["token_ids"] == results["c"]["token_ids"]  # same seed, same result


def test_eos_ends_generation(tiny_family, tmp_path, capsys):
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(parse_config({"tiers": [{"name": "t", "model": tiny_family["target"]}, {"name": "m", "model": tiny_family["mid"]}]}))
    prompt = engine.tokenizer("import os")["input_ids"]
    free = engine.generate(engine.parse_request({"prompt_ids": prompt, "max_new_tokens": 30}))
    # declare the 5th generated token an end-of-sequence token: generation must stop right there
    stop = free["token_ids"][4]
    engine.scheduler.eos_token_ids = frozenset({stop})
    result = engine.generate(engine.parse_request({"prompt_ids": prompt, "max_new_tokens": 30}))
    first = free["token_ids"].index(stop)
    assert result["token_ids"] == free["token_ids"][: first + 1]
    assert result["finish_reason"] == "eos"
