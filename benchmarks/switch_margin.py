"""`lengths: auto` on held-out prompts with several tier-set switch margins, against fixed lengths.

    python benchmarks/switch_margin.py [-c configs/demo.yaml] [--temperature 0] [--repeats 6]
                                       [--margins 0.08 0.15 0.2 0.3] [--fixed 6,6 4,6]
                                       [--out benchmarks/switch-margin-t0]

The tuner switches to another set of tiers (bypassing one, or bringing it back) only when
the predicted gain exceeds `tuning.switch_hysteresis` (docs/time-model.md, re-tuning). This runs, on
the held-out prompts `polyspec tune` uses, each fixed plan (full chain) and, per margin, a
fresh `lengths: auto` tuner (start-up profile, no acceptance data), plus one tuner that
never bypasses and one that estimates skip pairs from probes only (no shadow estimates); arms interleaved, order reversed every other pass, `repeats` passes, EOS
ignored, 1 torch thread. Reports the median ms per token of each arm, tokens/s against the
best fixed plan, and how often each auto arm changed plan. Not a test: no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=48)
    parser.add_argument("--margins", type=float, nargs="+", default=[0.08, 0.15, 0.2, 0.3])
    parser.add_argument("--fixed", nargs="+", default=["6,6", "4,6"], help="full-chain lengths, comma separated")
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)

    import torch

    from polyspec.harness import tune, tune_measure
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tuning.tuner import Plan

    torch.set_num_threads(1)
    config = load_config(args.config)
    settings = tune.TuneSettings(temperature=args.temperature, max_new_tokens=args.max_new_tokens, grid_max=6, max_prompts=8)
    sets = tune.split_prompts(None, config, 8)
    engine = Engine(config, auto_tune=False)
    engine.scheduler.eos_token_ids = frozenset()
    ids = [engine.parse_request({"prompt": p, "max_new_tokens": args.max_new_tokens}).prompt_ids for p in sets.heldout]
    typical = int(statistics.median(len(i) for i in ids)) + 24
    context = (list(ids[0]) * (typical // len(ids[0]) + 1))[:typical]
    base = engine.make_tuner(context, max_length=6)
    full = tuple(range(len(engine.tiers)))
    fixed = {f"fixed {spec}": Plan(tuple(int(x) for x in spec.split(",")), full) for spec in args.fixed}
    autos = {f"auto, margin {m:g}": {"switch_hysteresis": m} for m in args.margins}
    autos["auto, no bypass"] = {"allow_bypass": False}
    autos["auto, margin 0.2, no shadow"] = {"switch_hysteresis": 0.2, "shadow": False}  # skip pairs from probes only
    arms = list(fixed) + list(autos)
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    changes: dict[str, list[int]] = {arm: [] for arm in autos}
    started = time.time()
    for repeat in range(args.repeats):
        order = arms if repeat % 2 == 0 else arms[::-1]
        for arm in order:
            if arm in fixed:
                wall[arm].append(tune.run_plan(engine, fixed[arm], ids, settings).wall_ms)
            else:
                tuner = base.copy_with(**autos[arm])
                wall[arm].append(tune_measure.run_auto(engine, tuner, ids, settings).wall_ms)
                changes[arm].append(len(tuner.history))
        print(f"pass {repeat + 1}/{args.repeats}: " + ", ".join(f"{a} {wall[a][-1]:.2f}" for a in arms), file=sys.stderr, flush=True)
    engine.close()

    best_fixed = min(fixed, key=lambda a: statistics.median(wall[a]))
    best_ms = statistics.median(wall[best_fixed])
    rows = [{"arm": arm, "ms_per_token": round(statistics.median(wall[arm]), 4),
             "runs_ms_per_token": [round(w, 4) for w in wall[arm]],
             "tokens_per_s_over_best_fixed": round(best_ms / statistics.median(wall[arm]), 4),
             "plan_changes": changes.get(arm)} for arm in arms]
    result = {"config": args.config, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
              "heldout_prompts": len(ids), "repeats": args.repeats, "torch_threads": 1, "best_fixed": best_fixed,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)), "rows": rows}
    lines = [f"# `lengths: auto` vs switch margin ({Path(args.config).name}, T = {args.temperature:g})", "",
             f"{len(ids)} held-out prompts x {args.max_new_tokens} tokens, {args.repeats} interleaved passes, 1 torch thread, "
             f"{result['date_utc']} UTC, load average at the end {os.getloadavg()[0]:.1f}. Median over passes.", "",
             "| arm | ms/token | tokens/s / best fixed | plan changes per run |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['arm']} | {row['ms_per_token']:.2f} | {row['tokens_per_s_over_best_fixed']:.3f} | "
                     f"{'' if row['plan_changes'] is None else ', '.join(map(str, row['plan_changes']))} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out + ".md").write_text(text)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 3.2))
            for index, arm in enumerate(arms):
                ax.scatter([index] * len(wall[arm]), wall[arm], s=12, color="0.6")
                ax.scatter([index], [statistics.median(wall[arm])], marker="_", s=400, color="C0" if arm in fixed else "C1")
            ax.set_xticks(range(len(arms)), arms, rotation=25, ha="right", fontsize=8)
            ax.set_ylabel("ms per token (lower is better)")
            ax.set_title(f"held-out prompts, T = {args.temperature:g}: each pass (grey), median (bar)", fontsize=9)
            fig.tight_layout()
            fig.savefig(args.out + ".png", dpi=110)
        except ImportError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
