"""`polyspec train-draft`: train a drafter that shares the target's features or layers.

    polyspec train-draft --target models/stdlib/target --kind feature --out models/stdlib/drafters/feature
    polyspec train-draft --target models/stdlib/target --kind early-exit --layers 1,2,3 --out models/stdlib/drafters/early-exit

- `--kind feature`: a one-layer head over the target's last hidden states and the next
  token's embedding (EAGLE style), with FSPAD's feature sampling (`--no-sampling` to drop
  it) and partial alignment (`--loss fspad`, the default: the logits read the layer
  through their own norm and correction, so feature regression and logit confidence are
  decoupled) or the plain EAGLE loss (`--loss eagle`: one output vector is both the
  regressed feature and the LM head's input). Loss = SmoothL1(feature) + w * CE(logits vs
  the target's distribution), over two unrolled steps (the second step reads the first
  step's predicted features, as drafting does past the first token), with Gaussian noise
  on the input features.
- `--kind early-exit`: Kangaroo's adapter (one decoder layer and a norm, initialised from
  the target's next layer) over the target's first L layers, distilled on the target's
  distribution. Several `--layers` values make a sweep: each gets an equal share of the
  budget and the one whose chain [target, early-exit] decodes the held-out prompts
  fastest (tokens/s, interleaved with the target alone) is kept.

Data: the demo family's corpus (the standard library's `.py` files, the target's held-out
files excluded, polyspec.harness.zoo), tokenized with the target's tokenizer and cached
under `--work`. Training is resumable: a checkpoint is written every minute and at the
end of the `--minutes` budget; running the same command again continues it. The result
directory holds the drafter (`drafter.json`, `model.safetensors`) with its training
record and the held-out acceptance report (polyspec.harness.draft_report).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CHECKPOINT_EVERY_S = 60.0


def corpus_streams(tokenizer, work: Path, max_train_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams of the stdlib corpus in the target's tokenizer, cached."""
    from polyspec.harness.zoo import EOS_TOKEN, split_corpus

    work.mkdir(parents=True, exist_ok=True)
    train_path, held_path = work / "train.npy", work / "held_out.npy"
    if not (train_path.exists() and held_path.exists()):
        train_texts, held = split_corpus()
        eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

        def encode(texts: list[str], budget: int) -> np.ndarray:
            pieces, total = [], 0
            for text in texts:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
                pieces.append(np.asarray(ids, dtype=np.uint16))
                total += len(ids)
                if total >= budget:
                    break
            return np.concatenate(pieces)

        rng = np.random.default_rng(0)
        order = rng.permutation(len(train_texts))  # a budget-limited stream still spans the library
        np.save(held_path, encode([text for _, text in held], 1 << 62))
        np.save(train_path, encode([train_texts[i] for i in order], max_train_tokens))
    return np.load(train_path), np.load(held_path)


def _lr_at(progress: float, peak: float) -> float:
    """Linear warm-up over the first 5 % of the run, then cosine down to a tenth of `peak`."""
    if progress < 0.05:
        return peak * max(progress, 1e-3) / 0.05
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - 0.05) / 0.95))))


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


class FeatureObjective:
    """Loss of the feature head on one batch: two unrolled steps of feature + logit distillation."""

    def __init__(self, target, head, loss: str, unroll: int = 2, noise: float = 0.1, cls_weight: float = 0.1) -> None:
        self.target, self.head, self.loss, self.unroll, self.noise, self.cls_weight = target, head, loss, unroll, noise, cls_weight

    def __call__(self, ids: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device)[None].expand(batch, length)
        with torch.no_grad():
            feats = self.target.model(ids).last_hidden_state  # [B, T, H] after the final norm
            probs = torch.softmax(self.target.lm_head(feats).float(), dim=-1)  # [B, T, V]
            embeds = self.target.model.embed_tokens(ids)
        previous = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)  # the feature each position reads
        if self.noise > 0:
            scale = self.noise * feats.pow(2).mean().sqrt()
            # drawn on the CPU generator whatever the device, so a checkpoint resumes the same stream
            previous = previous + scale * torch.randn(previous.shape, generator=generator).to(previous.device)
        total, parts = 0.0, {}
        for step in range(self.unroll):
            feature, logit_input = self.head(previous, embeds, positions)
            # step s predicts the feature of position p from s predicted features back: position p needs p >= s
            valid = slice(step, None)
            regression = F.smooth_l1_loss(feature[:, valid], feats[:, valid])
            classification = soft_cross_entropy(self.target.lm_head(logit_input[:, valid]), probs[:, valid])
            weight = 1.0 if step == 0 else 0.5
            total = total + weight * (regression + self.cls_weight * classification)
            parts[f"reg{step}"], parts[f"ce{step}"] = float(regression.detach()), float(classification.detach())
            previous = torch.cat([torch.zeros_like(feature[:, :1]), feature[:, :-1]], dim=1)
        return total, parts


