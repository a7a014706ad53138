"""`polyspec bench`: polyspec side by side with what a user would run instead (issue 3).

Every system runs on the same prompts, interleaved: for each prompt and repeat, every
system generates back to back (in a rotating order), so machine noise hits all alike.

    target                    our engine, the target alone (no speculation): the baseline
    hf-generate               transformers `generate()` on the same target weights
    hf-assisted:<tier>        transformers assisted generation, a model drafter of the chain
                              (its defaults; `@k<k>`: a constant k-token draft, our length)
    hf-prompt-lookup          transformers prompt-lookup decoding
    polyspec:<tiers>          our chain: the target with each drafter, and the full chain,
                              with the config's fixed lengths (and `@auto` with the tuner)

Each system generates exactly `max_new_tokens` tokens: end-of-sequence is disabled
everywhere (our scheduler gets no EOS ids; transformers gets `eos_token_id=None`), so
no system stops early and token counts compare. Per system and temperature the report
gives tokens/s (median over prompts x repeats), the speedup over `target`, our mean
accepted length per stage (draft tokens accepted per verified block), and, for greedy,
whether every output equals the target's own greedy output.

The prompts ship with the demo family (`models/stdlib/prompts.jsonl`, `{"prompt", "class"}`
lines): code-completion prompts cut at function / class boundaries from standard-library
files the family never trained on, plus free-text English prompts (`write_prompts`); its
"repetitive-code" rows (held-out code-page tables) are for `polyspec tune`'s shift test
and are not measured here (`measured_prompts`).
"""

from __future__ import annotations

import abc
import ast
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from polyspec.orchestrator.config import ChainConfig, TierConfig
from polyspec.workers.core.errors import PolyspecError

QUICK_PROMPTS = {"code": 4, "prose": 2}  # --quick: the first prompts of each class (about a minute in all)
REPETITIVE_CODE = "repetitive-code"  # the class of REPETITIVE_CUTS' prompts
SHIFT_ONLY_CLASSES = (REPETITIVE_CODE,)  # prompts for `polyspec tune`'s code -> prose test alone (see measured_prompts)
QUICK_MAX_NEW_TOKENS = 64
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_REPEATS = 1  # 40 prompts already give a stable median; raise it with --repeats
DEFAULT_TEMPERATURES = (0.0, 1.0)
WARMUP_TOKENS = 8
HF_PROMPT_LOOKUP_TOKENS = 10  # the value transformers' documentation uses
EOS_POLICY = "disabled in every system: polyspec scheduler eos_token_ids = {}; transformers eos_token_id = None"
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


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    repeats: int = DEFAULT_REPEATS
    threads: int = 1
    seed: int = 0
    warmup: bool = True
    tuned: bool = True  # also the `lengths: auto` chains


@dataclasses.dataclass
class RunOutcome:
    """One generation by one system."""

    token_ids: list[int]
    seconds: float
    stages: list[dict] | None = None  # our scheduler's per-stage stats; None for transformers
    tier_busy_s: dict[str, float] | None = None  # our tiers' forward / lookup seconds


@dataclasses.dataclass
class Skipped:
    system: str
    reason: str


# ----------------------------------------------------------------------------- systems


class System(abc.ABC):
    """Something that continues a prompt with exactly `max_new_tokens` tokens."""

    name: str
    lengths: list[int] | str | None = None  # our speculation lengths, for the report

    @abc.abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> RunOutcome:
        """Generate and time one continuation."""


class EngineSystem(System):
    """Our engine (target alone, or a chain) with end-of-sequence disabled."""

    def __init__(self, name: str, config: ChainConfig, speculative: bool = True) -> None:
        from polyspec.orchestrator.engine import Engine

        self.name = name
        self.engine = Engine(config, speculative=speculative)
        self.engine.scheduler.eos_token_ids = frozenset()  # generate exactly max_new_tokens
        if speculative:
            self.lengths = "auto" if config.speculation.lengths == "auto" else list(self.engine.scheduler.lengths)

    def generate(self, prompt_ids, max_new_tokens, temperature, seed):
        request = self.engine.parse_request(
            {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0, "top_k": 0, "seed": seed}
        )
        started = time.perf_counter()
        result = self.engine.generate(request)
        seconds = time.perf_counter() - started
        stats = result["stats"]
        busy = {tier["tier"]: tier["busy_s"] for tier in stats["tiers"]}
        return RunOutcome(result["token_ids"], seconds, stats["stages"] or None, busy)


