"""`polyspec tune`: the time model against the clock, on the chain of a config.

    polyspec tune -c CONFIG [--prompts FILE] [--temperature T] [--max-new-tokens N]
                  [--grid-max K] [--max-prompts P] [--repeats R] [--heldout-prompts Q]
                  [--heldout-repeats H] [--json]

Steps (all in this process, embedded mode):
1. profile every tier (profiler.profile_tiers) at the prompts' typical context length, and
   each model tier's prefill of every prompt;
2. calibrate: generate every prompt with every usable set of tiers (the full chain and each
   bypass) at long, middle and short lengths, through the tuner's hooks without re-tuning:
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

Prompt file: JSONL, one `{"prompt": "..."}` object per line, optionally with a `"class"`
-- the format of `models/stdlib/prompts.jsonl`, the set that ships with the demo family and
the default here (found beside the target model's folder); with no such file a few built-in
code prompts are used. The tuning and held-out sets are evenly spaced through the prompts of
every class but "repetitive-code"; the shift test runs that class's prompts (evenly spaced),
else the held-out "code" prompts, then "prose" prompts from outside the tuning set.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from polyspec.harness.bench import machine_info
from polyspec.orchestrator.config import ChainConfig, load_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tuning.time_model import first_round_ms, generation_ms, latency, relative_error
from polyspec.orchestrator.tuning.tuner import Plan, Tuner, request_class
from polyspec.workers.core.errors import PolyspecError
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import DraftTree

BUILTIN_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the given folders.\"\"\"\n    for folder in argv[1:]:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "def parse_header(line):\n    \"\"\"Split 'Name: value' into a (name, value) pair.\"\"\"\n    name, _, value = line.partition(':')\n",
    "    def test_round_trip(self):\n        data = {'a': 1, 'b': [1, 2, 3]}\n        self.assertEqual(json.loads(json.dumps(data)), data)\n\n    def test_",
)
DEFAULT_GRID_MAX = 8
DEFAULT_MAX_PROMPTS = 8
CONFIRM_TOP = 5  # grid points measured again with the tuner's choice (see run_tune)


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
    # Held-out prompts. At T = 0 on the Ray demo chain a few prompts decide that comparison:
    # the int8 tier's greedy token flips at a near-tie with the lengths it runs at (its
    # logits come from forwards of k_1 + 1 tokens), so [6, 6] drew a rejection on two of 8
    # held-out prompts that [6, 4] did not, each ~50 ms of ~2 s a pass (recovering the draft-ahead
    # stream takes two slow rounds), and lost 6-9 % to [6, 4] in four runs of 3-5 passes (in
    # every one of the 16 passes), where on the tuning prompts the two were within 1.4 %. With 8 prompts one such event moved the
    # ratio 2.5 %; with 16, about 1.2 % (docs/time-model.md §6, session 20).
    heldout_prompts: int = 16
    top_p: float = 1.0
    top_k: int = 0

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


# ----------------------------------------------------------------------------- prompts


def default_prompts_path(config: ChainConfig) -> Path:
    """The family's prompt set ships next to its models: <target dir>/../prompts.jsonl."""
    return Path(config.tiers[0].model).parent / "prompts.jsonl"


def read_prompts(path: Path) -> list[str]:
    """The prompts of a bench/tune prompt file (JSONL, one {"prompt", "class"} per line) that
    bench measures and tune tunes on (not the shift test's own class)."""
    from polyspec.harness.bench import measured_prompts, read_prompts as read_bench_prompts

    return [entry.text for entry in measured_prompts(read_bench_prompts(str(path)))]


def _classed_prompts(path: str | None, config: ChainConfig) -> tuple[list[tuple[str, str]], str]:
    """[(text, class)] of the prompt file (or the built-in code prompts), and where they came from."""
    from polyspec.harness.bench import read_prompts as read_bench_prompts

    if path is not None:
        if not Path(path).exists():
            raise TuneError(f"prompts file not found: {path}")
        source = path
    elif default_prompts_path(config).exists():
        source = str(default_prompts_path(config))
    else:
        return [(text, "code") for text in BUILTIN_PROMPTS], "built-in code prompts"
    return [(entry.text, entry.kind) for entry in read_bench_prompts(source)], source


