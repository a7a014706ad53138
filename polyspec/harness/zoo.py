"""The demo model family, trained from the Python standard library's own source.

So that the tests, the demo and the benchmarks need no model hub, the project trains its
own small family: a byte-level BPE tokenizer and Llama-style
models of very different sizes, all on the `.py` files of the running interpreter's
standard library. Everything is deterministic from one seed, checkpointed so an
interrupted build resumes where it stopped, and the finished weights are small enough
to ship in the repository (``models/stdlib/``).

    polyspec zoo build --out models/stdlib --work .zoo-work
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

EOS_TOKEN = "<|endoftext|>"
HELD_OUT_FRACTION = 1 / 20  # files whose path hash falls in this bucket are never trained on
MAX_FILE_BYTES = 400_000


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape and training budget of one member of the family."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    train_tokens: int
    learning_rate: float
    batch_size: int = 16


@dataclasses.dataclass(frozen=True)
class ZooSpec:
    seed: int = 0
    vocab_size: int = 4096
    context: int = 512
    models: tuple[ModelSpec, ...] = (
        # the target: ~9.7M parameters, the strongest and slowest member
        ModelSpec("target", 320, 6, 5, 864, train_tokens=6_000_000, learning_rate=1.5e-3),
        # the small drafter: ~1.1M parameters, several times cheaper per forward
        ModelSpec("small", 128, 3, 4, 352, train_tokens=5_000_000, learning_rate=3e-3),
    )


# ----------------------------------------------------------------------------- corpus


def stdlib_files(stdlib_dir: str | None = None) -> list[Path]:
    """The standard library's `.py` files (site-packages excluded), sorted by path."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        files.append(path)
    return files


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha1(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % round(1 / HELD_OUT_FRACTION) == 0


def split_corpus(stdlib_dir: str | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """(training texts, [(relative path, text)] held out), deterministic for a given Python."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in stdlib_files(str(root)):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(root).as_posix()
        (held.append((rel, text)) if is_held_out(rel) else train.append(text))
    return train, held


# -------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    """Byte-level BPE saved as a transformers fast tokenizer (loadable with AutoTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def encode_corpus(tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one uint16 stream, documents separated by EOS."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pieces = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        pieces.append(np.asarray(ids + [eos], dtype=np.uint16))
    return np.concatenate(pieces)


# ----------------------------------------------------------------------------- models


def build_config(spec: ModelSpec, vocab_size: int, context: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def _lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_loss(model, stream: np.ndarray, context: int, max_windows: int = 64) -> float:
    """Mean next-token loss (nats/token) over non-overlapping windows of the held-out stream."""
    model.eval()
    n_windows = min(max_windows, (len(stream) - 1) // context)
    losses = []
    with torch.no_grad():
        for w in range(n_windows):
            chunk = torch.from_numpy(stream[w * context : (w + 1) * context + 1].astype(np.int64))
            out = model(chunk[None, :-1], labels=chunk[None, :-1].clone())
            # labels are shifted inside the model; recompute exactly on [:-1] -> [1:]
            logits = out.logits[0].float()
            losses.append(torch.nn.functional.cross_entropy(logits, chunk[1:]).item())
    model.train()
    return float(np.mean(losses))


def train_model(
    spec: ModelSpec,
    zoo: ZooSpec,
    train_stream: np.ndarray,
    held_stream: np.ndarray,
    work_dir: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    checkpoint_every_s: float = 120.0,
) -> dict:
    """Train one member; resumes from `work_dir/<name>.ckpt`; saves to `out_dir/<name>`."""
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaForCausalLM

    final_dir = out_dir / spec.name
    report_path = final_dir / "training.json"
    if report_path.exists():
        return json.loads(report_path.read_text())

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(zoo.seed)
    config = build_config(spec, zoo.vocab_size, zoo.context, tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    tokens_per_step = spec.batch_size * zoo.context
    total_steps = spec.train_tokens // tokens_per_step
    step = 0
    rng = np.random.default_rng(zoo.seed + hash_name(spec.name))

    ckpt_path = work_dir / f"{spec.name}.ckpt"
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        rng.bit_generator.state = state["rng"]

    def save_checkpoint():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "rng": rng.bit_generator.state},
            tmp,
        )
        os.replace(tmp, ckpt_path)  # atomic: a kill mid-save leaves the previous checkpoint

    n_params = sum(p.numel() for p in model.parameters())
    model.train()
    last_save = time.monotonic()
    started = time.monotonic()
    start_step = step
    bar = tqdm(total=total_steps, initial=step, desc=f"train {spec.name} ({n_params / 1e6:.1f}M)", unit="step")
    max_start = len(train_stream) - zoo.context - 1
    while step < total_steps:
        starts = rng.integers(0, max_start, size=spec.batch_size)
        batch = torch.from_numpy(np.stack([train_stream[s : s + zoo.context + 1] for s in starts]).astype(np.int64))
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, total_steps, spec.learning_rate)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed = time.monotonic() - started
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{(step - start_step) * tokens_per_step / max(elapsed, 1e-9):.0f}")
        bar.update(1)
        if time.monotonic() - last_save > checkpoint_every_s:
            save_checkpoint()
            last_save = time.monotonic()
    bar.close()
    save_checkpoint()

    loss = held_out_loss(model, held_stream, zoo.context)
    final_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(final_dir))
    tokenizer.save_pretrained(str(final_dir))
    report = {
        "name": spec.name,
        "parameters": n_params,
        "train_tokens": step * tokens_per_step,
        "held_out_loss_nats_per_token": round(loss, 4),
        "spec": dataclasses.asdict(spec),
        "seed": zoo.seed,
        "context": zoo.context,
    }
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def hash_name(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little")


def prepare(zoo: ZooSpec, work_dir: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """Tokenizer and token streams, cached under work_dir."""
    from transformers import AutoTokenizer

    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = work_dir / "tokenizer"
    train_path, held_path = work_dir / "train.npy", work_dir / "held_out.npy"
    if not (train_path.exists() and held_path.exists() and (tokenizer_dir / "tokenizer.json").exists()):
        train_texts, held = split_corpus()
        print(f"corpus: {len(train_texts)} training files, {len(held)} held-out files")
        train_tokenizer(train_texts, zoo.vocab_size, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        np.save(held_path, encode_corpus(tokenizer, [text for _, text in held]))
        np.save(train_path, encode_corpus(tokenizer, train_texts))
    return tokenizer_dir, np.load(train_path), np.load(held_path)


def build(out_dir: str, work_dir: str, only: list[str] | None = None, threads: int = 1, zoo: ZooSpec = ZooSpec()) -> list[dict]:
    torch.set_num_threads(threads)
    out, work = Path(out_dir), Path(work_dir)
    tokenizer_dir, train_stream, held_stream = prepare(zoo, work)
    print(f"tokens: {len(train_stream):,} train, {len(held_stream):,} held out")
    reports = []
    for spec in zoo.models:
        if only and spec.name not in only:
            continue
        reports.append(train_model(spec, zoo, train_stream, held_stream, work, out, tokenizer_dir))
        print(json.dumps(reports[-1]))
    return reports
