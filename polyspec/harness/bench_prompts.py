"""`polyspec bench`'s and `polyspec tune`'s prompts.

The prompts ship with the demo family (`models/stdlib/prompts.jsonl`, `{"prompt", "class"}`
lines): code-completion prompts cut at function / class boundaries from standard-library
files the family never trained on, plus free-text English prompts (`write_prompts`); its
"repetitive-code" rows (held-out code-page tables) are for `polyspec tune`'s shift test
and are not measured by bench (`measured_prompts`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
from pathlib import Path

from polyspec.workers.core.errors import PolyspecError
from polyspec.orchestrator.tokenization import encode_prompt

QUICK_PROMPTS = {"code": 4, "prose": 2}  # --quick: the first prompts of each class (about a minute in all)
REPETITIVE_CODE = "repetitive-code"  # the class of REPETITIVE_CUTS' prompts
SHIFT_ONLY_CLASSES = (REPETITIVE_CODE,)  # prompts for `polyspec tune`'s code -> prose test alone (see measured_prompts)
PROMPT_MIN_TOKENS, PROMPT_MAX_TOKENS = 100, 200
MIN_BODY_LINES = 4  # a cut is only worth completing if the body goes on for a while
SKIPPED_DIRS = ("encodings/",)  # generated codec tables: boilerplate an n-gram drafter would flatter
# ... which is what the "repetitive-code" class is for (the tune shift test's code half, never
# measured by bench): held-out code-page tables, one entry per line, each prompt ending at the
# first character of an entry; (file, 1-based line the prompt ends in), all in the upper halves
# (0x80-0xff), where code pages differ (every codec's lower half is the same ASCII table)
REPETITIVE_CUTS = (
    ("encodings/cp1251.py", 200), ("encodings/cp1251.py", 246), ("encodings/cp1251.py", 280),
    ("encodings/cp850.py", 124), ("encodings/cp850.py", 319), ("encodings/cp850.py", 620),
    ("encodings/iso8859_6.py", 198), ("encodings/iso8859_6.py", 265),
)

PROSE_PROMPTS = (
    "The library keeps a small cache of recently used objects. When the cache is full, the oldest entry is",
    "To read a configuration file, open it in text mode, parse each line, and ignore blank lines and comments. "
    "Values that cannot be parsed are reported to the user with the line number, so that",
    "This module provides a simple way to run a command in a subprocess and wait for it to finish. "
    "The return code is checked, and if the command failed, an exception is raised that contains",
    "A queue is a first-in, first-out data structure. Items are added at one end and removed from the other. "
    "In a multi-threaded program, the queue must be protected by a lock because",
    "Return a new list containing the items of the sequence in sorted order. The sort is stable, which means that",
    "The server listens on the given address and port. Each incoming connection is handled by a separate thread, and",
    "Dates and times can be compared, subtracted and formatted. A naive datetime object does not contain any information about",
    "If the file does not exist, the function creates it with the default permissions. Otherwise the existing file is",
)


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    text: str
    kind: str  # "code" | "prose" (the JSONL "class" field)
    source: str | None = None  # "<held-out stdlib file>:<line of the cut>" for code prompts


def _docstring_end(node) -> int | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno
    return None


def cut_points(source: str) -> list[int]:
    """1-based line numbers after which a def/class body starts: the header (+ docstring) ends there."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    cuts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.body[0].lineno == node.lineno:
            continue  # a one-line definition: nothing to complete after a header
        end = _docstring_end(node) or node.body[0].lineno - 1
        if node.end_lineno - end >= MIN_BODY_LINES:
            cuts.append(end)
    return sorted(set(cuts))


def prompt_before(lines: list[str], cut: int, tokenizer, tail: str = "") -> str | None:
    """Whole lines ending at line `cut` (then `tail`), PROMPT_MIN..MAX_TOKENS long: the longest
    that starts after a blank line (a paragraph boundary), else the longest."""
    longest = paragraph = None
    for start in range(cut, 0, -1):
        candidate = "".join(lines[start - 1 : cut]) + tail
        count = len(encode_prompt(tokenizer, candidate))
        if count > PROMPT_MAX_TOKENS:
            break
        if count >= PROMPT_MIN_TOKENS and not lines[start - 1].isspace():
            longest = candidate
            if start == 1 or lines[start - 2].isspace():
                paragraph = candidate
    return paragraph or longest


