"""`polyspec tune`'s report: the JSON entries (per plan, per tier, the summaries) and the
text form `polyspec tune` prints without `--json`."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from polyspec.harness.bench import machine_info
from polyspec.harness.tune_measure import Measurement, TuneSettings
from polyspec.orchestrator.config import ChainConfig
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tuning.chain_model import relative_error
from polyspec.orchestrator.tuning.tuner import Plan, Tuner


def plan_entry(engine: Engine, plan: Plan, predicted: float, measured: Measurement) -> dict:
    return {
        "lengths": [plan.lengths[level] for level in plan.active[:-1]],
        "tiers": [engine.tiers[t].name for t in plan.active],
        "predicted_ms_per_token": round(predicted, 4),
        "measured_ms_per_token": round(measured.wall_ms, 4),
        "measured_cpu_ms_per_token": round(measured.cpu_ms, 4),
    }


def tier_report(engine: Engine, tuner: Tuner, key: str, grid_max: int) -> list[dict]:
    tiers = []
    profile = tuner.profile
    last = len(engine.tiers) - 1
    for index, tier in enumerate(engine.tiers):
        entry: dict = {"name": tier.name, "forward_ms": None, "draft_ms": None, "acceptance": None}
        full = tuple(range(len(engine.tiers)))
        if profile.forward[index] is not None:
            entry["forward_ms"] = {str(m): round(v, 4) for m, v in profile.forward_ms(index, full).items()}
        if profile.draft[index] is not None:
            entry["draft_ms"] = {str(k): round(v, 4) for k, v in profile.draft_ms(index, full).items()}
            entry["proposal_fill"] = round(tuner.fill(key, index), 4)  # share of an asked block it proposes
        if index < last:
            entry["acceptance"] = acceptance_entry(engine, tuner, key, index, index + 1, grid_max)
        if index == 0 and last >= 2:
            entry["acceptance_skip"] = acceptance_entry(engine, tuner, key, 0, last, grid_max)
        tiers.append(entry)
    return tiers


def acceptance_entry(engine: Engine, tuner: Tuner, key: str, verifier: int, drafter: int, grid_max: int) -> dict:
    rates = tuner.accept_rates(key, verifier, drafter)
    estimate = tuner.estimates(key).get((verifier, drafter))
    return {
        "drafter": engine.tiers[drafter].name,
        "per_position": [round(r, 4) for r in rates[: 2 * grid_max]],
        "blocks": 0 if estimate is None else int(round(estimate.blocks)),
    }


def lengths_of(plan: Plan) -> list[int]:
    """The plan's lengths of the stages in use (one per tier in use but the bottom)."""
    return [plan.lengths[level] for level in plan.active[:-1]]


@dataclasses.dataclass
class Contenders:
    """The plans a tune run predicts and measures: the grid over every tier, the tuner's choice,
    the best plan with each tier bypassed, and the target alone (no bypass and no baseline in a
    distributed chain, which runs every tier every round)."""

    grid: list[Plan]
    chosen: Plan
    bypass: list[tuple[int, Plan]]  # (bypassed tier, best plan without it)
    baseline: Plan | None

    def plans(self) -> list[Plan]:
        """Every plan once, in report order."""
        return list(dict.fromkeys(self.grid + [self.chosen] + [plan for _, plan in self.bypass] + ([self.baseline] if self.baseline else [])))


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
    round_overhead_ms: float
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


