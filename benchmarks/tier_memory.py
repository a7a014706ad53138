"""What one model tier keeps resident: the process's memory after `load_model_tier`, and what is in it.

Loads one tier the way a chain does (`load_model_tier`, one thread, CPU) in a fresh process and prints
one JSON line, sizes in GiB:

- `rss_*`: /proc/self/status after the imports, after loading, after `gc.collect()` (anything left in
  reference cycles), after `malloc_trim(0)` (free pages glibc kept), after a `BatchedLlama` over the
  model (the batched engine builds one per batched tier) and after one forward of 8 tokens;
  `anon` is the process's own memory, `file` mapped file pages (weights `from_pretrained` maps from
  a safetensors file in the dtype they are stored in: clean page cache, faulted in by the first
  forward and reclaimable under memory pressure);
- `peak_*`: the load's high-water mark (VmHWM) and the largest anonymous part, sampled every 20 ms;
- `tensors`: float parameters and buffers (distinct storages), int8 weights of the dynamically quantized
  Linears (int8 + float32 bias, from their shapes), oneDNN copies made by block_linear, rotary tables.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/tier_memory.py --model zoo:qwen2.5-coder-1.5b --quantize int8
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/tier_memory.py --model zoo:qwen2.5-coder-1.5b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time

import torch

GIB = 2**30


def memory() -> dict[str, float]:
    """VmRSS / VmHWM / RssAnon / RssFile of this process, GiB."""
    fields = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = round(int(value.split()[0]) * 1024 / GIB, 3)
    return out


class AnonPeak(threading.Thread):
    """The largest RssAnon seen while running (VmHWM also counts mapped file pages)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0.0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, memory()["anon"])
            time.sleep(0.02)


def tensor_bytes(model, lean) -> dict[str, float]:
    from polyspec.workers.tiers.block_linear import PACKED

    storages = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    int8 = onednn = 0
    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):  # int8 weight, float32 bias
            int8 += module.in_features * module.out_features + 4 * module.out_features
        if getattr(module, PACKED, None) is not None:
            onednn += getattr(module, PACKED).numel() * 4
    tables = (lean.cos.numel() + lean.sin.numel()) * lean.cos.element_size() if lean is not None else 0
    sizes = {"float_params_buffers": sum(storages.values()), "int8_linears": int8, "onednn_copies": onednn, "rotary_tables": tables}
    return {name: round(size / GIB, 3) for name, size in sizes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder, hub id or zoo:NAME")
    parser.add_argument("--quantize", choices=("int8",), default=None)
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (an int8 tier loads bfloat16 weights)")
    args = parser.parse_args()

    from polyspec.orchestrator.config import TierConfig
    from polyspec.workers.tiers.batched_llama import BatchedLlama
    from polyspec.workers.tiers.loading import load_model_tier, quiet_transformers, return_freed_memory
    from polyspec.workers.tiers.model_cache import resolve_zoo_reference

    quiet_transformers()
    report: dict = {"model": args.model, "quantize": args.quantize, "dtype": args.dtype, "torch": torch.__version__}
    report["rss_imports"] = memory()
    tier = TierConfig(name="tier", model=resolve_zoo_reference(args.model), dtype=args.dtype, quantize=args.quantize,
                      device="cpu", threads=1)
    sampler = AnonPeak()
    sampler.start()
    started = time.perf_counter()
    loaded = load_model_tier(tier)
    report["load_s"] = round(time.perf_counter() - started, 1)
    sampler.running = False
    sampler.join()
    report["rss_loaded"] = memory()
    report["peak"] = {"hwm": report["rss_loaded"]["hwm"], "anon": round(max(sampler.peak, report["rss_loaded"]["anon"]), 3)}
    gc.collect()
    report["rss_after_gc"] = memory()
    return_freed_memory()  # malloc_trim(0)
    report["rss_after_trim"] = memory()
    report["tensors"] = tensor_bytes(loaded.model, loaded._lean)
    batched = BatchedLlama(loaded.model) if BatchedLlama.supports(loaded.model, torch.device("cpu")) else None
    report["rss_with_batched"] = memory()
    tokens = list(range(100, 108))
    with torch.inference_mode():  # through the tier's forward (block_linear may have moved weights)
        if loaded._lean is not None:
            loaded._lean.forward(loaded._lean.new_cache(), tokens, list(range(len(tokens))), None)
        else:
            loaded.model(torch.tensor([tokens]))
    report["rss_after_forward"] = memory()
    del batched
    print(json.dumps(report))


if __name__ == "__main__":
    main()
