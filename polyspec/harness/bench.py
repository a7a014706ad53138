"""`polyspec bench`: polyspec side by side with what a user would run instead.

Every system runs on the same prompts, interleaved: for each prompt and repeat, every
system generates back to back (in a rotating order), so machine noise hits all alike.

    target                    our engine, the target alone (no speculation): the baseline
    hf-generate               transformers `generate()` on the same target weights
    hf-assisted:<tier>        transformers assisted generation, a model drafter of the chain
                              (its defaults; `@k<k>`: a constant k-token draft, our length)
    hf-prompt-lookup          transformers prompt-lookup decoding
    polyspec:<tiers>          our chain: the target with each drafter, and the full chain,
                              with the config's fixed lengths (and `@auto` with the goodput planner)

Each system generates exactly `max_new_tokens` tokens: end-of-sequence is disabled
everywhere (our scheduler gets no EOS ids; transformers gets `eos_token_id=None`), so
no system stops early and token counts compare. Per system and temperature the report
gives tokens/s (median over prompts x repeats), the speedup over `target`, our mean
accepted length per stage (draft tokens accepted per verified block), and, for greedy,
whether every output equals the target's own greedy output.

The prompts are bench_prompts' (they ship with the demo family); the systems are
bench_systems'.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from polyspec.harness.bench_prompts import SHIFT_ONLY_CLASSES, BenchPrompt, measured_prompts, quick_subset, read_prompts, write_prompts
from polyspec.harness.bench_systems import EngineSystem, HFSystem, System, build_systems
from polyspec.harness.real_report import cpu_name
from polyspec.orchestrator.config import ChainConfig
from polyspec.workers.core.errors import PolyspecError
from polyspec.orchestrator.tokenization import encode_prompt

QUICK_MAX_NEW_TOKENS = 64
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_REPEATS = 1  # 40 prompts already give a stable median; raise it with --repeats
DEFAULT_TEMPERATURES = (0.0, 1.0)
WARMUP_TOKENS = 8
EOS_POLICY = "disabled in every system: polyspec scheduler eos_token_ids = {}; transformers eos_token_id = None"


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    repeats: int = DEFAULT_REPEATS
    threads: int = 1
    seed: int = 0
    warmup: bool = True
    tuned: bool = True  # also the `lengths: auto` chains


# ----------------------------------------------------------------------------- running


def _tokenize(system: EngineSystem, prompts: list[BenchPrompt]) -> list[list[int]]:
    return [encode_prompt(system.engine.tokenizer, p.text) for p in prompts]


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
        "cpu": cpu_name(),
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
