"""Per-round acceptance depends on the block length; per-text-position acceptance does not.

    python benchmarks/renewal_rates.py [-c configs/demo.yaml] [-n 48] [--lengths 6 3 2]

The bottom drafter (the n-gram tier) against the target's greedy text of `polyspec tune`'s
tuning prompts: for every context of the generated text, how many tokens the drafter's
proposal (k_max = 6) matches. A chain asking for k tokens is then simulated over that text
(a round from a context with a run of a emits min(a, k) + 1 tokens), which gives the true
tokens per round at each k. Against it, what the tuner would predict from the rounds of
chains at `--lengths` (as `polyspec tune`'s calibration runs them):

- per-round table: per-position rates counted per round (the tuner before the renewal
  weighting; `AcceptanceEstimate(along_text=False)`), pooled over the lengths;
- text table: each round weighted by the tokens it covers, turned back into rounds at k by
  `time_model.renewal_rates` (the tuner now);
- both again from the rounds at the longest length only (a chain running it online).

No timing: the numbers are deterministic for a given model and prompt file. docs/time-model.md
(acceptance) says what the table shows; benchmarks/HISTORY.md has a run of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K_MAX = 6


def per_position(rounds: list[tuple[int, int]], along_text: bool) -> tuple[float, ...]:
    """The tuner's own estimate (tuner.AcceptanceEstimate, no forgetting) from (length asked,
    accepted) rounds: per position of the text (each round weighted accepted + 1) or per round."""
    from polyspec.orchestrator.tuning.tuner import AcceptanceEstimate

    estimate = AcceptanceEstimate(decay=1.0, along_text=along_text)
    for asked, accepted in rounds:
        estimate.observe(asked, accepted)
    return estimate.rates()[:K_MAX]


def chain_rounds(runs: list[int], k: int) -> list[tuple[int, int]]:
    """The rounds of a chain asking for k tokens over a text whose drafter runs are `runs`."""
    rounds, at = [], 0
    while at < len(runs):
        accepted = min(runs[at], k)
        rounds.append((k, accepted))
        at += accepted + 1
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("-n", "--max-new-tokens", type=int, default=48)
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 3, 2])
    args = parser.parse_args(argv)
    if not all(1 <= k <= K_MAX for k in args.lengths):
        print(f"error: --lengths must be in 1..{K_MAX}", file=sys.stderr)
        return 2

    import torch

    from polyspec.harness import tune
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine, GenerationRequest
    from polyspec.orchestrator.tuning.time_model import expected_emitted, renewal_rates
    from polyspec.workers.tiers.tier import NGramTier

    torch.set_num_threads(1)
    config = load_config(args.config)
    bottom = config.tiers[-1]
    if not bottom.is_ngram:
        print("error: the chain's bottom tier must be the n-gram tier", file=sys.stderr)
        return 2
    sets = tune.split_prompts(None, config, 8)
    engine = Engine(config, auto_tune=False)
    engine.scheduler.eos_token_ids = frozenset()
    drafter = NGramTier(bottom.name, engine.vocab_size, bottom.max_ngram, bottom.min_ngram)
    params = tune.TuneSettings().params()
    texts = []
    for prompt in sets.tuning:
        ids = engine.parse_request({"prompt": prompt, "max_new_tokens": args.max_new_tokens}).prompt_ids
        out = engine.generate(GenerationRequest(tuple(ids), args.max_new_tokens, params, 0))
        texts.append((len(ids), list(ids) + list(out["token_ids"])))
    engine.close()

    runs = []  # per prompt, per generated context: how many tokens the drafter's proposal matches
    for prompt_len, text in texts:
        per_context = []
        for at in range(prompt_len, len(text)):
            found = drafter._continuations(text[:at], K_MAX, 1)
            proposal = found[0] if found else []
            matched = 0
            while matched < len(proposal) and at + matched < len(text) and proposal[matched] == text[at + matched]:
                matched += 1
            per_context.append(matched)
        runs.append(per_context)

    pooled = [r for per_context in runs for k in args.lengths for r in chain_rounds(per_context, k)]
    longest = [r for per_context in runs for r in chain_rounds(per_context, max(args.lengths))]
    lengths = ", ".join(map(str, args.lengths))
    print(f"{len(texts)} prompts x {args.max_new_tokens} greedy tokens ({Path(args.config).name}); tokens per n-gram round")
    print(f"| k | true (chain at k) | per-round table, k = {lengths} | text table, k = {lengths} | text table, k = {max(args.lengths)} only | per-round table, k = {max(args.lengths)} only |")
    print("|---|---|---|---|---|---|")
    for k in range(1, K_MAX + 1):
        true_rounds = [r for per_context in runs for r in chain_rounds(per_context, k)]
        true = sum(accepted + 1 for _, accepted in true_rounds) / len(true_rounds)
        cells = [
            expected_emitted(per_position(pooled, False), k),
            expected_emitted(renewal_rates(per_position(pooled, True), k), k),
            expected_emitted(renewal_rates(per_position(longest, True), k), k),
            expected_emitted(per_position(longest, False), k),
        ]
        print(f"| {k} | {true:.2f} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
