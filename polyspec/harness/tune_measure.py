"""`polyspec tune`'s measurements: interleaved passes over plans and planners, and the held-out
comparison.

Every run generates exactly `max_new_tokens` (the caller disables EOS); a pass is interleaved
per prompt (`interleaved_pass`) so that the items it compares see the same seconds of a
machine whose speed drifts.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import statistics
import time

from polyspec.orchestrator.engine import Engine, GenerationRequest
from polyspec.orchestrator.tuning.batch_model import BatchPlanner, Plan
from polyspec.workers.core.errors import PolyspecError
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks

DEFAULT_GRID_MAX = 8
DEFAULT_MAX_PROMPTS = 8


class TuneError(PolyspecError):
    pass


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    temperature: float = 0.0
    max_new_tokens: int = 64
    grid_max: int = DEFAULT_GRID_MAX
    max_prompts: int = DEFAULT_MAX_PROMPTS
    seed: int = 0
    repeats: int = 1  # passes over every plan; the median pass is reported
    heldout_repeats: int = 7  # passes of the held-out comparison (best grid point, fresh auto, warm auto; interleaved per prompt)
    # Held-out prompts. A few prompts can decide that comparison: a drafter's greedy token
    # can flip at a near-tie with the lengths it runs at (its logits come from forwards of
    # k + 1 tokens), so one plan draws a rejection another does not; each such event moves a
    # ratio over 8 prompts by ~2.5 %, over 16 by ~1.2 % (benchmarks/HISTORY.md).
    heldout_prompts: int = 16
    top_p: float = 1.0
    top_k: int = 0

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def measure_prefill_ms(engine: Engine, prompt_ids: list[int], repeats: int = 3) -> list[float]:
    """Per tier: ms of one forward over the whole prompt on a fresh sequence (0 for the n-gram tier)."""
    params = SamplingParams()
    out = []
    for index, tier in enumerate(engine.scheduler.tiers):
        if not tier.has_weights:
            out.append(0.0)
            continue
        samples = []
        for repeat in range(repeats):
            seq_id = ("tune-prefill", index, repeat)
            started = time.perf_counter()
            tier.score_batch([seq_id], [prompt_ids], Blocks.empty(1), [params])
            samples.append((time.perf_counter() - started) * 1000.0)
            tier.release(seq_id)
        out.append(statistics.median(samples))
    return out


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Per generated token: wall time (what the model predicts) and this process's CPU time
    (the same minus time the OS gave other processes: a diagnostic on a shared machine)."""

    wall_ms: float
    cpu_ms: float


@dataclasses.dataclass
class Pinned:
    """A `contract.RoundPlanner` that runs `fixed` every step and passes what it observes to `planner`: the
    planner learns the plan's acceptance and forward costs (the calibration) without choosing the plan."""

    fixed: Plan
    planner: BatchPlanner
    shadows = False
    predicted_tokens_per_s = None

    def plan(self, step) -> tuple[list[int], tuple[int, ...]]:
        return list(self.fixed.lengths), self.fixed.active

    def observe(self, observation) -> None:
        self.planner.observe(observation)  # (a step it did not plan refines its tables only)

    def drafters(self, step) -> tuple[int, ...]:
        return ()


def copy_planner(planner: BatchPlanner) -> BatchPlanner:
    """A copy of `planner`'s estimates and A/B that plans on the same tiers (they are not copied)."""
    return copy.deepcopy(planner, {id(planner.tiers): planner.tiers})


def run_plan(engine: Engine, plan: Plan, prompt_ids: list[list[int]], settings: TuneSettings, planner: BatchPlanner | None = None) -> Measurement:
    """Every prompt with `plan` (fixed lengths / tiers); with `planner`, through its observations
    (it learns but does not plan: `Pinned`)."""
    return interleaved_pass(engine, [plan if planner is None else (plan, planner)], prompt_ids, settings, seed=0)[0]


PASS_SEED_STRIDE = 1 << 16  # request seeds of one pass: settings.seed + prompt number + stride * pass seed


