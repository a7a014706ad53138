"""The time model's predicted speed of every shipped Qwen2.5-Coder chain on a GPU, and what `lengths: auto` picks.

Predictions, not measurements: per-forward GPU costs (by default the reference figures of FACTS.md
"GPU figures": a plain PyTorch forward replayed as one CUDA graph, not polyspec's own step) and the
real pair's acceptance measured on the CPU on HumanEval prompts, put through the project's time
model (polyspec.orchestrator.tuning). Greedy requests; batch 1, 16 and 64.

    python benchmarks/gpu/predict_chains.py        # built-in reference costs -> benchmarks/gpu/predicted-chains.{json,md}
    python benchmarks/gpu/predict_chains.py --costs $OUT/device-round.json $OUT/reference-1.5b.json \\
        $OUT/reference-0.5b.json --out-dir $OUT     # a GPU run's own costs (device_round.sh's last step)

Costs. Each model's forward time t(B, W), B rows of W new tokens, fills the goodput planner's
(batch, width) grid (`batch_model.ForwardTable`): measured cells as they are, the others on the line
of measured cells of their kind (one new token per row, or a block; the blocks' line starts at the
smallest one-token cell), by new tokens B * W (`time_model.latency`: linear between points and past
the last), then made monotone (`batch_model.monotone`). Files given with --costs (reference.py's
JSON, device_round.py's device-round.json; polyspec's own steps win a cell both measure) replace the
built-in cells they measure; a model's other cells are the built-in ones scaled by the median ratio
measured / built-in. The quantized copy of the target (`quantize: int8` in the shipped configs; on
the GPU the `quantize: fp8` copy) is an ESTIMATE: each cell of the target less half its memory floor
(fp8 reads half the weight bytes: weight bytes / 2 over the copy bandwidth), without the kernels that
quantize the activations or fp8's faster GEMM. The n-gram lookup costs `lookup_ms` of host time per
request per round (the CPU start-up profile, benchmarks/real-models.profile.json). A verifier's forward
is priced at the full block (k + 1 per row): a batched static step pads every row to it.

Acceptance. A stage's per-token rate a is the one whose expected tokens per round match the measured
mean accepted length at length k: E(a, k) = (1 - a^(k+1)) / (1 - a) = 1 + mean accepted
(`batch_acceptance.expected_tokens`; its inverse `real_report.fitted_rate` solves
a + a^2 + ... + a^k = mean accepted). Only the bottom stage of a fixed-length chain counts: its blocks
are the k tokens asked (a middle tier hands up more). A missing n-gram proposal counts as a
rejection, as in the time model. A pair's rate is its measurements' weighted by the requests behind
each (benchmarks/real-models.json: 2 HumanEval prompts at T = 0; benchmarks/qwen-batch.json: the
stage statistics of its first request, HumanEval-5). The int8 copy's acceptance stands for the fp8 copy's.

Models. A fixed chain at batch B: `chain_model.chain_cost` (the serial form, a middle tier's
overshoot included) with each tier's forward at B rows, so tokens/s = B / C_0; the bottom's block
costs `BatchPlanner.draft_ms` (a model drafter: a 2-token forward then k - 1 one-token forwards; the
lookup: B lookups). `lengths: auto` on batched and device tiers is the goodput planner
(`BatchPlanner`), built here from the same ForwardTables and rates: its `predicted_best` is the pick,
its `goodput` a second estimate of any 2- or 3-tier plan. `chain_model.search_lengths` over every set
of tiers and lengths 1..max_length shows what the planner's grid of lengths leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import types
from pathlib import Path

from polyspec.harness.real_report import fitted_rate
from polyspec.orchestrator.config import BatchingConfig, TuningConfig, load_config
from polyspec.orchestrator.tuning.batch_acceptance import expected_tokens
from polyspec.orchestrator.tuning.batch_model import BATCH_GRID, WIDTH_GRID, BatchPlanner, ForwardTable, Plan
from polyspec.orchestrator.tuning.profiler import monotone
from polyspec.harness.chain_model import chain_cost, search_lengths
from polyspec.harness.time_model import StageSpec, latency

REPO = Path(__file__).resolve().parents[2]

BATCHES = (1, 16, 64)
MAX_LENGTH = TuningConfig().max_length  # the config's longest length: the full searches' range
STAGE_WIDTHS = 4 * MAX_LENGTH + 2  # forward widths a stage's latency table lists (a middle tier's overshoot included)
ASSUMED_RATE = 0.75  # FACTS.md: greedy agreement, 0.5B drafter vs 1.5B target, 5 prompts (the issue's figure)
EVIDENCE_TOKENS = 1e9  # tokens of evidence given to the planner's acceptance estimator: its prior no longer counts

# FACTS.md "GPU figures": ../shared/gpu/reference.py on a lent H200 (torch 2.11.0+cu130, 2026-11-27), Qwen2.5-Coder
# shapes, random weights, bf16, 256-token cache, one forward replayed as a CUDA graph: ms per (batch, new tokens per row)
REFERENCE_SOURCE = "reference H200 (FACTS.md GPU figures, CUDA graph)"
REFERENCE_COPY_GBPS = 4170.0  # read + write
REFERENCE = {
    "1.5b": {"weight_bytes": 3.09e9,
             "ms": {(1, 1): 3.30, (1, 8): 3.89, (16, 1): 3.76, (64, 1): 4.00, (64, 4): 6.37, (64, 8): 8.08}},
    "0.5b": {"weight_bytes": 0.99e9, "ms": {(1, 1): 2.31, (1, 8): 2.78, (64, 1): 2.81, (64, 8): 4.99}},
}
MODEL_OF_ROLE = {"target": "1.5b", "small": "0.5b"}  # the quantized copy ("copy") is derived from the target
ROLE_LABEL = {"target": "target", "copy": "fp8", "small": "0.5B", "ngram": "n-gram"}
REAL_MODELS_ROLE = {"target": "target", "int8": "copy", "small": "small", "ngram": "ngram"}  # real-models.json's tier names


# ------------------------------------------------------------------------------------------- costs


@dataclasses.dataclass
class Costs:
    """Per-forward ms on the planner's grid for each model role, and what else a round costs."""

    tables: dict[str, ForwardTable]  # role ("target", "copy", "small") -> ms of one forward of (batch, width)
    sources: dict[str, str]  # role -> where its cells came from
    lookup_ms: float  # host ms of one request's n-gram lookup
    step_overhead_ms: float  # host ms a step costs beyond its forwards (0 with the reference: forwards only)

    def stage_table(self, role: str, batch: int) -> dict[int, float]:
        """t(m) of one forward of `batch` rows of m new tokens (a time_model LatencyTable)."""
        return {m: self.tables[role].estimate(batch, m) for m in range(1, STAGE_WIDTHS + 1)}