def build_report(engine: Engine, config: ChainConfig, tuner: Tuner, settings: TuneSettings, prompts: list[str], results: TuneResults) -> dict:
    """The JSON report of a tune run (`polyspec tune --json`)."""
    contenders, measured = results.contenders, results.measured
    return {
        "config": config.source,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "prompts": len(prompts),
        "repeats": settings.repeats,
        "grid": [plan_report(engine, results, plan) for plan in contenders.grid],
        "chosen": plan_report(engine, results, contenders.chosen),
        "bypass": [{"bypassed": engine.tiers[tier].name, **plan_report(engine, results, plan)} for tier, plan in contenders.bypass],
        "baseline": plan_report(engine, results, contenders.baseline) if contenders.baseline else None,
        "runtime": {"backend": config.runtime.backend, "pipeline": tuner.pipelined if tuner.distributed else False},
        # the CPU matters: how a drafter's forward compares with the target's differs between CPUs
        "machine": {**machine_info(torch.get_num_threads(), config.tiers[0].dtype, "cpu"),
                    "tier_threads": {tier.name: tier.threads for tier in config.tiers}},
        "auto": {
            "measured_ms_per_token": round(measured["auto"].wall_ms, 4),
            "measured_cpu_ms_per_token": round(measured["auto"].cpu_ms, 4),
            "plans": results.auto_plans,
        },
        "tiers": results.tiers,
        "round_overhead_ms": round(results.round_overhead_ms, 4),
        "step_overhead_ms": round(tuner.timing.step_overhead_ms, 4) if tuner.distributed else None,  # per target round (distributed)
        "ahead_slowdown": {engine.tiers[t].name: round(v, 4) for t, v in tuner.timing.ahead_slowdown.items()},  # pipelined drafters
        "first_round_scale": round(tuner.first_round_scale, 4) if tuner.distributed else None,  # first rounds, measured / modelled
        "jitter_cv": round(tuner.timing.jitter_cv, 4) if tuner.distributed and tuner.pipelined else None,  # spread of round / block times
        "summary": summary(engine, results, "wall_ms"),
        # this process's CPU time: meaningless when the tiers run in other processes
        "summary_cpu": None if tuner.distributed else summary(engine, results, "cpu_ms"),
        "heldout": results.heldout,
        "shift": results.shift,
    }


# ----------------------------------------------------------------------------- text


def tier_lines(report: dict) -> list[str]:
    """Per tier: forward and draft latencies, acceptance; then the overheads."""
    lines = []
    for tier in report["tiers"]:
        parts = [f"{tier['name']:>10}"]
        if tier["forward_ms"]:
            sizes = list(tier["forward_ms"].items())
            parts.append("forward ms " + " ".join(f"{m}:{v:.2f}" for m, v in sizes[:: max(1, len(sizes) // 6)]))
        if tier["draft_ms"]:
            parts.append("draft ms " + " ".join(f"{k}:{v:.2f}" for k, v in list(tier["draft_ms"].items())[::2]))
        if tier["acceptance"]:
            rates = tier["acceptance"]["per_position"][:6]
            parts.append(f"accepts {tier['acceptance']['drafter']}: " + " ".join(f"{r:.2f}" for r in rates))
        lines.append("  ".join(parts))
    lines.append(f"{'':>10}  per-round overhead outside forwards: {report['round_overhead_ms']:.3f} ms")
    if report.get("step_overhead_ms") is not None:
        lines.append(f"{'':>10}  per target round (the driver's call, the target's call to its drafter): {report['step_overhead_ms']:.3f} ms")
    if report.get("first_round_scale") is not None:
        lines.append(f"{'':>10}  a request's first round (prefills + set-up), measured / modelled: {report['first_round_scale']:.3f}")
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
    lines = [describe("tuner's choice", report["chosen"])]
    for entry in report["bypass"]:
        lines.append(describe(f"without {entry['bypassed']}", entry))
    if report["baseline"]:
        lines.append(describe("target alone", report["baseline"]))
    lines.append(f"lengths: auto (fresh tuner): measured {report['auto']['measured_ms_per_token']:.3f} ms/token, {len(report['auto']['plans'])} plan changes")
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
            f"held out, lengths: auto with a tuner that has served the tuning prompts: {heldout['warm_auto_ms_per_token']:.3f} ms/token,"
            f" {heldout['warm_auto_tokens_per_s_over_best']:.3f}x"
        )
    return lines


def shift_lines(shift: dict | None) -> list[str]:
    if not shift:
        return []
    rounds = shift["rounds_to_first_change"]
    change = "no change of plan" if rounds is None else f"first change of plan after {rounds} rounds"
    best, before = shift.get("best_at_end"), shift.get("plan_at_switch")
    if rounds is None and best is not None:
        same = best == before
        change += (f" (the model's best on the prose is the plan at the switch, {'+'.join(best['tiers'])} {best['lengths']})" if same
                   else f" (the model's best on the prose: {'+'.join(best['tiers'])} {best['lengths']})")
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
