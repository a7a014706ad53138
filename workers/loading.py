"""Loading a chain's tiers: `from_pretrained` of an id or a path, dtype, int8, vocabulary check."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import torch

from workers.errors import ModelLoadError
from workers.tiers import ModelTier, NGramTier, Tier

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    """Library chatter (progress bars, deprecation notes) is not for the CLI user."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("torch.ao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}: {exc}") from None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_tokenizer(model: str, tier_name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # transformers raises OSError / ValueError / HF hub errors
        raise ModelLoadError(f"tier {tier_name!r}: cannot load a tokenizer from {model!r}: {_short(exc)}") from None


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of every Linear (weights int8 per tensor, activations quantized on the fly)."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8)


def load_model_tier(tier, vocab_size: int | None = None) -> ModelTier:
    """Load one model tier from its TierConfig (orchestrator.config)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(tier.device)
    if tier.quantize == "int4":
        raise ModelLoadError(f"tier {tier.name!r}: quantize: int4 needs a GPU quantization backend; on CPU use int8")
    if tier.quantize == "int8" and device.type != "cpu":
        raise ModelLoadError(f"tier {tier.name!r}: quantize: int8 (torch dynamic quantization) runs on CPU only; set device: cpu")
    dtype = torch.float32 if tier.quantize else TORCH_DTYPES[tier.dtype]
    if tier.threads:
        torch.set_num_threads(tier.threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(tier.model, dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:
        where = "local directory" if os.path.isdir(tier.model) else "local path or a Hugging Face model id"
        raise ModelLoadError(f"tier {tier.name!r}: cannot load model {tier.model!r} (not a loadable {where}): {_short(exc)}") from None
    model = model.to(device).eval()
    head = model.get_output_embeddings()
    out_features = head.weight.shape[0] if head is not None else model.config.vocab_size
    if tier.quantize == "int8":
        model = quantize_int8(model)
    return ModelTier(tier.name, model, vocab_size or out_features, device, tier.threads)


def check_vocabularies(tiers_config, tokenizers: dict) -> int:
    """All model tiers must share one vocabulary; returns its size. Raises naming both tiers."""
    names = list(tokenizers)
    reference_name = names[0]
    reference = tokenizers[reference_name].get_vocab()
    for name in names[1:]:
        vocab = tokenizers[name].get_vocab()
        if vocab != reference:
            differing = sorted(set(vocab.items()) ^ set(reference.items()))
            example = differing[0][0] if differing else "?"
            raise ModelLoadError(
                f"tiers {reference_name!r} and {name!r} do not share a vocabulary "
                f"({len(reference)} vs {len(vocab)} tokens; e.g. token {example!r} differs)"
            )
    return len(reference)


def load_tiers(tiers_config) -> tuple[list[Tier], object]:
    """Tiers (target first) and the shared tokenizer."""
    model_configs = [t for t in tiers_config if not t.is_ngram]
    tokenizers = {}
    for tier in model_configs:
        tokenizers[tier.name] = load_tokenizer(tier.model, tier.name)
    check_vocabularies(model_configs, tokenizers)
    tiers: list[Tier] = [load_model_tier(tier) for tier in model_configs]
    # logits may be padded differently per model; every tier samples and verifies over the
    # same first V columns, the no-speculation baseline included, so the chain stays exact
    vocab_size = min(t.vocab_size for t in tiers)
    for tier in tiers:
        tier.vocab_size = vocab_size
    ordered: list[Tier] = []
    model_iter = iter(tiers)
    for tier in tiers_config:
        ordered.append(NGramTier(tier.name, vocab_size, tier.max_ngram, tier.min_ngram) if tier.is_ngram else next(model_iter))
    return ordered, tokenizers[model_configs[0].name]