class HFSystem(System):
    """transformers `generate()` on the target, optionally assisted (`assistant_model=` / prompt lookup)."""

    def __init__(self, name: str, model, **generate_kwargs) -> None:
        self.name = name
        self.model = model
        self.generate_kwargs = generate_kwargs

    def generate(self, prompt_ids, max_new_tokens, temperature, seed):
        import torch

        sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)  # [1, T]
        torch.manual_seed(seed)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                **sampling,
                **self.generate_kwargs,
            )
        seconds = time.perf_counter() - started
        return RunOutcome(output[0, len(prompt_ids) :].tolist(), seconds)


def _without_eos(model):
    """`eos_token_id=None` in a `generate()` call falls back to the model's generation config, so clear it there."""
    model.generation_config.eos_token_id = None
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = 0  # batch of one: never used, but keeps generate() quiet
    return model


def _hf_model(tier: TierConfig):
    """A tier's model exactly as our loader builds it (dtype, int8), for transformers to drive."""
    from polyspec.workers.tiers.loading import load_model_tier

    return _without_eos(load_model_tier(tier).model)


def _with_lengths(config: ChainConfig, tiers: tuple[TierConfig, ...], lengths) -> ChainConfig:
    speculation = dataclasses.replace(config.speculation, lengths=lengths)
    return dataclasses.replace(config, tiers=tiers, speculation=speculation)


def polyspec_chains(config: ChainConfig) -> list[tuple[str, ChainConfig]]:
    """(system name, config): the target with each drafter, then the full chain.

    A two-tier chain target+X uses the length the full chain gives the stage that verifies X.
    """
    fixed = config.speculation_lengths()
    target = config.tiers[0]
    chains = []
    for index, drafter in enumerate(config.tiers[1:], start=1):
        chains.append((f"polyspec:{target.name}+{drafter.name}", _with_lengths(config, (target, drafter), (fixed[index - 1],))))
    if len(config.tiers) > 2:
        chains.append(("polyspec:" + "+".join(t.name for t in config.tiers), _with_lengths(config, config.tiers, tuple(fixed))))
    return chains


@contextlib.contextmanager
def shared_model_tiers(loaded: dict):
    """Engines built inside load each model tier once (`loaded` keeps them between uses).

    Our systems then share their model tiers, as the transformers systems share the target
    model: loading is most of `--quick`'s start-up. Sharing is safe: a tier keeps one cache
    per sequence id (unique per request) and the scheduler counts busy time per request."""
    import polyspec.workers.tiers.loading as loading

    original = loading.load_model_tier

    def load(tier, vocab_size=None):
        key = (tier.name, tier.model, tier.dtype, tier.quantize, tier.device, tier.threads, vocab_size)
        if key not in loaded:
            loaded[key] = original(tier, vocab_size)
        return loaded[key]

    loading.load_model_tier = load
    try:
        yield
    finally:
        loading.load_model_tier = original


def build_systems(config: ChainConfig, notes: list[str], tuned: bool = True) -> tuple[list[System], list[Skipped]]:
    """Load every system of the comparison; `notes` collects what the report must say.
    `tuned`: also the chains with `lengths: auto` (left out of `--quick`)."""
    loaded: dict = {}
    with shared_model_tiers(loaded):
        systems: list[System] = [EngineSystem("target", config, speculative=False)]
    peers, skipped = hf_systems(config, notes)
    systems += peers
    with shared_model_tiers(loaded):
        for name, chain_config in polyspec_chains(config):
            systems.append(EngineSystem(name, chain_config))
        if tuned:
            systems += auto_systems(config, notes)
        else:
            notes.append("--quick: the chains with lengths: auto are left out (`polyspec bench` without --quick, or `polyspec tune`, measures them)")
    return systems, skipped


