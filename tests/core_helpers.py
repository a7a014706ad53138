"""Small helpers of the core-math and device-round tests."""

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


def keep_last_child_path(seq_id, block: DraftTree, pairs, batched_target, context: list[int]) -> list[int]:
    """Verdict on a drafted tree: the path of each level's last child down to a leaf, kept by every
    (one-request tier, batched tier) pair; the batched target's cache then holds `context` and the
    path's tokens, which are returned."""
    path = [block.children(-1)[-1]]
    while block.children(path[-1]):
        path.append(block.children(path[-1])[-1])
    for one, many in pairs:
        one.accept_path(seq_id, path)
        many.accept_path(seq_id, path)
    kept = [block.tokens[j] for j in path]
    assert batched_target.cache.tokens[batched_target.cache.slot_of[seq_id]] == context + kept
    return kept


class CompiledGraphs:
    """`torch.compile(fn, fullgraph=True)` with a backend that only counts the graphs it is handed:
    a graph break raises (fullgraph), a recompilation shows as a second graph. Tracing only, so it
    checks capturability in seconds on the CPU (no code generation)."""

    def __init__(self, fn) -> None:
        self.graphs: list = []

        def counting_backend(graph_module, example_inputs):
            self.graphs.append(graph_module)
            return graph_module.forward

        torch._dynamo.reset()
        self.compiled = torch.compile(fn, backend=counting_backend, fullgraph=True, dynamic=False)

    def __call__(self, *args):
        return self.compiled(*args)

    def close(self) -> None:
        torch._dynamo.reset()


def greedy_references(model, prompts: list[list[int]], max_new: int) -> dict[tuple[int, ...], list[int]]:
    """The model's own greedy `generate` of each prompt (no EOS stop), on the model's device: what a
    lossless chain's greedy output must equal. {tuple(prompt): new token ids}."""
    out = {}
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        out[tuple(prompt)] = generated[0, len(prompt):].tolist()
    return out
