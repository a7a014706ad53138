"""`polyspec tune`: the goodput planner's time model against the clock, on the chain of a config.

    polyspec tune -c CONFIG [--prompts FILE] [--temperature T] [--max-new-tokens N]
                  [--grid-max K] [--max-prompts P] [--repeats R] [--heldout-prompts Q]
                  [--heldout-repeats H] [--json]

Steps, on the config's chain (embedded, or Ray actors driven from this process; the planner is
the one `lengths: auto` runs, batch_model.BatchPlanner, one request at a time: a load of one):
1. profile every tier's forward at a batch of one (profiler.profile_batched; a Ray chain's
   tiers in their own processes, driver.profile_grid_remote), and, embedded, each model tier's
   prefill of every prompt;
2. calibrate: generate every prompt with every set of tiers the planner considers (a Ray
   chain: the full one) at long, middle and short lengths, through the planner's observations
   without letting it plan (tune_measure.Pinned): acceptance as plain counts per pair (no
   fading), forward costs refined online;
3. predict, from those estimates only, the ms per token of every grid point (k_i in 1..K for
   every stage of the full chain), of the planner's choice, of the best plan with each tier
   bypassed and of the target alone: (sum of prefills + new tokens / tokens a step x the
   step's ms) / tokens, the step as `BatchPlanner.step_ms` prices it at a batch of one;
4. measure every one of them (the same prompts, seeds and token counts; EOS is ignored so
   every run generates exactly max_new_tokens), in `--repeats` passes, each interleaved per
   prompt (every plan generates prompt 1 in a shuffled order, then prompt 2, ...: the
   machine's speed drifts over seconds, and plans compared must see the same seconds);
   the calibration plans run again inside every pass, interleaved with the measured runs,
   and each pass is predicted from them, so prediction and measurement see the same seconds
   of a machine whose speed drifts; the reported prediction is the median over passes (the
   first calibration's alone, made before any pass, is reported too);
5. the best grid points again against the planner's choice (fresh passes: the minimum of
   many noisy measurements is biased low); the best grid point against `lengths: auto` on
   `--heldout-prompts` held-out prompts (16; evenly spaced through the prompts the tuning
   set left over), with a fresh planner and with one that has served the tuning prompts
   (warm), in `--heldout-repeats` interleaved passes (the goal is a 5 % ratio);
   a fresh planner on code prompts then prose prompts (how many rounds until its plan changes).

The goodput planner prices plans of up to three tiers (the target, a middle tier, a bottom
drafter), so the grid is over chains of two or three tiers. A Ray chain's prefills are not
measured apart: its predictions leave them out.

The modules: tune_prompts (the prompt sets), tune_measure (interleaved passes and the held-out
measurement), tune_report (the JSON report and its text form); this one predicts, calibrates
and runs the steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys

import torch

from polyspec.harness.tune_measure import (
    TuneError,
    TuneSettings,
    copy_planner,
    interleaved_pass,
    measure,
    measure_heldout,
    measure_plans,
    measure_prefill_ms,
    measure_shift,
    run_plan,
)
from polyspec.harness.tune_prompts import PromptSets, split_prompts
from polyspec.harness.tune_report import Confirmation, Contenders, TuneResults, build_report, format_report, tier_report
from polyspec.orchestrator.chain_args import chain_config
from polyspec.orchestrator.config import ChainConfig
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tuning.batch_model import BatchPlanner, Plan
from polyspec.orchestrator.tuning.options import goodput_options

CONFIRM_TOP = 5  # grid points measured again with the planner's choice (see confirm)
MAX_TIERS = 3  # the longest chain the goodput planner prices


# ----------------------------------------------------------------------------- predicting


def plan_of(num_tiers: int, active: tuple[int, ...], lengths: tuple[int, ...]) -> Plan:
    """The plan running the tiers `active` (target first) with `lengths[i]` at the i-th verifying tier of them."""
    per_tier = [0] * (num_tiers - 1)
    for level, k in zip(active[:-1], lengths):
        per_tier[level] = k
    return Plan(tuple(active), tuple(per_tier))


def predict_plan(planner: BatchPlanner, plan: Plan, prefill_extra_ms: list[list[float]], new_tokens: int) -> float:
    """Predicted ms per token over the prompts: prefills of the tiers in use + the steps that
    commit `new_tokens` (the model's step time over its expected tokens a step, at a batch of one)."""
    ms, tokens = planner.step_ms(plan, 1)
    decode = new_tokens / max(tokens, 1e-9) * ms
    total = sum(decode + sum(extra[t] for t in plan.active) for extra in prefill_extra_ms)
    return total / (new_tokens * len(prefill_extra_ms))


# ----------------------------------------------------------------------------- calibrating


def distributed(engine: Engine) -> bool:
    """The chain runs as tier workers (runtime.backend: ray): every tier runs every round."""
    return hasattr(engine.scheduler, "membership")


def tier_sets(planner: BatchPlanner) -> list[tuple[int, ...]]:
    """The sets of tiers the planner speculates with (a Ray chain: the full one only), in its order."""
    return list(dict.fromkeys(plan.active for plan in planner.plans if plan.speculating))


def calibration_plans(planner: BatchPlanner, grid_max: int) -> list[Plan]:
    """Every set of tiers the planner considers at a few lengths: long, middle and short blocks.

    (The target alone needs no acceptance: its prediction uses the profile.)"""
    lengths = sorted({grid_max, max(1, grid_max // 2), min(2, grid_max)}, reverse=True)
    num_tiers = len(planner.tiers)
    return [plan_of(num_tiers, active, (k,) * (len(active) - 1)) for active in tier_sets(planner) for k in lengths]


def start_planner(engine: Engine, settings: TuneSettings) -> BatchPlanner:
    """The goodput planner on a start-up profile at a batch of one, its acceptance plain counts (no fading)
    and no shadow proposals (the pairs a plan leaves out are measured directly by the calibration)."""
    remote = distributed(engine)
    if remote:
        from polyspec.orchestrator.distributed.driver import profile_grid_remote

        tables, lookup = profile_grid_remote(engine.scheduler, 1)
    else:
        from polyspec.orchestrator.tuning.profiler import profile_batched

        tables, lookup = profile_batched(engine.scheduler.tiers, engine.vocab_size, 1)
    options = dict(goodput_options(engine.config.tuning, remote), max_length=settings.grid_max)
    return BatchPlanner(engine.scheduler.tiers, tables, lookup, tree_width=engine.config.speculation.tree_width, **options)


def calibrate(engine: Engine, prompt_ids: list[list[int]], settings: TuneSettings, log) -> tuple[BatchPlanner, BatchPlanner, list[list[float]]]:
    """Steps 1-2: a planner holding the start-up profile (refined in every set of tiers) and acceptance
    counts from passes over the prompts with every set of tiers (`calibration_plans`); a fresh planner
    on the start-up profile alone (what `lengths: auto` starts from); and per prompt, per tier, the
    prefill's extra ms over a forward of one token."""
    log("profiling the tiers")
    fresh = start_planner(engine, settings)
    planner = copy_planner(fresh)
    planner.acceptance.keep, planner.shadows = 1.0, False
    if distributed(engine):
        prefill_extra = [[0.0] * len(engine.tiers) for _ in prompt_ids]
    else:
        first_forward = [table.estimate(1, 1) if table is not None else 0.0 for table in planner.tables]
        prefill_extra = [[max(0.0, ms - first) for ms, first in zip(measure_prefill_ms(engine, list(ids)), first_forward)]
                         for ids in prompt_ids]
    full = tuple(range(len(engine.tiers)))
    longest = plan_of(len(full), full, (settings.grid_max,) * (len(full) - 1))
    log("warming up")
    run_plan(engine, longest, prompt_ids[:1], dataclasses.replace(settings, max_new_tokens=min(16, settings.max_new_tokens)))
    recalibrate(engine, planner, prompt_ids, settings, log)
    return planner, fresh, prefill_extra


def recalibrate(engine: Engine, planner: BatchPlanner, prompt_ids: list[list[int]], settings: TuneSettings, log) -> None:
    """One pass of the calibration plans through the planner's observations (`calibration_items`), alone."""
    items, after, finish = calibration_items(planner, settings)
    names = ", ".join(sorted({"+".join(engine.tiers[t].name for t in plan.active) for plan, _ in items}))
    # interleaved per prompt like the measurements: every set of tiers' forwards are refined over the same
    # seconds of the machine
    interleaved_pass(engine, items, prompt_ids, settings, seed=settings.seed + 3000,
                     after=after, log=lambda message: log(f"calibrating {len(items)} plans ({names}): {message}"))
    finish()


def calibration_items(planner: BatchPlanner, settings: TuneSettings):
    """A pass of the calibration plans through the planner's observations, as items of an
    `interleaved_pass` (with its `after` hook, and `finish()` to call once the pass is over: the
    planner needs neither): acceptance counts grow, forward costs follow the machine."""
    planner.greedy_share = 1.0 if settings.params().greedy else 0.0  # (what `step_ms` prices the plans at)
    return [(plan, planner) for plan in calibration_plans(planner, settings.grid_max)], None, lambda: None


# ----------------------------------------------------------------------------- the run


def run_tune(config: ChainConfig, prompts: list[str], settings: TuneSettings, log=None, sets: PromptSets | None = None) -> dict:
    """Profile, calibrate, predict and measure; the report (see the module docstring).
    `sets`: held-out prompts (best grid point vs `lengths: auto`) and the code -> prose sequence."""
    log = log or (lambda message: None)
    if not 2 <= len(config.tiers) <= MAX_TIERS:
        raise TuneError(f"tune needs a chain of two or three tiers (the goodput planner prices up to {MAX_TIERS}), got {len(config.tiers)}")
    torch.manual_seed(settings.seed)
    engine = Engine(config, auto_tune=False)
    try:
        return tune_engine(engine, config, prompts, settings, log, sets)
    finally:
        engine.close()  # a ray chain's actors go


def token_ids(engine: Engine, texts: list[str], settings: TuneSettings) -> list[list[int]]:
    return [engine.parse_request({"prompt": p, "max_new_tokens": settings.max_new_tokens}).prompt_ids for p in texts]


def check_room(engine: Engine, prompt_ids: list[list[int]], settings: TuneSettings) -> None:
    """Every prompt, its tokens and the longest blocks fit the model's context."""
    limit = engine.scheduler.max_context
    longest = max(len(ids) for ids in prompt_ids)
    if limit is not None and longest + settings.max_new_tokens + 2 * settings.grid_max + 2 >= limit:
        raise TuneError(f"the longest prompt ({longest} tokens) + max_new_tokens ({settings.max_new_tokens}) does not fit the model context ({limit})")


def contenders(planner: BatchPlanner, predict, grid_max: int, remote: bool) -> Contenders:
    """Step 3's plans: every grid point of the full chain, the planner's choice, the best plan
    (predicted) without each tier, the target alone."""
    num_tiers = len(planner.tiers)
    full = tuple(range(num_tiers))
    grid = [plan_of(num_tiers, full, lengths) for lengths in itertools.product(range(1, grid_max + 1), repeat=num_tiers - 1)]
    chosen = planner.predicted_best(1)
    bypass = []
    if not remote:  # a distributed chain runs every tier or none: no bypass to compare
        for tier in range(1, num_tiers):
            plans = [plan_of(num_tiers, active, lengths) for active in tier_sets(planner) if tier not in active
                     for lengths in itertools.product(range(1, grid_max + 1), repeat=len(active) - 1)]
            if plans:
                bypass.append((tier, min(plans, key=predict)))
    return Contenders(grid, chosen, bypass, planner.plans[0])


def fresh_planners(start: BatchPlanner):
    """A factory of what `lengths: auto` starts from: the start-up profile, no acceptance data."""
    return lambda: copy_planner(start)


def confirm(engine: Engine, plans: Contenders, measured: dict, prompt_ids: list[list[int]], settings: TuneSettings, log) -> Confirmation:
    """The CONFIRM_TOP best grid points and the choice again, in fresh interleaved passes: the
    smallest of 36-64 noisy measurements is biased low (the winner's curse)."""
    best = sorted(plans.grid, key=lambda plan: measured[plan].wall_ms)[:CONFIRM_TOP]
    confirm_plans = list(dict.fromkeys(best + [plans.chosen]))
    log(f"confirming the {len(best)} best grid points and the choice")
    return Confirmation(best, confirm_plans, measure_plans(engine, confirm_plans, prompt_ids, settings, log))


def tune_engine(engine: Engine, config: ChainConfig, prompts: list[str], settings: TuneSettings, log, sets: PromptSets | None) -> dict:
    """Steps 1-5 on a built engine; the report."""
    engine.scheduler.eos_token_ids = frozenset()  # every run generates exactly max_new_tokens
    prompt_ids = token_ids(engine, prompts, settings)
    check_room(engine, prompt_ids, settings)
    planner, start, prefill_extra = calibrate(engine, prompt_ids, settings, log)

    # step 3: predictions, from the calibration only
    def predict(plan: Plan) -> float:
        return predict_plan(planner, plan, prefill_extra, settings.max_new_tokens)

    plans = contenders(planner, predict, settings.grid_max, distributed(engine))

    def predict_all() -> dict:
        return {plan: predict(plan) for plan in plans.plans()}

    first_predicted = predict_all()
    tiers = tier_report(engine, planner)

    # step 4: measurements. Each pass is predicted from calibration runs interleaved with it
    # (the same seconds of a machine whose speed drifts by 10-30 % over minutes), never from
    # the measured runs themselves.
    make_auto_planner = fresh_planners(start)
    measured, auto_planners, per_pass = measure(engine, plans.plans(), prompt_ids, settings, make_auto_planner, log,
                                                predict=lambda repeat: predict_all(),
                                                calibration=lambda: calibration_items(planner, settings))
    predicted = {plan: statistics.median(p[plan] for p in per_pass) for plan in plans.plans()}

    # step 5
    best_wall = min(plans.grid, key=lambda plan: measured[plan].wall_ms)
    heldout = shift = None
    if sets is not None and sets.heldout:
        heldout = measure_heldout(engine, best_wall, token_ids(engine, sets.heldout, settings), settings, make_auto_planner, log,
                                  warm_planner=auto_planners[-1])
    if sets is not None and sets.shift_code and sets.shift_prose:
        log("shift: code prompts, then prose")
        shift = measure_shift(engine, make_auto_planner(), token_ids(engine, sets.shift_code, settings),
                              token_ids(engine, sets.shift_prose, settings), settings)
    confirmation = confirm(engine, plans, measured, prompt_ids, settings, log)
    results = TuneResults(plans, predicted, first_predicted, measured, confirmation, auto_planners[-1].history, tiers, heldout, shift)
    return build_report(engine, config, settings, prompts, results)


# ----------------------------------------------------------------------------- CLI


def settings_from_args(args, config: ChainConfig) -> TuneSettings:
    """The run's settings: the command line's, the config's sampling where it gives none."""
    settings = TuneSettings(
        temperature=args.temperature if args.temperature is not None else config.sampling.temperature,
        max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else config.sampling.max_new_tokens,
        grid_max=args.grid_max,
        max_prompts=args.max_prompts,
        seed=args.seed,
        repeats=args.repeats,
        heldout_repeats=args.heldout_repeats,
        heldout_prompts=args.heldout_prompts,
        top_p=config.sampling.top_p,
        top_k=config.sampling.top_k,
    )
    if min(settings.grid_max, settings.max_new_tokens, settings.max_prompts, settings.repeats, settings.heldout_repeats, settings.heldout_prompts) < 1 \
            or settings.temperature < 0:
        raise TuneError("--grid-max, --max-new-tokens, --max-prompts, --repeats, --heldout-prompts and --heldout-repeats"
                        " must be >= 1 and --temperature >= 0")
    return settings


def cmd_tune(args, config: ChainConfig | None = None) -> int:
    """`config`: the chain the flags name, when the caller has it already (chain_args.chain_config)."""
    config = config or chain_config(args)
    settings = settings_from_args(args, config)
    sets = split_prompts(args.prompts, config, settings.max_prompts, settings.heldout_prompts)
    prompts, source = sets.tuning, sets.source

    def log(message: str) -> None:
        print(f"[tune] {message}", file=sys.stderr, flush=True)

    log(f"{len(prompts)} prompts from {source}")
    log(f"held out: {len(sets.heldout)} prompts; shift: {len(sets.shift_code)} code then {len(sets.shift_prose)} prose")
    report = run_tune(config, prompts, settings, log, sets)
    report["prompts_source"] = source
    print(json.dumps(report) if args.json else format_report(report))
    return 0
