"""Sampling parameters and the logits -> probabilities warp shared by every tier.

Losslessness across tiers needs the *same* warp on both sides of every verification
(the verifier's rows and the drafter's rows it checks against), so there is exactly one implementation of it, here. Probabilities are
always float32, whatever the model's dtype.
"""

from __future__ import annotations

import dataclasses

import torch

# Below this temperature a request decodes greedily (vLLM's threshold too): float32 cannot
# represent the warp of much smaller ones (logits / 1e-45 overflow, and 5e-324 is 0 in
# float32), and at 1e-5 the warped row is already one-hot unless two logits lie within ~1e-4.
GREEDY_BELOW_TEMPERATURE = 1e-5
# top_p = 0 (OpenAI's range is [0, 1]) and any top_p below float32's smallest normal number
# keep only the top token, as this one does; raised to it so it survives float32 fields.
SMALLEST_TOP_P = float(torch.finfo(torch.float32).tiny)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. A temperature of 0 (or any below GREEDY_BELOW_TEMPERATURE)
    means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    # the request's structured-output state (polyspec.workers.core.grammar.GrammarState): every tier masks its
    # rows with it before the warp; None: free output. Not part of equality (one per request).
    grammar: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        # numerically extreme but legal values get their defined meaning in a form every path carries
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p < SMALLEST_TOP_P:
            object.__setattr__(self, "top_p", SMALLEST_TOP_P)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> float32 probabilities under temperature, top-k, then top-p.

    logits: [..., V] in any dtype. Returns [..., V] float32 rows summing to 1.
    For greedy params the result is a one-hot row at the argmax (first index on ties),
    so greedy is the temperature -> 0 limit and every rule below stays well defined.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # the largest logit becomes exactly 0 before the division, so no temperature overflows it
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V]
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest value still keeps the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] probability row (float32)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


class RandomStream(torch.Generator):
    """One request's randomness at one tier, for draws on the host and on the device alike.

    Host draws (`torch.multinomial(..., generator=stream)`) read and advance the generator's own
    state. Device draws are counter-based (polyspec.workers.core.device_verify.stream_uniforms):
    they are keyed by (`key`, a counter), and `take(count)` hands out the next `count` counter
    values. Neither depends on what else is in a batch, and both are put back exactly by
    `snapshot` / `restore` (a step retried after a failure draws what it drew before)."""

    def __new__(cls, seed: int | None = None):
        return super().__new__(cls)  # a CPU generator (torch.Generator would read `seed` as its device)

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        if seed is None:
            self.seed()
        else:
            self.manual_seed(int(seed))
        self.key = self.initial_seed() & ((1 << 63) - 1)  # an int64 on the device
        self.counter = 0

    def take(self, count: int = 1) -> int:
        """The first of `count` fresh counter values for device draws."""
        first = self.counter
        self.counter += count
        return first

    def snapshot(self) -> tuple[torch.Tensor, int]:
        return self.get_state(), self.counter

    def restore(self, snapshot: tuple[torch.Tensor, int]) -> None:
        state, self.counter = snapshot
        self.set_state(state)
