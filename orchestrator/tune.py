"""`polyspec tune`: the time model against the clock, on the chain of a config.

    polyspec tune -c CONFIG [--prompts FILE] [--temperature T] [--max-new-tokens N]
                  [--grid-max K] [--max-prompts P] [--json]

Steps (all in this process, embedded mode):
1. profile every tier (profiler.profile_tiers) at the prompts' typical context length, and
   each model tier's prefill of every prompt;
2. calibrate acceptance: generate every prompt once with the full chain at the longest
   lengths, through the tuner's hooks without re-tuning (plain counts, no recency weighting);
   latencies are refined online from the same runs;
3. predict, from those estimates only, the ms per token of every grid point (k_i in
   1..K for every stage), of the tuner's choice and of the best chain with each tier
   bypassed: (sum of prefills + time_model.generation_ms) / tokens;
4. measure every one of them (the same prompts, seeds and token counts; EOS is ignored so
   every run generates exactly max_new_tokens).

Prompt file: JSONL, one `{"prompt": "..."}` object per line (other fields, such as
`"class"`, are ignored) -- the format of `models/stdlib/prompts.jsonl`, the set that ships
with the demo family and the default here (found beside the target model's folder); with
no such file a few built-in code prompts are used.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from orchestrator.config import ChainConfig, load_config
from orchestrator.engine import Engine
from orchestrator.time_model import generation_ms, latency, relative_error
from orchestrator.tuner import Plan, Tuner, request_class
from workers.errors import PolyspecError
from workers.sampling import SamplingParams
from workers.tree import DraftTree

BUILTIN_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the given folders.\"\"\"\n    for folder in argv[1:]:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "def parse_header(line):\n    \"\"\"Split 'Name: value' into a (name, value) pair.\"\"\"\n    name, _, value = line.partition(':')\n",
    "    def test_round_trip(self):\n        data = {'a': 1, 'b': [1, 2, 3]}\n        self.assertEqual(json.loads(json.dumps(data)), data)\n\n    def test_",
)
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


# ----------------------------------------------------------------------------- prompts


def default_prompts_path(config: ChainConfig) -> Path:
    """The family's prompt set ships next to its models: <target dir>/../prompts.jsonl."""
    return Path(config.tiers[0].model).parent / "prompts.jsonl"


