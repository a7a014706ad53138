"""A skip pair's shadow estimate against the same pair measured directly (docs/time-model.md, shadow estimates).

    python benchmarks/shadow_bias.py [-c configs/demo.yaml] [--weighting first|none|all]

Greedy, on `polyspec tune`'s tuning and held-out prompt sets: the full chain runs every
prompt (the tuner builds the target<-bottom shadow estimate from the bottom tier's
proposals at committed contexts), then target+bottom runs the same prompts (the direct
estimate). Counts never forget (decay 1). Prints both per-position rates and the ms per
token the time model predicts for target+bottom at k = 6 from each. `--weighting`: how a
shadow sample is counted -- `first` (the code: position 1 weighted 1 / (matched + 1)),
`none` (unit weights), `all` (every position weighted 1 / (matched + 1)).
Acceptance counts are deterministic here (greedy); the predicted ms read the latency
profile measured at start-up, so they move with the machine, their ratio much less.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--weighting", choices=["first", "none", "all"], default="first")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    import torch

    from polyspec.harness import tune
    from polyspec.orchestrator.tuning import estimates as estimates_module
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine
    from polyspec.orchestrator.tuning.time_model import renewal_rates
    from polyspec.orchestrator.tuning.tuner import Plan

    torch.set_num_threads(1)
    if args.weighting != "first":
        observe = estimates_module.AcceptanceEstimate.observe

        def reweighted(self, proposed, accepted, first_weight=1.0):
            if first_weight == 1.0 or args.weighting == "none":  # a direct observation, or unit weights
                return observe(self, proposed, accepted)
            # "all": the whole sample at weight 1 / (matched + 1)
            self.blocks += first_weight
            for position in range(min(accepted, estimates_module.MAX_POSITIONS)):
                self.successes[position] += first_weight
                self.trials[position] += first_weight
            if accepted < min(proposed, estimates_module.MAX_POSITIONS):
                self.trials[accepted] += first_weight

        estimates_module.AcceptanceEstimate.observe = reweighted

    config = load_config(args.config)
    settings = tune.TuneSettings(temperature=0.0, max_new_tokens=args.max_new_tokens, grid_max=6, max_prompts=8)
    sets = tune.split_prompts(None, config, 8)
    engine = Engine(config, auto_tune=False)
    engine.scheduler.eos_token_ids = frozenset()
    last = len(engine.tiers) - 1
    if last < 2:
        print("error: the chain needs a middle tier (a skip pair target<-bottom)", file=sys.stderr)
        return 2
    full, skip = tuple(range(last + 1)), (0, last)
    for name, prompts in (("tuning", sets.tuning), ("held-out", sets.heldout)):
        ids = [engine.parse_request({"prompt": p, "max_new_tokens": args.max_new_tokens}).prompt_ids for p in prompts]
        tuner = engine.make_tuner((list(ids[0]) * 10)[:100], max_length=6, decay=1.0)
        tune.run_plan(engine, Plan((6,) * last, full), ids, settings, tuner)
        shadow = tuner.estimates("greedy", shadow=True)[skip]
        tune.run_plan(engine, Plan((6,) * last, skip), ids, settings, tuner)
        direct = tuner.estimates("greedy")[skip]
        from_direct = tuner.predict("greedy", skip, (6,) * last)
        tuner.class_state("greedy").estimates.pop(skip)
        from_shadow = tuner.predict("greedy", skip, (6,) * last)
        print(f"{name} prompts ({len(ids)} x {args.max_new_tokens} tokens), shadow weighting {args.weighting!r}")
        # the direct estimate is per position of the text: as rounds at k = 6 see it
        print("  direct  rates 1-6:", [round(r, 3) for r in renewal_rates(direct.rates(), 6)[:6]], f"({direct.blocks:.0f} blocks)")
        print("  shadow  rates 1-6:", [round(r, 3) for r in shadow.rates()[:6]], f"({shadow.blocks:.1f} weighted samples)")
        print(f"  predicted target+{engine.tiers[last].name} [6]: {from_direct:.3f} ms/token from direct, "
              f"{from_shadow:.3f} from shadow ({100 * (from_shadow / from_direct - 1):+.0f} %)")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
