"""The planner over several workloads: each shipped `-auto` config against every fixed config of its own
tiers and the target alone, at 1 and at 4 requests at once, through `polyspec batch`.

    python benchmarks/planner.py --rounds 2                     # the real run (Qwen2.5-Coder; resumable)
    python benchmarks/planner.py --family demo --smoke          # the demo family, minutes: checks the script
    python benchmarks/planner.py --workloads code math --concurrency 1 --systems target qwen2.5-coder-3tier-auto
    python benchmarks/planner.py --workloads code chat chat-2   # chat-2: MT-Bench's second turns too (opt-in)
    python benchmarks/planner.py --fresh                        # start over

Workloads: benchmarks/planner-questions/question.jsonl (code completion, chat, translation, summarization,
math; its README names each source), `--prompts` questions of each (evenly spaced through its 8), first turns only; code is
sent as a plain completion prompt, the rest as a user message through the chat template (the demo family
has none: there every turn is a plain prompt). Greedy, `--tokens` new tokens at most (a chat answer may
stop sooner), `--threads auto`.

Systems (`--family qwen`): the target alone (`qwen2.5-coder-2tier --no-speculation`), every shipped fixed
Qwen2.5-Coder config whose tiers are a subset of an -auto config's with the same target (ngram, 2tier,
3tier, int8, int8-3tier, int8-0.5b, 4tier), and the -auto configs (3tier-auto, 4tier-auto). Each run is one
`polyspec batch` process (polyspec.harness.batch_bench): tokens/s = generated tokens / decoding wall time,
load and start-up profile excluded. Within a round every system runs a cell (workload, concurrency)
before the next cell starts, so a slow stretch of the machine hits every system of a cell alike.

Judged per (workload, concurrency), for each -auto config: tokens/s over the best fixed config of its own
tiers (bar: >= 0.95) and over the target alone (bar: >= 1.0); greedy tokens equal to the target's.

Writes benchmarks/planner.{json,md,png}; finished runs go to benchmarks/planner.partial.jsonl. `--smoke`
writes benchmarks/planner-smoke.* instead (never the judged table). Needs `polyspec zoo fetch
qwen2.5-coder` (the real run) and matplotlib for the plot.

Duration of the real run on 2 cores, from benchmarks/qwen-batch.partial.jsonl (the same configs, 4 HumanEval
prompts x 128 tokens at once: 30-45 s decoding, 38-80 s a process with the load) and the target alone's 7-10
tokens/s one request at a time: about 60 s a run at 4 requests and 85 s at 1, so about 2 hours a round (10
systems x 5 workloads x 2 concurrencies) and 4 hours for `--rounds 2`; the smoke test took 13 minutes (50 runs of 7-17 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from polyspec.harness.batch_bench import (
    append_partial,
    describe_divergences,
    first_divergences,
    pin_here,
    read_partial,
    run_batch,
    target_of,
    tier_set,
)

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = REPO / "benchmarks" / "planner-questions" / "question.jsonl"
WORKLOADS = ("code", "chat", "translation", "summarization", "math")
SECOND_TURNS = "chat-2"  # opt-in: MT-Bench's second turns, after the target alone's own first answer
CONCURRENCY = (1, 4)
TARGET = "target"
AUTO_BAR = 0.95  # the -auto config's tokens/s over the best fixed config of its own tiers
TARGET_BAR = 1.0  # ... and over the target alone


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    config: str  # a file under configs/, without .yaml
    lengths: str | None = None  # --lengths: an override of the config's speculation lengths
    speculative: bool = True

    @property
    def path(self) -> Path:
        return REPO / "configs" / f"{self.config}.yaml"

    @property
    def auto(self) -> bool:
        return self.speculative and (self.lengths == "auto" or self.name.endswith("-auto"))


@dataclasses.dataclass(frozen=True)
class Family:
    systems: tuple[System, ...]  # the target alone first
    chat: bool  # the target has a chat template: chat turns go as messages
    clip_chars: int | None = None  # each turn cut to this many characters (the demo family's 512-token context)


FAMILIES = {
    "qwen": Family((System(TARGET, "qwen2.5-coder-2tier", speculative=False),
                    *(System(f"qwen2.5-coder-{name}", f"qwen2.5-coder-{name}")
                      for name in ("ngram", "2tier", "3tier", "int8", "int8-3tier", "int8-0.5b", "4tier", "3tier-auto", "4tier-auto"))),
                   chat=True),
    # the demo family ships no local -auto config: its chains with --lengths auto stand in (smoke test only)
    "demo": Family((System(TARGET, "demo", speculative=False), System("demo", "demo"), System("demo-2tier", "demo-2tier"),
                    System("demo-auto", "demo", lengths="auto"), System("demo-2tier-auto", "demo-2tier", lengths="auto")),
                   chat=False, clip_chars=600),
}


def own_fixed(auto: System, systems: list[System]) -> list[System]:
    """The fixed configs an -auto config is judged against: same target, tiers a subset of its own."""
    return [s for s in systems if s.speculative and not s.auto and target_of(s.path) == target_of(auto.path)
            and tier_set(s.path) <= tier_set(auto.path)]


def questions(workloads: list[str], count: int) -> dict[str, list[dict]]:
    """`count` questions of each workload, evenly spaced through its 8 (each spread over its source already)."""
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    by_workload = {w: [r for r in rows if r["category"] == w] for w in workloads}
    return {w: [found[i * len(found) // count] for i in range(min(count, len(found)))] for w, found in by_workload.items()}


def request(question: dict, family: Family) -> dict:
    """The `polyspec batch` line of a question's first turn."""
    text = question["turns"][0][: family.clip_chars] if family.clip_chars else question["turns"][0]
    key = f"q{question['question_id']}"
    if question["mode"] == "chat" and family.chat:
        return {"id": key, "messages": [{"role": "user", "content": text}]}
    return {"id": key, "prompt": text}


