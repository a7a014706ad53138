"""The real-model benchmark's report: per-system speed and acceptance, the judged ratios, and
the time model's prediction of the best speedup the measured costs and acceptance allow.

Speedup of a system = geometric mean over prompts of (target alone's seconds / the system's
seconds) on the same prompt at the same temperature (`cpu_speedup`: the same with the CPU
seconds the benchmark's process spent, which other jobs on a shared machine move less); tokens/s = tokens / seconds over all
its runs of a prompt class. Greedy equality: at T = 0, the system's tokens equal the target
alone's on the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
from pathlib import Path

FORWARD_SIZES = (1, 3, 5, 9)
MAX_LENGTH = 8


# ------------------------------------------------------------------ forward costs


def profile_costs(systems: list, context: list[int]) -> dict | None:
    """forward_ms[m] of every model tier (median of 2 verification rounds over m new tokens at
    the first prompt's context) and the n-gram lookup's draft_ms: the time model's inputs."""
    from polyspec.orchestrator.tuning.profiler import profile_draft, profile_forward
    from polyspec.workers.core.sampling import SamplingParams
    from polyspec.workers.tiers.batched import BatchedModelTier, BatchedNGramTier

    tiers = {}
    for system in systems:
        scheduler = getattr(getattr(system, "engine", None), "scheduler", None)  # (transformers' systems have none)
        for tier in getattr(scheduler, "tiers", []) or []:
            if isinstance(tier, (BatchedModelTier, BatchedNGramTier)) and tier.name not in tiers:  # (not a remote tier)
                tiers[tier.name] = tier
    if not tiers:
        return None
    params = SamplingParams()
    out = {}
    for name, tier in tiers.items():
        if tier.can_verify:
            out[name] = {"forward_ms": {m: round(v, 2) for m, v in profile_forward(tier, context, FORWARD_SIZES, params, 2).items()}}
        else:
            out[name] = {"draft_ms": {k: round(v, 3) for k, v in profile_draft(tier, context, range(1, MAX_LENGTH + 1), params, repeats=2).items()}}
    return out


def costs_from_runs(rows: list[dict]) -> dict | None:
    """Forward costs measured inside the runs themselves (same load as the speeds they
    explain): per model tier, ms per forward over m new tokens, from its busy time and its
    stage's blocks (m = tokens proposed per block + 1); a bottom drafter's ms per drafted
    token as its forward_ms[1]; the target alone's busy time per token as the target's."""
    sums: dict[str, dict[int, list[float]]] = {}

    def add(tier: str, m: int, seconds: float, count: float) -> None:
        entry = sums.setdefault(tier, {}).setdefault(m, [0.0, 0.0])
        entry[0] += seconds
        entry[1] += count

    for run in rows:
        busy = run.get("tier_busy_s") or {}
        stages = run.get("stages") or []
        if not busy:
            continue
        if not stages and "target" in busy and run["tokens"]:
            add("target", 1, busy["target"], len(run["tokens"]))
            continue
        if len(stages) != len(busy) - 1 or any(s["blocks"] == 0 for s in stages):
            continue  # a chain whose stages do not line up with its tiers (bypass): skip
        tiers = list(busy)
        for index, stage in enumerate(stages):
            verifier, drafter = tiers[index], tiers[index + 1]
            m = max(1, round(stage["proposed"] / stage["blocks"])) + 1
            add(verifier, m, busy[verifier], stage["blocks"])
            if index == len(stages) - 1 and stage["proposed"]:
                if drafter == "ngram":
                    add(drafter, 0, busy[drafter], stage["blocks"])
                else:
                    add(drafter, 1, busy[drafter], stage["proposed"])
    if not sums:
        return None
    out = {}
    for tier, table in sums.items():
        if tier == "ngram":
            per = table[0][0] / table[0][1] * 1000.0
            out[tier] = {"draft_ms": {k: round(per, 3) for k in range(1, MAX_LENGTH + 1)}}
        else:
            out[tier] = {"forward_ms": {m: round(v[0] / v[1] * 1000.0, 1) for m, v in sorted(table.items()) if v[1]}}
    return out


def _table(costs: dict, tier: str) -> dict[int, float]:
    entry = costs[tier]
    table = entry.get("forward_ms") or entry.get("draft_ms")
    return {int(k): float(v) for k, v in table.items()}


def fitted_rate(mean_accepted: float, length: int) -> float:
    """One acceptance rate a per position such that a + a^2 + ... + a^k = the measured mean accepted."""
    if length <= 0:
        return 0.0
    mean_accepted = min(mean_accepted, length - 1e-6)
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid**i for i in range(1, length + 1)) < mean_accepted:
            low = mid
        else:
            high = mid
    return round(low, 4)


