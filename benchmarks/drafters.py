"""The trained drafters against the demo family's other drafters, in one interleaved run.

    python benchmarks/drafters.py [--prompts 4] [--tokens 40] [--full] [--out benchmarks/drafters]
    taskset -c 1 env OMP_NUM_THREADS=1 python benchmarks/drafters.py --judged   # the judged run

Chains over the stdlib target (models/stdlib): the target alone; with `small`, the int8
copy, the n-gram tier and the demo chain (no trained drafter); with the feature head
(FSPAD loss; and the EAGLE-loss ablation), the early-exit drafter, chains of them with
cheaper tiers under them and their trees (`--full`). Every system decodes the same
held-out `code` prompts at T = 0 and T = 1, interleaved (polyspec.harness.bench.measure:
rotating order per prompt), EOS ignored. A system whose checkpoint is missing is skipped.

Per system and temperature: tokens/s (median), speedup over the target alone, and per
stage the mean accepted length, the acceptance per position (P(accepted >= j)) and the
mean block length (proposed / blocks: below k for the early-exit drafter). The feature
head, `small` and the ablation run at the same k so their acceptance compares directly.
Also: each trained drafter's extra parameters and training cost (from its drafter.json),
and the machine's load average before and after (the machine is shared: ratios within
this run are what to read).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILY = REPO / "models" / "stdlib"
DRAFTERS = FAMILY / "drafters"

TARGET = {"name": "target", "model": str(FAMILY / "target"), "threads": 1}
SMALL = {"name": "small", "model": str(FAMILY / "small"), "threads": 1}
INT8 = {"name": "int8", "model": str(FAMILY / "target"), "quantize": "int8", "threads": 1}
NGRAM = {"name": "ngram", "model": "ngram", "max_ngram": 3}
FEATURE = {"name": "feature", "model": {"feature_head": str(DRAFTERS / "feature")}, "threads": 1}
FEATURE_EAGLE = {"name": "feature-eagle", "model": {"feature_head": str(DRAFTERS / "feature-eagle")}, "threads": 1}
EXIT_THRESHOLD = 0.3
K = 4  # the common length of the acceptance comparison
JUDGED = {"prompts": 12, "tokens": 64, "full": True}  # --judged: the comparison


def early_exit() -> dict:
    return {"name": "early-exit", "model": {"early_exit": str(DRAFTERS / "early-exit"), "exit_threshold": EXIT_THRESHOLD}, "threads": 1}


def systems_spec(full: bool) -> list[tuple[str, list[dict], dict, bool]]:
    """(name, tiers target first, the speculation section, has a trained drafter)."""
    specs = [
        (f"target+small@{K}", [TARGET, SMALL], {"lengths": [K]}, False),
        ("target+int8+ngram@12,10", [TARGET, INT8, NGRAM], {"lengths": [12, 10]}, False),  # the demo chain
        (f"target+feature@{K}", [TARGET, FEATURE], {"lengths": [K]}, True),
        (f"target+feature-eagle@{K}", [TARGET, FEATURE_EAGLE], {"lengths": [K]}, True),
        ("target+feature+ngram@4,6", [TARGET, FEATURE, NGRAM], {"lengths": [4, 6]}, True),
        ("target+early-exit@6", [TARGET, early_exit()], {"lengths": [6]}, True),
    ]
    if full:
        specs += [
            # more chains without a trained drafter: the best of them is the bar's baseline
            ("target+int8@12", [TARGET, INT8], {"lengths": [12]}, False),
            ("target+ngram@6", [TARGET, NGRAM], {"lengths": [6]}, False),
            ("target+small+ngram@4,6", [TARGET, SMALL, NGRAM], {"lengths": [4, 6]}, False),
            # trained drafters with cheaper tiers under them, and as the last tier of a tree
            ("target+early-exit+ngram@6,6", [TARGET, early_exit(), NGRAM], {"lengths": [6, 6]}, True),
            ("target+feature+early-exit@4,4", [TARGET, FEATURE, early_exit()], {"lengths": [4, 4]}, True),
            ("target+feature tree w2@4", [TARGET, FEATURE], {"lengths": [4], "tree_width": 2}, True),
            ("target+early-exit tree w2@6", [TARGET, early_exit()], {"lengths": [6], "tree_width": 2}, True),
        ]
    present = lambda tiers: all(Path(next(iter(t["model"].values()))).is_dir() for t in tiers if isinstance(t["model"], dict))  # noqa: E731
    return [spec for spec in specs if present(spec[1])]


def drafter_costs() -> dict:
    costs = {}
    for name in ("feature", "feature-eagle", "early-exit"):
        path = DRAFTERS / name / "drafter.json"
        if path.exists():
            meta = json.loads(path.read_text())
            training = meta.get("training", {})
            costs[name] = {
                "extra_parameters": training.get("extra_parameters"),
                "train_steps": training.get("steps"),
                "train_tokens": training.get("tokens"),
                "train_seconds": training.get("train_seconds"),
                "train_device": training.get("device") or "cpu",
                "loss": training.get("loss"),
                "layers": meta.get("layers"),
                "held_out": training.get("held_out"),
                "sweep": {k: v.get("speedup_vs_target_T0") for k, v in (meta.get("sweep") or {}).items()} or None,
            }
    return costs


def run(prompts: int, tokens: int, full: bool) -> dict:
    from polyspec.harness.bench import BenchSettings, measure
    from polyspec.harness.bench_systems import EngineSystem
    from polyspec.harness.draft_report import held_out_prompts, stage_summary
    from polyspec.orchestrator.config import parse_config
    from polyspec.orchestrator.tokenization import encode_prompt

    load_before = os.getloadavg()
    base = parse_config({"tiers": [TARGET], "speculation": {"lengths": []}})
    systems = [EngineSystem("target", base, speculative=False)]
    flags = {"target": False}
    for name, tiers, speculation, trained in systems_spec(full):
        systems.append(EngineSystem(name, parse_config({"tiers": tiers, "speculation": speculation})))
        flags[name] = trained
    texts = held_out_prompts(str(FAMILY / "target"), prompts)
    tokenizer = systems[0].engine.tokenizer
    prompt_ids = [encode_prompt(tokenizer, t) for t in texts]
    settings = BenchSettings(max_new_tokens=tokens, temperatures=(0.0, 1.0), repeats=1, threads=1)
    runs = measure(systems, prompt_ids, settings)
    rows = []
    for system in systems:
        for temperature in settings.temperatures:
            done = runs[(system.name, temperature)]
            speed = statistics.median(r["tokens_per_s"] for r in done)
            base_speed = statistics.median(r["tokens_per_s"] for r in runs[("target", temperature)])
            stages = {}
            for run_ in done:
                for stage in run_["stages"] or []:
                    stages.setdefault(f"{stage['tier']}<-{stage['drafter']}", []).append(stage)
            rows.append(
                {
                    "system": system.name,
                    "temperature": temperature,
                    "trained_drafter": flags[system.name],
                    "tokens_per_s": round(speed, 2),
                    "speedup": round(speed / base_speed, 3),
                    "stages": {key: stage_summary(value) for key, value in stages.items()},
                }
            )
    return {
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "threads": 1, "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "settings": {"prompts": len(prompt_ids), "max_new_tokens": tokens, "full": full, "temperatures": list(settings.temperatures), "exit_threshold": EXIT_THRESHOLD, "k": K},
        "drafters": drafter_costs(),
        "rows": rows,
        "bars": bars(rows),
    }


def _row(rows, system, temperature):
    return next((r for r in rows if r["system"] == system and r["temperature"] == temperature), None)


def _mal(row) -> float:
    return next(iter(row["stages"].values()))["mean_accepted_length"] if row and row["stages"] else 0.0


def bars(rows: list[dict]) -> dict:
    """The issue's bars, computed from this run's rows."""
    out = {}
    for temperature, bar in ((0.0, 1.5), (1.0, 1.3)):
        feature, small = _mal(_row(rows, f"target+feature@{K}", temperature)), _mal(_row(rows, f"target+small@{K}", temperature))
        out[f"feature_vs_small_accepted_T{temperature:g}"] = {"ratio": round(feature / small, 3) if small else None, "bar": bar}
        eagle = _mal(_row(rows, f"target+feature-eagle@{K}", temperature))
        out[f"fspad_vs_eagle_accepted_T{temperature:g}"] = {"ratio": round(feature / eagle, 3) if eagle else None}
        with_trained = [r for r in rows if r["temperature"] == temperature and r["trained_drafter"]]
        without = [r for r in rows if r["temperature"] == temperature and not r["trained_drafter"] and r["system"] != "target"]
        if not with_trained or not without:
            continue
        best_with, best_without = max(with_trained, key=lambda r: r["tokens_per_s"]), max(without, key=lambda r: r["tokens_per_s"])
        out[f"best_trained_vs_best_untrained_T{temperature:g}"] = {
            "ratio": round(best_with["tokens_per_s"] / best_without["tokens_per_s"], 3), "bar": 1.2,
            "with": best_with["system"], "without": best_without["system"],
        }
    early = _row(rows, "target+early-exit@6", 0.0)
    out["early_exit_vs_target_T0"] = {"ratio": early["speedup"] if early else None, "bar": 1.3}
    return out


def markdown(report: dict) -> str:
    lines = [
        "# Trained drafters on the stdlib demo family",
        "",
        f"{report['settings']['prompts']} held-out code prompts x {report['settings']['max_new_tokens']} tokens, 1 thread, EOS ignored, "
        f"interleaved. Load average before / after: {', '.join(f'{x:.1f}' for x in report['machine']['load_average_before'])} / "
        f"{', '.join(f'{x:.1f}' for x in report['machine']['load_average_after'])} (a shared machine: read the ratios).",
        "",
        "| system | T | tokens/s | speedup | stage: mean accepted length (per position; mean block) |",
        "|---|---:|---:|---:|---|",
    ]
    for row in report["rows"]:
        stages = "; ".join(
            f"{k}: {v['mean_accepted_length']:.2f} ({', '.join(f'{p:.2f}' for p in v['per_position'])}; block {v['mean_block_length']:.2f})"
            for k, v in row["stages"].items()
        )
        lines.append(f"| {row['system']} | {row['temperature']:g} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {stages or '-'} |")
    lines += ["", "| drafter | extra parameters | training steps | tokens | seconds | device | loss |", "|---|---:|---:|---:|---:|---|---|"]
    number = lambda x: f"{x:,}" if isinstance(x, int) else str(x)  # noqa: E731 - a checkpoint may lack a field
    for name, cost in report["drafters"].items():
        lines.append(f"| {name} | {number(cost['extra_parameters'])} | {cost['train_steps']} | {number(cost['train_tokens'])} | "
                     f"{cost['train_seconds']} | {cost['train_device']} | {cost['loss']} |")
    lines += ["", "| bar | measured | required |", "|---|---:|---:|"]
    for name, bar in report["bars"].items():
        extra = f" ({bar['with']} vs {bar['without']})" if "with" in bar else ""
        lines.append(f"| {name}{extra} | {bar['ratio']} | {bar.get('bar', '-')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "The judged run (issue #34's bars), on a quiet machine, one core:\n"
            "    taskset -c 1 env OMP_NUM_THREADS=1 python benchmarks/drafters.py --judged\n"
            f"= --prompts {JUDGED['prompts']} --tokens {JUDGED['tokens']} --full: every chain above at T = 0 and 1 "
            "(roughly a quarter of an hour on one idle core);\nit rewrites benchmarks/drafters.{json,md}. "
            "A quick check: --prompts 1 --tokens 8 --out /tmp/drafters."
        ),
    )
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts (default 4)")
    parser.add_argument("--tokens", type=int, default=40, help="new tokens per prompt (default 40)")
    parser.add_argument("--full", action="store_true",
                        help="also more chains without a trained drafter, trained drafters with cheaper tiers under them, and trees")
    parser.add_argument("--judged", action="store_true", help=f"the judged run: {JUDGED}")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "drafters"), help="output prefix (.json and .md)")
    args = parser.parse_args()
    if args.judged:
        args.prompts, args.tokens, args.full = JUDGED["prompts"], JUDGED["tokens"], True
    import torch

    torch.set_num_threads(1)
    report = run(args.prompts, args.tokens, args.full)
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
