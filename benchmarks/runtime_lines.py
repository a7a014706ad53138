"""Runtime lines (`orchestrator/` + `workers/`, every .py) and which work wrote them: the one-family issue's structure bar.

    python benchmarks/runtime_lines.py                 # since d36d6a6, the commit before the one-family work
    python benchmarks/runtime_lines.py --base REV --list

The one-family issue judges the lines of what existed at its base commit (bar: 15,000); code that other issues
added since comes on top. Each line of HEAD is attributed with `git blame` to the commit that last wrote it, and
each commit since the base to an issue by its subject (OWNERS' patterns: the subjects name their feature), with
OVERRIDES for subjects that name another issue's feature while doing this issue's work (a fold in the grammar
module's docstring is not structured output). A line another issue's commit wrote and this issue later rewrote
counts as this issue's, and a commit whose subject matches no pattern counts as this issue's, so the in-scope
figure errs high. `--list` prints every commit attributed elsewhere with its lines, to check by hand.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = "d36d6a6"
THIS = "one tier family"
OWNERS = {  # the other issues open or resolved since the base, by what their commits' subjects name
    "tiers at memory speed": r"int4|int8w|gguf|GGUF|weight.only|weight_only|llama\.cpp|llamacpp|switch_rows|block path|"
                             r"first_block_rows|ForwardTable: a table with switch",
    "hostile clients": r"hostile|guard|bounded_json|bounded JSON|BodyBudget|slowloris|tenant|state-dir lock|"
                       r"one server per state dir|client JSON measured|approximate_json is refused|jobs: an invalid item",
    "structured output": r"[Gg]rammar|[Ss]tructured output|json_schema|constraint",
    "the planner on unseen work": r"goodput planner|^planner:|acceptance that moves|Per request where it pays|"
                                  r"planner's decisions|GetStats carries the planner|tuning: every option|"
                                  r"tuning options reach|The tuning: options reach|polyspec_plans|validate names, per path",
}
OVERRIDES = {  # commits whose subjects match another issue's pattern but whose work is the one-family issue's
    THIS: "c8235f5 165b0a2 82a18c6 7344796 f86f735 e1a45df 26a2ea9 2fbb9a7 b96f94c 6f3f282 aa783cf 3c8c4fc 91752ab d0a968e "
          "5e6bf3c ea4f173 283c997 12f67d6 ba4ea32 264e952 895f97d 809ae9b f2ded9c 7c3b545 6b3d5bb 6302eaf 0c92eeb 76f291b "
          "80bfb41 6706403",
    "tiers at memory speed": "14bc29e",
}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def owners(base: str) -> dict[str, str]:
    """Each commit since `base` (7-hex prefix) -> the issue that wrote it."""
    forced = {h: issue for issue, hashes in OVERRIDES.items() for h in hashes.split()}
    out = {}
    for line in git("log", "--no-merges", "--format=%h %s", f"{base}..HEAD").splitlines():
        commit, subject = line.split(" ", 1)
        commit = commit[:7]
        hits = [issue for issue, pattern in OWNERS.items() if re.search(pattern, subject)]
        out[commit] = forced.get(commit) or (hits[0] if len(hits) == 1 else THIS)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default=BASE)
    parser.add_argument("--list", action="store_true", help="every commit attributed to another issue, with its lines")
    args = parser.parse_args()
    owner = owners(args.base)
    lines, per_commit = collections.Counter(), collections.Counter()
    files = sorted(p.relative_to(REPO) for d in ("orchestrator", "workers") for p in (REPO / d).rglob("*.py"))
    for path in files:
        for line in git("blame", "--line-porcelain", "HEAD", "--", str(path)).splitlines():
            found = re.match(r"^([0-9a-f]{40}) \d+ \d+", line)
            if found:
                commit = found.group(1)[:7]
                per_commit[commit] += commit in owner
                lines[owner.get(commit, f"before {args.base}")] += 1
    total = sum(lines.values())
    others = sum(n for issue, n in lines.items() if issue in OWNERS)
    for issue, n in lines.most_common():
        print(f"{issue}: {n}")
    print(f"total: {total}; other issues: {others}; what existed at {args.base} (with this issue's work): {total - others}")
    if args.list:
        log = git("log", "--no-merges", "--format=%h %s", f"{args.base}..HEAD").splitlines()
        subjects = {line[:7]: line.split(" ", 1)[1] for line in log}
        for commit, n in per_commit.most_common():
            if n and owner[commit] != THIS:
                print(f"  {owner[commit]}: {commit} {n} lines: {subjects[commit][:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
