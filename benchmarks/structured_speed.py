"""Structured output's cost and effect on speculation: the same chain, the same chat prompts, with and without a
JSON schema, interleaved prompt by prompt (greedy). Reported per mode: tokens/s, the target stage's accepted draft
tokens per block, and for the constrained runs the masks computed per committed token.

The texts differ (a constrained reply is JSON, a free one is whatever the model writes), so tokens/s compares the
cost of a token under each, not the same text.

    python benchmarks/structured_speed.py -c configs/demo.yaml --prompts 4 --tokens 64
    python benchmarks/structured_speed.py -c configs/qwen2.5-coder-3tier.yaml --prompts 2 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "language": {"enum": ["python", "c", "rust", "go"]},
    "functions": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                                               "args": {"type": "integer", "minimum": 0, "maximum": 9}},
                                             "required": ["name", "args"]}, "maxItems": 4}},
    "required": ["name", "language", "functions"]}
PROMPTS = ["Describe a small Python module that parses CSV files, as JSON.", "Describe a C library for linked lists, as JSON.",
           "Describe a Rust crate that hashes files, as JSON.", "Describe a Go package for HTTP retries, as JSON."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from polyspec.orchestrator.config import load_config
    from polyspec.orchestrator.engine import Engine

    engine = Engine(load_config(args.config), auto_tune=False)
    rows = {"free": [], "json_schema": []}
    for prompt in PROMPTS[: args.prompts]:
        for mode in rows:
            raw = {"prompt": prompt, "max_new_tokens": args.tokens, "temperature": 0}
            if mode == "json_schema":
                raw["json_schema"] = SCHEMA
            request = engine.parse_request(raw)
            fills = []
            if request.constraint is not None:  # count the masks this request's matcher computes
                start = engine.start

                def counting_start(req, start=start):
                    state = start(req)
                    fills.append(state.params.grammar)
                    return state

                engine.start = counting_start
            result = engine.generate(request)
            engine.__dict__.pop("start", None)
            stage = result["stats"]["stages"][0] if result["stats"]["stages"] else {}
            rows[mode].append({"tokens": len(result["token_ids"]), "tokens_per_s": result["stats"]["tokens_per_s"],
                               "accepted_per_block": stage.get("mean_accepted_length", 0.0),
                               "masks_per_token": fills[0].mask_fills / max(1, len(result["token_ids"])) if fills else 0.0,
                               "finish": result["finish_reason"]})
    summary = {mode: {key: round(statistics.fmean(r[key] for r in runs), 3) for key in ("tokens", "tokens_per_s", "accepted_per_block",
                                                                                          "masks_per_token")}
               for mode, runs in rows.items()}
    print(json.dumps({"config": args.config, "load_average": os.getloadavg()[0], "summary": summary, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
