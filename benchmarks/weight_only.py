"""Weight-only kernels on this CPU: ms per projection for 1..16 rows (a decode step to a verified block).

Two workloads, each cycled over enough copies that no weight stays in cache (a decode step reads
every weight once):
- `mlp`: one 1536 x 8960 MLP matrix of Qwen2.5-Coder-1.5B (weight [8960, 1536]), `COPIES` copies;
- `layer`: the seven projections of one 1.5B decoder layer (q, k, v, o, gate, up, down), `LAYERS`
  layers; ms per layer.

Kernels: bf16 / float32 `F.linear`, dynamic int8 (`quantize: int8`, float32 activations), and the
`WeightOnlyLinear` paths of polyspec.workers.tiers.weight_only (int8w and int4, the quantized
kernel, the block path, and `auto`: the path `measured_dense_rows` picks). Run pinned:

    taskset -c 1 python benchmarks/weight_only.py --threads 1      # writes benchmarks/weight_only.{json,md}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from polyspec.workers.tiers import weight_only as wo
from polyspec.harness.real_report import cpu_name

HIDDEN, INTERMEDIATE, KV = 1536, 8960, 256
LAYER_SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
ROWS = (1, 4, 8, 16)
COPIES = 24  # 24 x 27.5 MB of bf16: past a 300 MB L3
LAYERS = 6
HERE = Path(__file__).resolve().parent


def dynamic_int8(weight: torch.Tensor):
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.float()
    quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)[0]
    params = quantized._packed_params._packed_params
    return lambda x: torch.ops.quantized.linear_dynamic(x, params, True)


def systems(shapes, copies: int):
    """name -> (activation dtype, [one callable per weight of every copy])."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(copies) for n, k in shapes]
    out = {"bf16 F.linear": (torch.bfloat16, [lambda x, w=w: F.linear(x, w) for w in weights])}
    int8 = [wo.WeightOnlyLinear.from_int8(wo.quantize_int8_channels(w), None) for w in weights]
    int4 = [wo.WeightOnlyLinear.from_int4(wo.quantize_int4_groups(w, wo.DEFAULT_GROUP_SIZE), None) for w in weights]
    for name, modules in (("int8w", int8), ("int4", int4)):
        out[f"{name} kernel"] = (torch.bfloat16, [m.kernel for m in modules])
        out[f"{name} block path"] = (torch.bfloat16, [m.block_path for m in modules])
        for m in modules:
            m.dense_rows = wo.measured_dense_rows(m, torch.bfloat16)
        out[f"{name} auto"] = (torch.bfloat16, list(modules))
    fp32 = [w.float() for w in weights[: len(shapes) * max(1, copies // 2)]]
    out["fp32 F.linear"] = (torch.float32, [lambda x, w=w: F.linear(x, w) for w in fp32])
    out["dynamic int8 (fp32)"] = (torch.float32, [dynamic_int8(w) for w in weights])
    return out, int8 + int4


def time_pass(functions, inputs: dict, in_features: list[int], per: int) -> float:
    """ms per `per` consecutive functions (one weight, or one layer) over one pass over all of them."""
    started = time.perf_counter()
    for function, k in zip(functions, in_features):
        function(inputs[k])
    return (time.perf_counter() - started) * 1e3 / (len(functions) / per)


def run(threads: int, repeats: int) -> dict:
    """Every kernel at every row count once per repeat, interleaved (a slow stretch of a shared machine hits
    all alike); the best of the repeats."""
    torch.set_num_threads(threads)
    results = []
    with torch.inference_mode():
        for workload, shapes, copies in (("mlp", ((INTERMEDIATE, HIDDEN),), COPIES), ("layer", LAYER_SHAPES, LAYERS)):
            table, modules = systems(shapes, copies)
            best: dict[tuple, float] = {}
            for _ in range(repeats):
                for rows in ROWS:
                    for name, (dtype, functions) in table.items():
                        in_features = [shapes[i % len(shapes)][1] for i in range(len(functions))]
                        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in set(in_features)}
                        ms = time_pass(functions, inputs, in_features, len(shapes))
                        best[(name, rows)] = min(ms, best.get((name, rows), float("inf")))
            for (name, rows), ms in sorted(best.items(), key=lambda item: (list(table).index(item[0][0]), item[0][1])):
                results.append({"workload": workload, "kernel": name, "rows": rows, "ms": round(ms, 4)})
                print(f"{workload:6s} {name:22s} rows {rows:3d}  {ms:8.3f} ms", flush=True)
            dense_rows = sorted({(m.kind, m.out_features, m.in_features, m.dense_rows) for m in modules})
            results.append({"workload": workload, "dense_rows": [list(d) for d in dense_rows]})
            del table, modules
    return {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__, "repeats": repeats, "results": results}


def markdown(report: dict) -> str:
    rows = [r for r in report["results"] if "kernel" in r]
    base = {(r["workload"], r["rows"]): r["ms"] for r in rows if r["kernel"] == "bf16 F.linear"}
    lines = [
        f"# Weight-only kernels: {report['cpu']}, {report['threads']} thread(s), torch {report['torch']}, best of {report['repeats']}",
        "",
        "ms per matrix (`mlp`: one 8960 x 1536 weight) or per decoder layer (`layer`: the 1.5B's 7 projections),",
        "weights cycled so none stays in cache; x bf16 = bf16 `F.linear`'s ms / this ms (above 1: faster).",
        "",
        "| workload | kernel | rows | ms | x bf16 |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['kernel']} | {r['rows']} | {r['ms']:.3f} | {base[(r['workload'], r['rows'])] / r['ms']:.2f} |")
    lines.append("")
    for r in report["results"]:
        if "dense_rows" in r:
            chosen = ", ".join(f"{kind} {n}x{k}: {'never' if d >= wo.NEVER else d}" for kind, n, k, d in r["dense_rows"])
            lines.append(f"- {r['workload']}: block path from (rows): {chosen}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "weight_only")
    args = parser.parse_args()
    report = run(args.threads, args.repeats)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
