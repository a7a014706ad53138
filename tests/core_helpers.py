"""Small helpers of the core-math tests."""

from __future__ import annotations

import torch

from polyspec.workers.core.tree import DraftTree


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed` (None: from the operating system's entropy)."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def ancestors_and_self(tree: DraftTree, node: int) -> list[int]:
    """The path from the root of `tree` to `node`, both included."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]