def predict(costs: dict | None, chain: list[str], rates: list[float]) -> dict | None:
    """Best lengths and speedup over the target alone that the serial time model gives for
    `chain` with these forward costs and per-stage acceptance rates."""
    from polyspec.harness.chain_model import search_lengths
    from polyspec.harness.time_model import StageSpec

    if not costs or any(t not in costs for t in chain):
        return None
    stages = [StageSpec(forward_ms=_table(costs, chain[i]), accept_rates=(rates[i],)) for i in range(len(chain) - 1)]
    bottom = chain[-1]
    if "draft_ms" in costs[bottom]:
        draft = _table(costs, bottom)
    else:
        one = _table(costs, bottom)[1]
        draft = {k: one * k for k in range(1, MAX_LENGTH + 1)}
    lengths, ms = search_lengths(stages, draft, MAX_LENGTH)
    target_ms = _table(costs, chain[0])[1]
    return {"best_lengths": lengths, "ms_per_token": round(ms, 2), "target_ms_per_token": round(target_ms, 2), "predicted_speedup": round(target_ms / ms, 3)}


# ------------------------------------------------------------------ summaries


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def stage_acceptance(runs: list[dict]) -> list[dict]:
    """Per stage (verifier order): mean accepted tokens per block, blocks and proposed share."""
    totals: dict[str, dict] = {}
    order: list[str] = []
    for run in runs:
        for stage in run.get("stages") or []:
            name = stage["tier"]
            if name not in totals:
                totals[name] = {"accepted": 0, "blocks": 0, "proposed": 0}
                order.append(name)
            for key in ("accepted", "blocks", "proposed"):
                totals[name][key] += stage.get(key, 0)
    return [
        {"verifier": name, "mean_accepted": round(t["accepted"] / t["blocks"], 3) if t["blocks"] else 0.0, "blocks": t["blocks"],
         "proposed_per_block": round(t["proposed"] / t["blocks"], 3) if t["blocks"] else 0.0}
        for name, t in ((n, totals[n]) for n in order)
    ]


def summarize(rows: list[dict], described: dict, prompts: list) -> list[dict]:
    kinds = sorted({p.kind for p in prompts})
    by = {(r["system"], r["temperature"], r["prompt"]): r for r in rows}
    temperatures = sorted({r["temperature"] for r in rows})
    out = []
    for system, info in described.items():
        for temperature in temperatures:
            entry = {"system": system, "temperature": temperature, **{"ran_with": info}}
            for kind in kinds + ["all"]:
                runs = [by[(system, temperature, p.id)] for p in prompts if (kind in ("all", p.kind)) and (system, temperature, p.id) in by]
                if not runs:
                    continue
                base = {p.id: by.get(("target", temperature, p.id)) for p in prompts}
                ratios = {r["prompt"]: base[r["prompt"]]["seconds"] / r["seconds"] for r in runs if base.get(r["prompt"])}
                cpu = {r["prompt"]: base[r["prompt"]]["cpu_seconds"] / r["cpu_seconds"] for r in runs
                       if base.get(r["prompt"]) and base[r["prompt"]].get("cpu_seconds") and r.get("cpu_seconds")}
                block = {
                    "prompts": len(runs),
                    # CPU seconds of this process (its threads' work): less moved by other jobs on a shared machine than wall time
                    "cpu_speedup": round(_geomean(list(cpu.values())) or 0.0, 3) if cpu else None,
                    "tokens_per_s": round(sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs), 3),
                    "speedup": round(_geomean(list(ratios.values())) or 0.0, 3),
                    "speedup_per_prompt": {k: round(v, 3) for k, v in ratios.items()},
                    "stages": stage_acceptance(runs),
                    "loadavg_1m_median": statistics.median(r["loadavg"][0] for r in runs if r.get("loadavg")) if any(r.get("loadavg") for r in runs) else None,
                }
                if temperature == 0.0:
                    equal = [r["tokens"] == base[r["prompt"]]["tokens"] for r in runs if base.get(r["prompt"])]
                    block["greedy_equal"] = f"{sum(equal)}/{len(equal)}"
                    block["greedy_first_divergence"] = [_divergence(r["tokens"], base[r["prompt"]]["tokens"]) for r in runs if base.get(r["prompt"]) and r["tokens"] != base[r["prompt"]]["tokens"]]
                entry[kind] = block
            out.append(entry)
    return out