def second_turn(question: dict, answer: str, family: Family) -> dict:
    """The `polyspec batch` line of a chat question's second turn: the first turn, the target alone's answer to it
    (every system gets the same conversation), then the second turn."""
    first, second = question["turns"][0], question["turns"][1]
    key = f"q{question['question_id']}t2"
    if family.chat:
        return {"id": key, "messages": [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                                        {"role": "user", "content": second}]}
    text = f"{first}\n{answer}\n{second}"
    return {"id": key, "prompt": text[-family.clip_chars:] if family.clip_chars else text}


def cell_rows(workload: str, picked: dict[str, list[dict]], family: Family, runs: list[dict]) -> list[dict] | None:
    """A workload's requests; the second turns need the target alone's first answers (None until a chat run has them)."""
    if workload != SECOND_TURNS:
        return [request(q, family) for q in picked[workload]]
    firsts = sorted((r for r in runs if r["system"] == TARGET and r["workload"] == "chat"), key=lambda r: r["concurrency"])
    if not firsts:
        return None
    answers = firsts[0]["texts"]
    return [second_turn(q, answers[f"q{q['question_id']}"], family) for q in picked["chat"]
            if len(q["turns"]) > 1 and f"q{q['question_id']}" in answers]


def cell_key(run: dict) -> tuple[str, int]:
    return run["workload"], run["concurrency"]


def divergences(runs: list[dict], family: Family, requests: dict[str, dict]) -> dict[tuple, dict]:
    """Per (workload, concurrency, system): where its tokens differ from the target alone's in that cell."""
    target_ids, others = {}, {}
    for run in runs:
        cell = f"{run['workload']}|{run['concurrency']}"
        ids = {f"{cell}|{key}": tokens for key, tokens in run["token_ids"].items()}
        if run["system"] == TARGET:
            target_ids.update(ids)  # the first round's (greedy: every round's are the same or it shows as a divergence)
        else:
            others.setdefault(run["system"], {}).update(ids)
    found = first_divergences(family.systems[0].path, {f"{c}|{key}": requests[key] for c in {k.rsplit("|", 1)[0] for k in target_ids}
                                                       for key in requests}, target_ids, sorted(others.items()))
    out: dict[tuple, dict] = {}
    for system, by_key in found.items():
        for key, where in by_key.items():
            workload, concurrency, request_id = key.split("|")
            out.setdefault((workload, int(concurrency), system), {})[request_id] = where
    return out