def request_seed(settings: TuneSettings, pass_seed: int, number: int) -> int:
    """The sampling seed of prompt `number` in the pass seeded `pass_seed`: one for every item
    of the pass (they sample alike until their rounds differ), a new one in every pass. At
    T = 1 a pass samples one realisation of the requests; with the same seeds in every pass,
    each repeat, the confirmation and the held-out passes replayed the grid's realisation, so
    a plan that drew few rejections (or many) kept them in every measurement. On the Ray demo
    chain this made one k_0 measure slower than its neighbours in almost every grid, from the
    rejections its realisation happened to draw (benchmarks/HISTORY.md). At
    T = 0 the seed plays no part."""
    return settings.seed + number + PASS_SEED_STRIDE * pass_seed


def interleaved_pass(engine: Engine, items: list, prompt_ids: list[list[int]], settings: TuneSettings, seed: int,
                     after=None, log=None, record=None) -> list[Measurement]:
    """One measurement pass, interleaved per prompt: every item generates prompt 1 (in a
    shuffled order), then every item prompt 2, and so on. An item is a Plan (fixed lengths and
    tiers), a planner (`lengths: auto`, learning as it goes over the prompts in order), or a
    (Plan, planner) pair (the plan's fixed lengths through the planner's observations: it learns,
    it does not plan; the calibration). `after(index)` is called after each run of item `index`;
    `record(index, prompt_number, output)` too, with the run's result;
    `log(message)` after each prompt.

    A shared CPU's speed drifts over seconds: the demo chain at fixed lengths measured 4.0 and
    5.2 ms/token in whole passes a minute apart, and two plans measured one after the other
    (every prompt with one, then every prompt with the other) came out anywhere from 0.99x to
    1.24x apart from one pass to the next, where per-prompt interleaving kept the same pair
    within 0.98-1.00x. Items compared here see the same seconds of the machine.
    Returns one Measurement per item, in the order given."""
    params = settings.params()
    scheduler = engine.scheduler
    totals = [[0.0, 0.0, 0] for _ in items]  # wall s, this process's CPU s, tokens
    rng = random.Random(seed)
    try:
        for number, ids in enumerate(prompt_ids):
            order = list(range(len(items)))
            rng.shuffle(order)
            for index in order:
                item = items[index]
                if isinstance(item, Plan):
                    scheduler.planner = None
                    scheduler.lengths, scheduler.active = list(item.lengths), tuple(item.active)
                elif isinstance(item, tuple):
                    scheduler.planner = Pinned(*item)
                else:
                    scheduler.planner = item
                cpu_started = time.process_time()
                output = engine.generate(GenerationRequest(tuple(ids), settings.max_new_tokens, params, request_seed(settings, seed, number)))
                total = totals[index]
                total[0] += output["stats"]["time_s"]
                total[1] += time.process_time() - cpu_started
                total[2] += len(output["token_ids"])
                if after is not None:
                    after(index)
                if record is not None:
                    record(index, number, output)
            if log is not None:
                log(f"prompt {number + 1}/{len(prompt_ids)}")
    finally:
        scheduler.planner = None
    return [Measurement(1000.0 * wall / max(1, tokens), 1000.0 * cpu / max(1, tokens)) for wall, cpu, tokens in totals]


def _medians(runs: list[Measurement]) -> Measurement:
    return Measurement(statistics.median(m.wall_ms for m in runs), statistics.median(m.cpu_ms for m in runs))


