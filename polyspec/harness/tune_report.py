"""`polyspec tune`'s report: the JSON entries (per plan, per tier, the summaries) and the
text form `polyspec tune` prints without `--json`."""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from polyspec.harness.bench import machine_info
from polyspec.harness.tune_measure import Measurement, TuneSettings
from polyspec.orchestrator.config import ChainConfig
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tuning.batch_model import WIDTH_GRID, BatchPlanner, Plan


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured (inf when nothing was measured)."""
    return abs(predicted - measured) / measured if measured > 0 else math.inf


def plan_entry(engine: Engine, plan: Plan, predicted: float, measured: Measurement) -> dict:
    return {
        "lengths": lengths_of(plan),
        "tiers": [engine.tiers[t].name for t in plan.active],
        "predicted_ms_per_token": round(predicted, 4),
        "measured_ms_per_token": round(measured.wall_ms, 4),
        "measured_cpu_ms_per_token": round(measured.cpu_ms, 4),
    }


def tier_report(engine: Engine, planner: BatchPlanner) -> list[dict]:
    """Per tier, as the calibrated planner sees it at a batch of one: a model tier's forward ms per width
    (new tokens), a lookup tier's ms a draft, and its acceptance as the drafter of the tier above it
    (the target's of the bottom tier too, in a chain of three)."""
    tiers = []
    last = len(engine.tiers) - 1
    greedy = planner.greedy_share >= 1.0
    for index, tier in enumerate(engine.tiers):
        table = planner.tables[index]
        entry: dict = {"name": tier.name, "forward_ms": None, "lookup_ms": None, "acceptance": None}
        if table is not None:
            entry["forward_ms"] = {str(w): round(table.estimate(1, w), 4) for w in WIDTH_GRID}
        else:
            entry["lookup_ms"] = round(planner.lookup_ms[index], 4)
        if index < last:
            entry["acceptance"] = acceptance_entry(engine, planner, index, index + 1, greedy)
        if index == 0 and last >= 2:
            entry["acceptance_skip"] = acceptance_entry(engine, planner, 0, last, greedy)
        tiers.append(entry)
    return tiers


def acceptance_entry(engine: Engine, planner: BatchPlanner, verifier: int, drafter: int, greedy: bool) -> dict:
    return {"drafter": engine.tiers[drafter].name, "rate": round(planner.rate(verifier, drafter, greedy), 4)}


def lengths_of(plan: Plan) -> list[int]:
    """The plan's lengths of the stages in use (one per tier in use but the bottom)."""
    return [plan.lengths[level] for level in plan.active[:-1]]


@dataclasses.dataclass
class Contenders:
    """The plans a tune run predicts and measures: the grid over every tier, the planner's choice,
    the best plan with each tier bypassed (none in a distributed chain, which runs every tier or
    none), and the target alone."""

    grid: list[Plan]
    chosen: Plan
    bypass: list[tuple[int, Plan]]  # (bypassed tier, best plan without it)
    baseline: Plan

    def plans(self) -> list[Plan]:
        """Every plan once, in report order."""
        return list(dict.fromkeys(self.grid + [self.chosen] + [plan for _, plan in self.bypass] + [self.baseline]))


@dataclasses.dataclass
class Confirmation:
    """The best grid points measured again with the choice, in fresh passes (the smallest of
    many noisy measurements is biased low: the winner's curse)."""

    contenders: list[Plan]  # the best grid points of the first measurement
    plans: list[Plan]  # contenders + the choice
    measured: dict  # {plan: Measurement}


@dataclasses.dataclass
class TuneResults:
    """What a tune run found, before it becomes the report."""

    contenders: Contenders
    predicted: dict  # {plan: median over passes of the predicted ms/token}
    first_predicted: dict  # {plan: ms/token predicted from the initial calibration alone}
    measured: dict  # {plan or "auto": median Measurement}
    confirmation: Confirmation
    auto_plans: list  # the plan changes of the last fresh `lengths: auto` run
    tiers: list[dict]  # tier_report, taken right after the initial calibration
    heldout: dict | None
    shift: dict | None


def plan_report(engine: Engine, results: TuneResults, plan: Plan) -> dict:
    return {**plan_entry(engine, plan, results.predicted[plan], results.measured[plan]),
            "predicted_first_calibration_ms_per_token": round(results.first_predicted[plan], 4)}


def summary(engine: Engine, results: TuneResults, field: str) -> dict:
    """Predicted against measured over the grid, and the choice against the best grid point,
    in `field` ("wall_ms" or "cpu_ms") of the measurements."""
    grid, chosen, confirmation = results.contenders.grid, results.contenders.chosen, results.confirmation
    value = {plan: getattr(results.measured[plan], field) for plan in results.contenders.plans()}
    errors = [relative_error(results.predicted[plan], value[plan]) for plan in grid]
    best = min(grid, key=value.get)
    again = {plan: getattr(confirmation.measured[plan], field) for plan in confirmation.plans}
    best_again = min(confirmation.contenders, key=again.get)
    first_errors = [relative_error(results.first_predicted[plan], value[plan]) for plan in grid]
    return {
        "median_relative_error": round(statistics.median(errors), 4),
        "max_relative_error": round(max(errors), 4),
        # the initial calibration's predictions only (no re-calibration between passes)
        "first_calibration_median_relative_error": round(statistics.median(first_errors), 4),
        "best_grid": plan_report(engine, results, best),
        "chosen_over_best": round(value[chosen] / value[best], 4),
        "auto_over_best": round(getattr(results.measured["auto"], field) / value[best], 4),
        "confirmed": {
            "plans": [{"lengths": lengths_of(p), "tiers": [engine.tiers[t].name for t in p.active],
                       "ms_per_token": round(again[p], 4)} for p in confirmation.plans],
            "best_grid_lengths": lengths_of(best_again),
            "chosen_over_best": round(again[chosen] / again[best_again], 4),
        },
    }


def build_report(engine: Engine, config: ChainConfig, settings: TuneSettings, prompts: list[str], results: TuneResults) -> dict:
    """The JSON report of a tune run (`polyspec tune --json`)."""
    contenders, measured = results.contenders, results.measured
    remote = config.runtime.backend == "ray"
    return {
        "config": config.source,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "prompts": len(prompts),
        "repeats": settings.repeats,
        "grid": [plan_report(engine, results, plan) for plan in contenders.grid],
        "chosen": plan_report(engine, results, contenders.chosen),
        "bypass": [{"bypassed": engine.tiers[tier].name, **plan_report(engine, results, plan)} for tier, plan in contenders.bypass],
        "baseline": plan_report(engine, results, contenders.baseline),
        "runtime": {"backend": config.runtime.backend, "pipeline": config.runtime.pipeline if remote else False},
        # the CPU matters: how a drafter's forward compares with the target's differs between CPUs
        "machine": {**machine_info(torch.get_num_threads(), config.tiers[0].dtype, "cpu"),
                    "tier_threads": {tier.name: tier.threads for tier in config.tiers}},
        "auto": {
            "measured_ms_per_token": round(measured["auto"].wall_ms, 4),
            "measured_cpu_ms_per_token": round(measured["auto"].cpu_ms, 4),
            "plans": results.auto_plans,
        },
        "tiers": results.tiers,
        "summary": summary(engine, results, "wall_ms"),
        # this process's CPU time: meaningless when the tiers run in other processes
        "summary_cpu": None if remote else summary(engine, results, "cpu_ms"),
        "heldout": results.heldout,
        "shift": results.shift,
    }


# ----------------------------------------------------------------------------- text


def tier_lines(report: dict) -> list[str]:
    """Per tier: forward ms per width (or a lookup's ms), acceptance."""
    lines = []
    for tier in report["tiers"]:
        parts = [f"{tier['name']:>10}"]
        if tier["forward_ms"]:
            parts.append("forward ms " + " ".join(f"{w}:{v:.2f}" for w, v in tier["forward_ms"].items()))
        if tier["lookup_ms"] is not None:
            parts.append(f"lookup ms {tier['lookup_ms']:.3f}")
        if tier["acceptance"]:
            parts.append(f"accepts {tier['acceptance']['drafter']}: {tier['acceptance']['rate']:.2f}")
        lines.append("  ".join(parts))
    return lines


def grid_lines(report: dict) -> list[str]:
    """The grid: predicted, measured, relative error and CPU time per plan."""
    lines = [f"{'lengths':>12} {'predicted':>10} {'measured':>9} {'error':>7} {'cpu':>7}   (ms per token; cpu: this process's CPU time)"]
    for entry in report["grid"]:
        error = relative_error(entry["predicted_ms_per_token"], entry["measured_ms_per_token"])
        lines.append(
            f"{str(entry['lengths']):>12} {entry['predicted_ms_per_token']:>10.3f} {entry['measured_ms_per_token']:>9.3f}"
            f" {100 * error:>6.1f}% {entry['measured_cpu_ms_per_token']:>7.3f}"
        )
    return lines


def describe(label: str, entry: dict) -> str:
    return (
        f"{label}: {'+'.join(entry['tiers'])} {entry['lengths']}  predicted {entry['predicted_ms_per_token']:.3f}"
        f"  measured {entry['measured_ms_per_token']:.3f} ms/token"
    )


def plan_lines(report: dict) -> list[str]:
    """The choice, each bypass, the target alone and `lengths: auto`."""
    lines = [describe("planner's choice", report["chosen"])]
    for entry in report["bypass"]:
        lines.append(describe(f"without {entry['bypassed']}", entry))
    lines.append(describe("target alone", report["baseline"]))
    lines.append(f"lengths: auto (fresh planner): measured {report['auto']['measured_ms_per_token']:.3f} ms/token, {len(report['auto']['plans'])} plan changes")
    return lines


def heldout_lines(heldout: dict | None) -> list[str]:
    if not heldout:
        return []
    lines = [
        f"held out ({heldout['prompts']} prompts): best grid point {heldout['best_grid_lengths']} {heldout['best_grid_ms_per_token']:.3f},"
        f" lengths: auto {heldout['auto_ms_per_token']:.3f} ms/token: auto's tokens/s {heldout['auto_tokens_per_s_over_best']:.3f}x the best grid point's"
    ]
    if "warm_auto_ms_per_token" in heldout:
        lines.append(
            f"held out, lengths: auto with a planner that has served the tuning prompts: {heldout['warm_auto_ms_per_token']:.3f} ms/token,"
            f" {heldout['warm_auto_tokens_per_s_over_best']:.3f}x"
        )
    return lines


def shift_lines(shift: dict | None) -> list[str]:
    if not shift:
        return []
    rounds = shift["rounds_to_first_change"]
    change = "no change of plan" if rounds is None else f"first change of plan after {rounds} rounds"
    return [f"code -> prose: {shift['prose_rounds']} prose rounds from round {shift['prose_from_round']}; {change}"]


def summary_lines(report: dict) -> list[str]:
    lines = []
    for label, summary in (("wall", report["summary"]), ("cpu", report["summary_cpu"])):
        if summary is None:
            continue
        confirmed = summary["confirmed"]
        lines.append(
            f"[{label} time] measured again with the {len(confirmed['plans'])} best: best {confirmed['best_grid_lengths']},"
            f" choice / best {confirmed['chosen_over_best']:.3f}"
        )
        lines.append(
            f"[{label} time] median |predicted - measured| / measured over the grid: {100 * summary['median_relative_error']:.1f} %"
            f" (max {100 * summary['max_relative_error']:.1f} %); best grid point {summary['best_grid']['lengths']};"
            f" measured / best grid point: choice {summary['chosen_over_best']:.3f}, auto {summary['auto_over_best']:.3f}"
        )
    return lines


def format_report(report: dict) -> str:
    """The report as `polyspec tune` prints it without `--json`."""
    lines = [f"config {report['config']}  temperature {report['temperature']}  {report['max_new_tokens']} tokens x {report['prompts']} prompts", ""]
    lines += tier_lines(report)
    lines += [""] + grid_lines(report) + [""]
    lines += plan_lines(report)
    lines += heldout_lines(report.get("heldout"))
    lines += shift_lines(report.get("shift"))
    lines += summary_lines(report)
    return "\n".join(lines)