def hf_systems(config: ChainConfig, notes: list[str]) -> tuple[list[System], list[Skipped]]:
    """transformers on the same target weights: plain; assisted by each model drafter, with
    its defaults and (`@k<k>`) with the length our two-tier chain uses; prompt lookup."""
    target_model = _hf_model(config.tiers[0])
    systems: list[System] = [HFSystem("hf-generate", target_model)]
    skipped: list[Skipped] = []
    fixed = config.speculation_lengths()
    for index, tier in enumerate(config.tiers[1:]):
        name = f"hf-assisted:{tier.name}"
        if tier.is_ngram:
            skipped.append(Skipped(name, "model-free n-gram tier: transformers' counterpart is hf-prompt-lookup"))
            continue
        systems.append(HFSystem(name, target_model, assistant_model=_hf_model(tier)))
        systems.append(HFSystem(f"{name}@k{fixed[index]}", target_model, assistant_model=_fixed_length_assistant(tier, fixed[index])))
    lookup = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}
    ngram = next((t for t in config.tiers if t.is_ngram), None)
    if ngram is not None:
        lookup["max_matching_ngram_size"] = ngram.max_ngram
    systems.append(HFSystem("hf-prompt-lookup", target_model, **lookup))
    notes.append(
        f"hf-prompt-lookup: {json.dumps(lookup)}; hf-assisted:<tier>: transformers defaults (heuristic schedule); "
        "hf-assisted:<tier>@k<k>: num_assistant_tokens k, constant schedule, assistant_confidence_threshold 0"
    )
    return systems, skipped


def _fixed_length_assistant(tier: TierConfig, length: int):
    """An assistant that always drafts `length` tokens, like our fixed-length stage."""
    model = _hf_model(tier)
    model.generation_config.num_assistant_tokens = length
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0  # no early exit on low confidence
    return model


def auto_systems(config: ChainConfig, notes: list[str]) -> list[System]:
    """The chains again with `lengths: auto`, if this engine tunes (its scheduler has a tuner)."""
    chains = polyspec_chains(config)
    systems: list[System] = []
    for name, chain_config in chains:
        system = EngineSystem(name + "@auto", _with_lengths(chain_config, chain_config.tiers, "auto"))
        if getattr(system.engine.scheduler, "tuner", None) is None:
            notes.append("speculation.lengths: auto not measured: this engine has no tuner yet (fixed lengths only)")
            return []
        systems.append(system)
    return systems


# ----------------------------------------------------------------------------- prompts


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
        count = len(tokenizer(candidate, add_special_tokens=False)["input_ids"])
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


# ----------------------------------------------------------------------------- running


def _tokenize(system: EngineSystem, prompts: list[BenchPrompt]) -> list[list[int]]:
    return [system.engine.tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]


def _check_room(config_limit: int | None, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    longest = max(len(ids) for ids in prompt_ids)
    if config_limit is not None and longest + max_new_tokens >= config_limit:
        raise PolyspecError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) does not fit the model context ({config_limit})"
        )


def measure(systems: list[System], prompt_ids: list[list[int]], settings: BenchSettings) -> dict[tuple[str, float], list[dict]]:
    """Interleaved runs: {(system, temperature): [{prompt, repeat, tokens_per_s, token_ids, stages}]}."""
    from tqdm import tqdm

    if settings.warmup:
        for system in systems:
            for temperature in settings.temperatures:
                system.generate(prompt_ids[0], WARMUP_TOKENS, temperature, settings.seed)
    runs: dict[tuple[str, float], list[dict]] = {(s.name, t): [] for s in systems for t in settings.temperatures}
    total = len(prompt_ids) * settings.repeats * len(settings.temperatures) * len(systems)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=None)
    turn = 0
    for prompt_index, ids in enumerate(prompt_ids):
        for repeat in range(settings.repeats):
            seed = settings.seed + 1000 * prompt_index + repeat
            for temperature in settings.temperatures:
                order = systems[turn % len(systems) :] + systems[: turn % len(systems)]  # rotate: no fixed first / last
                turn += 1
                for system in order:
                    cpu_started = time.process_time()
                    outcome = system.generate(ids, settings.max_new_tokens, temperature, seed)
                    cpu_seconds = time.process_time() - cpu_started
                    runs[(system.name, temperature)].append(
                        {
                            "prompt": prompt_index,
                            "repeat": repeat,
                            "tokens_per_s": len(outcome.token_ids) / outcome.seconds,
                            "cpu_tokens_per_s": len(outcome.token_ids) / max(cpu_seconds, 1e-9),
                            "token_ids": outcome.token_ids,
                            "stages": outcome.stages,
                            "seconds": outcome.seconds,
                            "tier_busy_s": outcome.tier_busy_s,
                        }
                    )
                    bar.update(1)
    bar.close()
    return runs


