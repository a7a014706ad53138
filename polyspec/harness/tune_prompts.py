"""`polyspec tune`'s prompt sets: the tuning set, the held-out set and the shift test's halves.

Prompt file: JSONL, one `{"prompt": "..."}` object per line, optionally with a `"class"`
-- the format of `models/stdlib/prompts.jsonl`, the set that ships with the demo family and
the default (found beside the target model's folder); with no such file a few built-in
code prompts are used. The tuning and held-out sets are evenly spaced through the prompts of
every class but "repetitive-code"; the shift test runs that class's prompts (evenly spaced),
else the held-out "code" prompts, then "prose" prompts from outside the tuning set.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from polyspec.harness.bench_prompts import REPETITIVE_CODE, SHIFT_ONLY_CLASSES
from polyspec.harness.bench_prompts import read_prompts as read_bench_prompts
from polyspec.harness.tune_measure import TuneError
from polyspec.orchestrator.config import ChainConfig

BUILTIN_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the given folders.\"\"\"\n    for folder in argv[1:]:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "def parse_header(line):\n    \"\"\"Split 'Name: value' into a (name, value) pair.\"\"\"\n    name, _, value = line.partition(':')\n",
    "    def test_round_trip(self):\n        data = {'a': 1, 'b': [1, 2, 3]}\n        self.assertEqual(json.loads(json.dumps(data)), data)\n\n    def test_",
)


def default_prompts_path(config: ChainConfig) -> Path:
    """The family's prompt set ships next to its models: <target dir>/../prompts.jsonl."""
    return Path(config.tiers[0].model).parent / "prompts.jsonl"


def _classed_prompts(path: str | None, config: ChainConfig) -> tuple[list[tuple[str, str]], str]:
    """[(text, class)] of the prompt file (or the built-in code prompts), and where they came from."""
    if path is not None:
        if not Path(path).exists():
            raise TuneError(f"prompts file not found: {path}")
        source = path
    elif default_prompts_path(config).exists():
        source = str(default_prompts_path(config))
    else:
        return [(text, "code") for text in BUILTIN_PROMPTS], "built-in code prompts"
    return [(entry.text, entry.kind) for entry in read_bench_prompts(source)], source


def _evenly(items: list, count: int) -> list:
    if len(items) <= count:
        return list(items)
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def _tuning_classes(classed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every prompt but the shift test's own class (bench_prompts.SHIFT_ONLY_CLASSES): the sets picked
    from these stay what they were before a file gained that class."""
    return [(text, kind) for text, kind in classed if kind not in SHIFT_ONLY_CLASSES]


@dataclasses.dataclass
class PromptSets:
    """The tuning set (grid, calibration), a disjoint held-out set (best grid point vs
    `lengths: auto`), and a code-then-prose sequence from outside the tuning set (the shift test:
    its code half is the "repetitive-code" class, text the n-gram drafter's copies continue
    even at T = 1, where the file has one, else held-out "code" prompts)."""

    tuning: list[str]
    heldout: list[str]  # empty when the file has no prompts left over
    shift_code: list[str]
    shift_prose: list[str]
    source: str


def split_prompts(path: str | None, config: ChainConfig, max_prompts: int, heldout_prompts: int | None = None) -> PromptSets:
    """`max_prompts` tuning prompts, evenly spaced; `heldout_prompts` (default: as many)
    held-out ones, evenly spaced through the rest; the shift test's code and prose halves."""
    everything, source = _classed_prompts(path, config)
    classed = _tuning_classes(everything)
    repetitive = [text for text, kind in everything if kind == REPETITIVE_CODE]
    half = max(1, max_prompts // 2)
    tuning_index = set(_evenly(range(len(classed)), max_prompts))
    rest = [i for i in range(len(classed)) if i not in tuning_index]
    heldout_index = _evenly(rest, heldout_prompts or max_prompts)
    heldout = [classed[i] for i in heldout_index]
    return PromptSets(
        tuning=[classed[i][0] for i in sorted(tuning_index)],
        heldout=[text for text, _ in heldout],
        shift_code=_evenly(repetitive, half) if repetitive else [text for text, kind in heldout if kind == "code"][:half],
        shift_prose=[classed[i][0] for i in rest if classed[i][1] == "prose"][:half],
        source=source,
    )