def code_prompts(tokenizer, count: int, seed: int = 0, stdlib_dir: str | None = None) -> list[BenchPrompt]:
    """`count` prompts, at most one per held-out standard-library file, cut before a def/class body."""
    from polyspec.harness.zoo import split_corpus

    _, held_out = split_corpus(stdlib_dir)
    rng = random.Random(seed)
    files = [(path, text) for path, text in held_out if not path.startswith(SKIPPED_DIRS)]
    rng.shuffle(files)
    prompts = []
    for path, text in files:
        lines = text.splitlines(keepends=True)
        cuts = cut_points(text)
        rng.shuffle(cuts)
        found = next(((cut, p) for cut, p in ((cut, prompt_before(lines, cut, tokenizer)) for cut in cuts[:8]) if p), None)
        if found:
            prompts.append(BenchPrompt(found[1], "code", f"{path}:{found[0]}"))
        if len(prompts) == count:
            break
    return prompts


def repetitive_prompts(tokenizer, stdlib_dir: str | None = None) -> list[BenchPrompt]:
    """The REPETITIVE_CUTS prompts: the table lines before the cut line, then that line's
    indentation and first character (the prompt ends part-way into another entry)."""
    from polyspec.harness.zoo import split_corpus

    held_out = dict(split_corpus(stdlib_dir)[1])
    prompts = []
    for path, line in REPETITIVE_CUTS:
        lines = held_out.get(path, "").splitlines(keepends=True)
        if len(lines) < line:
            continue  # another Python's standard library
        entry = lines[line - 1]
        text = prompt_before(lines, line - 1, tokenizer, tail=entry[: len(entry) - len(entry.lstrip()) + 1])
        if text:
            prompts.append(BenchPrompt(text, REPETITIVE_CODE, f"{path}:{line}"))
    return prompts


def write_prompts(path: str, tokenizer_source: str, code_count: int = 32, seed: int = 0) -> list[BenchPrompt]:
    """Build the demo family's held-out prompt set and write it as `{"prompt", "class"}` JSONL."""
    from polyspec.workers.tiers.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source, "target")
    prompts = code_prompts(tokenizer, code_count, seed) + [BenchPrompt(text, "prose") for text in PROSE_PROMPTS]
    prompts += repetitive_prompts(tokenizer)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for prompt in prompts:
            source = {"source": prompt.source} if prompt.source else {}
            out.write(json.dumps({"prompt": prompt.text, "class": prompt.kind, **source}) + "\n")
    return prompts


def read_prompts(path: str) -> list[BenchPrompt]:
    if not Path(path).exists():
        raise PolyspecError(f"prompts file not found: {path} (write one with `polyspec bench -c CONFIG --write-prompts {path}`)")
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PolyspecError(f"{path} line {number}: malformed JSON: {exc.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise PolyspecError(f'{path} line {number}: expected {{"prompt": "..."}} (with an optional "class": "code" | "prose")')
        prompts.append(BenchPrompt(record["prompt"], str(record.get("class", "unknown")), record.get("source")))
    if not prompts:
        raise PolyspecError(f"prompts file {path} has no prompts")
    return prompts


def measured_prompts(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """The prompts bench measures (and `polyspec tune` tunes and holds out): every class but
    SHIFT_ONLY_CLASSES, whose prompts (tables an n-gram drafter copies) exist for the shift
    test alone and would flatter the drafter in an average."""
    return [prompt for prompt in prompts if prompt.kind not in SHIFT_ONLY_CLASSES]


def quick_subset(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """The first QUICK_PROMPTS[class] prompts of each class (all classes kept)."""
    taken: dict[str, int] = {}
    subset = []
    for prompt in prompts:
        if taken.get(prompt.kind, 0) < QUICK_PROMPTS.get(prompt.kind, 1):
            taken[prompt.kind] = taken.get(prompt.kind, 0) + 1
            subset.append(prompt)
    return subset