def mean_accepted_lengths(runs: list[dict]) -> dict[str, float] | None:
    """Per stage ("verifier<-drafter"): draft tokens accepted per verified block, pooled over runs."""
    totals: dict[str, list[int]] = {}
    for run in runs:
        for stage in run["stages"] or []:
            key = f"{stage['tier']}<-{stage['drafter']}"
            accepted_blocks = totals.setdefault(key, [0, 0])
            accepted_blocks[0] += stage["accepted"]
            accepted_blocks[1] += stage["blocks"]
    if not totals:
        return None
    return {key: round(accepted / blocks, 3) if blocks else 0.0 for key, (accepted, blocks) in totals.items()}


def time_split(runs: list[dict]) -> dict[str, float] | None:
    """Milliseconds per generated token inside each tier, and outside every tier ("other": scheduling, sampling)."""
    if not runs or runs[0]["tier_busy_s"] is None:
        return None
    tokens = sum(len(r["token_ids"]) for r in runs)
    split = {}
    for name in runs[0]["tier_busy_s"]:
        split[name] = sum(r["tier_busy_s"][name] for r in runs)
    split["other"] = sum(r["seconds"] for r in runs) - sum(split.values())
    return {name: round(1000 * seconds / tokens, 3) for name, seconds in split.items()}


def summarize(systems: list[System], runs: dict[tuple[str, float], list[dict]], settings: BenchSettings) -> list[dict]:
    """One result row per (system, temperature)."""
    rows = []
    for temperature in settings.temperatures:
        target_runs = runs[("target", temperature)]
        target_tps = statistics.median(r["tokens_per_s"] for r in target_runs)
        reference = {(r["prompt"], r["repeat"]): r["token_ids"] for r in target_runs}
        for system in systems:
            system_runs = runs[(system.name, temperature)]
            tps = statistics.median(r["tokens_per_s"] for r in system_runs)
            equal = all(r["token_ids"] == reference[(r["prompt"], r["repeat"])] for r in system_runs) if temperature == 0 else None
            is_hf = isinstance(system, HFSystem)
            rows.append(
                {
                    "system": system.name,
                    "temperature": temperature,
                    "tokens_per_s": round(tps, 2),
                    "speedup_vs_target": round(tps / target_tps, 3),
                    # tokens per second of this process's CPU time: what the run would give with
                    # the cores to itself (a diagnostic for a shared machine; ratios use tokens_per_s)
                    "cpu_tokens_per_s": round(statistics.median(r["cpu_tokens_per_s"] for r in system_runs), 2),
                    "mean_accepted_length": None if is_hf else mean_accepted_lengths(system_runs),
                    "greedy_equal": equal,
                    "lengths": system.lengths,
                    "ms_per_token_by_tier": time_split(system_runs),
                    "runs": len(system_runs),
                    "tokens_per_s_min_max": [round(min(r["tokens_per_s"] for r in system_runs), 2), round(max(r["tokens_per_s"] for r in system_runs), 2)],
                }
            )
    return rows


def machine_info(threads: int, dtype: str, device: str) -> dict:
    import torch
    import transformers

    if device == "cuda":
        device = f"cuda ({torch.cuda.get_device_name()})"
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews every system alike, but see it
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _display_path(path: str) -> str:
    try:
        return os.path.relpath(path) if os.path.isabs(path) else path
    except ValueError:
        return path


def config_summary(config: ChainConfig) -> dict:
    return {
        "source": config.source,
        "tiers": [
            {"name": t.name, "model": _display_path(t.model), "dtype": t.dtype, "quantize": t.quantize}
            for t in config.tiers
        ],
        "speculation": {"lengths": list(config.speculation_lengths()) if not isinstance(config.speculation.lengths, str) else config.speculation.lengths,
                        "tree_width": config.speculation.tree_width, "verifier": config.speculation.verifier},
    }


def with_threads(config: ChainConfig, threads: int) -> ChainConfig:
    """Every tier runs with the bench's thread count (recorded in the report)."""
    return dataclasses.replace(config, tiers=tuple(dataclasses.replace(t, threads=threads) for t in config.tiers))


