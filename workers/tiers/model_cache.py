"""Where `polyspec zoo fetch` puts converted models, and how a config names them (`zoo:NAME`)."""

from __future__ import annotations

import os
from pathlib import Path

ZOO_PREFIX = "zoo:"


def model_cache_dir() -> Path:
    """$POLYSPEC_MODEL_CACHE, or ~/.cache/polyspec/models."""
    return Path(os.environ.get("POLYSPEC_MODEL_CACHE") or "~/.cache/polyspec/models").expanduser()


def resolve_zoo_reference(model: str) -> str:
    """`zoo:NAME` -> the folder `polyspec zoo fetch NAME` writes; anything else unchanged."""
    if model.startswith(ZOO_PREFIX):
        return str(model_cache_dir() / model[len(ZOO_PREFIX) :])
    return model


def fetch_hint(path: str) -> str:
    """' (fetch it with ...)' for a missing folder of the model cache, '' otherwise."""
    candidate = Path(path)
    if candidate.suffix == ".gguf":
        return ""
    if candidate.parent == model_cache_dir():
        return f"; fetch it first: polyspec zoo fetch {candidate.name}"
    return ""
