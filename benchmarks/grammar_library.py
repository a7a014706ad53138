"""Which grammar library for structured output: xgrammar against llguidance over Qwen2.5's 151,936-token vocabulary.

For each constraint (a nested JSON schema, a regex, an EBNF grammar) a fixed valid reply is tokenized with the
Qwen2.5-Coder tokenizer and walked token by token: the next-token mask is filled before each token, then the token
is accepted. Reported per library: the tokenizer table's build time, compile time, mask time per token (median,
p90, mean over `--repeats` walks; the first walk warms caches), whether rolling back 5 tokens and re-accepting
works, and the installed size. Also polyspec's own cost per position (`GrammarState.allowed`: xgrammar's fill plus
the unpack to a bool row). Needs llguidance installed to compare (`pip install llguidance==1.9.1`).

    python benchmarks/grammar_library.py --tokenizer ~/.cache/polyspec/models/qwen2.5-coder-0.5b --out benchmarks/grammar-library.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path

VOCAB = 151936
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
CASES = {
    "json_schema": ("json_schema", json.dumps(SCHEMA),
                    '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc", "bb"], "address": {"city": "London", "zip": "12345"}}'),
    "regex": ("regex", r"(def|class) [a-z_]+\([a-z_, ]*\):\n    return [a-z_ +*0-9]+", "def add_two(a, b):\n    return a + b * 2"),
    "grammar": ("grammar", 'root ::= expr\nexpr ::= term (" + " term)*\nterm ::= [0-9]+ | "(" expr ")"', "(12 + 7) + 3 + (4 + (5 + 600))"),
}


def installed_mb(*distributions: str) -> float:
    total = 0
    for name in distributions:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        total += sum(f.locate().stat().st_size for f in files if f.locate().exists())
    return total / 1e6


def walk_xgrammar(tokenizer, repeats: int) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    out = {"tokenizer_table_s": time.perf_counter() - started, "cases": {}}
    for name, (kind, source, text) in CASES.items():
        started = time.perf_counter()
        if kind == "json_schema":
            compiled = compiler.compile_json_schema(source, any_whitespace=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(source)
        else:
            compiled = compiler.compile_grammar(source)
        compile_s = time.perf_counter() - started
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        times = []
        for repeat in range(repeats + 1):
            matcher.reset()
            for token in ids:
                began = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                if repeat:
                    times.append(time.perf_counter() - began)
                assert matcher.accept_token(token), (name, token)
        matcher.reset()
        for token in ids[:10]:
            matcher.accept_token(token)
        matcher.rollback(5)
        rollback_ok = all(matcher.accept_token(t) for t in ids[5:])
        out["cases"][name] = {"compile_s": compile_s, "tokens": len(ids), "rollback_ok": rollback_ok, **summary(times)}
    return out


def walk_llguidance(tokenizer, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    out = {"tokenizer_table_s": time.perf_counter() - started, "cases": {}}
    for name, (kind, source, text) in CASES.items():
        started = time.perf_counter()
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                source, defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(_lark(source))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special_tokens=False)
        bitmask = lt.allocate_token_bitmask(1, VOCAB)
        times = []
        for repeat in range(repeats + 1):
            matcher.reset()
            for token in ids:
                began = time.perf_counter()
                lt.fill_next_token_bitmask(matcher, bitmask, 0)
                if repeat:
                    times.append(time.perf_counter() - began)
                assert matcher.consume_token(token), (name, token, matcher.get_error())
        matcher.reset()
        for token in ids[:10]:
            matcher.consume_token(token)
        matcher.rollback(5)
        rollback_ok = all(matcher.consume_token(t) for t in ids[5:])
        out["cases"][name] = {"compile_s": compile_s, "tokens": len(ids), "rollback_ok": rollback_ok, **summary(times)}
    return out


def _lark(ebnf: str) -> str:
    """The benchmark's EBNF grammar in Lark's syntax (the same language)."""
    return ('start: expr\nexpr: term (" + " term)*\nterm: /[0-9]+/ | "(" expr ")"\n')


def walk_polyspec(tokenizer, repeats: int) -> dict:
    """polyspec's cost per position: GrammarState.allowed (fill + unpack to a [V] bool row), masks not cached."""
    from polyspec.workers.core.grammar import GrammarBook, constraint_from_fields

    book = GrammarBook(tokenizer, VOCAB, (tokenizer.eos_token_id,))
    out = {}
    for name, (kind, source, text) in CASES.items():
        raw = {kind: json.loads(source) if kind == "json_schema" else source}
        spec = book.compile(constraint_from_fields(raw))
        ids = tokenizer.encode(text, add_special_tokens=False)
        times = []
        for repeat in range(repeats + 1):
            state = book.start(spec, prompt_len=0)
            for j in range(len(ids)):
                began = time.perf_counter()
                state.allowed(ids[:j])
                if repeat:
                    times.append(time.perf_counter() - began)
        out[name] = summary(times)
    return out


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"mask_us_median": 1e6 * statistics.median(ordered), "mask_us_p90": 1e6 * ordered[int(0.9 * (len(ordered) - 1))],
            "mask_us_mean": 1e6 * statistics.fmean(ordered)}


