"""The device round's costs on a GPU, for the judged ratios against `reference.py`'s graph step.

Builds Qwen2.5-Coder model shapes (`shapes/`) with random weights (a forward's cost does not
depend on the weights' values), bf16, and drives polyspec's one round (`ChainScheduler`) over device
tiers (`BatchedModelTier(steps=True)`) the way the engine does (start, prefill, step_all), timing with the device
synchronised:

- target alone, 1 request, `--new` tokens after a `--prompt`-token prompt: ms per token;
- one speculative round of an 8-token block (the target's step: forward of 9 tokens, warp,
  verification), and the drafter's one-token step: ms each, graph-replayed;
- 16 and 64 requests, speculation off: tokens/s over the steps after every prompt is cached;
- the 0.5B's one-token step over the 1.5B's (the tier cost ratio the planner prices), and an fp8 copy
  of the 1.5B's (`quantize: fp8`, the paper's middle tier on a GPU) where the device runs fp8;
- greedy output of the target alone against transformers' own greedy `generate` (same weights).

    python benchmarks/gpu/device_round.py --out-dir $OUT              # on the GPU
    python benchmarks/gpu/device_round.py --device cpu --layers 2 --new 8 --batches 1,4   # a CPU smoke run

Writes device-round.json and device-round.md into --out-dir.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent


def build(shape: str, layers: int | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(HERE / "shapes" / f"{shape}.json")
    if layers:
        config.num_hidden_layers = layers
        config.layer_types = config.layer_types[:layers]
    config.max_position_embeddings = 1024  # the pool holds what the benchmark needs, not 32k positions
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def scheduler_for(models: list, names: list[str], lengths: list[int], slots: int):
    from polyspec.orchestrator.decode.scheduler import ChainScheduler
    from polyspec.workers.tiers.batched import BatchedModelTier
    from polyspec.workers.tiers.tier import ModelTier

    tiers = [BatchedModelTier(ModelTier(name, model, model.config.vocab_size, model.device), slots, steps=True, context=512)
             for name, model in zip(names, models)]
    return ChainScheduler(tiers, lengths)


def decode_rate(scheduler, prompts: list[list[int]], new: int, device) -> dict:
    """Prefill every prompt, then time the steps until every request has `new` tokens."""
    from polyspec.workers.core.sampling import SamplingParams

    states = [scheduler.start(p, new, SamplingParams()) for p in prompts]
    scheduler.prefill(states)
    scheduler.step_all(states)  # the first step captures the graphs of its buckets
    done_before = sum(len(s.new_tokens) for s in states)
    started = sync(device)
    steps = 0
    while not all(s.done for s in states):
        scheduler.step_all([s for s in states if not s.done])
        steps += 1
    seconds = sync(device) - started
    tokens = sum(len(s.new_tokens) for s in states) - done_before
    outputs = [scheduler.finish(s).token_ids for s in states]
    return {"requests": len(prompts), "steps": steps, "tokens": tokens, "seconds": round(seconds, 4),
            "ms_per_step": round(1000 * seconds / max(steps, 1), 3), "tokens_per_s": round(tokens / seconds, 1), "outputs": outputs}


def step_ms(run_step, device, repeats: int) -> float:
    run_step()
    run_step()
    times = []
    for _ in range(repeats):
        started = sync(device)
        run_step()
        times.append(sync(device) - started)
    return round(1000 * statistics.median(times), 3)


def tier_step_costs(target_scheduler, drafter_scheduler, vocab: int, device, repeats: int) -> dict:
    """Graph-replayed costs of the target's step over a 9-token row (8 drafts) and of each model's one-token step
    (`BatchedLlama.step`: the forward a round replays; its warp and verdict run after it)."""

    def run(scheduler, block: int):
        tier = scheduler.tiers[0]
        tier.cache.allocate()
        ids = torch.randint(0, vocab, (1, block + 1), device=device)
        positions = (200 + torch.arange(block + 1, device=device))[None]
        slots = torch.zeros(1, dtype=torch.long, device=device)

        def step(ids, positions, slots):
            return tier.model.step(tier.cache, ids, positions, positions, slots, 256)

        return lambda: tier.graphs.run(("bench", block), step, [ids, positions, slots])

    with torch.inference_mode():
        return {
            "target_round_block8_ms": step_ms(run(target_scheduler, 8), device, repeats),
            "target_step_1_token_ms": step_ms(run(target_scheduler, 0), device, repeats),
            "target_draft_step_ms": step_ms(run(target_scheduler, 0), device, repeats),
            "drafter_draft_step_ms": step_ms(run(drafter_scheduler, 0), device, repeats),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a CPU smoke run)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out-dir", default=str(HERE))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = build("qwen2.5-coder-1.5b", args.layers, device, dtype)
    drafter = build("qwen2.5-coder-0.5b", args.layers, device, dtype)
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    batches = [int(b) for b in args.batches.split(",")]
    slots = max(batches + [1])
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
              "torch": torch.__version__, "dtype": args.dtype, "layers": args.layers or "all", "prompt": args.prompt, "new": args.new}

    alone = scheduler_for([target], ["target"], [], slots)
    prompt = torch.randint(0, vocab, (args.prompt,), generator=generator).tolist()
    one = decode_rate(alone, [prompt], args.new, device)
    result["one_request"] = {k: v for k, v in one.items() if k != "outputs"}
    result["one_request"]["ms_per_token"] = round(1000 * one["seconds"] / max(one["tokens"], 1), 3)
    with torch.inference_mode():
        reference = target.generate(torch.tensor([prompt], device=device), max_new_tokens=args.new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    result["greedy_equal_to_generate"] = one["outputs"][0] == reference
    result["greedy_agreeing_prefix"] = next((i for i, (a, b) in enumerate(zip(one["outputs"][0], reference)) if a != b), len(reference))
    for batch in batches:
        prompts = [torch.randint(0, vocab, (args.prompt,), generator=generator).tolist() for _ in range(batch)]
        rate = decode_rate(alone, prompts, args.new, device)
        result[f"target_alone_{batch}"] = {k: v for k, v in rate.items() if k != "outputs"}
    drafter_alone = scheduler_for([drafter], ["drafter"], [], 1)
    result["steps"] = tier_step_costs(alone, drafter_alone, vocab, device, args.repeats)
    result["steps"]["drafter_over_target_one_token"] = round(result["steps"]["drafter_draft_step_ms"] / result["steps"]["target_draft_step_ms"], 3)
    from polyspec.workers.tiers.fp8_linear import fp8_problem, quantize_fp8

    why = fp8_problem(device)
    if why is None:  # the paper's middle tier on a GPU: an fp8 copy of the target (workers/tiers/fp8_linear.py)
        fp8_model = quantize_fp8(build("qwen2.5-coder-1.5b", args.layers, device, dtype))
        fp8_steps = tier_step_costs(scheduler_for([fp8_model], ["fp8"], [], 1), drafter_alone, vocab, device, args.repeats)
        result["steps"]["fp8_round_block8_ms"] = fp8_steps["target_round_block8_ms"]
        result["steps"]["fp8_draft_step_ms"] = fp8_steps["target_draft_step_ms"]
        result["steps"]["fp8_over_target_one_token"] = round(fp8_steps["target_draft_step_ms"] / result["steps"]["target_draft_step_ms"], 3)
        del fp8_model
    else:
        result["fp8"] = why

    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device-round.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Device round on {result['device']} ({args.dtype}, torch {torch.__version__})", "",
             "| measure | value |", "|---|---:|",
             f"| target alone, 1 request: ms per token | {result['one_request']['ms_per_token']} |"]
    for batch in batches:
        lines.append(f"| target alone, {batch} requests: tokens/s | {result[f'target_alone_{batch}']['tokens_per_s']} |")
    for key, value in result["steps"].items():
        lines.append(f"| {key} | {value} |")
    lines.append(f"| greedy equal to transformers' generate | {result['greedy_equal_to_generate']} "
                 f"(first {result['greedy_agreeing_prefix']} tokens agree) |")
    (out / "device-round.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