def _divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _tiers_of(system: str) -> list[str]:
    return system.split(":", 1)[1].split("+") if ":" in system else [system]


def judged(summary: list[dict], kind: str = "code") -> dict:
    """The ratios the benchmark is judged by, on one prompt class."""
    out: dict = {"prompt_class": kind}
    for temperature in sorted({e["temperature"] for e in summary}):
        rows = {e["system"]: e[kind]["speedup"] for e in summary if e["temperature"] == temperature and kind in e}
        chains = {s: v for s, v in rows.items() if s.startswith(("chain:", "auto:", "ray:"))}
        embedded = {s: v for s, v in rows.items() if s.startswith(("chain:", "auto:"))}
        hf = {s: v for s, v in rows.items() if s.startswith("hf-")}
        two = {s: v for s, v in embedded.items() if s.startswith("chain:") and len(_tiers_of(s)) == 2}
        more = {s: v for s, v in embedded.items() if s.startswith("chain:") and len(_tiers_of(s)) >= 3}
        ray = {s: v for s, v in rows.items() if s.startswith("ray:")}
        t = f"T={temperature:g}"
        best = max(chains.items(), key=lambda kv: kv[1]) if chains else None
        entry = {}
        if best:
            entry["best_chain"] = {"system": best[0], "x_target": best[1]}
        if best and hf:
            top_hf = max(hf.items(), key=lambda kv: kv[1])
            entry["best_chain_vs_best_transformers"] = {"transformers": top_hf[0], "ratio": round(best[1] / top_hf[1], 3)}
        if two and more:
            b2, b3 = max(two.items(), key=lambda kv: kv[1]), max(more.items(), key=lambda kv: kv[1])
            entry["best_3plus_vs_best_2tier"] = {"best_3plus": b3[0], "best_2tier": b2[0], "ratio": round(b3[1] / b2[1], 3)}
        if ray and embedded:
            r = max(ray.items(), key=lambda kv: kv[1])
            same = "chain:" + r[0].split(":", 1)[1]
            be = max(embedded.items(), key=lambda kv: kv[1])
            entry["ray_vs_embedded"] = {"ray": r[0], "vs_best_embedded": round(r[1] / be[1], 3), "best_embedded": be[0],
                                        "vs_same_chain_embedded": round(r[1] / rows[same], 3) if same in rows else None}
        autos = [e for e in summary if e["temperature"] == temperature and e["system"].startswith("auto:")]
        for e in autos:
            per_prompt = {}
            for k in ("code", "prose"):
                if k in e:
                    per_prompt.update(e[k]["speedup_per_prompt"])
            if per_prompt:
                entry["auto_vs_target_min_per_prompt"] = {"min": min(per_prompt.values()), "prompt": min(per_prompt, key=per_prompt.get),
                                                          "prompts_below_0.95": sum(v < 0.95 for v in per_prompt.values()), "prompts": len(per_prompt)}
        if temperature == 0.0:
            entry["greedy_equal"] = {e["system"]: e["all"].get("greedy_equal") for e in summary if e["temperature"] == 0.0 and "all" in e}
        out[t] = entry
    return out