def markdown(results: dict) -> str:
    lines = [f"# Grammar library: xgrammar vs llguidance ({VOCAB:,}-token vocabulary)", "",
             f"Machine: {results['machine']}. {results['note']}", "",
             "| library | version | installed MB | tokenizer table s | constraint | compile ms | tokens | mask µs median | p90 | mean | rollback |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for library in ("xgrammar", "llguidance"):
        entry = results.get(library)
        if entry is None:
            continue
        for name, case in entry["cases"].items():
            lines.append(f"| {library} | {entry['version']} | {entry['installed_mb']:.1f} | {entry['tokenizer_table_s']:.2f} | {name} | "
                         f"{1e3 * case['compile_s']:.1f} | {case['tokens']} | {case['mask_us_median']:.1f} | {case['mask_us_p90']:.1f} | "
                         f"{case['mask_us_mean']:.1f} | {'yes' if case['rollback_ok'] else 'NO'} |")
    lines += ["", f"Installed size: the wheels' own files (xgrammar with apache-tvm-ffi). xgrammar also requires triton on Linux "
              f"x86-64 ({results['triton_mb']:.0f} MB here): a CUDA build of torch already depends on it, a CPU-only install adds it. "
              "llguidance depends on nothing."]
    lines += ["", "polyspec's cost per position (`GrammarState.allowed`: xgrammar's fill plus the unpack to a bool row of the vocabulary):", "",
              "| constraint | µs median | p90 | mean |", "|---|---|---|---|"]
    for name, case in results["polyspec"].items():
        lines.append(f"| {name} | {case['mask_us_median']:.1f} | {case['mask_us_p90']:.1f} | {case['mask_us_mean']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=str(Path.home() / ".cache/polyspec/models/qwen2.5-coder-0.5b"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the table here (Markdown) and the figures beside it (.json)")
    parser.add_argument("--note", default="", help="a line on the conditions (a shared machine, its load)")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # as a tier runs (threads: 1); the unpack is ~60 µs on one thread, slower when threads contend
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                          f"load average {os.getloadavg()[0]:.1f} at the start",
               "note": args.note, "tokenizer": args.tokenizer, "repeats": args.repeats}
    results["xgrammar"] = {"version": importlib.metadata.version("xgrammar"),
                           "installed_mb": installed_mb("xgrammar", "apache-tvm-ffi"), **walk_xgrammar(tokenizer, args.repeats)}
    try:
        results["llguidance"] = {"version": importlib.metadata.version("llguidance"), "installed_mb": installed_mb("llguidance"),
                                 **walk_llguidance(tokenizer, args.repeats)}
    except ImportError:
        print("llguidance is not installed: xgrammar alone")
    results["triton_mb"] = installed_mb("triton")
    results["polyspec"] = walk_polyspec(tokenizer, args.repeats)
    text = markdown(results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
