"""How a config names models: `zoo:NAME` (the folder `polyspec zoo fetch NAME` writes), `zoo:NAME.gguf`
(the GGUF file it keeps beside it, for `quantize: gguf`) and `ngram` (the model-free tier). Nothing here imports torch, so a config is checked in
milliseconds, before any model library loads."""

from __future__ import annotations

import os
from pathlib import Path

from polyspec.workers.core.errors import ConfigError

ZOO_PREFIX = "zoo:"
NGRAM_MODEL = "ngram"
# the names `polyspec zoo fetch` converts (polyspec.harness.zoo_fetch.MODELS; a test keeps the two equal)
ZOO_NAMES = ("smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
# ... and the GGUF file each keeps under gguf/ (zoo_fetch.MODELS' gguf_file; the same test)
ZOO_GGUF = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
GGUF_SUFFIX = ".gguf"


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
    if name.endswith(GGUF_SUFFIX) and name[: -len(GGUF_SUFFIX)] in ZOO_GGUF:
        return str(model_cache_dir() / "gguf" / ZOO_GGUF[name[: -len(GGUF_SUFFIX)]])
    folder = model_cache_dir() / name
    if name not in ZOO_NAMES and not folder.is_dir():
        raise ConfigError(f"unknown zoo model {name[:80]!r} (known: {', '.join(ZOO_NAMES)}; `polyspec zoo list` shows what is fetched)")
    return str(folder)


def fetch_hint(path: str) -> str:
    """'; fetch it first: ...' for a missing folder of the model cache that the zoo can fetch, '' otherwise."""
    candidate = Path(path)
    if candidate.parent == model_cache_dir() and candidate.name in ZOO_NAMES:
        return f"; fetch it first: polyspec zoo fetch {candidate.name}"
    fetched_by = {file: name for name, file in ZOO_GGUF.items()}
    if candidate.parent == model_cache_dir() / "gguf" and candidate.name in fetched_by:
        return f"; fetch it first: polyspec zoo fetch {fetched_by[candidate.name]}"
    return ""