def report(runs: list[dict], meta: dict, family: Family, ties: dict | None = None) -> dict:
    systems = [s for s in family.systems if s.name in meta["systems"]]
    cells = []
    for workload in meta["workloads"]:
        for concurrency in meta["concurrency"]:
            here = [r for r in runs if cell_key(r) == (workload, concurrency)]
            target = [r for r in here if r["system"] == TARGET]
            base = statistics.median(r["tokens_per_s"] for r in target) if target else None
            rows = {}
            for system in systems:
                mine = [r for r in here if r["system"] == system.name]
                if not mine:
                    continue
                rates = [r["tokens_per_s"] for r in mine]
                same = all(r["token_ids"] == target[0]["token_ids"] for r in mine) if target else None
                found = (ties or {}).get((workload, concurrency, system.name))
                # greedy-equal up to ties: each divergence within one rounding step of the dtype, which a forward of
                # another shape (a batch of blocks, not single tokens) may break either way
                equal = same is True or bool(same is False and found and all(d.get("tie", False) for d in found.values()))
                if same is False and found:
                    same = describe_divergences(found)
                rows[system.name] = {"runs": len(rates), "tokens_per_s": round(statistics.median(rates), 3),
                                     "spread": [round(min(rates), 3), round(max(rates), 3)],
                                     "x_target": round(statistics.median(rates) / base, 3) if base else None,
                                     "greedy_equals_target": same, "greedy_equal_up_to_ties": equal,
                                     "generated_tokens": mine[-1]["generated_tokens"],
                                     "stages": mine[-1]["stages"], "plans": mine[-1].get("plans")}
            judged = {}
            for auto in (s for s in systems if s.auto and s.name in rows):
                fixed = [f for f in own_fixed(auto, systems) if f.name in rows]
                best = max(fixed, key=lambda f: rows[f.name]["tokens_per_s"], default=None)
                mine = rows[auto.name]
                x_best = round(mine["tokens_per_s"] / rows[best.name]["tokens_per_s"], 3) if best else None
                judged[auto.name] = {"x_target": mine["x_target"], "best_fixed_of_its_tiers": best and best.name,
                                     "x_best_fixed_of_its_tiers": x_best, "fixed_compared": [f.name for f in fixed],
                                     "meets_bars": (x_best is not None and x_best >= AUTO_BAR and mine["x_target"] is not None
                                                    and mine["x_target"] >= TARGET_BAR and mine["greedy_equal_up_to_ties"])}
            cells.append({"workload": workload, "concurrency": concurrency, "rows": rows, "auto": judged})
    autos = sorted({name for cell in cells for name in cell["auto"]})
    summary = {name: {"cells": sum(name in c["auto"] for c in cells),
                      "cells_meeting_bars": sum(c["auto"].get(name, {}).get("meets_bars", False) for c in cells),
                      "lowest_x_best_fixed": min((c["auto"][name]["x_best_fixed_of_its_tiers"] for c in cells
                                                  if name in c["auto"] and c["auto"][name]["x_best_fixed_of_its_tiers"] is not None),
                                                 default=None),
                      "lowest_x_target": min((c["auto"][name]["x_target"] for c in cells
                                              if name in c["auto"] and c["auto"][name]["x_target"] is not None), default=None)}
               for name in autos}
    return {"meta": meta, "bars": {"x_best_fixed_of_its_tiers": AUTO_BAR, "x_target": TARGET_BAR}, "summary": summary,
            "cells": cells}


def short(name: str) -> str:
    return name.replace("qwen2.5-coder-", "")