def fill_grid(cells: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Every (batch, width) cell of the planner's grid from measured ones (module docstring); from the
    reference's 1 x 1 and 1 x 8, a block of 4 costs 3/7 of the way from one to the other."""
    decode = {b * w: ms for (b, w), ms in cells.items() if w == 1}
    block = {b * w: ms for (b, w), ms in cells.items() if w > 1}
    smallest = min(decode)  # a block of one token is a decode step: the blocks' line starts there
    block = {smallest: decode[smallest], **block} if block and min(block) > smallest else (block or decode)
    grid = {(b, w): cells.get((b, w), latency(decode if w == 1 else block, b * w))
            for b, w in itertools.product(BATCH_GRID, WIDTH_GRID)}
    return monotone(grid)


def read_cost_files(paths: list[Path]) -> tuple[dict[str, dict], dict[str, float]]:
    """Measured cells per model ({"1.5b": {(batch, width): (ms, source)}}) and the run's facts (copy_GBps,
    weight bytes, step overhead) from reference.py JSONs and device-round.json; keys a file lacks are skipped."""
    cells: dict[str, dict] = {"1.5b": {}, "0.5b": {}}
    facts: dict[str, float] = {}
    loaded = [(path, json.loads(path.read_text())) for path in paths]
    # reference.py's files first, so that polyspec's own steps (device-round.json) win a cell both measure
    for path, data in sorted(loaded, key=lambda item: not isinstance(item[1].get("steps"), list)):
        if isinstance(data.get("steps"), list):  # reference.py
            model = "0.5b" if "0.5b" in str(data.get("shape", path.name)) else "1.5b"
            for row in data["steps"]:
                kind = "graph_ms" if row.get("graph_ms") else "eager_ms"  # eager only where no CUDA graph ran (a CPU)
                if row.get(kind):
                    cells[model][(int(row["batch"]), int(row["width"]))] = (float(row[kind]), f"{path.name} {kind}")
            if data.get("copy_GBps"):
                facts["copy_GBps"] = float(data["copy_GBps"])
            if data.get("weight_bytes"):
                facts[f"weight_bytes_{model}"] = float(data["weight_bytes"])
            continue
        steps = data.get("steps") or {}  # device_round.py: polyspec's own steps, graph-replayed
        per_token = (data.get("one_request") or {}).get("ms_per_token")
        one_token_step = steps.get("target_step_1_token_ms")
        overhead = max(0.0, per_token - one_token_step) if per_token and one_token_step else 0.0
        facts["step_overhead_ms"] = overhead
        for key, model, cell in (("target_step_1_token_ms", "1.5b", (1, 1)), ("target_round_block8_ms", "1.5b", (1, 9)),
                                 ("drafter_draft_step_ms", "0.5b", (1, 1))):
            if steps.get(key):
                cells[model][cell] = (float(steps[key]), f"{path.name} {key}")
        for key, value in data.items():  # target_alone_<batch>: whole steps, speculation off
            if key.startswith("target_alone_") and isinstance(value, dict) and value.get("ms_per_step"):
                batch = int(key.rsplit("_", 1)[1])
                if (batch, 1) not in cells["1.5b"]:  # (batch 1: the graph step above)
                    forward_ms = float(value["ms_per_step"]) - overhead
                    cells["1.5b"][(batch, 1)] = (forward_ms, f"{path.name} {key} less the step overhead")
    return cells, facts


def build_costs(cost_files: list[Path], lookup_ms: float) -> Costs:
    measured, facts = read_cost_files(cost_files)
    tables, sources = {}, {}
    for role, model in MODEL_OF_ROLE.items():
        reference = REFERENCE[model]["ms"]
        own = {cell: ms for cell, (ms, _) in measured[model].items()}
        if own:  # the run's level, the reference's shape where the run did not measure
            reference_table = ForwardTable(fill_grid(reference))
            scale = statistics.median(ms / reference_table.estimate(*cell) for cell, ms in own.items())
            cells = {**{cell: ms * scale for cell, ms in reference.items()}, **own}
            named = ", ".join(sorted({source for _, source in measured[model].values()}))
            sources[role] = f"measured: {named}; other cells: {REFERENCE_SOURCE} x {scale:.3f}"
        else:
            cells, sources[role] = dict(reference), REFERENCE_SOURCE
        tables[role] = ForwardTable(fill_grid(cells))
    weight_bytes = facts.get("weight_bytes_1.5b", REFERENCE["1.5b"]["weight_bytes"])
    copy_gbps = facts.get("copy_GBps", REFERENCE_COPY_GBPS)
    saving_ms = weight_bytes / 2 / (copy_gbps * 1e9) * 1000.0
    tables["copy"] = ForwardTable({cell: max(ms - saving_ms, saving_ms) for cell, ms in tables["target"].ms.items()})
    sources["copy"] = (f"ESTIMATE: the target's cells less {saving_ms:.3f} ms, half its weight bytes "
                       f"({weight_bytes / 1e9:.2f} GB / 2) at {copy_gbps:.0f} GB/s; no activation-quantization kernels, "
                       "no faster fp8 GEMM")
    return Costs(tables, sources, lookup_ms, facts.get("step_overhead_ms", 0.0))


def profile_lookup_ms(path: Path) -> float:
    """The n-gram lookup's host ms per request: the median of the CPU start-up profile's draft_ms."""
    profile = json.loads(path.read_text())
    return statistics.median(float(ms) for ms in profile["ngram"]["draft_ms"].values())


# -------------------------------------------------------------------------------------- acceptance


def role_of(tier) -> str | None:
    """"target", "copy" (the target quantized), "small" (the 0.5B) or "ngram" for a config's tier; None for a
    tier outside those four (a quantized 0.5B: no measured costs here)."""
    if tier.model == "ngram":
        return "ngram"
    small = "0.5b" in tier.model
    if tier.quantize:
        return None if small else "copy"
    return "small" if small else "target"


def chain_roles(config_path: Path) -> tuple[list[str], tuple[int, ...] | str]:
    """The roles of a config's tiers (target first) and its speculation lengths (a tuple, or "auto"); no roles for a
    config this prediction does not model (a quantized target, or a tier outside the four roles)."""
    config = load_config(str(config_path))
    roles = [role_of(t) for t in config.tiers]
    if None in roles or config.tiers[0].quantize:
        return [], config.speculation.lengths
    return roles, config.speculation.lengths


def stage_measurements(repo: Path) -> list[dict]:
    """The bottom stage of each fixed-length chain measured greedy on HumanEval prompts, with its per-token rate."""
    out = []
    batch = json.loads((repo / "benchmarks" / "qwen-batch.json").read_text())
    for row in batch["rows"]:
        path = repo / "configs" / f"{row['system']}.yaml"
        if not row["stages"] or not path.exists():
            continue
        roles, lengths = chain_roles(path)
        if lengths != "auto":
            bottom = row["stages"][-1]
            # the length the run drafted with, from the row's own record (a shipped config's lengths may have moved
            # since the run); shorter blocks in it are a request's last ones, cut to the tokens it had left
            k = max(bottom.get("lengths") or [lengths[-1]])
            out.append({"pair": (roles[-2], roles[-1]), "source": "qwen-batch.json", "system": row["system"], "k": k,
                        "mean_accepted": bottom["mean_accepted_length"], "requests": 1})
    real = json.loads((repo / "benchmarks" / "real-models.json").read_text())
    for result in real["results"]:
        lengths = real["systems"].get(result["system"], {}).get("lengths")
        code = result.get("code") or {}
        fixed_chain = result["system"].startswith("chain:") and isinstance(lengths, list)
        if result["temperature"] == 0.0 and fixed_chain and code.get("stages"):
            names = result["system"].split(":", 1)[1].split("+")
            out.append({"pair": (REAL_MODELS_ROLE[names[-2]], REAL_MODELS_ROLE[names[-1]]), "source": "real-models.json",
                        "system": result["system"], "k": lengths[-1], "mean_accepted": code["stages"][-1]["mean_accepted"],
                        "requests": code["prompts"]})
    for m in out:
        m["rate"] = fitted_rate(m["mean_accepted"], m["k"])
        m["expected_tokens"] = round(expected_tokens(m["rate"], m["k"]), 4)  # = 1 + mean accepted: the inverse checked
    return out


def pair_rates(measurements: list[dict]) -> dict[tuple[str, str], float]:
    """Per (verifier, drafter) role pair: its measurements' rates weighted by their requests."""
    pairs: dict[tuple[str, str], list[dict]] = {}
    for m in measurements:
        pairs.setdefault(m["pair"], []).append(m)
    return {pair: sum(m["rate"] * m["requests"] for m in ms) / sum(m["requests"] for m in ms) for pair, ms in pairs.items()}


def label(pair: tuple[str, str]) -> str:
    return f"{ROLE_LABEL[pair[0]]}<-{ROLE_LABEL[pair[1]]}"


# ------------------------------------------------------------------------------------------ models


def goodput_planner(costs: Costs, rates: dict, roles: list[str]) -> BatchPlanner:
    """The planner of `lengths: auto` over these tiers, its tables from `costs` and its acceptance at `rates`."""
    tiers = [types.SimpleNamespace(name=ROLE_LABEL[r], can_verify=r != "ngram", has_weights=r != "ngram", forward_log=[])
             for r in roles]
    planner = BatchPlanner(tiers, [None if r == "ngram" else costs.tables[r] for r in roles],
                           [costs.lookup_ms if r == "ngram" else 0.0 for r in roles],
                           max_batched_tokens=BatchingConfig().max_batched_tokens)  # (the shipped configs keep the default)
    for (level, verifier), (drafter, role) in itertools.combinations(enumerate(roles), 2):
        # the counts its estimator (batch_acceptance.Acceptance) holds after a long greedy run at this rate:
        # accepted tokens, and rounds ended by a rejection
        planner.acceptance.accepted[(level, drafter, True)] = EVIDENCE_TOKENS * rates[(verifier, role)]
        planner.acceptance.rejected[(level, drafter, True)] = EVIDENCE_TOKENS * (1.0 - rates[(verifier, role)])
    return planner


def chain_inputs(costs: Costs, rates: dict, roles: list[str], batch: int) -> tuple[list[StageSpec], dict[int, float]]:
    """The time model's stages (target first) and the bottom drafter's draft_ms for the chain `roles` at `batch` rows."""
    stages = [StageSpec(forward_ms=costs.stage_table(roles[i], batch), accept_rates=(rates[(roles[i], roles[i + 1])],),
                        overhead_ms=costs.step_overhead_ms if i == 0 else 0.0) for i in range(len(roles) - 1)]
    planner = goodput_planner(costs, rates, roles)
    return stages, {k: planner.draft_ms(len(roles) - 1, batch, k) for k in range(1, STAGE_WIDTHS + 1)}


def ms_per_token(costs: Costs, rates: dict, roles: list[str], lengths, batch: int) -> float:
    """C_0, ms per token of one request, of the chain `roles` at `lengths` when `batch` requests step together."""
    if len(roles) == 1:
        return costs.tables["target"].estimate(batch, 1) + costs.step_overhead_ms
    stages, draft_ms = chain_inputs(costs, rates, roles, batch)
    return chain_cost(stages, draft_ms, list(lengths))


def full_search(costs: Costs, rates: dict, roles: list[str], batch: int) -> tuple[tuple[int, ...], list[int], float]:
    """The lowest C_0 over every set of tiers the chain can run (the target first, the lookup only at the
    bottom, as `Planner.candidate_sets`) and every length 1..MAX_LENGTH: (active tiers, lengths, C_0)."""
    best = ((0,), [], ms_per_token(costs, rates, ["target"], [], batch))
    for size in range(1, len(roles)):
        for subset in itertools.combinations(range(1, len(roles)), size):
            active = (0,) + subset
            if any(roles[t] == "ngram" for t in active[:-1]):
                continue
            lengths, ms = search_lengths(*chain_inputs(costs, rates, [roles[t] for t in active], batch), MAX_LENGTH)
            if ms < best[2]:
                best = (active, lengths, ms)
    return best


def plan_of(roles: list[str], active: tuple[int, ...], lengths) -> Plan:
    """The planner's Plan of `active` tiers with one length per stage (Plan.lengths[tier] = k of the stage the tier verifies)."""
    per_tier = [0] * (len(roles) - 1)
    for tier, k in zip(active, lengths):
        per_tier[tier] = k
    return Plan(tuple(active), tuple(per_tier))


def described(roles: list[str], active, lengths) -> dict:
    return {"tiers": [ROLE_LABEL[roles[t]] for t in active], "lengths": list(lengths)}


# ------------------------------------------------------------------------------------------- report


def predict(costs: Costs, rates: dict, measurements: list[dict], repo: Path = REPO) -> dict:
    """Every shipped chain at every batch (an -auto config: at the planner's pick), the picks, the issue's claims."""
    alone = {b: b * 1000.0 / ms_per_token(costs, rates, ["target"], [], b) for b in BATCHES}
    chains, picks = [], []
    overhead = costs.step_overhead_ms  # the planner's tables are forwards only: its step time gets it added
    for path in sorted((repo / "configs").glob("qwen2.5-coder-*.yaml")):
        roles, lengths = chain_roles(path)
        if len(roles) < 2:
            continue  # one model alone (the 0.5B's baseline config): not a chain of the pair
        planner = goodput_planner(costs, rates, roles)
        for batch in BATCHES:
            if lengths == "auto":
                plan = planner.predicted_best(batch)
                active, chosen = plan.active, [plan.lengths[t] for t in plan.active[:-1]]  # (the pick ignores the overhead)
                searched_active, searched_lengths, searched_ms = full_search(costs, rates, roles, batch)
                picks.append({"config": path.stem, "batch": batch, "pick": described(roles, active, chosen),
                              "pick_goodput_x_target": round(planner.goodput(plan, batch, overhead) / alone[batch], 3),
                              "full_search": described(roles, searched_active, searched_lengths),
                              "full_search_x_target": round(batch * 1000.0 / searched_ms / alone[batch], 3)})
            else:
                active, chosen = tuple(range(len(roles))), list(lengths)
                plan = plan_of(roles, active, chosen)
            tokens_per_s = batch * 1000.0 / ms_per_token(costs, rates, [roles[t] for t in active], chosen, batch)
            goodput = planner.goodput(plan, batch, overhead) if len(active) <= 3 else None  # (it prices at most 3 tiers)
            chains.append({"config": path.stem, "batch": batch, "auto": lengths == "auto", **described(roles, active, chosen),
                           "tokens_per_s": round(tokens_per_s, 1), "x_target": round(tokens_per_s / alone[batch], 3),
                           "goodput_model_x_target": None if goodput is None else round(goodput / alone[batch], 3)})
    return {"target_alone_tokens_per_s": {str(b): round(v, 1) for b, v in alone.items()}, "chains": chains, "planner": picks,
            "claims": check_claims(costs, rates, alone, measurements)}


def check_claims(costs: Costs, rates: dict, alone: dict, measurements: list[dict]) -> dict:
    """The issue's figures at batch 1, x target per length k: target <- 0.5B (the issue: 0.84-0.94x at an
    agreement of 0.75) at 0.75, also with the costs read as the issue did (every block of 2+ tokens costs
    the measured 1 x 8 forward, k drafted tokens k one-token forwards), and at the measured rate;
    target <- n-gram (the issue: ~1.7x) at its measured rate and at every n-gram stage's rate pooled."""
    def by_length(roles: list[str], rate: float) -> dict:
        at = {**rates, (roles[0], roles[1]): rate}
        return {str(k): round(1000.0 / ms_per_token(costs, at, roles, [k], 1) / alone[1], 3) for k in range(1, MAX_LENGTH + 1)}

    def as_the_issue(rate: float) -> dict:
        block_ms = costs.tables["target"].estimate(1, 8)
        stage = StageSpec(forward_ms={1: costs.tables["target"].estimate(1, 1), 2: block_ms, STAGE_WIDTHS: block_ms},
                          accept_rates=(rate,), overhead_ms=costs.step_overhead_ms)
        draft_ms = {k: k * costs.tables["small"].estimate(1, 1) for k in range(1, STAGE_WIDTHS + 1)}
        return {str(k): round(1000.0 / chain_cost([stage], draft_ms, [k]) / alone[1], 3) for k in range(1, MAX_LENGTH + 1)}

    small, ngram = rates[("target", "small")], rates[("target", "ngram")]
    pooled = pair_rates([dict(m, pair=("target", "ngram")) for m in measurements if m["pair"][1] == "ngram"])[("target", "ngram")]
    return {f"target<-0.5B at rate {ASSUMED_RATE}": by_length(["target", "small"], ASSUMED_RATE),
            f"target<-0.5B at rate {ASSUMED_RATE}, costs read as the issue did": as_the_issue(ASSUMED_RATE),
            f"target<-0.5B at the measured rate {small:.3f}": by_length(["target", "small"], small),
            f"target<-n-gram at the measured rate {ngram:.3f}": by_length(["target", "ngram"], ngram),
            f"target<-n-gram at every n-gram stage's rate pooled, {pooled:.3f}": by_length(["target", "ngram"], pooled)}


def cost_summary(costs: Costs) -> dict:
    return {"models": {ROLE_LABEL[role]: {"source": costs.sources[role],
                                          "grid_ms": {f"{b}x{w}": round(ms, 3) for (b, w), ms in sorted(table.ms.items())}}
                       for role, table in costs.tables.items()},
            "lookup_ms_per_request": round(costs.lookup_ms, 4), "step_overhead_ms": round(costs.step_overhead_ms, 3)}


def markdown(report: dict) -> str:
    models, short = report["costs"]["models"], lambda config: config.removeprefix("qwen2.5-coder-")
    lines = ["# Predicted speed of the shipped Qwen2.5-Coder chains on a GPU", "",
             f"PREDICTIONS of the time model, not measurements. Forward costs: {models['target']['source']}; "
             f"the fp8 tier (the configs' int8 copy): {models['fp8']['source']}. Acceptance: measured on the CPU on HumanEval "
             "prompts, greedy. Written by `benchmarks/gpu/predict_chains.py` (how: its docstring, benchmarks/gpu/README.md).", "",
             "Per-token acceptance: " + ", ".join(f"{pair} {rate}" for pair, rate in report["acceptance"]["rates"].items())
             + f". n-gram lookup {report['costs']['lookup_ms_per_request']} ms per request; step overhead "
             f"{report['costs']['step_overhead_ms']} ms. Target alone: "
             + ", ".join(f"{v:,.0f} tokens/s at batch {b}" for b, v in report["target_alone_tokens_per_s"].items()) + ".", "",
             "| chain | tiers | lengths | batch | predicted tokens/s | x target | x target (goodput model) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for row in report["chains"]:
        goodput = "—" if row["goodput_model_x_target"] is None else f"{row['goodput_model_x_target']:.2f}"
        lengths = f"auto: {row['lengths']}" if row["auto"] else str(row["lengths"])
        lines.append(f"| {short(row['config'])} | {' <- '.join(row['tiers'])} | {lengths} | {row['batch']} | "
                     f"{row['tokens_per_s']:,.0f} | {row['x_target']:.2f} | {goodput} |")
    lines += ["", "`lengths: auto`: the goodput planner's pick (`BatchPlanner.predicted_best`, lengths on its grid) and the "
              f"serial model's full search (every set of tiers, lengths 1..{MAX_LENGTH}):", "",
              "| config | batch | planner's pick | x target (goodput model) | full search | x target |",
              "|---|---:|---|---:|---|---:|"]
    for pick in report["planner"]:
        chosen, searched = pick["pick"], pick["full_search"]
        lines.append(f"| {short(pick['config'])} | {pick['batch']} | {' <- '.join(chosen['tiers'])} {chosen['lengths']} | "
                     f"{pick['pick_goodput_x_target']:.2f} | {' <- '.join(searched['tiers'])} {searched['lengths']} | "
                     f"{pick['full_search_x_target']:.2f} |")
    lines += ["", "The issue's figures at batch 1, x target at length k:", "",
              "| case | " + " | ".join(f"k={k}" for k in range(1, MAX_LENGTH + 1)) + " |", "|---|" + "---:|" * MAX_LENGTH]
    for case, by_k in report["claims"].items():
        lines.append(f"| {case} | " + " | ".join(f"{v:.2f}" for v in by_k.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", nargs="*", default=[],
                        help="a GPU run's reference.py JSONs and/or device-round.json (files missing are skipped)")
    parser.add_argument("--lookup-ms", type=float, default=None, help="host ms of one n-gram lookup (default: the CPU profile's)")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    cost_files = [Path(p) for p in args.costs if Path(p).is_file()]
    lookup_ms = args.lookup_ms
    if lookup_ms is None:
        lookup_ms = profile_lookup_ms(REPO / "benchmarks" / "real-models.profile.json")
    costs = build_costs(cost_files, lookup_ms)
    measurements = stage_measurements(REPO)
    rates = pair_rates(measurements)
    report = {"what": "time-model predictions from per-forward GPU costs and CPU-measured acceptance, not measured speeds",
              "cost_files": [str(p) for p in cost_files], "batches": list(BATCHES), "costs": cost_summary(costs),
              "acceptance": {"conversion": "the per-token rate a with expected_tokens(a, k) = 1 + mean accepted at "
                                           "length k (fitted_rate); bottom stages of fixed-length chains; weighted by the "
                                           "requests measured",
                             "note": "the fp8 copy's rates are the int8 copy's, measured on the CPU",
                             "rates": {label(pair): round(rate, 4) for pair, rate in sorted(rates.items())},
                             "measurements": [{**m, "pair": label(m["pair"])} for m in measurements]},
              **predict(costs, rates, measurements)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predicted-chains.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "predicted-chains.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