def measure(engine: Engine, plans: list[Plan], prompt_ids: list[list[int]], settings: TuneSettings, make_auto_planner, log,
            predict=None, calibration=None) -> tuple[dict, list[BatchPlanner], list[dict]]:
    """Step 4: `settings.repeats` passes, each over every plan and one fresh `lengths: auto`
    planner, interleaved per prompt (`interleaved_pass`), with `calibration()`'s items (see
    `calibration_items`) interleaved in the same pass; after each pass `predict(repeat)`
    returns its predictions (from the calibration runs, never the measured ones). Returns
    ({plan or "auto": median Measurement}, the auto runs' planners, [per-pass predictions])."""
    runs: dict = {plan: [] for plan in [*plans, "auto"]}
    planners = []
    predictions = []
    started = time.perf_counter()
    for repeat in range(settings.repeats):
        extra, after, finish = calibration() if calibration is not None else ([], None, None)
        auto_planner = make_auto_planner()
        measured = [*plans, auto_planner]
        hook = (lambda index: after(index - len(measured)) if index >= len(measured) else None) if after is not None else None
        results = interleaved_pass(engine, [*measured, *extra], prompt_ids, settings, seed=settings.seed + repeat, after=hook)
        if finish is not None:
            finish()
        for item, result in zip([*plans, "auto"], results):
            runs[item].append(result)
        planners.append(auto_planner)
        if predict is not None:
            predictions.append(predict(repeat))
        log(f"pass {repeat + 1}/{settings.repeats}: {len(plans) + 1} runs of {len(prompt_ids)} prompts"
            f"{f' and {len(extra)} calibration runs' if extra else ''} ({time.perf_counter() - started:.0f} s)")
    return {item: _medians(values) for item, values in runs.items()}, planners, predictions


def measure_plans(engine: Engine, plans: list[Plan], prompt_ids: list[list[int]], settings: TuneSettings, log) -> dict:
    """{plan: median Measurement} over `settings.repeats` fresh interleaved passes."""
    runs: dict = {plan: [] for plan in plans}
    for repeat in range(settings.repeats):
        for plan, result in zip(plans, interleaved_pass(engine, plans, prompt_ids, settings, seed=settings.seed + 1000 + repeat)):
            runs[plan].append(result)
        log(f"confirm pass {repeat + 1}/{settings.repeats}")
    return {plan: _medians(values) for plan, values in runs.items()}


def measure_heldout(engine: Engine, best: Plan, prompt_ids: list[list[int]], settings: TuneSettings, make_auto_planner, log,
                    warm_planner: BatchPlanner | None = None) -> dict:
    """The best grid point (fixed lengths, chosen on the tuning set) against `lengths: auto` on
    prompts neither saw; `heldout_repeats` passes, interleaved per prompt. Auto runs twice a pass:
    a fresh planner (start-up profile only: a server's first requests), and, when `warm_planner`
    is given, a copy of it (a planner that has already served other prompts: the tuning set,
    in one `lengths: auto` run), as in a server that has been up for a while."""
    runs: dict[str, list[Measurement]] = {"fixed": [], "auto": [], "warm": []}
    detail = []  # per pass, per item: ms/token of each prompt, and the planners' plans in each
    for repeat in range(settings.heldout_repeats):
        items = {"fixed": best, "auto": make_auto_planner()}
        if warm_planner is not None:
            items["warm"] = copy_planner(warm_planner)
        names = list(items)
        this_pass = {name: {"prompt_ms_per_token": [None] * len(prompt_ids)} for name in names}

        def record(index: int, number: int, output) -> None:
            entry = this_pass[names[index]]
            entry["prompt_ms_per_token"][number] = round(1000.0 * output["stats"]["time_s"] / max(1, len(output["token_ids"])), 3)
            if "plans" in output["stats"]:  # what the planner ran in that prompt: [new tokens so far, lengths, tiers] at each change
                entry.setdefault("plans", [None] * len(prompt_ids))[number] = [[p["new_tokens"], p["lengths"], p["tiers"]] for p in output["stats"]["plans"]]

        results = interleaved_pass(engine, list(items.values()), prompt_ids, settings, seed=settings.seed + 2000 + repeat, record=record)
        for name, result in zip(items, results):
            runs[name].append(result)
            this_pass[name]["ms_per_token"] = round(result.wall_ms, 4)
        detail.append(this_pass)
        log(f"held-out pass {repeat + 1}/{settings.heldout_repeats}")
    return heldout_summary(runs, detail, best, len(prompt_ids), settings.heldout_repeats)


