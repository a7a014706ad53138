"""`polyspec tune`: the time model against the clock, on the chain of a config.

    polyspec tune -c CONFIG [--prompts FILE] [--temperature T] [--max-new-tokens N]
                  [--grid-max K] [--max-prompts P] [--repeats R] [--heldout-prompts Q]
                  [--heldout-repeats H] [--json]

Steps, on the config's chain (embedded, or Ray actors driven from this process; the tuner is
the chain's planner in both, fed the same typed observations):
1. profile every tier (profiler.profile_tiers; a Ray chain's tiers in their own processes,
   driver.profile_remote) at the prompts' typical context length, and each model tier's
   prefill of every prompt;
2. calibrate: generate every prompt with every usable set of tiers (the full chain and each
   bypass; a Ray chain has only the full one) at long, middle and short lengths, through the
   tuner's hooks without re-tuning:
   acceptance as plain counts per stage (no recency weighting), latencies refined online
   per set of tiers (a tier is slower on a shared CPU when others run in between);
3. predict, from those estimates only, the ms per token of every grid point (k_i in
   1..K for every stage), of the tuner's choice and of the best chain with each tier
   bypassed: (sum of prefills + time_model.generation_ms) / tokens;
4. measure every one of them (the same prompts, seeds and token counts; EOS is ignored so
   every run generates exactly max_new_tokens), in `--repeats` passes, each interleaved per
   prompt (every plan generates prompt 1 in a shuffled order, then prompt 2, ...: the
   machine's speed drifts over seconds, and plans compared must see the same seconds;
   the calibration runs are interleaved the same way); the calibration plans run again
   inside every pass, interleaved with the measured runs, and each pass is predicted from
   them (latency tables: that pass's plain means), so prediction and measurement see the
   same seconds of a machine whose speed drifts; the reported prediction is the median over
   passes (the first calibration's alone, made before any pass, is reported too);
5. the best grid points again against the tuner's choice (fresh passes: the minimum of many
   noisy measurements is biased low); the best grid point against `lengths: auto` on
   `--heldout-prompts` held-out prompts (16; evenly spaced through the prompts the tuning
   set left over), with a fresh tuner and with one that has served the tuning prompts
   (warm), in `--heldout-repeats` interleaved passes (the goal is a 5 % ratio);
   a fresh tuner on code prompts then prose prompts (how many
   rounds until its plan changes).

The modules: tune_prompts (the prompt sets), tune_measure (interleaved passes, held-out and
shift measurements), tune_report (the JSON report and its text form); this one predicts,
calibrates and runs the steps.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import statistics
import sys

import torch

from polyspec.harness.tune_measure import (
    TuneError,
    TuneSettings,
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
from polyspec.orchestrator.tuning.time_model import latency
from polyspec.orchestrator.tuning.chain_model import first_round_ms, generation_ms
from polyspec.orchestrator.tuning.tuner import Plan, Tuner, request_class

CONFIRM_TOP = 5  # grid points measured again with the tuner's choice (see confirm)


# ----------------------------------------------------------------------------- predicting


def predict_plan(tuner: Tuner, key: str, plan: Plan, prefill_extra_ms: list[list[float]], new_tokens: int) -> float:
    """Predicted ms per token over the prompts: prefills of the tiers in use + decoding."""
    if len(plan.active) == 1:
        decode = [new_tokens * (latency(tuner.profile.forward_ms(0, plan.active), 1) + tuner.timing.round_overhead_ms)] * len(prefill_extra_ms)
    else:
        stages, draft_ms = tuner.stages(key, plan.active)
        lengths = [plan.lengths[level] for level in plan.active[:-1]]
        if stages[0].pipelined:  # each prompt's prefill is the head start of its second block (time_model.RoundModel)
            decode = [generation_ms([dataclasses.replace(stages[0], head_start_ms=extra[0])] + stages[1:], draft_ms, lengths, new_tokens, tuner.tree_width)
                      for extra in prefill_extra_ms]
        else:
            decode = [generation_ms(stages, draft_ms, lengths, new_tokens, tuner.tree_width)] * len(prefill_extra_ms)
    total = sum(ms + sum(extra[t] for t in plan.active) for ms, extra in zip(decode, prefill_extra_ms))
    if tuner.first_round_scale != 1.0 and len(plan.active) > 1:  # a distributed chain: its first rounds, as calibrated
        total += (tuner.first_round_scale - 1.0) * sum(modelled_first_rounds(tuner, key, plan, prefill_extra_ms, new_tokens))
    return total / (new_tokens * len(prefill_extra_ms))


def modelled_first_rounds(tuner: Tuner, key: str, plan: Plan, prefill_extra_ms: list[list[float]], new_tokens: int) -> list[float]:
    """Per prompt, the model's ms for a request's first target round with `plan`: the prefills'
    extra time of the tiers in use + the round with nothing drafted ahead (`first_round_ms`)."""
    stages, draft_ms = tuner.stages(key, plan.active)
    lengths = [plan.lengths[level] for level in plan.active[:-1]]
    first = first_round_ms(stages, draft_ms, lengths, new_tokens, tuner.tree_width)
    return [first + sum(extra[t] for t in plan.active) for extra in prefill_extra_ms]


def calibrate_first_rounds(tuner: Tuner, key: str, runs: list[tuple[Plan, list[float]]], prefill_extra_ms: list[list[float]], new_tokens: int) -> None:
    """A distributed chain's first target round of a request costs more than its model (the
    prefills as profiled + a round with nothing drafted ahead): every tier sets the sequence up,
    and a pipelined drafter starts drafting ahead beside the target's prefill. `runs`: the
    calibration's plans with the first-round wall ms of each prompt, in prompt order; the
    tuner keeps the median of measured / modelled (`first_round_scale`)."""
    ratios = []
    for plan, walls in runs:
        for wall, modelled in zip(walls, modelled_first_rounds(tuner, key, plan, prefill_extra_ms, new_tokens)):
            if modelled > 0:
                ratios.append(wall / modelled)
    if ratios:
        tuner.first_round_scale = statistics.median(ratios)



# ----------------------------------------------------------------------------- calibrating


def distributed(engine: Engine) -> bool:
    """The chain runs as tier workers (runtime.backend: ray): every tier runs every round."""
    return hasattr(engine.scheduler, "membership")


def calibration_plans(tuner: Tuner, grid_max: int) -> list[Plan]:
    """Every usable set of tiers at a few lengths: long, middle and short blocks.

    (The target alone reports no rounds to the tuner: its prediction uses the start-up profile.)"""
    lengths = sorted({grid_max, max(1, grid_max // 2), min(2, grid_max)}, reverse=True)
    return [Plan((k,) * (tuner.num_tiers - 1), active) for active in tuner.candidate_sets() for k in lengths]


def calibrate(engine: Engine, prompt_ids: list[list[int]], settings: TuneSettings, log) -> tuple[Tuner, list[list[float]]]:
    """Steps 1-2: a tuner holding the latency profile (start-up, then refined in every set of
    tiers) and acceptance counts from passes over the prompts with every usable set of tiers
    (`calibration_plans`); and per prompt, per tier, the prefill's extra ms."""
    log("profiling the tiers")
    typical = int(statistics.median(len(ids) for ids in prompt_ids)) + settings.max_new_tokens // 2
    context = (list(prompt_ids[0]) * (typical // len(prompt_ids[0]) + 1))[:typical]
    # calibration: plain counts over all prompts (no decay); skip pairs are measured directly below
    calibrating = dataclasses.replace(engine.config.tuning, max_length=settings.grid_max, decay=1.0, shadow=False)
    if distributed(engine):  # every tier profiles itself (and its prefills) in its own process
        from polyspec.orchestrator.distributed.driver import profile_remote

        profile, prefill_ms = profile_remote(engine.scheduler, typical, settings.params(), settings.grid_max,
                                             prefill_lens=[len(ids) for ids in prompt_ids])
        tuner = Tuner(profile, calibrating, tree_width=engine.scheduler.tree_width, distributed=True,
                      pipelined=bool(engine.scheduler.pipeline))
        prefills = [[prefill_ms[tier][number] for tier in range(len(engine.tiers))] for number in range(len(prompt_ids))]
    else:
        tuner = engine.make_tuner(context, **dataclasses.asdict(calibrating))
        prefills = [measure_prefill_ms(engine, list(ids)) for ids in prompt_ids]
    profile = tuner.profile
    first_forward = [latency(profile.forward_ms(i), 1) if profile.forward[i] is not None else 0.0 for i in range(len(engine.tiers))]
    prefill_extra = [[max(0.0, ms - first) for ms, first in zip(row, first_forward)] for row in prefills]

    full = tuple(range(len(engine.tiers)))
    longest = Plan((settings.grid_max,) * (len(full) - 1), full)
    log("warming up")
    run_plan(engine, longest, prompt_ids[:1], dataclasses.replace(settings, max_new_tokens=min(16, settings.max_new_tokens)))
    recalibrate(engine, tuner, prompt_ids, settings, log, prefill_extra)
    return tuner, prefill_extra


def recalibrate(engine: Engine, tuner: Tuner, prompt_ids: list[list[int]], settings: TuneSettings, log,
                prefill_extra_ms: list[list[float]]) -> None:
    """One pass of the calibration plans through the tuner's hooks (`calibration_items`), alone."""
    items, after, finish = calibration_items(engine, tuner, settings, prefill_extra_ms)
    names = ", ".join(sorted({"+".join(engine.tiers[t].name for t in plan.active) for plan, _ in items}))
    # interleaved per prompt like the measurements: every set of tiers' latency table is
    # refined over the same seconds of the machine (one after the other, a slow phase
    # landed on one set: the target's t(1) came out 7.3 ms in one set and 10.4 ms in another)
    interleaved_pass(engine, items, prompt_ids, settings, seed=settings.seed + 3000,
                     after=after, log=lambda message: log(f"calibrating {len(items)} plans ({names}): {message}"))
    finish()


def calibration_items(engine: Engine, tuner: Tuner, settings: TuneSettings, prefill_extra_ms: list[list[float]]):
    """A pass of the calibration plans through the tuner's hooks, as items of an
    `interleaved_pass` (with its `after` hook, and `finish()` to call once the pass is over):
    acceptance counts grow, and the latency tables become this pass's plain means (a shared
    CPU drifts over minutes; an EMA kept the last prompt's few forwards, and the predictions of
    whole runs moved with them, every grid row off by the same 10-20 %);
    a distributed chain's first rounds are calibrated from the same runs."""
    prompts = len(prefill_extra_ms)
    plans = calibration_plans(tuner, settings.grid_max)
    walls: list[list[float]] = [[] for _ in plans]  # per plan: first-round wall ms per prompt (distributed)
    tuner.profile.restart_means()
    tuner.first_rounds.clear()

    def after(index: int) -> None:
        walls[index].extend(tuner.first_rounds)
        tuner.first_rounds.clear()

    def finish() -> None:
        first_rounds = [(plan, runs) for plan, runs in zip(plans, walls) if tuner.distributed and len(runs) == prompts]
        if first_rounds:
            calibrate_first_rounds(tuner, request_class(settings.params()), first_rounds, prefill_extra_ms, settings.max_new_tokens)

    return [(plan, tuner) for plan in plans], after, finish



# ----------------------------------------------------------------------------- the run


def run_tune(config: ChainConfig, prompts: list[str], settings: TuneSettings, log=None, sets: PromptSets | None = None) -> dict:
    """Profile, calibrate, predict and measure; the report (see the module docstring).
    `sets`: held-out prompts (best grid point vs `lengths: auto`) and the code -> prose sequence."""
    log = log or (lambda message: None)
    if len(config.tiers) < 2:
        raise TuneError("tune needs a chain of at least two tiers")
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


def contenders(tuner: Tuner, key: str, num_tiers: int, grid_max: int) -> Contenders:
    """Step 3's plans: every grid point, the tuner's choice, each bypass, the target alone."""
    full = tuple(range(num_tiers))
    grid = [Plan(lengths, full) for lengths in itertools.product(range(1, grid_max + 1), repeat=num_tiers - 1)]
    chosen = tuner.choose(key)
    # a distributed chain runs every tier every round: no bypass, no target alone to compare
    bypass = [] if tuner.distributed else [(tier, tuner.choose(key, exclude=tier)) for tier in range(1, num_tiers)]
    baseline = None if tuner.distributed else Plan((grid_max,) * (num_tiers - 1), (0,))
    return Contenders(grid, chosen, bypass, baseline)


def fresh_tuners(tuner: Tuner, grid_max: int):
    """A factory of what `lengths: auto` starts from: the start-up profile, no acceptance data."""

    def make() -> Tuner:
        profile = copy.deepcopy(tuner.profile)
        profile.online_forward.clear()
        profile.online_draft.clear()
        profile.plain_means = False  # (the calibration's tables are pass means; a tuner's are EMAs)
        fresh = Tuner(profile, max_length=grid_max, tree_width=tuner.tree_width, distributed=tuner.distributed,
                      pipelined=tuner.pipelined)
        return fresh

    return make


def confirm(engine: Engine, plans: Contenders, measured: dict, prompt_ids: list[list[int]], settings: TuneSettings, log) -> Confirmation:
    """The CONFIRM_TOP best grid points and the choice again, in fresh interleaved passes: the
    smallest of 36-64 noisy measurements is biased low (the winner's curse)."""
    best = sorted(plans.grid, key=lambda plan: measured[plan].wall_ms)[:CONFIRM_TOP]
    confirm_plans = list(dict.fromkeys(best + [plans.chosen]))
    log(f"confirming the {len(best)} best grid points and the choice")
    return Confirmation(best, confirm_plans, measure_plans(engine, confirm_plans, prompt_ids, settings, log))


def heldout_and_shift(engine: Engine, sets: PromptSets | None, best: Plan, settings: TuneSettings, make_auto_tuner, warm_tuner: Tuner,
                      log) -> tuple[dict | None, dict | None]:
    """Step 5's held-out comparison and the code -> prose shift test, where `sets` has their prompts."""
    heldout = shift = None
    if sets is not None and sets.heldout:
        heldout = measure_heldout(engine, best, token_ids(engine, sets.heldout, settings), settings, make_auto_tuner, log, warm_tuner=warm_tuner)
    if sets is not None and sets.shift_code and sets.shift_prose:
        log("shift: code prompts, then prose")
        shift = measure_shift(engine, make_auto_tuner(), token_ids(engine, sets.shift_code, settings),
                              token_ids(engine, sets.shift_prose, settings), settings)
    return heldout, shift


def tune_engine(engine: Engine, config: ChainConfig, prompts: list[str], settings: TuneSettings, log, sets: PromptSets | None) -> dict:
    """Steps 1-5 on a built engine; the report."""
    engine.scheduler.eos_token_ids = frozenset()  # every run generates exactly max_new_tokens
    prompt_ids = token_ids(engine, prompts, settings)
    check_room(engine, prompt_ids, settings)
    tuner, prefill_extra = calibrate(engine, prompt_ids, settings, log)

    # step 3: predictions, from the calibration only
    key = request_class(settings.params())
    plans = contenders(tuner, key, len(engine.tiers), settings.grid_max)

    def predict_all() -> dict:
        return {plan: predict_plan(tuner, key, plan, prefill_extra, settings.max_new_tokens) for plan in plans.plans()}

    first_predicted = predict_all()
    tiers = tier_report(engine, tuner, key, settings.grid_max)
    overhead_ms = tuner.timing.round_overhead_ms

    # step 4: measurements. Each pass is predicted from calibration runs interleaved with it
    # (the same seconds of a machine whose speed drifts by 10-30 % over minutes: calibrated in
    # a pass of its own just before, a whole grid came out over- or under-predicted by 13-16 %,
    # every row the same way), never from the measured runs themselves.
    make_auto_tuner = fresh_tuners(tuner, settings.grid_max)
    measured, auto_tuners, per_pass = measure(engine, plans.plans(), prompt_ids, settings, make_auto_tuner, log,
                                              predict=lambda repeat: predict_all(),
                                              calibration=lambda: calibration_items(engine, tuner, settings, prefill_extra))
    predicted = {plan: statistics.median(p[plan] for p in per_pass) for plan in plans.plans()}

    # step 5
    best_wall = min(plans.grid, key=lambda plan: measured[plan].wall_ms)
    heldout, shift = heldout_and_shift(engine, sets, best_wall, settings, make_auto_tuner, auto_tuners[-1], log)
    confirmation = confirm(engine, plans, measured, prompt_ids, settings, log)
    results = TuneResults(plans, predicted, first_predicted, measured, confirmation, auto_tuners[-1].history, tiers, overhead_ms, heldout, shift)
    return build_report(engine, config, tuner, settings, prompts, results)


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
