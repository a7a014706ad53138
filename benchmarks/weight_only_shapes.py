"""Weight-only paths per matrix shape of Qwen2.5-Coder-1.5B, 1 to 512 rows (a decode step, verified blocks, a prefill).

For each projection shape of a 1.5B decoder layer (q/o 1536 x 1536, k/v 256 x 1536, gate/up 8960 x 1536,
down 1536 x 8960; weight [out, in]) and each row count: bf16 `F.linear`, and per format (int4 group 128,
int4 group 32, int8w) the quantized kernel (`WeightOnlyLinear.kernel`) and the block path
(`block_path`: widen once, one GEMM per slice); for int4 group 128 also the block path as it was before
the widening was rewritten (`old block path`, kept here only to measure the change). Every system at
every row count once per repeat, interleaved, so a slow stretch of a shared machine hits all alike;
each call cycles over `COPIES` copies of the weights so that none stays in cache; the best repeat.
Also `measured_dense_rows` per shape and format: the row count chosen at load, and how long choosing took.

    python benchmarks/weight_only_shapes.py --threads 2     # writes benchmarks/weight_only_shapes.2t.json and
                                                           # the 2-thread section of benchmarks/weight_only.md
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from polyspec.harness.real_report import cpu_name
from polyspec.workers.tiers import weight_only as wo

SHAPES = {"q/o 1536x1536": (1536, 1536), "k/v 256x1536": (256, 1536), "gate/up 8960x1536": (8960, 1536), "down 1536x8960": (1536, 8960)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
COPIES = 4
HERE = Path(__file__).resolve().parent
def markers(threads: int) -> tuple[str, str]:
    return f"<!-- weight_only_shapes {threads} threads: begin -->", f"<!-- weight_only_shapes {threads} threads: end -->"


def old_block_path(module: wo.WeightOnlyLinear, x: torch.Tensor, state: dict) -> torch.Tensor:
    """The int4 block path before this change (commit 1958cc4): nibbles stacked, widened in bf16 arithmetic per
    packed block, a batched matmul per slice and a gather of the columns into row order."""
    if "block" not in state:
        block, order = wo.cpu_int4_layout(module.out_features)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(block)
        scale, zero = module.scales_and_zeros[..., 0].T, module.scales_and_zeros[..., 1].T  # [N, G]
        by_block = scale.reshape(-1, block, scale.shape[1])[:, order].permute(0, 2, 1).unsqueeze(2).contiguous()
        zeros = zero.reshape(-1, block, zero.shape[1])[:, order].permute(0, 2, 1).unsqueeze(2).contiguous()
        state["block"] = (block, inverse, by_block, zeros)
    block, inverse, block_scale, block_zero = state["block"]
    packed = module.weight.view(-1, module.in_features, block // 2)
    blocks_per_slice = max(1, wo.SLICE_BYTES // (2 * module.in_features * block))
    groups = module.in_features // module.group_size
    outs = []
    for start in range(0, packed.shape[0], blocks_per_slice):
        part = packed[start : start + blocks_per_slice]
        nibbles = torch.stack((part & 15, part >> 4), dim=-1).view(part.shape[0], groups, module.group_size, block)
        widened = (nibbles.to(x.dtype) - wo.INT4_MID) * block_scale[start : start + blocks_per_slice].to(x.dtype)
        widened = widened + block_zero[start : start + blocks_per_slice].to(x.dtype)
        outs.append(torch.matmul(x, widened.view(part.shape[0], module.in_features, block)))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out[:, :, inverse].permute(1, 0, 2).reshape(x.shape[0], module.out_features)


def systems(out_features: int, in_features: int) -> tuple[dict, list]:
    torch.manual_seed(0)
    weights = [torch.randn(out_features, in_features) * 0.02 for _ in range(COPIES)]
    table = {"bf16 F.linear": [lambda x, w=w.bfloat16(): F.linear(x, w) for w in weights]}
    formats = []
    for name, make in (
        ("int4 g128", lambda w: wo.WeightOnlyLinear.from_int4(wo.quantize_int4_groups(w, 128), None)),
        ("int4 g32", lambda w: wo.WeightOnlyLinear.from_int4(wo.quantize_int4_groups(w, 32), None)),
        ("int8w", lambda w: wo.WeightOnlyLinear.from_int8(wo.quantize_int8_channels(w), None)),
    ):
        modules = [make(w) for w in weights]
        formats.append((name, modules[0]))
        table[f"{name} kernel"] = [m.kernel for m in modules]
        table[f"{name} block path"] = [m.block_path for m in modules]
        if name == "int4 g128" and modules[0]._block is not None:
            table[f"{name} old block path"] = [lambda x, m=m, state={}: old_block_path(m, x, state) for m in modules]
    del weights
    return table, formats


def run(threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    results, choices = [], []
    with torch.inference_mode():
        for shape, (out_features, in_features) in SHAPES.items():
            table, formats = systems(out_features, in_features)
            for name, module in formats:
                wo._dense_rows.clear()
                started = time.perf_counter()
                chosen = wo.measured_dense_rows(module, torch.bfloat16)
                choices.append({"shape": shape, "format": name, "dense_rows": None if chosen >= wo.NEVER else chosen,
                                "seconds": round(time.perf_counter() - started, 3)})
                print(choices[-1], flush=True)
            best: dict[tuple, float] = {}
            for _ in range(repeats):
                for rows in ROWS:
                    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
                    for name, functions in table.items():
                        functions[0](x)  # warm (allocations)
                        started = time.perf_counter()
                        for function in functions:
                            function(x)
                        ms = (time.perf_counter() - started) * 1e3 / len(functions)
                        best[(name, rows)] = min(ms, best.get((name, rows), float("inf")))
            for (name, rows), ms in sorted(best.items(), key=lambda item: (list(table).index(item[0][0]), item[0][1])):
                results.append({"shape": shape, "system": name, "rows": rows, "ms": round(ms, 4)})
            print(shape, {k: round(v, 2) for k, v in best.items() if k[1] in (1, 16, 64, 512)}, flush=True)
            del table, formats
    return {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__, "repeats": repeats, "copies": COPIES,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "results": results, "dense_rows": choices}


def markdown(report: dict, note: str) -> str:
    ms = {(r["shape"], r["system"], r["rows"]): r["ms"] for r in report["results"]}
    systems_seen = list(dict.fromkeys(r["system"] for r in report["results"]))
    begin, end = markers(report["threads"])
    lines = [
        begin,
        f"## Per shape of the 1.5B, 1-512 rows: kernel, block path, bf16 ({report['cpu']}, {report['threads']} threads)",
        "",
        f"torch {report['torch']}, {report['date']}, `python benchmarks/weight_only_shapes.py --threads {report['threads']}` "
        f"(benchmarks/weight_only_shapes.{report['threads']}t.json): ms per matrix, best of {report['repeats']} interleaved repeats, each call cycling "
        f"{report['copies']} copies of the weights. {note}",
        "",
        "`old block path`: the int4 block path before this change (nibbles stacked, widened in bf16 arithmetic per packed block, "
        "a batched matmul per block slice, a gather of the columns). The block path now: the packed half-blocks transposed "
        "to K-major as 16-byte elements, the nibbles split on contiguous bytes, `(q - 8) * scale + zero` in one `addcmul` "
        "(float32 inside, one rounding: `dequantize_int4` bit for bit), one GEMM per ~8 MiB slice.",
        "",
    ]
    for shape in SHAPES:
        lines += [f"### {shape} (ms; in brackets: x bf16 `F.linear`, above 1 faster)", "",
                  "| system | " + " | ".join(str(r) for r in ROWS) + " |", "|---|" + "---:|" * len(ROWS)]
        for system in systems_seen:
            if (shape, system, ROWS[0]) not in ms:
                continue
            cells = []
            for rows in ROWS:
                value, base = ms[(shape, system, rows)], ms[(shape, "bf16 F.linear", rows)]
                cells.append(f"{value:.2f}" if system == "bf16 F.linear" else f"{value:.2f} ({base / value:.2f})")
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["`measured_dense_rows` at load (the first probed row count where the block path was faster; `never`: not up to 512), "
              "and the seconds choosing took:", "", "| shape | format | block path from | s |", "|---|---|---:|---:|"]
    for c in report["dense_rows"]:
        lines.append(f"| {c['shape']} | {c['format']} | {c['dense_rows'] or 'never'} | {c['seconds']:.2f} |")
    lines += ["", end]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, help="default: benchmarks/weight_only_shapes.<threads>t.json")
    parser.add_argument("--markdown", type=Path, default=HERE / "weight_only.md")
    args = parser.parse_args()
    report = run(args.threads, args.repeats)
    (args.out or HERE / f"weight_only_shapes.{args.threads}t.json").write_text(json.dumps(report, indent=1) + "\n")
    section = markdown(report, args.note)
    text = args.markdown.read_text() if args.markdown.exists() else ""
    begin, end = markers(args.threads)
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end) + "\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    args.markdown.write_text(text)
    print(section)


if __name__ == "__main__":
    main()