def _evenly(items: list, count: int) -> list:
    if len(items) <= count:
        return list(items)
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def _tuning_classes(classed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every prompt but the shift test's own class (bench.SHIFT_ONLY_CLASSES): the sets picked
    from these stay what they were before a file gained that class."""
    from polyspec.harness.bench import SHIFT_ONLY_CLASSES

    return [(text, kind) for text, kind in classed if kind not in SHIFT_ONLY_CLASSES]


def load_prompts(path: str | None, config: ChainConfig, max_prompts: int) -> tuple[list[str], str]:
    """(prompts, where they came from); at most `max_prompts`, evenly spaced through the file
    (the shift test's own class left out)."""
    classed, source = _classed_prompts(path, config)
    return [text for text, _ in _evenly(_tuning_classes(classed), max_prompts)], source


@dataclasses.dataclass
class PromptSets:
    """The tuning set (grid, calibration), a disjoint held-out set (best grid point vs
    `lengths: auto`), and a code-then-prose sequence from outside the tuning set (the shift test:
    its code half is the "repetitive-code" class, text the n-gram drafter's copies continue
    even at T = 1, where the file has one, else held-out "code" prompts)."""

    tuning: list[str]
    heldout: list[str]  # empty when the file has no prompts left over
    shift_code: list[str]
    shift_prose: list[str]
    source: str


def split_prompts(path: str | None, config: ChainConfig, max_prompts: int, heldout_prompts: int | None = None) -> PromptSets:
    """`max_prompts` tuning prompts, evenly spaced; `heldout_prompts` (default: as many)
    held-out ones, evenly spaced through the rest; the shift test's code and prose halves."""
    from polyspec.harness.bench import REPETITIVE_CODE

    everything, source = _classed_prompts(path, config)
    classed = _tuning_classes(everything)
    repetitive = [text for text, kind in everything if kind == REPETITIVE_CODE]
    half = max(1, max_prompts // 2)
    tuning_index = set(_evenly(range(len(classed)), max_prompts))
    rest = [i for i in range(len(classed)) if i not in tuning_index]
    heldout_index = _evenly(rest, heldout_prompts or max_prompts)
    heldout = [classed[i] for i in heldout_index]
    return PromptSets(
        tuning=[classed[i][0] for i in sorted(tuning_index)],
        heldout=[text for text, _ in heldout],
        shift_code=_evenly(repetitive, half) if repetitive else [text for text, kind in heldout if kind == "code"][:half],
        shift_prose=[classed[i][0] for i in rest if classed[i][1] == "prose"][:half],
        source=source,
    )


# ----------------------------------------------------------------------------- measuring


def measure_prefill_ms(engine: Engine, prompt_ids: list[int], repeats: int = 3) -> list[float]:
    """Per tier: ms of one forward over the whole prompt on a fresh sequence (0 for the n-gram tier)."""
    params = SamplingParams()
    out = []
    for index, tier in enumerate(engine.tiers):
        if not hasattr(tier, "model"):
            out.append(0.0)
            continue
        samples = []
        for repeat in range(repeats):
            seq_id = ("tune-prefill", index, repeat)
            started = time.perf_counter()
            tier.score(seq_id, prompt_ids, DraftTree([], [], None), params)
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


def run_plan(engine: Engine, plan: Plan, prompt_ids: list[list[int]], settings: TuneSettings, tuner: Tuner | None = None) -> Measurement:
    """Every prompt with `plan` (fixed lengths / tiers); with `tuner`, through its hooks
    (it learns but does not re-tune)."""
    return interleaved_pass(engine, [plan if tuner is None else (plan, tuner)], prompt_ids, settings, seed=0)[0]


def run_auto(engine: Engine, tuner: Tuner, prompt_ids: list[list[int]], settings: TuneSettings) -> Measurement:
    """Every prompt with `lengths: auto` (the tuner learning as it goes)."""
    return interleaved_pass(engine, [tuner], prompt_ids, settings, seed=0)[0]


PASS_SEED_STRIDE = 1 << 16  # request seeds of one pass: settings.seed + prompt number + stride * pass seed


def request_seed(settings: TuneSettings, pass_seed: int, number: int) -> int:
    """The sampling seed of prompt `number` in the pass seeded `pass_seed`: one for every item
    of the pass (they sample alike until their rounds differ), a new one in every pass. At
    T = 1 a pass samples one realisation of the requests; with the same seeds in every pass,
    each repeat, the confirmation and the held-out passes replayed the grid's realisation, so
    a plan that drew few rejections (or many) kept them in every measurement. On the Ray demo
    chain, with the tuning prompts' old seeds, [5, 1] lost 1.04 blocks a request and [6, 1]
    0.46 (their acceptance rates expect 0.4 and 0.3), so k_0 = 5 measured slower than 4 and 6 in 12 of 13
    committed grids; with other seeds 4, 5, 6 fall in order (docs/time-model.md §6). At
    T = 0 the seed plays no part."""
    return settings.seed + number + PASS_SEED_STRIDE * pass_seed


def interleaved_pass(engine: Engine, items: list, prompt_ids: list[list[int]], settings: TuneSettings, seed: int,
                     after=None, log=None, record=None) -> list[Measurement]:
    """One measurement pass, interleaved per prompt: every item generates prompt 1 (in a
    shuffled order), then every item prompt 2, and so on. An item is a Plan (fixed lengths and
    tiers), a Tuner (`lengths: auto`, learning as it goes over the prompts in order), or a
    (Plan, Tuner) pair (the plan's fixed lengths through the tuner's hooks: it learns, it does
    not re-tune; the calibration). `after(index)` is called after each run of item `index`;
    `record(index, prompt_number, output)` too, with the run's GenerationOutput;
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
                    scheduler.tuner = None
                    scheduler.lengths, scheduler.active = list(item.lengths), tuple(item.active)
                elif isinstance(item, tuple):
                    plan, scheduler.tuner = item
                    scheduler.tuner.fixed = plan
                    scheduler.lengths, scheduler.active = list(plan.lengths), tuple(plan.active)
                else:
                    item.fixed = None
                    scheduler.tuner = item
                cpu_started = time.process_time()
                output = scheduler.generate(list(ids), settings.max_new_tokens, params, seed=request_seed(settings, seed, number))
                total = totals[index]
                total[0] += output.stats["time_s"]
                total[1] += time.process_time() - cpu_started
                total[2] += len(output.token_ids)
                if after is not None:
                    after(index)
                if record is not None:
                    record(index, number, output)
            if log is not None:
                log(f"prompt {number + 1}/{len(prompt_ids)}")
    finally:
        scheduler.tuner = None
    return [Measurement(1000.0 * wall / max(1, tokens), 1000.0 * cpu / max(1, tokens)) for wall, cpu, tokens in totals]


def _medians(runs: list[Measurement]) -> Measurement:
    return Measurement(statistics.median(m.wall_ms for m in runs), statistics.median(m.cpu_ms for m in runs))


def measure(engine: Engine, plans: list[Plan], prompt_ids: list[list[int]], settings: TuneSettings, make_auto_tuner, log,
            predict=None, calibration=None) -> tuple[dict, list[Tuner], list[dict]]:
    """Step 4: `settings.repeats` passes, each over every plan and one fresh `lengths: auto`
    tuner, interleaved per prompt (`interleaved_pass`), with `calibration()`'s items (see
    `calibration_items`) interleaved in the same pass; after each pass `predict(repeat)`
    returns its predictions (from the calibration runs, never the measured ones). Returns
    ({plan or "auto": median Measurement}, the auto runs' tuners, [per-pass predictions])."""
    runs: dict = {plan: [] for plan in [*plans, "auto"]}
    tuners = []
    predictions = []
    started = time.perf_counter()
    for repeat in range(settings.repeats):
        extra, after, finish = calibration() if calibration is not None else ([], None, None)
        auto_tuner = make_auto_tuner()
        measured = [*plans, auto_tuner]
        hook = (lambda index: after(index - len(measured)) if index >= len(measured) else None) if after is not None else None
        results = interleaved_pass(engine, [*measured, *extra], prompt_ids, settings, seed=settings.seed + repeat, after=hook)
        if finish is not None:
            finish()
        for item, result in zip([*plans, "auto"], results):
            runs[item].append(result)
        tuners.append(auto_tuner)
        if predict is not None:
            predictions.append(predict(repeat))
        log(f"pass {repeat + 1}/{settings.repeats}: {len(plans) + 1} runs of {len(prompt_ids)} prompts"
            f"{f' and {len(extra)} calibration runs' if extra else ''} ({time.perf_counter() - started:.0f} s)")
    return {item: _medians(values) for item, values in runs.items()}, tuners, predictions


def measure_plans(engine: Engine, plans: list[Plan], prompt_ids: list[list[int]], settings: TuneSettings, log) -> dict:
    """{plan: median Measurement} over `settings.repeats` fresh interleaved passes."""
    runs: dict = {plan: [] for plan in plans}
    for repeat in range(settings.repeats):
        for plan, result in zip(plans, interleaved_pass(engine, plans, prompt_ids, settings, seed=settings.seed + 1000 + repeat)):
            runs[plan].append(result)
        log(f"confirm pass {repeat + 1}/{settings.repeats}")
    return {plan: _medians(values) for plan, values in runs.items()}


def predict_plan(tuner: Tuner, key: str, plan: Plan, prefill_extra_ms: list[list[float]], new_tokens: int) -> float:
    """Predicted ms per token over the prompts: prefills of the tiers in use + decoding."""
    if len(plan.active) == 1:
        decode = [new_tokens * (latency(tuner.profile.forward_ms(0, plan.active), 1) + tuner.round_overhead_ms)] * len(prefill_extra_ms)
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


def measure_heldout(engine: Engine, best: Plan, prompt_ids: list[list[int]], settings: TuneSettings, make_auto_tuner, log,
                    warm_tuner: Tuner | None = None) -> dict:
    """The best grid point (fixed lengths, chosen on the tuning set) against `lengths: auto` on
    prompts neither saw; `heldout_repeats` passes, interleaved per prompt. Auto runs twice a pass:
    a fresh tuner (start-up profile only: a server's first requests), and, when `warm_tuner`
    is given, a copy of it (a tuner that has already served other prompts: the tuning set,
    in one `lengths: auto` run), as in a server that has been up for a while."""
    runs: dict[str, list[Measurement]] = {"fixed": [], "auto": [], "warm": []}
    detail = []  # per pass, per item: ms/token of each prompt, and the tuners' plans in each
    for repeat in range(settings.heldout_repeats):
        items = {"fixed": best, "auto": make_auto_tuner()}
        if warm_tuner is not None:
            items["warm"] = copy.deepcopy(warm_tuner)
        names = list(items)
        this_pass = {name: {"prompt_ms_per_token": [None] * len(prompt_ids)} for name in names}

        def record(index: int, number: int, output) -> None:
            entry = this_pass[names[index]]
            entry["prompt_ms_per_token"][number] = round(1000.0 * output.stats["time_s"] / max(1, len(output.token_ids)), 3)
            if "plans" in output.stats:  # what the tuner ran in that prompt: [new tokens so far, lengths, tiers] at each change
                entry.setdefault("plans", [None] * len(prompt_ids))[number] = [[p["new_tokens"], p["lengths"], p["tiers"]] for p in output.stats["plans"]]

        results = interleaved_pass(engine, list(items.values()), prompt_ids, settings, seed=settings.seed + 2000 + repeat, record=record)
        for name, result in zip(items, results):
            runs[name].append(result)
            this_pass[name]["ms_per_token"] = round(result.wall_ms, 4)
        detail.append(this_pass)
        log(f"held-out pass {repeat + 1}/{settings.heldout_repeats}")
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
    # machine's speed drifts; at T = 1 each pass samples other texts: the best grid point's
    # passes spread 5.3-7.6 ms/token in one run), and the ratio of the two medians could pair
    # one item's slow pass with the other's fast one. Over the 45 committed held-out sections
    # with per-pass detail (7 passes each), the median bootstrap sd of the paired median was
    # 0.018 against 0.028 for the ratio of medians (kept below), with no lean: higher in 23 of
    # 45, by 0.0005 at the median (docs/time-model.md §6, session 21).
    return {
        "prompts": len(prompt_ids),
        "passes": settings.heldout_repeats,
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


def shift_view(engine: Engine, tuner: Tuner, key: str) -> dict:
    """What the tuner believes at one moment of the shift test: acceptance per pair it has
    measured (positions 1-4) and the best plan it predicts with every tier and without each."""
    names = [tier.name for tier in engine.tiers]
    acceptance = {
        f"{names[v]}<-{names[d]}": {"per_position": [round(r, 3) for r in tuner.accept_rates(key, v, d)[:4]], "blocks": round(estimate.blocks, 1)}
        for (v, d), estimate in sorted(tuner.estimates(key).items())
    }
    contenders = [tuner.choose(key, bypass=False)]
    if not tuner.distributed:  # a distributed chain cannot bypass a tier
        contenders += [tuner.choose(key, exclude=tier) for tier in range(1, len(engine.tiers))]
    predicted = [
        {"tiers": [names[t] for t in plan.active], "lengths": [plan.lengths[level] for level in plan.active[:-1]], "ms_per_token": round(plan.predicted_ms, 4)}
        for plan in dict.fromkeys(contenders)
    ]
    return {"acceptance": acceptance, "predicted": predicted}


def measure_shift(engine: Engine, tuner: Tuner, code_ids: list[list[int]], prose_ids: list[list[int]], settings: TuneSettings) -> dict:
    """`lengths: auto` on code prompts, then prose prompts, in one tuner: the target rounds
    from the first prose round to the next change of plan (lengths or tiers) made after it.
    (A change planned for the first prose round itself is not counted: it was decided before
    that round, from code rounds only.) With the tuner's view at the switch and at the end."""
    params = settings.params()
    key = request_class(params)
    engine.scheduler.tuner = tuner
    tuner.fixed = None
    try:
        for number, ids in enumerate(code_ids):
            engine.scheduler.generate(list(ids), settings.max_new_tokens, params, seed=settings.seed + number)
        switch_round = tuner._state(key).rounds
        plan_before = tuner._state(key).plan
        at_switch = shift_view(engine, tuner, key)
        for number, ids in enumerate(prose_ids):
            engine.scheduler.generate(list(ids), settings.max_new_tokens, params, seed=settings.seed + 100 + number)
        end_round = tuner._state(key).rounds
    finally:
        engine.scheduler.tuner = None
    changes = [h for h in tuner.history if h["round"] > switch_round]
    at_end = shift_view(engine, tuner, key)
    best_at_end = min(at_end["predicted"], key=lambda plan: plan["ms_per_token"])
    return {
        "code_prompts": len(code_ids),
        "prose_prompts": len(prose_ids),
        "prose_from_round": switch_round,
        "prose_rounds": end_round - switch_round,
        "plan_at_switch": None if plan_before is None else {
            "lengths": [plan_before.lengths[level] for level in plan_before.active[:-1]],
            "tiers": [engine.tiers[t].name for t in plan_before.active],
        },
        "rounds_to_first_change": (changes[0]["round"] - switch_round) if changes else None,
        "at_switch": at_switch,
        "at_end": at_end,
        # the model's best plan on the prose's estimates: when it is the plan at the switch, the
        # prose gave the lengths nothing to follow (an int8 copy of the target accepts ~99 % of
        # code and prose alike; a bypassed n-gram tier stays bypassed)
        "best_at_end": {"tiers": best_at_end["tiers"], "lengths": best_at_end["lengths"]},
        "history": tuner.history,
    }


# ----------------------------------------------------------------------------- the run


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
    if distributed(engine):  # every tier profiles itself (and its prefills) in its own process
        from polyspec.orchestrator.distributed.driver import profile_remote

        profile, prefill_ms = profile_remote(engine.scheduler, typical, settings.params(), settings.grid_max,
                                             prefill_lens=[len(ids) for ids in prompt_ids])
        tuner = Tuner(profile, max_length=settings.grid_max, tree_width=engine.scheduler.tree_width)
        tuner.distributed, tuner.pipelined = True, bool(engine.scheduler.pipeline)
        prefills = [[prefill_ms[tier][number] for tier in range(len(engine.tiers))] for number in range(len(prompt_ids))]
    else:
        tuner = engine.make_tuner(context, max_length=settings.grid_max)
        prefills = [measure_prefill_ms(engine, list(ids)) for ids in prompt_ids]
    tuner.decay = 1.0  # calibration: plain counts over all prompts
    tuner.shadow = False  # skip pairs are measured directly below
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
    whole runs moved with them: all 36 grid rows 13 % over in one run, 16 % under in another);
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


def run_tune(config: ChainConfig, prompts: list[str], settings: TuneSettings, log=None, sets: PromptSets | None = None) -> dict:
    """Profile, calibrate, predict and measure; the report (see the module docstring).
    `sets`: held-out prompts (best grid point vs `lengths: auto`) and the code -> prose sequence."""
    log = log or (lambda message: None)
    if len(config.tiers) < 2:
        raise TuneError("tune needs a chain of at least two tiers")
    torch.manual_seed(settings.seed)
    engine = Engine(config, auto_tune=False)
    try:
        return _tune(engine, config, prompts, settings, log, sets)
    finally:
        engine.close()  # a ray chain's actors go


def _tune(engine: Engine, config: ChainConfig, prompts: list[str], settings: TuneSettings, log, sets: PromptSets | None) -> dict:
    engine.scheduler.eos_token_ids = frozenset()  # every run generates exactly max_new_tokens
    prompt_ids = [engine.parse_request({"prompt": p, "max_new_tokens": settings.max_new_tokens}).prompt_ids for p in prompts]
    limit = engine.scheduler.max_context
    longest = max(len(ids) for ids in prompt_ids)
    if limit is not None and longest + settings.max_new_tokens + 2 * settings.grid_max + 2 >= limit:
        raise TuneError(f"the longest prompt ({longest} tokens) + max_new_tokens ({settings.max_new_tokens}) does not fit the model context ({limit})")
    tuner, prefill_extra = calibrate(engine, prompt_ids, settings, log)

    # step 3: predictions, from the calibration only
    key = request_class(settings.params())
    full = tuple(range(len(engine.tiers)))
    grid = [Plan(lengths, full) for lengths in itertools.product(range(1, settings.grid_max + 1), repeat=len(full) - 1)]
    chosen = tuner.choose(key)
    # a distributed chain runs every tier every round: no bypass, no target alone to compare
    bypass = [] if tuner.distributed else [(tier, tuner.choose(key, exclude=tier)) for tier in range(1, len(full))]
    baseline = None if tuner.distributed else Plan((settings.grid_max,) * (len(full) - 1), (0,))
    plans = list(dict.fromkeys(grid + [chosen] + [plan for _, plan in bypass] + ([baseline] if baseline else [])))
    def predict_all() -> dict:
        return {plan: predict_plan(tuner, key, plan, prefill_extra, settings.max_new_tokens) for plan in plans}

    first_predicted = predict_all()
    tiers = tier_report(engine, tuner, key, settings.grid_max)
    overhead_ms = tuner.round_overhead_ms

    # step 4: measurements
    def make_auto_tuner() -> Tuner:  # what `lengths: auto` starts from: the start-up profile, no acceptance data
        profile = copy.deepcopy(tuner.profile)
        profile.online_forward.clear()
        profile.online_draft.clear()
        profile.plain_means = False  # (the calibration's tables are pass means; a tuner's are EMAs)
        fresh = Tuner(profile, max_length=settings.grid_max, tree_width=tuner.tree_width)
        fresh.distributed, fresh.pipelined = tuner.distributed, tuner.pipelined
        return fresh

    # Each pass is predicted from calibration runs interleaved with it (the same seconds of a
    # machine whose speed drifts by 10-30 % over minutes: calibrated in a pass of its own just
    # before, the whole grid of a run came out 13 % over- or 16 % under-predicted, every row
    # the same way), never from the measured runs themselves.
    measured, auto_tuners, per_pass = measure(engine, plans, prompt_ids, settings, make_auto_tuner, log,
                                              predict=lambda repeat: predict_all(),
                                              calibration=lambda: calibration_items(engine, tuner, settings, prefill_extra))
    predicted = {plan: statistics.median(p[plan] for p in per_pass) for plan in plans}

    def ids_of(texts: list[str]) -> list[list[int]]:
        return [engine.parse_request({"prompt": p, "max_new_tokens": settings.max_new_tokens}).prompt_ids for p in texts]

    heldout = shift = None
    best_wall = min(grid, key=lambda plan: measured[plan].wall_ms)
    if sets is not None and sets.heldout:
        heldout = measure_heldout(engine, best_wall, ids_of(sets.heldout), settings, make_auto_tuner, log, warm_tuner=auto_tuners[-1])
    if sets is not None and sets.shift_code and sets.shift_prose:
        log("shift: code prompts, then prose")
        shift = measure_shift(engine, make_auto_tuner(), ids_of(sets.shift_code), ids_of(sets.shift_prose), settings)

    def entry(plan: Plan) -> dict:
        return {**plan_entry(engine, plan, predicted[plan], measured[plan]), "predicted_first_calibration_ms_per_token": round(first_predicted[plan], 4)}

    # the winner's curse: the smallest of 36-64 noisy measurements is biased low, so the
    # choice is compared with the best grid points again, in fresh interleaved passes
    contenders = sorted(grid, key=lambda plan: measured[plan].wall_ms)[:CONFIRM_TOP]
    confirm_plans = list(dict.fromkeys(contenders + [chosen]))
    log(f"confirming the {len(contenders)} best grid points and the choice")
    confirmed = measure_plans(engine, confirm_plans, prompt_ids, settings, log)

    def summary(field: str) -> dict:
        value = {plan: getattr(measured[plan], field) for plan in plans}
        errors = [relative_error(predicted[plan], value[plan]) for plan in grid]
        best = min(grid, key=value.get)
        again = {plan: getattr(confirmed[plan], field) for plan in confirm_plans}
        best_again = min(contenders, key=again.get)
        first_errors = [relative_error(first_predicted[plan], value[plan]) for plan in grid]
        return {
            "median_relative_error": round(statistics.median(errors), 4),
            "max_relative_error": round(max(errors), 4),
            # the initial calibration's predictions only (no re-calibration between passes)
            "first_calibration_median_relative_error": round(statistics.median(first_errors), 4),
            "best_grid": entry(best),
            "chosen_over_best": round(value[chosen] / value[best], 4),
            "auto_over_best": round(getattr(measured["auto"], field) / value[best], 4),
            "confirmed": {
                "plans": [{"lengths": [p.lengths[level] for level in p.active[:-1]], "tiers": [engine.tiers[t].name for t in p.active],
                           "ms_per_token": round(again[p], 4)} for p in confirm_plans],
                "best_grid_lengths": [best_again.lengths[level] for level in best_again.active[:-1]],
                "chosen_over_best": round(again[chosen] / again[best_again], 4),
            },
        }

    return {
        "config": config.source,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "prompts": len(prompts),
        "repeats": settings.repeats,
        "grid": [entry(plan) for plan in grid],
        "chosen": entry(chosen),
        "bypass": [{"bypassed": engine.tiers[tier].name, **entry(plan)} for tier, plan in bypass],
        "baseline": entry(baseline) if baseline else None,
        "runtime": {"backend": config.runtime.backend, "pipeline": tuner.pipelined if tuner.distributed else False},
        # the CPU matters: the demo chain's int8 tier costs 0.6x the target's forward on an AMD EPYC, 0.8x on an AVX-512 Xeon
        "machine": {**machine_info(torch.get_num_threads(), config.tiers[0].dtype, "cpu"),
                    "tier_threads": {tier.name: tier.threads for tier in config.tiers}},
        "auto": {
            "measured_ms_per_token": round(measured["auto"].wall_ms, 4),
            "measured_cpu_ms_per_token": round(measured["auto"].cpu_ms, 4),
            "plans": auto_tuners[-1].history,
        },
        "tiers": tiers,
        "round_overhead_ms": round(overhead_ms, 4),
        "step_overhead_ms": round(tuner.step_overhead_ms, 4) if tuner.distributed else None,  # per target round (distributed)
        "ahead_slowdown": {engine.tiers[t].name: round(v, 4) for t, v in tuner.ahead_slowdown.items()},  # pipelined drafters
        "first_round_scale": round(tuner.first_round_scale, 4) if tuner.distributed else None,  # first rounds, measured / modelled
        "jitter_cv": round(tuner.jitter_cv, 4) if tuner.distributed and tuner.pipelined else None,  # spread of round / block times
        "summary": summary("wall_ms"),
        # this process's CPU time: meaningless when the tiers run in other processes
        "summary_cpu": None if tuner.distributed else summary("cpu_ms"),
        "heldout": heldout,
        "shift": shift,
    }


# ----------------------------------------------------------------------------- output


def format_report(report: dict) -> str:
    lines = [f"config {report['config']}  temperature {report['temperature']}  {report['max_new_tokens']} tokens x {report['prompts']} prompts", ""]
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
    lines += ["", f"{'lengths':>12} {'predicted':>10} {'measured':>9} {'error':>7} {'cpu':>7}   (ms per token; cpu: this process's CPU time)"]
    for entry in report["grid"]:
        error = relative_error(entry["predicted_ms_per_token"], entry["measured_ms_per_token"])
        lines.append(
            f"{str(entry['lengths']):>12} {entry['predicted_ms_per_token']:>10.3f} {entry['measured_ms_per_token']:>9.3f}"
            f" {100 * error:>6.1f}% {entry['measured_cpu_ms_per_token']:>7.3f}"
        )
    lines.append("")

    def describe(label: str, entry: dict) -> str:
        return (
            f"{label}: {'+'.join(entry['tiers'])} {entry['lengths']}  predicted {entry['predicted_ms_per_token']:.3f}"
            f"  measured {entry['measured_ms_per_token']:.3f} ms/token"
        )

    lines.append(describe("tuner's choice", report["chosen"]))
    for entry in report["bypass"]:
        lines.append(describe(f"without {entry['bypassed']}", entry))
    if report["baseline"]:
        lines.append(describe("target alone", report["baseline"]))
    lines.append(f"lengths: auto (fresh tuner): measured {report['auto']['measured_ms_per_token']:.3f} ms/token, {len(report['auto']['plans'])} plan changes")
    heldout = report.get("heldout")
    if heldout:
        lines.append(
            f"held out ({heldout['prompts']} prompts): best grid point {heldout['best_grid_lengths']} {heldout['best_grid_ms_per_token']:.3f},"
            f" lengths: auto {heldout['auto_ms_per_token']:.3f} ms/token: auto's tokens/s {heldout['auto_tokens_per_s_over_best']:.3f}x the best grid point's"
        )
        if "warm_auto_ms_per_token" in heldout:
            lines.append(
                f"held out, lengths: auto with a tuner that has served the tuning prompts: {heldout['warm_auto_ms_per_token']:.3f} ms/token,"
                f" {heldout['warm_auto_tokens_per_s_over_best']:.3f}x"
            )
    shift = report.get("shift")
    if shift:
        rounds = shift["rounds_to_first_change"]
        change = "no change of plan" if rounds is None else f"first change of plan after {rounds} rounds"
        best, before = shift.get("best_at_end"), shift.get("plan_at_switch")
        if rounds is None and best is not None:
            same = best == before
            change += (f" (the model's best on the prose is the plan at the switch, {'+'.join(best['tiers'])} {best['lengths']})" if same
                       else f" (the model's best on the prose: {'+'.join(best['tiers'])} {best['lengths']})")
        lines.append(f"code -> prose: {shift['prose_rounds']} prose rounds from round {shift['prose_from_round']}; {change}")
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
    return "\n".join(lines)


def cmd_tune(args) -> int:
    config = load_config(args.config)
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