def run_bench(config: ChainConfig, prompts: list[BenchPrompt], settings: BenchSettings, prompts_source: str | None = None) -> dict:
    """Load every system, run the interleaved comparison, return the report (JSON-ready)."""
    import torch

    from polyspec.workers.tiers.loading import quiet_transformers

    quiet_transformers()
    torch.set_num_threads(settings.threads)
    config = with_threads(config, settings.threads)
    notes: list[str] = []
    systems, skipped = build_systems(config, notes, settings.tuned)
    target = systems[0]
    prompt_ids = _tokenize(target, prompts)
    _check_room(target.engine.scheduler.max_context, prompt_ids, settings.max_new_tokens)
    runs = measure(systems, prompt_ids, settings)
    classes: dict[str, int] = {}
    for prompt in prompts:
        classes[prompt.kind] = classes.get(prompt.kind, 0) + 1
    return {
        "machine": machine_info(settings.threads, config.tiers[0].dtype, target_device(config)),
        "config": config_summary(config),
        "settings": {
            "prompts": prompts_source,
            "prompt_classes": classes,
            "prompt_tokens_mean": round(statistics.mean(len(ids) for ids in prompt_ids), 1),
            "max_new_tokens": settings.max_new_tokens,
            "temperatures": list(settings.temperatures),
            "repeats": settings.repeats,
            "seed": settings.seed,
            "eos": EOS_POLICY,
            "sampling": "temperature T, top_k 0, top_p 1 (transformers: do_sample=True, top_k=0, top_p=1.0)",
            "tokens_per_s": "median over prompts x repeats of new tokens / wall seconds of one generate call",
        },
        "skipped": [dataclasses.asdict(s) for s in skipped],
        "notes": notes,
        "results": summarize(systems, runs, settings),
    }


# ----------------------------------------------------------------------------- outputs


def _format_accepted(value: dict | None) -> str:
    return "—" if not value else ", ".join(f"{stage} {length:.2f}" for stage, length in value.items())


def _format_split(value: dict | None) -> str:
    return "—" if not value else ", ".join(f"{name} {ms:.2f}" for name, ms in value.items())


def markdown_table(report: dict) -> str:
    machine, settings = report["machine"], report["settings"]
    classes = ", ".join(f"{n} {kind}" for kind, n in settings["prompt_classes"].items())
    lines = [
        f"# polyspec bench: {report['config']['source'] or 'config'}",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch thread(s), {machine['device']}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}; "
        f"dtype {machine['dtype']}; {machine['date']}; load average {machine.get('load_average_1m', '?')} at the end.",
        "",
        f"Prompts: {classes} ({settings['prompts']}), x {settings['repeats']} repeat(s), "
        f"{settings['max_new_tokens']} new tokens each; EOS {settings['eos']}.",
        f"tokens/s: {settings['tokens_per_s']}. Mean accepted length: draft tokens accepted per verified block, per stage. "
        "ms/token by tier: our wall time per generated token inside each tier's forwards / lookups, and outside them (other). "
        "CPU tokens/s: tokens per second of this process's CPU time (median), what each system would reach with a core "
        "to itself; on a shared machine the gap to tokens/s is time the OS gave to other work.",
        "",
        "| system | T | tokens/s | speedup vs target | mean accepted length | greedy equal | ms/token by tier | CPU tokens/s |",
        "|---|---:|---:|---:|---|:---:|---|---:|",
    ]
    for row in report["results"]:
        equal = {True: "yes", False: "**NO**", None: "—"}[row["greedy_equal"]]
        lines.append(
            f"| {row['system']} | {row['temperature']:g} | {row['tokens_per_s']:.1f} | {row['speedup_vs_target']:.2f}x "
            f"| {_format_accepted(row['mean_accepted_length'])} | {equal} | {_format_split(row['ms_per_token_by_tier'])} "
            f"| {row.get('cpu_tokens_per_s', float('nan')):.1f} |"
        )
    for item in report["skipped"]:
        lines.append(f"\nSkipped {item['system']}: {item['reason']}.")
    for note in report["notes"]:
        lines.append(f"\nNote: {note}.")
    return "\n".join(lines) + "\n"


