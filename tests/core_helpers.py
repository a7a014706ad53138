"""Small helpers of the core-math, device-round and chain tests."""

from __future__ import annotations

import torch

from polyspec.orchestrator.batch_runner import run_requests
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


class DecoderEngine:
    """A bare decoder (a ChainScheduler, a distributed chain) as the one request loop's engine: request `i`
    is `jobs[i]` ((prompt_ids, max_new_tokens, params, seed)), its result (i, its GenerationOutput)."""

    batched = False  # rounds in turn (a distributed chain's in flight at once: `concurrent_steps`)

    def __init__(self, decoder, jobs: list[tuple], max_requests: int = 1) -> None:
        self.scheduler, self.jobs, self.max_requests = decoder, jobs, max_requests

    def start(self, index: int):
        prompt_ids, max_new_tokens, params, seed = self.jobs[index]
        state = self.scheduler.start(list(prompt_ids), max_new_tokens, params, seed)
        state.request = index
        return state

    def step(self, state) -> list[int]:
        return self.scheduler.step(state)

    def finish(self, state):
        return state.request, self.scheduler.finish(state)

    def cancel(self, state):
        return state.request, self.scheduler.cancel(state)


def generate_each(decoder, jobs: list[tuple], concurrency: int, on_done) -> None:
    """Every job ((prompt_ids, max_new_tokens, params, seed)) through the one request loop, up to `concurrency`
    in flight; `on_done(index, GenerationOutput or the exception its rounds raised)`."""
    run_requests(DecoderEngine(decoder, jobs, concurrency), range(len(jobs)), lambda done: on_done(*done),
                 max_requests=concurrency, on_error=on_done)


def generate_alone(decoder, prompt_ids, max_new_tokens: int, params, seed: int | None = None, on_commit=None):
    """One request on a bare decoder through the one request loop (a batch of one); its GenerationOutput."""
    outputs = []
    run_requests(DecoderEngine(decoder, [(prompt_ids, max_new_tokens, params, seed)]), [0], outputs.append,
                 on_delta=None if on_commit is None else lambda _, tokens, text: on_commit(tokens))
    return outputs[0][1]