def time_model_predictions(summary: list[dict], costs: dict | None) -> list[dict]:
    """Per fixed-length chain and temperature: measured per-stage rates -> the best speedup the
    serial time model predicts with the profiled forward costs (at the best lengths)."""
    out = []
    for e in summary:
        info = e["ran_with"]
        if not e["system"].startswith("chain:") or "all" not in e or not isinstance(info.get("lengths"), list):
            continue
        chain = _tiers_of(e["system"])
        stages = e["all"]["stages"]
        if len(stages) != len(chain) - 1:
            continue
        rates = [fitted_rate(s["mean_accepted"], k) for s, k in zip(stages, info["lengths"])]
        prediction = predict(costs, chain, rates)
        if prediction:
            out.append({"system": e["system"], "temperature": e["temperature"], "stage_rates": rates, **prediction,
                        "measured_speedup": e["all"]["speedup"]})
    return out


def pipeline_bounds(rows: list[dict]) -> list[dict]:
    """Per Ray (pipelined) chain and temperature: the most it could gain if its drafting were
    entirely hidden behind verification. A round still costs the target's verify forward on the
    one core (one thread) the target's actor has, so tokens/s <= tokens per round / verify time;
    the ratio to the target alone (every core) on the same prompts is the bound on its speedup."""
    out = []
    keys = sorted({(r["system"], r["temperature"]) for r in rows if r["system"].startswith("ray:")})
    for system, temperature in keys:
        runs = [r for r in rows if r["system"] == system and r["temperature"] == temperature and r.get("stages")]
        prompts = {r["prompt"] for r in runs}
        alone = [r for r in rows if r["system"] == "target" and r["temperature"] == temperature and r["prompt"] in prompts]
        blocks = sum(r["stages"][0]["blocks"] for r in runs)
        if not blocks or not alone:
            continue
        verify_s = sum(r["stages"][0]["time_s"] for r in runs) / blocks
        per_round = sum(r["stages"][0]["accepted"] + r["stages"][0]["blocks"] for r in runs) / blocks
        alone_rate = sum(len(r["tokens"]) for r in alone) / sum(r["seconds"] for r in alone)
        measured = sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)
        out.append({"system": system, "temperature": temperature, "prompts": len(prompts),
                    "target_verify_ms_one_core": round(verify_s * 1000.0, 1),
                    "block_tokens": round(sum(r["stages"][0]["proposed"] for r in runs) / blocks + 1, 2),
                    "tokens_per_round": round(per_round, 2), "target_alone_tokens_per_s": round(alone_rate, 3),
                    "bound_x_target": round(per_round / verify_s / alone_rate, 3), "measured_x_target": round(measured / alone_rate, 3)})
    return out


# ------------------------------------------------------------------ outputs


def build_report(settings, prompts, described, rows, costs, load_s) -> dict:
    summary = summarize(rows, described, prompts)
    in_runs = costs_from_runs(rows)
    report = {
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("out",)},
        "machine": {"cpu": cpu_name(), "cores": __import__("os").cpu_count(), "python": platform.python_version(),
                    "loadavg_during_runs": _load_range(rows)},
        "prompts": [{"id": p.id, "kind": p.kind} for p in prompts],
        "systems": described,
        "load_seconds": round(load_s, 1) if load_s is not None else None,
        "results": summary,
        "judged": {kind: judged(summary, kind) for kind in ("code", "prose", "all")},
        "forward_costs_ms": costs,
        "forward_costs_from_runs_ms": in_runs,
        "time_model_costs": "from_runs" if usable(in_runs) else "profile",
        "time_model": time_model_predictions(summary, in_runs if usable(in_runs) else costs),
        "ray_pipeline_bound": pipeline_bounds(rows),
        "runs": len(rows),
    }
    return report


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable(costs: dict | None) -> bool:
    """Costs the time model can read: the target's single-token forward and one larger block."""
    target = (costs or {}).get("target", {}).get("forward_ms", {})
    return 1 in {int(k) for k in target} and len(target) >= 2


def _load_range(rows: list[dict]) -> dict | None:
    loads = [r["loadavg"][0] for r in rows if r.get("loadavg")]
    if not loads:
        return None
    return {"min_1m": min(loads), "median_1m": statistics.median(loads), "max_1m": max(loads)}


