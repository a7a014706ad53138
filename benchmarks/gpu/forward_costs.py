"""Forward costs of the real chain's model shapes on a GPU, and what they predict.

The real models' weights cannot reach a lent GPU machine (it has no network, and what travels
with the repository is capped far below a 1 GB checkpoint), but their *cost* does not depend
on the weights: a forward of a model with the same configuration and random weights costs
what the real one costs. This script builds Qwen2.5-Coder 1.5B and 0.5B from their
configurations (`shapes/`), in bf16 on the GPU, and measures one forward of `batch x block`
new tokens on top of a `context`-token KV cache, the quantity the time model is built from
(t_i(batch, tokens)). From those costs it gives the two-tier chain's predicted speedup over
the target alone for a range of per-token acceptance rates, with the standard expected
accepted length (1 - a^(k+1)) / (1 - a) for a block of k drafted tokens, and the cost of a
round k * t_draft(1) + t_target(k + 1).

    python benchmarks/gpu/forward_costs.py --out forward-costs.json

Prints a markdown table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent


def timed_forward(model, cache_len: int, batch: int, block: int, repeats: int, device) -> float:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, cache_len), device=device)
    cache = DynamicCache()
    with torch.inference_mode():
        model(prompt, past_key_values=cache, use_cache=True)
        new = torch.randint(0, vocab, (batch, block), device=device)
        positions = torch.arange(cache_len, cache_len + block, device=device).expand(batch, -1)
        times = []
        for i in range(repeats + 3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(new, past_key_values=cache, position_ids=positions, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:  # the first forwards pick kernels
                times.append(time.perf_counter() - start)
            cache.crop(-block)  # negative: drop this many tokens (transformers 5)
    return 1000 * statistics.median(times)


def predicted_speedup(t_target: dict[int, float], t_draft_1: float, accept: float, max_block: int) -> tuple[float, int]:
    best = (1.0, 0)
    for k in range(1, max_block + 1):
        if k + 1 not in t_target:
            continue
        tokens = (1 - accept ** (k + 1)) / (1 - accept)
        cost = k * t_draft_1 + t_target[k + 1]
        speedup = tokens * t_target[1] / cost
        if speedup > best[0]:
            best = (speedup, k)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="forward-costs.json")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": "bfloat16",
              "context": args.context, "torch": torch.__version__, "ms": {}}
    for shape in args.shapes:
        config = AutoConfig.from_pretrained(HERE / "shapes" / f"{shape}.json")
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        costs = {}
        for batch in args.batches:
            for block in args.blocks:
                if batch > 1 and block not in (1, 4, 8, 16):
                    continue
                costs[f"{batch}x{block}"] = round(timed_forward(model, args.context, batch, block, args.repeats, device), 3)
        report["ms"][shape] = costs
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    predict(report, args.shapes)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    print(f"# Forward costs, {report['device']}, bf16, {args.context}-token context (ms)\n")
    for shape, costs in report["ms"].items():
        print(f"## {shape}\n\n| batch x tokens | ms |\n|---|---:|")
        for key, ms in costs.items():
            print(f"| {key} | {ms} |")
        print()
    if "predicted_two_tier" in report:
        print(f"## Predicted speedup over the target alone (time model, acceptance per token)\n\n"
              f"| acceptance | target <- {args.shapes[1]} | block | target <- n-gram (free drafts) | block |\n|---|---:|---:|---:|---:|")
        for accept, row in report["predicted_two_tier"].items():
            free = report["predicted_free_drafter"][accept]
            print(f"| {accept} | {row['speedup']:.2f} | {row['block']} | {free['speedup']:.2f} | {free['block']} |")
    return 0


def predict(report: dict, shapes: list[str]) -> None:
    """The two-tier predictions from the measured costs: the second shape as the drafter, and a
    drafter whose drafts cost nothing (prompt lookup), each at its best block (0: do not speculate)."""
    if len(shapes) < 2:
        return
    target, draft = shapes[0], shapes[1]
    t_target = {int(key.split("x")[1]): ms for key, ms in report["ms"][target].items() if key.startswith("1x")}
    accepts = (0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
    report["predicted_two_tier"] = {
        f"{a:.2f}": dict(zip(("speedup", "block"), predicted_speedup(t_target, report["ms"][draft]["1x1"], a, 16))) for a in accepts}
    report["predicted_free_drafter"] = {
        f"{a:.2f}": dict(zip(("speedup", "block"), predicted_speedup(t_target, 0.0, a, 16))) for a in accepts}


if __name__ == "__main__":
    raise SystemExit(main())