def write(result: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    meta = result["meta"]
    title = f"# The planner over several workloads{' (SMOKE TEST: not the judged table)' if meta['smoke'] else ''}"
    pinned = f", pinned to CPU {meta['taskset']}" if meta["taskset"] else ""
    finished = f" Finished {meta['finished']}, load average then {meta['load_average_end']}." if meta.get("finished") else ""
    setting = (f"Family `{meta['family']}`; machine: {meta['cpu']}, {meta['cores']} cores; `--threads {meta['threads']}`{pinned}. "
               f"Greedy, at most {meta['tokens']} new tokens, {meta['prompts']} questions a workload (first turns; chat-2: the "
               "chat questions' second turns after the target alone's answer; ids in the JSON), "
               f"{' and '.join(map(str, meta['concurrency']))} request(s) at once; {meta['rounds']} round(s). "
               f"Command: `{meta['command']}`.{finished}")
    legend = ("tokens/s = generated tokens / decoding wall time of one `polyspec batch` process (load and start-up profile "
              "excluded); median over the rounds, spread min-max. x best fixed: the -auto config over the fastest fixed config "
              f"of its own tiers in that cell (bar {AUTO_BAR}); x target: over the target alone (bar {TARGET_BAR}); "
              "greedy = target: True, or per differing request the first differing token and the target's logit gap there (a cell "
              "meets the bars only where every such gap is a tie of the dtype's rounding); "
              "accepted per block: per verifier, the mean tokens it accepted a block, over every request of the last round's run.")
    lines = [title, "", setting, "", legend, "", "## -auto configs", "",
             "| auto config | cells | meeting both bars | lowest x best fixed | lowest x target |", "|---|---:|---:|---:|---:|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['cells']} | {s['cells_meeting_bars']} | {s['lowest_x_best_fixed']} | {s['lowest_x_target']} |")
    lines += ["", "| workload | requests | auto config | tokens/s | x target | best fixed of its tiers | x best fixed | greedy = target |",
              "|---|---:|---|---:|---:|---|---:|---|"]
    for cell in result["cells"]:
        for name, j in cell["auto"].items():
            row = cell["rows"][name]
            lines.append(f"| {cell['workload']} | {cell['concurrency']} | {short(name)} | {row['tokens_per_s']} | {j['x_target']} | "
                         f"{j['best_fixed_of_its_tiers'] and short(j['best_fixed_of_its_tiers'])} | {j['x_best_fixed_of_its_tiers']} | "
                         f"{row['greedy_equals_target']} |")
    lines += ["", "## Every system", ""]
    for cell in result["cells"]:
        lines += [f"### {cell['workload']}, {cell['concurrency']} at once", "",
                  "| system | runs | tokens/s | spread | x target | greedy = target | accepted per block |", "|---|---:|---:|---|---:|---|---|"]
        for name, r in cell["rows"].items():
            accepted = " / ".join(f"{s['tier']} {s['mean_accepted_length']}" for s in r["stages"]) or "—"
            lines.append(f"| {short(name)} | {r['runs']} | {r['tokens_per_s']} | {r['spread'][0]}-{r['spread'][1]} | {r['x_target']} | "
                         f"{r['greedy_equals_target']} | {accepted} |")
        lines.append("")
    stem.with_suffix(".md").write_text("\n".join(lines))
    plot(result, stem.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    meta = result["meta"]
    workloads, levels = meta["workloads"], meta["concurrency"]
    fig, axes = plt.subplots(len(levels), len(workloads), figsize=(3.2 * len(workloads), 3.4 * len(levels)), squeeze=False,
                             sharey=True)
    for cell in result["cells"]:
        ax = axes[levels.index(cell["concurrency"])][workloads.index(cell["workload"])]
        names = list(cell["rows"])
        colours = ["grey" if n == TARGET else "tab:orange" if n in cell["auto"] else "tab:blue" for n in names]
        ax.bar(range(len(names)), [cell["rows"][n]["x_target"] or 0 for n in names], color=colours)
        ax.axhline(TARGET_BAR, color="black", lw=0.8)
        ax.set_xticks(range(len(names)), [short(n) for n in names], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{cell['workload']}, {cell['concurrency']} at once", fontsize=9)
    for row in axes:
        row[0].set_ylabel("tokens/s / target alone")
    fig.suptitle(f"polyspec batch, greedy, {meta['family']} family: -auto (orange) vs fixed (blue)"
                 f"{' - SMOKE TEST' if meta['smoke'] else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from polyspec.harness.real_report import cpu_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen")
    parser.add_argument("--systems", nargs="+", default=None, help="only these systems (the target alone is always run)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=(*WORKLOADS, SECOND_TURNS),
                        help=f"{SECOND_TURNS}: also MT-Bench's second turns (after chat, which it needs)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    parser.add_argument("--prompts", type=int, default=4, help="questions a workload (evenly spaced through its 8)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every (system, cell), interleaved")
    parser.add_argument("--threads", default="auto", help="--threads of every run (a number, or auto)")
    parser.add_argument("--taskset", default=None, help="pin every run to these CPUs (taskset -c)")
    parser.add_argument("--smoke", action="store_true", help="2 questions a workload, 24 tokens; writes planner-smoke.*")
    parser.add_argument("--out", default=None, help="output stem (default benchmarks/planner, with --smoke planner-smoke)")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args(argv)
    pin_here(args.taskset)
    if args.smoke:
        args.prompts, args.tokens = min(args.prompts, 2), min(args.tokens, 24)
    family = FAMILIES[args.family]
    known = [s.name for s in family.systems]
    unknown = sorted(set(args.systems or ()) - set(known))
    if unknown:
        parser.error(f"--systems: {', '.join(unknown)} not in the {args.family} family ({', '.join(known)})")
    systems = [s for s in family.systems if s.name == TARGET or args.systems is None or s.name in args.systems]
    stem = Path(args.out) if args.out else REPO / "benchmarks" / ("planner-smoke" if args.smoke else "planner")
    stem.parent.mkdir(parents=True, exist_ok=True)
    partial = stem.with_name(stem.name + ".partial.jsonl")
    if args.fresh and partial.exists():
        partial.unlink()
    if SECOND_TURNS in args.workloads:  # after chat, whose target answers it continues
        args.workloads = [w for w in args.workloads if w != SECOND_TURNS] + [SECOND_TURNS]
    picked = questions([w for w in args.workloads if w != SECOND_TURNS] + (["chat"] if SECOND_TURNS in args.workloads else []),
                       args.prompts)
    meta = {"family": args.family, "smoke": args.smoke, "systems": [s.name for s in systems], "workloads": args.workloads,
            "concurrency": args.concurrency, "prompts": args.prompts, "tokens": args.tokens, "rounds": args.rounds,
            "threads": args.threads, "taskset": args.taskset, "cpu": cpu_name(), "cores": os.cpu_count(),
            "question_ids": {w: [q["question_id"] for q in qs] for w, qs in picked.items()},  # chat-2: chat's, second turns
            "sources": {w: [f"{q['source']} {q['source_id']}" for q in qs] for w, qs in picked.items()},
            "command": "python benchmarks/planner.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    # a run is kept only for the settings it was made with: a partial file of other settings is not mixed in
    same = {k: meta[k] for k in ("family", "prompts", "tokens", "threads", "taskset")}
    runs = [r for r in read_partial(partial) if r.get("settings") == same]
    for round_no in range(args.rounds):
        for workload in args.workloads:
            rows = cell_rows(workload, picked, family, runs)
            if not rows:
                print(f"{workload}: no target answers to chat's first turns yet: skipped", file=sys.stderr)
                continue
            for concurrency in args.concurrency:
                for system in systems:
                    done = [r for r in runs if r["system"] == system.name and cell_key(r) == (workload, concurrency)]
                    if len(done) > round_no:
                        continue
                    print(f"round {round_no + 1}/{args.rounds}: {workload} x{concurrency} {system.name} ...", file=sys.stderr, flush=True)
                    run = run_batch(system.path, rows, tokens=args.tokens, concurrency=concurrency, threads=args.threads,
                                    taskset=args.taskset, speculative=system.speculative, lengths=system.lengths)
                    run = {"system": system.name, "workload": workload, "concurrency": concurrency, "settings": same, **run}
                    print(f"  {run['tokens_per_s']} tok/s, {run['generated_tokens']} tokens (load {run['load_s']} s, "
                          f"process {run['process_wall_s']} s)", file=sys.stderr, flush=True)
                    runs.append(run)
                    append_partial(partial, run)
                    write(report(runs, meta, family), stem)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    requests = {r["id"]: r for w in args.workloads for r in (cell_rows(w, picked, family, runs) or [])}
    asked = [r for r in runs if cell_key(r)[0] in args.workloads and cell_key(r)[1] in args.concurrency]
    write(report(runs, meta, family, divergences(asked, family, requests)), stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