def read_prompts(path: Path) -> list[str]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TuneError(f"{path} line {number}: malformed JSON: {exc.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise TuneError(f'{path} line {number}: expected {{"prompt": "..."}}')
        prompts.append(record["prompt"])
    if not prompts:
        raise TuneError(f"prompts file {path} has no prompts")
    return prompts


def load_prompts(path: str | None, config: ChainConfig, max_prompts: int) -> tuple[list[str], str]:
    """(prompts, where they came from); at most `max_prompts`, evenly spaced through the file."""
    if path is not None:
        if not Path(path).exists():
            raise TuneError(f"prompts file not found: {path}")
        prompts, source = read_prompts(Path(path)), path
    elif default_prompts_path(config).exists():
        prompts, source = read_prompts(default_prompts_path(config)), str(default_prompts_path(config))
    else:
        prompts, source = list(BUILTIN_PROMPTS), "built-in code prompts"
    if len(prompts) > max_prompts:
        step = len(prompts) / max_prompts
        prompts = [prompts[int(i * step)] for i in range(max_prompts)]
    return prompts, source


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


def run_plan(engine: Engine, plan: Plan, prompt_ids: list[list[int]], settings: TuneSettings, tuner: Tuner | None = None) -> float:
    """Generate every prompt with `plan` (fixed lengths / tiers); measured ms per token.

    With `tuner`, the runs go through its hooks (it learns but does not re-tune)."""
    scheduler = engine.scheduler
    params = SamplingParams(temperature=settings.temperature)
    if tuner is not None:
        tuner.fixed = plan
    scheduler.tuner = tuner
    scheduler.lengths, scheduler.active = list(plan.lengths), tuple(plan.active)
    total_s, total_tokens = 0.0, 0
    for number, ids in enumerate(prompt_ids):
        output = scheduler.generate(list(ids), settings.max_new_tokens, params, seed=settings.seed + number)
        total_s += output.stats["time_s"]
        total_tokens += len(output.token_ids)
    scheduler.tuner = None
    return 1000.0 * total_s / max(1, total_tokens)


def predict_plan(tuner: Tuner, key: str, plan: Plan, prefill_extra_ms: list[list[float]], new_tokens: int) -> float:
    """Predicted ms per token over the prompts: prefills of the tiers in use + decoding."""
    if len(plan.active) == 1:
        decode_ms = new_tokens * latency(tuner.profile.forward_ms(0), 1)
    else:
        stages, draft_ms = tuner.stages(key, plan.active)
        lengths = [plan.lengths[level] for level in plan.active[:-1]]
        decode_ms = generation_ms(stages, draft_ms, lengths, new_tokens, tuner.tree_width)
    total = sum(decode_ms + sum(extra[t] for t in plan.active) for extra in prefill_extra_ms)
    return total / (new_tokens * len(prefill_extra_ms))


# ----------------------------------------------------------------------------- the run


def plan_entry(engine: Engine, plan: Plan, predicted: float, measured: float | None) -> dict:
    return {
        "lengths": [plan.lengths[level] for level in plan.active[:-1]],
        "tiers": [engine.tiers[t].name for t in plan.active],
        "predicted_ms_per_token": round(predicted, 4),
        "measured_ms_per_token": None if measured is None else round(measured, 4),
    }


def tier_report(engine: Engine, tuner: Tuner, key: str, grid_max: int) -> list[dict]:
    tiers = []
    profile = tuner.profile
    last = len(engine.tiers) - 1
    for index, tier in enumerate(engine.tiers):
        entry: dict = {"name": tier.name, "forward_ms": None, "draft_ms": None, "acceptance": None}
        if profile.forward[index] is not None:
            entry["forward_ms"] = {str(m): round(v, 4) for m, v in profile.forward_ms(index).items()}
        if profile.draft[index] is not None:
            entry["draft_ms"] = {str(k): round(v, 4) for k, v in profile.draft_ms(index).items()}
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


def run_tune(config: ChainConfig, prompts: list[str], settings: TuneSettings, log=None) -> dict:
    """Profile, calibrate, predict and measure; the report (see the module docstring)."""
    log = log or (lambda message: None)
    if len(config.tiers) < 2:
        raise TuneError("tune needs a chain of at least two tiers")
    torch.manual_seed(settings.seed)
    engine = Engine(config, auto_tune=False)
    engine.scheduler.eos_token_ids = frozenset()  # every run generates exactly max_new_tokens
    prompt_ids = [engine.parse_request({"prompt": p, "max_new_tokens": settings.max_new_tokens}).prompt_ids for p in prompts]
    limit = engine.scheduler.max_context
    longest = max(len(ids) for ids in prompt_ids)
    if limit is not None and longest + settings.max_new_tokens + 2 * settings.grid_max + 2 >= limit:
        raise TuneError(f"the longest prompt ({longest} tokens) + max_new_tokens ({settings.max_new_tokens}) does not fit the model context ({limit})")

    log("profiling the tiers")
    typical = int(statistics.median(len(ids) for ids in prompt_ids)) + settings.max_new_tokens // 2
    context = (list(prompt_ids[0]) * (typical // len(prompt_ids[0]) + 1))[:typical]
    tuner = engine.make_tuner(context, max_length=settings.grid_max)
    tuner.decay = 1.0  # calibration: plain counts over all prompts
    prefill = [measure_prefill_ms(engine, list(ids)) for ids in prompt_ids]
    first_forward = [latency(tuner.profile.forward_ms(i), 1) if tuner.profile.forward[i] is not None else 0.0 for i in range(len(engine.tiers))]
    prefill_extra = [[max(0.0, ms - first_forward[i]) for i, ms in enumerate(row)] for row in prefill]

    full = tuple(range(len(engine.tiers)))
    longest_plan = Plan((settings.grid_max,) * (len(full) - 1), full)
    log("warming up")
    run_plan(engine, longest_plan, prompt_ids[:1], dataclasses.replace(settings, max_new_tokens=min(16, settings.max_new_tokens)))
    log("calibrating acceptance")
    run_plan(engine, longest_plan, prompt_ids, settings, tuner)

    key = request_class(SamplingParams(temperature=settings.temperature))
    grid = [Plan(lengths, full) for lengths in itertools.product(range(1, settings.grid_max + 1), repeat=len(full) - 1)]
    predicted = {plan: predict_plan(tuner, key, plan, prefill_extra, settings.max_new_tokens) for plan in grid}
    chosen = tuner.choose(key)
    chosen = Plan(chosen.lengths, chosen.active)
    predicted[chosen] = predict_plan(tuner, key, chosen, prefill_extra, settings.max_new_tokens)
    bypass = []
    for tier in range(1, len(full)):
        plan = tuner.choose(key, exclude=tier)
        plan = Plan(plan.lengths, plan.active)
        predicted[plan] = predict_plan(tuner, key, plan, prefill_extra, settings.max_new_tokens)
        bypass.append((tier, plan))
    baseline = Plan(longest_plan.lengths, (0,))
    predicted[baseline] = predict_plan(tuner, key, baseline, prefill_extra, settings.max_new_tokens)
    tiers = tier_report(engine, tuner, key, settings.grid_max)

    measured: dict[Plan, float] = {}
    to_measure = list(dict.fromkeys(grid + [chosen] + [plan for _, plan in bypass] + [baseline]))
    started = time.perf_counter()
    for number, plan in enumerate(to_measure, start=1):
        measured[plan] = run_plan(engine, plan, prompt_ids, settings)
        log(f"measured {number}/{len(to_measure)} ({time.perf_counter() - started:.0f} s)")

    grid_entries = [plan_entry(engine, plan, predicted[plan], measured[plan]) for plan in grid]
    errors = [relative_error(predicted[plan], measured[plan]) for plan in grid]
    best = min(grid, key=lambda plan: measured[plan])
    return {
        "config": config.source,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "prompts": len(prompts),
        "grid": grid_entries,
        "chosen": plan_entry(engine, chosen, predicted[chosen], measured[chosen]),
        "bypass": [{"bypassed": engine.tiers[tier].name, **plan_entry(engine, plan, predicted[plan], measured[plan])} for tier, plan in bypass],
        "baseline": plan_entry(engine, baseline, predicted[baseline], measured[baseline]),
        "tiers": tiers,
        "summary": {
            "median_relative_error": round(statistics.median(errors), 4),
            "max_relative_error": round(max(errors), 4),
            "best_grid": plan_entry(engine, best, predicted[best], measured[best]),
            "chosen_over_best": round(measured[chosen] / measured[best], 4),
        },
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
    lines += ["", f"{'lengths':>12} {'predicted':>10} {'measured':>9} {'error':>7}   (ms per token)"]
    for entry in report["grid"]:
        error = relative_error(entry["predicted_ms_per_token"], entry["measured_ms_per_token"])
        lines.append(f"{str(entry['lengths']):>12} {entry['predicted_ms_per_token']:>10.3f} {entry['measured_ms_per_token']:>9.3f} {100 * error:>6.1f}%")
    lines.append("")

    def describe(label: str, entry: dict) -> str:
        return (
            f"{label}: {'+'.join(entry['tiers'])} {entry['lengths']}  predicted {entry['predicted_ms_per_token']:.3f}"
            f"  measured {entry['measured_ms_per_token']:.3f} ms/token"
        )

    lines.append(describe("tuner's choice", report["chosen"]))
    for entry in report["bypass"]:
        lines.append(describe(f"without {entry['bypassed']}", entry))
    lines.append(describe("target alone", report["baseline"]))
    summary = report["summary"]
    lines.append(describe("best grid point", summary["best_grid"]))
    lines.append(
        f"median |predicted - measured| / measured over the grid: {100 * summary['median_relative_error']:.1f} %"
        f" (max {100 * summary['max_relative_error']:.1f} %); choice / best grid point: {summary['chosen_over_best']:.3f}"
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
    )
    if settings.grid_max < 1 or settings.max_new_tokens < 1 or settings.max_prompts < 1 or settings.temperature < 0:
        raise TuneError("--grid-max, --max-new-tokens and --max-prompts must be >= 1 and --temperature >= 0")
    prompts, source = load_prompts(args.prompts, config, settings.max_prompts)

    def log(message: str) -> None:
        print(f"[tune] {message}", file=sys.stderr, flush=True)

    log(f"{len(prompts)} prompts from {source}")
    report = run_tune(config, prompts, settings, log)
    report["prompts_source"] = source
    print(json.dumps(report) if args.json else format_report(report))
    return 0