def _fmt(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Real models: polyspec chains vs the target alone and transformers",
        "",
        f"Target `{Path(s['target']).name}`, drafter `{Path(s['drafter']).name}`; {s['code']} HumanEval + {s['prose']} prose prompts, "
        f"{s['tokens']} new tokens, T = {', '.join(f'{t:g}' for t in s['temperatures'])}; runs interleaved (round-robin per prompt). "
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, 1-min load average during the runs "
        f"{json.dumps(report['machine']['loadavg_during_runs'])}.",
        "",
        "| system | ran with | T | code tok/s | code x target | prose tok/s | prose x target | x target in CPU s (all) | accepted / block per stage | greedy = target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for e in report["results"]:
        info = e["ran_with"]
        ran = ", ".join(f"{k} {v}" for k, v in info.items() if k in ("dtype", "threads", "lengths", "backend"))
        code, prose = e.get("code", {}), e.get("prose", {})
        stages = (e.get("all") or {}).get("stages") or []
        accepted = " / ".join(f"{st['verifier']} {st['mean_accepted']:.2f}" for st in stages) or "—"
        lines.append(
            f"| {e['system']} | {ran} | {e['temperature']:g} | {_fmt(code.get('tokens_per_s'))} | {_fmt(code.get('speedup'))} | "
            f"{_fmt(prose.get('tokens_per_s'))} | {_fmt(prose.get('speedup'))} | {_fmt((e.get('all') or {}).get('cpu_speedup'))} | {accepted} | {(e.get('all') or {}).get('greedy_equal', '')} |"
        )
    lines += ["", "## Judged ratios (HumanEval prompts)", "", "```json", json.dumps(report["judged"]["code"], indent=1), "```"]
    if report["time_model"]:
        lines += ["", "## Time model: best speedup the measured costs and acceptance allow", "",
                  "| chain | T | per-stage acceptance rate | best lengths | predicted x target | measured x target |", "|---|---:|---|---|---:|---:|"]
        for p in report["time_model"]:
            lines.append(f"| {p['system']} | {p['temperature']:g} | {', '.join(f'{r:.2f}' for r in p['stage_rates'])} | {p['best_lengths']} | "
                         f"{p['predicted_speedup']:.2f} | {p['measured_speedup']:.2f} |")
    if report.get("ray_pipeline_bound"):
        lines += ["", "## Ray pipelined chains: the bound if drafting were free", "",
                  "Each model tier is an actor on its own core with one thread, so the target verifies on one core "
                  "while the target alone uses every core. With drafting entirely hidden behind verification, a round "
                  "still costs one verify forward: tokens/s <= tokens per round / verify time.", "",
                  "| chain | T | prompts | target verify, 1 core (ms) | block tokens | tokens per round | bound x target | measured x target |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for b in report["ray_pipeline_bound"]:
            lines.append(f"| {b['system']} | {b['temperature']:g} | {b['prompts']} | {b['target_verify_ms_one_core']:.0f} | {b['block_tokens']:.2f} | "
                         f"{b['tokens_per_round']:.2f} | {b['bound_x_target']:.2f} | {b['measured_x_target']:.2f} |")
    for key, what in (("forward_costs_from_runs_ms", "measured inside the runs"), ("forward_costs_ms", "profiled before the runs")):
        if report.get(key):
            lines += ["", f"Forward costs {what} (ms per forward over m new tokens; a bottom drafter's m = 1 is per drafted token; "
                      f"n-gram: one lookup): " + "; ".join(f"{t}: {json.dumps(c)}" for t, c in report[key].items())]
    lines += ["", f"The time model read the costs {'measured inside the runs' if report.get('time_model_costs') == 'from_runs' else 'profiled before the runs'}."]
    return "\n".join(lines) + "\n"


def write_plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(report["systems"])
    series = [(t, kind) for t in report["settings"]["temperatures"] for kind in ("code", "prose")]
    fig, ax = plt.subplots(figsize=(max(8, len(systems) * 0.9), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (t, kind) in enumerate(series):
        values = []
        for system in systems:
            entry = next((e for e in report["results"] if e["system"] == system and e["temperature"] == t), None)
            values.append((entry or {}).get(kind, {}).get("speedup", 0.0) or 0.0)
        ax.bar([x + i * width for x in range(len(systems))], values, width, label=f"{kind}, T={t:g}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(systems))])
    ax.set_xticklabels(systems, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("speedup over the target alone")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict, stem: str) -> None:
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(stem + ".md").write_text(markdown(report))
    write_plot(report, stem + ".png")