class EarlyExitObjective:
    """Loss of the early-exit adapter: the target's distribution from the adapter over layer L."""

    def __init__(self, target, adapter, layers: int) -> None:
        self.target, self.adapter, self.layers = target, adapter, layers

    def __call__(self, ids: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device)[None].expand(batch, length)
        with torch.no_grad():
            out = self.target(ids, output_hidden_states=True)
            probs = torch.softmax(out.logits.float(), dim=-1)
            shallow = out.hidden_states[self.layers]  # the output of layer L
            rotary = self.target.model.rotary_emb(shallow, positions)
        x = self.adapter.layer(shallow, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        logits = self.target.lm_head(self.adapter.norm(x))
        loss = soft_cross_entropy(logits, probs)
        return loss, {"ce": float(loss.detach())}


def train(
    target,
    module,
    objective,
    stream: np.ndarray,
    checkpoint: Path,
    *,
    steps: int,
    batch: int,
    context: int,
    lr: float,
    minutes: float,
    seed: int,
    desc: str,
    device: str = "cpu",
) -> dict:
    """Train `module` (resuming from `checkpoint`) until `steps` or the time budget; the record so far."""
    from tqdm import tqdm

    for parameter in target.parameters():
        parameter.requires_grad_(False)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    record = {"steps": 0, "tokens": 0, "train_seconds": 0.0, "loss": None}
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=device)
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        generator.set_state(state["generator"])
        record = state["record"]

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save(
            {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng.bit_generator.state, "generator": generator.get_state(), "record": record},
            tmp,
        )
        os.replace(tmp, checkpoint)  # atomic: a kill mid-save keeps the previous checkpoint

    module.train()
    started = last_save = time.monotonic()
    spent_before = record["train_seconds"]
    bar = tqdm(total=steps, initial=record["steps"], desc=desc, unit="step")
    smoothed = None
    while record["steps"] < steps and time.monotonic() - started < minutes * 60:
        starts = rng.integers(0, len(stream) - context - 1, size=batch)
        ids = torch.from_numpy(np.stack([stream[s : s + context] for s in starts]).astype(np.int64)).to(device)
        # the schedule follows whichever ends first, the step count or this invocation's time
        # budget, so a budget-bound run (a slow CPU, a short GPU lease) still anneals
        progress = max(record["steps"] / steps, (time.monotonic() - started) / (minutes * 60))
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(progress, lr)
        loss, parts = objective(ids, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        record["steps"] += 1
        record["tokens"] += batch * context
        record["train_seconds"] = round(spent_before + time.monotonic() - started, 1)
        value = float(loss.detach())
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        record["loss"] = round(smoothed, 4)
        record["last"] = {k: round(v, 4) for k, v in parts.items()}
        bar.set_postfix(loss=f"{smoothed:.3f}")
        bar.update(1)
        if time.monotonic() - last_save > CHECKPOINT_EVERY_S:
            save()
            last_save = time.monotonic()
    bar.close()
    save()
    module.eval()
    record["done"] = record["steps"] >= steps
    return record


@torch.no_grad()
def held_out_loss(objective, stream: np.ndarray, context: int, windows: int = 16, device: str = "cpu") -> dict:
    """The objective's parts on fixed non-overlapping held-out windows (no noise)."""
    noise = getattr(objective, "noise", None)
    if noise is not None:
        objective.noise = 0.0
    totals: dict = {}
    count = min(windows, (len(stream) - 1) // context)
    for w in range(count):
        ids = torch.from_numpy(stream[w * context : (w + 1) * context].astype(np.int64))[None].to(device)
        _, parts = objective(ids)
        for key, value in parts.items():
            totals[key] = totals.get(key, 0.0) + value / count
    if noise is not None:
        objective.noise = noise
    return {k: round(v, 4) for k, v in totals.items()}


def count_parameters(module) -> int:
    return sum(p.numel() for name, p in module.named_parameters() if not name.startswith("decoder.embed_tokens"))


def load_target(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyspec.workers.tiers.loading import quiet_transformers

    quiet_transformers()
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if type(target).__name__ != "LlamaForCausalLM":
        raise ValueError(f"train-draft supports Llama-architecture targets; {path} is a {type(target).__name__}")
    return target, tokenizer


# ------------------------------------------------------------------------------ command


def _train_one(args, target, stream, held, kind: str, layers: int | None, run_dir: Path, minutes: float) -> tuple[object, dict]:
    from polyspec.workers.tiers.drafters import new_drafter

    torch.manual_seed(args.seed)
    if kind == "feature":
        module, meta = new_drafter("feature", target, sampling=args.sampling, decoupled=args.loss == "fspad")
    else:
        module, meta = new_drafter("early_exit", target, layers=layers)
    target.to(args.device)
    module.to(args.device)
    if kind == "feature":
        objective = FeatureObjective(target, module, args.loss, unroll=args.unroll, noise=args.noise, cls_weight=args.cls_weight)
        desc = f"feature head ({args.loss}{'' if args.sampling else ', no sampling'})"
    else:
        objective = EarlyExitObjective(target, module, layers)
        desc = f"early exit L={layers}"
    run_dir.mkdir(parents=True, exist_ok=True)
    record = train(
        target, module, objective, stream, run_dir / "train.ckpt",
        steps=args.steps, batch=args.batch, context=args.context, lr=args.lr, minutes=minutes, seed=args.seed, desc=desc, device=args.device,
    )
    record["held_out"] = held_out_loss(objective, held, args.context, device=args.device)
    target.to("cpu")  # the checkpoint and the acceptance report are CPU artefacts whatever trained them
    module.to("cpu")
    meta = {**meta, "training": {**record, "loss": args.loss if kind == "feature" else "distillation", "batch": args.batch,
            "context": args.context, "lr": args.lr, "threads": args.threads, "device": args.device, "seed": args.seed, "extra_parameters": count_parameters(module)}}
    return module, meta


def _report(args, directory: Path, kind: str, extra: dict | None = None) -> dict:
    from polyspec.harness.draft_report import chain_acceptance, held_out_prompts

    key = "feature_head" if kind == "feature" else "early_exit"
    spec = {"model": {key: str(directory), **(extra or {})}}
    prompts = held_out_prompts(args.target, args.report_prompts)
    return chain_acceptance(args.target, {"drafter": spec}, prompts, args.report_length, max_new_tokens=args.report_tokens, threads=args.threads)


def cmd_train_draft(args) -> int:
    from polyspec.workers.core.errors import PolyspecError
    from polyspec.workers.tiers.drafters import save_drafter

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PolyspecError("--device cuda: this torch sees no CUDA device")
    kind = args.kind.replace("-", "_")
    try:
        target, tokenizer = load_target(args.target)
    except (OSError, ValueError) as exc:
        raise PolyspecError(f"cannot load the target {args.target!r}: {str(exc).splitlines()[0]}") from None
    layers = [int(x) for x in str(args.layers).split(",")] if kind == "early_exit" else [None]
    if kind == "early_exit" and any(not 1 <= L < target.config.num_hidden_layers for L in layers):
        raise PolyspecError(f"--layers must lie in 1..{target.config.num_hidden_layers - 1} (the target has {target.config.num_hidden_layers} layers)")
    work = Path(args.work)
    stream, held = corpus_streams(tokenizer, work / "corpus", args.corpus_tokens)
    print(f"corpus: {len(stream):,} training tokens, {len(held):,} held-out tokens (cached in {work / 'corpus'})")
    out = Path(args.out)
    sweep = {}
    for L in layers:
        tag = f"{kind}-{args.loss}{'' if args.sampling else '-nosampling'}" if kind == "feature" else f"early_exit-L{L}"
        run_dir = work / tag
        module, meta = _train_one(args, target, stream, held, kind, L, run_dir, args.minutes / len(layers))
        candidate = out if len(layers) == 1 else run_dir / "drafter"
        save_drafter(candidate, kind, module, meta)
        if not meta["training"]["done"]:
            print(f"{tag}: budget spent at step {meta['training']['steps']}/{args.steps}; run the same command again to continue")
        if args.report_prompts:
            extra = {"exit_threshold": args.exit_threshold} if kind == "early_exit" else {}
            meta["acceptance"] = _report(args, candidate, kind, extra)
            save_drafter(candidate, kind, module, meta)
        sweep[L] = (candidate, module, meta)
    if len(layers) > 1:  # keep the fastest chain
        def speed(entry) -> float:
            return (entry[2].get("acceptance") or {}).get("drafter", {}).get("T=0", {}).get("speedup_vs_target", 0.0)

        best = max(sweep, key=lambda L: speed(sweep[L]))
        _, module, meta = sweep[best]
        meta["sweep"] = {str(L): {"speedup_vs_target_T0": speed(entry), "acceptance": entry[2].get("acceptance")} for L, entry in sweep.items()}
        save_drafter(out, kind, module, meta)
        print(f"sweep: L={best} kept ({', '.join(f'L={L}: {speed(e):.2f}x' for L, e in sweep.items())})")
    final = json.loads((out / "drafter.json").read_text())
    print(json.dumps({"out": str(out), "training": final["training"], "acceptance": final.get("acceptance")}, indent=2))
    return 0
