"""Start-up latency profiles kept on disk, so a second run of the same tier on the same
machine starts at once instead of measuring again (`lengths: auto` profiles every tier:
seconds for the demo chain, minutes for a 1.5B model on a CPU).

An entry belongs to one tier and one measurement: the model (its path or id, and the
size and modification time of each weight file, so a retrained or re-fetched model is
measured again), dtype, quantization, threads, device, the machine (host name, CPU model,
core count, torch version, GPU name), and what was measured (which sizes, the warp, the
tree). Anything else gets a new entry. Files are small JSON under `$POLYSPEC_PROFILE_CACHE`
(default ~/.cache/polyspec/profiles); delete the folder, or pass `--reprofile`, to measure again.
Trained drafters (whose cost depends on their target's state) are never cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

VERSION = 2  # bump when what a profile holds changes, or what it measured (2: the batched forward's attention and prefill got cheaper)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def cache_dir() -> Path:
    return Path(os.environ.get("POLYSPEC_PROFILE_CACHE") or "~/.cache/polyspec/profiles").expanduser()


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """What makes one machine's timings differ from another's."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "gpus": gpus}


def model_fingerprint(model: str) -> Any:
    """The model as it is on disk now: each weight file's name, size and modification time."""
    path = Path(model)
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        return model  # a hub id: the id stands for the weights
    return [model, [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]


def tier_key(tier, measurement: dict) -> str | None:
    """The cache key of one tier's measurement; None for what is never cached."""
    if tier.drafter:
        return None
    identity = {"version": VERSION, "model": model_fingerprint(tier.model) if not tier.is_ngram else "ngram",
                "dtype": tier.dtype, "quantize": tier.quantize, "threads": tier.threads, "device": tier.device,
                "max_ngram": tier.max_ngram, "min_ngram": tier.min_ngram, "machine": machine(), "measurement": measurement}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:40]


class ProfileCache:
    """get / put of per-tier measurements (JSON-able values) for the tiers of one config."""

    def __init__(self, tier_configs, refresh: bool = False, directory: Path | None = None) -> None:
        self.tier_configs = list(tier_configs)
        self.refresh = refresh  # --reprofile: measure again, and overwrite
        self.directory = directory or cache_dir()

    def _path(self, index: int, measurement: dict) -> Path | None:
        if index >= len(self.tier_configs):
            return None
        key = tier_key(self.tier_configs[index], measurement)
        return None if key is None else self.directory / f"{self.tier_configs[index].name}-{key}.json"

    def get(self, index: int, measurement: dict) -> Any | None:
        path = self._path(index, measurement)
        if self.refresh or path is None or not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))["value"]
        except (OSError, ValueError, KeyError):
            return None  # a torn or foreign file: measure again

    def put(self, index: int, measurement: dict, value: Any) -> None:
        path = self._path(index, measurement)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"tier": self.tier_configs[index].name, "machine": machine(), "value": value}),
                               encoding="utf-8")
            partial.replace(path)  # never a half-written entry
        except OSError:
            pass  # a read-only home: the profile is simply measured next time too


def encode_table(table: dict | None) -> list | None:
    """{size: ms} (sizes ints or tuples) -> JSON pairs."""
    return None if table is None else [[list(k) if isinstance(k, tuple) else k, v] for k, v in table.items()]


def decode_table(pairs: list | None) -> dict | None:
    return None if pairs is None else {tuple(k) if isinstance(k, list) else k: v for k, v in pairs}