def write_plot(report: dict, path: str) -> None:
    """Horizontal bars of tokens/s, one panel per temperature, with the target's rate as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({row["temperature"] for row in report["results"]})
    systems = list(dict.fromkeys(row["system"] for row in report["results"]))
    figure, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 0.45 * len(systems) + 1.6), sharey=True, squeeze=False)
    for axis, temperature in zip(axes[0], temperatures):
        rows = {row["system"]: row for row in report["results"] if row["temperature"] == temperature}
        rates = [rows[name]["tokens_per_s"] for name in systems]
        colors = ["tab:blue" if n.startswith("polyspec") else "tab:gray" if n == "target" else "tab:orange" for n in systems]
        axis.barh(systems, rates, color=colors)
        axis.axvline(rows["target"]["tokens_per_s"], color="black", linestyle="--", linewidth=1)
        for position, name in enumerate(systems):
            axis.text(rows[name]["tokens_per_s"], position, f" {rows[name]['speedup_vs_target']:.2f}x", va="center", fontsize=8)
        axis.set_title(f"temperature {temperature:g}")
        axis.set_xlabel("tokens/s (median)")
    axes[0][0].invert_yaxis()  # the axes share y: inverting each would undo it
    machine = report["machine"]
    figure.suptitle(f"polyspec bench: {machine['cpu']}, {machine['threads']} thread(s), {machine['dtype']}", fontsize=10)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(report: dict, json_path: str | None, markdown_path: str | None, plot_path: str | None) -> None:
    for path in (json_path, markdown_path, plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if markdown_path:
        Path(markdown_path).write_text(markdown_table(report), encoding="utf-8")
    if plot_path:
        write_plot(report, plot_path)


# ----------------------------------------------------------------------------- CLI


def default_prompts_path(config: ChainConfig) -> str:
    """The family's prompt set ships next to its models: <target dir>/../prompts.jsonl."""
    return str(Path(config.tiers[0].model).parent / "prompts.jsonl")


def target_device(config: ChainConfig) -> str:
    from polyspec.workers.tiers.loading import resolve_device

    return resolve_device(config.tiers[0].device).type


def default_output_stem(config: ChainConfig, quick: bool) -> str:
    """benchmarks/<device>-<config name>[-quick], e.g. benchmarks/cpu-demo."""
    stem = Path(config.source).stem if config.source else "bench"
    return f"benchmarks/{target_device(config)}-{stem}{'-quick' if quick else ''}"


def settings_from_args(args) -> BenchSettings:
    if args.threads < 1:
        raise PolyspecError(f"--threads must be >= 1, got {args.threads}")
    max_new = args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else DEFAULT_MAX_NEW_TOKENS)
    repeats = args.repeats or (1 if args.quick else DEFAULT_REPEATS)
    temperatures = tuple(args.temperature) if args.temperature else DEFAULT_TEMPERATURES
    if max_new < 1 or repeats < 1:
        raise PolyspecError("--max-new-tokens and --repeats must be >= 1")
    if any(not t >= 0 for t in temperatures):
        raise PolyspecError(f"--temperature must be >= 0, got {list(temperatures)}")
    if 0.0 not in temperatures:
        temperatures = (0.0, *temperatures)  # greedy_equal and the reference need the greedy runs
    return BenchSettings(max_new_tokens=max_new, temperatures=temperatures, repeats=repeats, threads=args.threads, tuned=not args.quick)


def cmd_bench(args) -> int:
    """`polyspec bench`: see the module docstring."""
    from polyspec.orchestrator.config import load_config

    config = load_config(args.config)
    if args.write_prompts:
        prompts = write_prompts(args.write_prompts, config.tiers[0].model)
        print(f"wrote {len(prompts)} prompts to {args.write_prompts}")
        return 0
    prompts_path = args.prompts or default_prompts_path(config)
    prompts = measured_prompts(read_prompts(prompts_path))
    if not prompts:
        raise PolyspecError(f"prompts file {prompts_path} has only {', '.join(SHIFT_ONLY_CLASSES)} prompts (the tune shift test's)")
    if args.quick:
        prompts = quick_subset(prompts)
    report = run_bench(config, prompts, settings_from_args(args), _display_path(prompts_path))
    outputs = (args.json, args.markdown, args.plot)
    if not any(outputs):
        stem = default_output_stem(config, args.quick)
        outputs = (f"{stem}.json", f"{stem}.md", f"{stem}.png")
    write_outputs(report, *outputs)
    print(markdown_table(report))
    return 0
