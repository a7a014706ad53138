"""One chain request through the Engine API, prefill + decode, with this tree's weight_only module (`new`) or another
(`old`: a file, e.g. the block path before it was rewritten). The numbers in benchmarks/weight_only.md ("GGUF prefill
and decode") came from, in turn, old / new / old / new processes:

    git show 1958cc4:workers/tiers/weight_only.py > /tmp/old_weight_only.py
    sed 's/threads: auto/threads: 2/g' configs/qwen2.5-coder-gguf.yaml > /tmp/gguf2.yaml
    python benchmarks/weight_only_prefill.py old /tmp/gguf2.yaml --old-module /tmp/old_weight_only.py
    python benchmarks/weight_only_prefill.py new /tmp/gguf2.yaml

Prints one JSON line of timings (the prompt: the first 1500 characters of orchestrator/tuning/time_model.py and a
question, 375 tokens for Qwen2.5; 48 new tokens), then one per model tier with its Linears' switch rows (-1: never).
"""
import argparse, importlib.util, json, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("old", "new"))
parser.add_argument("config")
parser.add_argument("--runs", type=int, default=1)
parser.add_argument("--old-module", default="/tmp/old_weight_only.py")
args = parser.parse_args()
mode = args.mode
if mode == "old":
    spec = importlib.util.spec_from_file_location("polyspec.workers.tiers.weight_only", args.old_module)
    module = importlib.util.module_from_spec(spec)
    sys.modules["polyspec.workers.tiers.weight_only"] = module
    spec.loader.exec_module(module)
    module.switch_rows = lambda model: ()  # the old tree had no pricing of the switch (lengths are fixed here anyway)
import torch
from polyspec.orchestrator.config import load_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.tiers import weight_only as wo
config = load_config(args.config)
started = time.perf_counter()
engine = Engine(config)
load_s = time.perf_counter() - started
from pathlib import Path
prompt = open(Path(__file__).resolve().parent.parent / "orchestrator/tuning/time_model.py").read()[:1500] + "\n# Summarize the module above in one sentence:\n"
out = {"mode": mode, "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
       "prompt_tokens": len(engine.encode(prompt))}
for i in range(args.runs):
    result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": 48}))
    st = result["stats"]
    out[f"run{i}"] = {"prefill_s": st["prefill_s"], "decode_s": st["decode_s"], "tokens": len(result["token_ids"]),
                      "decode_tok_s": round((len(result["token_ids"]) - 1) / st["decode_s"], 2) if st["decode_s"] else None}
out["token_ids_head"] = result["token_ids"][:16]
print(json.dumps(out), flush=True)
try:
    for tier in engine.scheduler.tiers[:2]:
        model = tier.model if isinstance(tier.model, torch.nn.Module) else tier.tier.model
        print(json.dumps({"mode": mode, "tier": tier.name, "dense_rows": sorted({(m.kind, m.out_features, m.in_features, m.dense_rows if m.dense_rows < wo.NEVER else -1)
                                for m in model.modules() if isinstance(m, wo.WeightOnlyLinear)})}), flush=True)
except Exception as error:
    print(json.dumps({"error": repr(error)}), flush=True)
