"""`quantize: gguf` on the zoo's GGUF files: rounding, accuracy, load and decode speed against the file's bf16 load.

Per model (each in its own processes, one model in memory at a time):

- weights: per GGUF type of the projections (and LM head), the kernel it lands on, the share of weights whose
  value in the kernel's format differs from the file's float32 value (int4: only the bfloat16 scale / zero
  moves them, the levels are the file's; int8: re-quantized per channel) and the relative RMS difference;
- accuracy, 2 code prompts x 32 greedy tokens: the tier's own greedy tokens against the file dequantized in
  float32 (transformers' loader), leading tokens equal and the largest logit difference teacher-forced on the
  tier's tokens; the same for the file's bf16 load (what `-m FILE.gguf` loads today) for scale;
- speed: `polyspec generate -m FILE.gguf --quantize gguf` against `polyspec generate -m FILE.gguf` (bf16 load),
  interleaved, `ROUNDS` each, greedy, `NEW_TOKENS` tokens, 1 thread (taskset -c 1 and --threads 1): decode tokens/s,
  load seconds and resident MB from the CLI's own load line.

    taskset -c 1 python benchmarks/gguf_weights.py         # writes benchmarks/gguf_weights.json and a section of weight_only.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF_DIR = Path.home() / ".cache/polyspec/models/gguf"
MODELS = {
    "smollm2-135m-q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-q4_k_m": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b-q4_k_m": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}
PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef list_python_files(folder):\n",
)
TOKENS = 32
NEW_TOKENS = 64
ROUNDS = 2
SECTION = "## GGUF files on the kernels (`quantize: gguf`)"


# ------------------------------------------------------------------------------ weights


def weight_stats(path: str) -> dict:
    """Per GGUF type of the Linears: kernel, tensors, weights, share moved, relative RMS difference against the file."""
    import numpy as np
    import torch

    from polyspec.workers.tiers import gguf_file, gguf_header
    from polyspec.workers.tiers.weight_only import quantize_int8_channels

    _, tensors = gguf_header.read_file(path, set())
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    names = [n for n in tensors if n.startswith("blk.") and n.endswith(".weight") and len(tensors[n].shape) == 2] + [head]
    stats: dict[str, dict] = {}
    for name in names:
        tensor = tensors[name]
        shape = tensor.matrix_shape
        int4 = gguf_file.maps_to_int4(tensor.qtype, shape)
        row = stats.setdefault(tensor.qtype, {"kernel": "int4" if int4 else "int8w", "tensors": 0, "weights": 0, "moved": 0, "sq_diff": 0.0, "sq": 0.0})
        row["tensors"] += 1
        for start in range(0, shape[0], gguf_file.ROWS_PER_CHUNK):
            stop = min(shape[0], start + gguf_file.ROWS_PER_CHUNK)
            exact = gguf_file.float_rows(tensor.qtype, tensor.data, shape, start, stop).astype(np.float64)
            if int4:
                levels = gguf_file.unpack(tensor.qtype, np.asarray(tensor.data).reshape(shape[0], -1)[start:stop], (stop - start, shape[1]))
                w = gguf_file.int4_weights(levels)
                q = w.q.double().reshape(stop - start, -1, w.group_size) - 8
                kernel = (q * w.scale.double()[..., None] + w.zero.double()[..., None]).reshape(stop - start, -1).numpy()
            else:
                w = quantize_int8_channels(torch.from_numpy(exact.astype(np.float32)))
                kernel = (w.q.double() * w.scale.to(torch.bfloat16).double()[:, None]).numpy()  # the kernel gets bf16 scales
            row["weights"] += exact.size
            row["moved"] += int((kernel != exact).sum())
            row["sq_diff"] += float(((kernel - exact) ** 2).sum())
            row["sq"] += float((exact**2).sum())
    return {
        qtype: {"kernel": r["kernel"], "tensors": r["tensors"], "weights": r["weights"], "share_moved": round(r["moved"] / r["weights"], 4),
                "relative_rms": float(f"{(r['sq_diff'] / r['sq']) ** 0.5:.3g}")}
        for qtype, r in sorted(stats.items())
    }


# ------------------------------------------------------------------------------ accuracy


def accuracy(path: str) -> dict:
    """Greedy tokens and logits of the tier (quantize: gguf), the float32 and the bf16 load of the file, one model at a time."""
    import torch

    from polyspec.workers.tiers import loading
    from polyspec.workers.tiers.gguf_model import load_gguf_weight_only

    torch.set_num_threads(1)
    tokenizer = loading.load_gguf_tokenizer(path)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]

    def greedy_and_logits(model, sequences=None):
        from transformers import DynamicCache

        out = []
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                cache, tokens = DynamicCache(), []
                logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
                while len(tokens) < TOKENS:
                    tokens.append(int(logits.argmax()))
                    logits = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
                forced = (sequences[i] if sequences else tokens)
                full = model(torch.tensor([prompt + forced])).logits[0, len(prompt) - 1 : -1].float()
                out.append((tokens, full))
        return out

    ours = load_gguf_weight_only(path, torch.bfloat16)
    linears = dict(ours.gguf_report["linears"])
    mine = greedy_and_logits(ours)
    del ours
    gc.collect()
    sequences = [tokens for tokens, _ in mine]
    result = {"linears": linears}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        other = greedy_and_logits(loading.load_gguf_model(path, dtype), sequences)
        gc.collect()
        if name == "float32":
            reference = other
            result["gguf_vs_float32"] = [
                {"equal_leading_tokens": _leading(a[0], b[0]), "max_logit_diff": round(float((a[1] - b[1]).abs().max()), 3),
                 "top1_agreement": round(float((a[1].argmax(-1) == b[1].argmax(-1)).float().mean()), 3)}
                for a, b in zip(mine, reference)
            ]
        else:
            result["bf16_load_vs_float32"] = [
                {"equal_leading_tokens": _leading(a[0], b[0]), "max_logit_diff": round(float((a[1] - b[1]).abs().max()), 3),
                 "top1_agreement": round(float((a[1].argmax(-1) == b[1].argmax(-1)).float().mean()), 3)}
                for a, b in zip(other, reference)
            ]
    return result


def _leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------ speed


def generate(path: str, quantize: bool) -> dict:
    command = ["taskset", "-c", "1", sys.executable, "-m", "polyspec", "generate", "-m", path, "--dtype", "bfloat16", "--threads", "1",
               "-p", PROMPTS[0], "-n", str(NEW_TOKENS), "--temperature", "0", "--json"]
    if quantize:
        command[command.index("--dtype"):command.index("--dtype")] = ["--quantize", "gguf"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout)
    loaded = re.search(r"loaded in ([\d.]+)s on \S+, ([+-]\d+) MB resident", done.stderr)
    stats = result["stats"]
    return {"decode_tok_s": round(stats["new_tokens"] / stats["decode_s"], 2), "new_tokens": stats["new_tokens"],
            "load_s": float(loaded.group(1)) if loaded else None, "resident_mb": int(loaded.group(2)) if loaded else None,
            "token_ids": result["token_ids"]}


def speed(path: str) -> dict:
    runs = {"gguf": [], "bf16": []}
    for _ in range(ROUNDS):  # interleaved: a drift of the shared machine hits both
        for name in ("gguf", "bf16"):
            runs[name].append(generate(path, name == "gguf"))
    out = {}
    for name, rows in runs.items():
        out[name] = {"decode_tok_s": [r["decode_tok_s"] for r in rows], "load_s": [r["load_s"] for r in rows],
                     "resident_mb": [r["resident_mb"] for r in rows]}
    out["same_tokens"] = runs["gguf"][0]["token_ids"] == runs["bf16"][0]["token_ids"]
    out["equal_leading_tokens"] = _leading(runs["gguf"][0]["token_ids"], runs["bf16"][0]["token_ids"])
    return out


# ------------------------------------------------------------------------------ report


def markdown(report: dict) -> str:
    lines = [SECTION, "", f"{report['cpu']}, 1 thread (taskset -c 1, --threads 1), torch {report['torch']}, {report['date']}. "
             "`python benchmarks/gguf_weights.py` (benchmarks/gguf_weights.json).", "",
             "Weights of the projections and LM head, per GGUF type: the kernel, and how far the kernel's format moves them from "
             "the file's float32 values (int4: the file's levels, scale and zero rounded to bfloat16; int8: re-quantized per channel, "
             "bf16 scale).", "",
             "| model | type | kernel | tensors | weights (M) | share moved | relative RMS |", "|---|---|---|---:|---:|---:|---:|"]
    for model, row in report["models"].items():
        for qtype, s in row["weights"].items():
            lines.append(f"| {model} | {qtype} | {s['kernel']} | {s['tensors']} | {s['weights'] / 1e6:.1f} | {s['share_moved']:.3f} | {s['relative_rms']:.2g} |")
    lines += ["", f"Accuracy against the file dequantized in float32 (transformers), {len(PROMPTS)} code prompts x {TOKENS} greedy tokens: "
              "leading tokens equal, largest logit difference and top-1 agreement teacher-forced on the `quantize: gguf` tier's tokens; "
              "the file's bf16 load (today's `-m FILE.gguf`) for scale.", "",
              "| model | Linears | gguf: equal tokens | gguf: max logit diff | gguf: top-1 | bf16 load: equal tokens | bf16 load: max logit diff |",
              "|---|---|---|---|---|---|---|"]
    for model, row in report["models"].items():
        a = row["accuracy"]
        g, b = a["gguf_vs_float32"], a["bf16_load_vs_float32"]
        linears = " + ".join(f"{n} {k}" for k, n in a["linears"].items())
        lines.append(f"| {model} | {linears} | {_tokens(g)} | "
                     f"{', '.join(str(x['max_logit_diff']) for x in g)} | {', '.join(str(x['top1_agreement']) for x in g)} | "
                     f"{_tokens(b)} | {', '.join(str(x['max_logit_diff']) for x in b)} |")
    lines += ["", f"`polyspec generate -m FILE.gguf --quantize gguf` against `polyspec generate -m FILE.gguf` (the bf16 load), greedy, "
              f"{NEW_TOKENS} tokens, one prompt, {ROUNDS} interleaved runs each: decode tokens/s, load s and resident MB from the load line.", "",
              "| model | gguf tok/s | bf16 tok/s | x | gguf load s | bf16 load s | gguf MB | bf16 MB | same tokens |", "|---|---|---|---:|---|---|---|---|---|"]
    for model, row in report["models"].items():
        s = row["speed"]
        g, b = s["gguf"], s["bf16"]
        ratio = max(g["decode_tok_s"]) / max(b["decode_tok_s"])
        same = "yes" if s["same_tokens"] else f"first {s['equal_leading_tokens']}"
        lines.append(f"| {model} | {', '.join(map(str, g['decode_tok_s']))} | {', '.join(map(str, b['decode_tok_s']))} | {ratio:.2f} | "
                     f"{', '.join(map(str, g['load_s']))} | {', '.join(map(str, b['load_s']))} | {', '.join(map(str, g['resident_mb']))} | "
                     f"{', '.join(map(str, b['resident_mb']))} | {same} |")
    lines += ["", "Notes: an int4 row's levels are the file's; \"moved\" there counts weights whose group's scale or zero is not a "
              "bfloat16 number (most are: the file's d * sc has up to 17 significant bits, bfloat16 8); scale and zero each move by at most 2^-9 of themselves. "
              "int8 rows are re-quantized from float32: a weight keeps its value only where its block's scale is the row's. "
              "Greedy runs that part from the float32 file's are not a bug by themselves: the file's own bf16 load parts too "
              "(reference top-two margins go down to ~0.02 on these prompts). The 2 cores are shared with other work: "
              "tokens/s of one run can move by 1.5x; both systems take turns so a drift hits both."]
    return "\n".join(lines) + "\n"


def _tokens(rows: list[dict]) -> str:
    return ", ".join(f"{row['equal_leading_tokens']}/{TOKENS}" for row in rows)


def write_section(text: str) -> None:
    path = HERE / "weight_only.md"
    current = path.read_text(encoding="utf-8")
    if SECTION in current:
        current = current[: current.index(SECTION)].rstrip("\n") + "\n"
    path.write_text(current + "\n" + text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--part", choices=("weights", "accuracy"), help=argparse.SUPPRESS)  # one model's part, in a child process
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(json.dumps(weight_stats(args.path) if args.part == "weights" else accuracy(args.path)))
        return
    import torch

    from polyspec.harness.real_report import cpu_name

    out_path = HERE / "gguf_weights.json"
    report = json.loads(out_path.read_text()) if out_path.exists() else {"models": {}}
    report.update({"cpu": cpu_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")})
    for model in args.models.split(","):
        path = str(GGUF_DIR / MODELS[model])
        row = {}
        for part in ("weights", "accuracy"):
            started = time.perf_counter()
            done = subprocess.run(["taskset", "-c", "1", sys.executable, __file__, "--part", part, "--path", path],
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise SystemExit(f"{model} {part}: {done.stderr.strip()[-2000:]}")
            row[part] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{model}: {part} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        started = time.perf_counter()
        row["speed"] = speed(path)
        print(f"{model}: speed in {time.perf_counter() - started:.0f}s: {row['speed']}", file=sys.stderr)
        report["models"][model] = row
        out_path.write_text(json.dumps(report, indent=2) + "\n")
    report["models"] = {m: report["models"][m] for m in MODELS if m in report["models"]}
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    write_section(markdown(report))


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