def heldout_summary(runs: dict[str, list[Measurement]], detail: list[dict], best: Plan, prompts: int, passes: int) -> dict:
    """The held-out section of the report from each item's measurements, pass by pass."""
    fixed, auto = runs["fixed"], runs["auto"]
    fixed_ms = statistics.median(m.wall_ms for m in fixed)
    auto_ms = statistics.median(m.wall_ms for m in auto)
    fixed_cpu = statistics.median(m.cpu_ms for m in fixed)
    auto_cpu = statistics.median(m.cpu_ms for m in auto)

    def paired(name: str, cpu: bool = False) -> float:
        """Median over passes of the pass's best-grid-point ms / the item's ms: tokens/s over
        the best grid point, each pass against the fixed run beside it (see the return)."""
        return statistics.median((f.cpu_ms / a.cpu_ms) if cpu else (f.wall_ms / a.wall_ms) for f, a in zip(fixed, runs[name]))

    warm = {}
    if runs["warm"]:
        warm_ms = statistics.median(m.wall_ms for m in runs["warm"])
        warm = {"warm_auto_ms_per_token": round(warm_ms, 4), "warm_auto_tokens_per_s_over_best": round(paired("warm"), 4),
                "warm_auto_ratio_of_medians": round(fixed_ms / warm_ms, 4)}
    # The ratio is paired per pass: the passes differ by more than the items of one pass (the
    # machine's speed drifts; at T = 1 each pass samples other texts), and the ratio of the two
    # medians could pair one item's slow pass with the other's fast one. Paired, the ratio's
    # bootstrap sd is about two thirds of the ratio of medians' (kept below), with no lean
    # either way (benchmarks/HISTORY.md).
    return {
        "prompts": prompts,
        "passes": passes,
        "best_grid_lengths": [best.lengths[level] for level in best.active[:-1]],
        "best_grid_ms_per_token": round(fixed_ms, 4),
        "auto_ms_per_token": round(auto_ms, 4),
        "auto_tokens_per_s_over_best": round(paired("auto"), 4),  # >= 0.95 is the goal
        "auto_ratio_of_medians": round(fixed_ms / auto_ms, 4),
        "best_grid_cpu_ms_per_token": round(fixed_cpu, 4),
        "auto_cpu_ms_per_token": round(auto_cpu, 4),
        "auto_cpu_tokens_per_s_over_best": round(paired("auto", cpu=True), 4),
        **warm,
        "per_pass": detail,
    }


def measure_shift(engine: Engine, planner: BatchPlanner, code_ids: list[list[int]], prose_ids: list[list[int]], settings: TuneSettings) -> dict:
    """`lengths: auto` on code prompts, then prose prompts, in one planner: the rounds from the first prose
    round to the first change of plan (lengths or tiers) after it, read from the requests' plan records.
    (The plan of the first prose round itself is not counted as a change: it was decided before that round,
    from code rounds only.)"""
    params = settings.params()
    records = []  # (prose?, plan record) of every request, in order
    engine.scheduler.planner = planner
    try:
        for prose, ids_list, offset in ((False, code_ids, 0), (True, prose_ids, 100)):
            for number, ids in enumerate(ids_list):
                output = engine.generate(GenerationRequest(tuple(ids), settings.max_new_tokens, params, settings.seed + offset + number))
                records += [(prose, record) for record in output["stats"]["plans"]]
    finally:
        engine.scheduler.planner = None
    code = [record for prose, record in records if not prose]
    prose = [record for is_prose, record in records if is_prose]
    switch_round = sum(record["rounds"] for record in code)

    def shown(record: dict) -> dict:
        return {"lengths": record["lengths"], "tiers": record["tiers"]}

    rounds, change = 0, None
    for before, record in zip(prose, prose[1:]):
        rounds += before["rounds"]
        if shown(record) != shown(before):
            change = rounds
            break
    return {
        "code_prompts": len(code_ids),
        "prose_prompts": len(prose_ids),
        "prose_from_round": switch_round,
        "prose_rounds": sum(record["rounds"] for record in prose),
        "plan_at_switch": shown(code[-1]) if code else None,
        "rounds_to_first_change": change,
        "history": planner.history,
    }
