"""How a config names models: `zoo:NAME` (the folder `polyspec zoo fetch NAME` writes) and
`ngram` (the model-free tier). Nothing here imports torch, so a config is checked in
milliseconds, before any model library loads."""

from __future__ import annotations

import os
from pathlib import Path

from polyspec.workers.core.errors import ConfigError

ZOO_PREFIX = "zoo:"
NGRAM_MODEL = "ngram"
# the names `polyspec zoo fetch` converts (polyspec.harness.zoo_fetch.MODELS; a test keeps the two equal)
ZOO_NAMES = ("smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def model_cache_dir() -> Path:
    """$POLYSPEC_MODEL_CACHE, or ~/.cache/polyspec/models."""
    return Path(os.environ.get("POLYSPEC_MODEL_CACHE") or "~/.cache/polyspec/models").expanduser()


def resolve_zoo_reference(model: str) -> str:
    """`zoo:NAME` -> the folder `polyspec zoo fetch NAME` writes; anything else unchanged.
    A name the zoo does not know (and no folder of that name in the cache) is a ConfigError
    listing the names it knows, so the user never gets a fetch command that cannot work."""
    if not model.startswith(ZOO_PREFIX):
        return model
    name = model[len(ZOO_PREFIX) :]
    folder = model_cache_dir() / name
    if name not in ZOO_NAMES and not folder.is_dir():
        raise ConfigError(f"unknown zoo model {name[:80]!r} (known: {', '.join(ZOO_NAMES)}; `polyspec zoo list` shows what is fetched)")
    return str(folder)


def fetch_hint(path: str) -> str:
    """'; fetch it first: ...' for a missing folder of the model cache that the zoo can fetch, '' otherwise."""
    candidate = Path(path)
    if candidate.parent == model_cache_dir() and candidate.name in ZOO_NAMES:
        return f"; fetch it first: polyspec zoo fetch {candidate.name}"
    return ""
