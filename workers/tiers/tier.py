"""The tiers of a chain as loaded: which model (or model-free drafter) each is, and its settings.

A loaded tier is a record: the model and where it runs (`ModelTier`), the n-gram drafter's
sizes (`NGramTier`), a feature head and the target it reads (`feature_tier.FeatureTier`). What
runs is the one tier family over them (polyspec.workers.tiers.batched: `batched_tiers` makes
each tier's runtime: a model tier's KV pool and forward, the n-gram index, the head's pool), the
same on every device and for one request or many.

Besides: `copy_forward`, the n-gram tier's copy, and `scratch_score`, a request's scoring of another prompt on a sequence of its own (SpecReason).
"""

from __future__ import annotations

import itertools

import torch

from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks
from polyspec.workers.tiers.weight_only import switch_rows


SCRATCH_SEQUENCE = "scratch-score"  # the sequence ids `scratch_score` keeps a request's scored prompts under
_scratch_ids = itertools.count()


def scratch_sequence(seq_id) -> tuple:
    """The sequence a request's `scratch_score` calls keep their KV under (to release with the request)."""
    return (SCRATCH_SEQUENCE, seq_id)


def scratch_score(tier, context: list[int], seq_id=None, temperature: float = 1.0) -> torch.Tensor:
    """The batched model tier `tier`'s distribution after `context` [V], on a sequence of its own: SpecReason's
    utility score, embedded and on a worker. With the request's `seq_id` the scored KV stays on
    `scratch_sequence(seq_id)`, so the request's next score computes only what its context does not share with
    this one (the problem and the reasoning so far) until the request is released; without, nothing is kept."""
    scratch = scratch_sequence(("once", next(_scratch_ids)) if seq_id is None else seq_id)
    params = SamplingParams(temperature=temperature)
    try:
        return tier.score_batch([scratch], [list(context)], Blocks.empty(1), [params])[0][-1]
    finally:
        if seq_id is None:
            tier.release(scratch)


class Tier:
    """One loaded tier of the chain (a record; `batched.batched_tiers` makes what runs)."""

    name: str
    vocab_size: int
    max_context: int | None = None  # positions the model can attend over; None = unbounded
    can_verify: bool = True
    deterministic_drafts: bool = False  # drafts are a function of the context (n-gram lookup)
    has_weights: bool = True  # its forwards stream model weights through the caches (not the n-gram lookup)
    up = True  # serving (a loaded tier always is; a remote tier's view says whether its worker answers)
    device = torch.device("cpu")  # where its forwards run (a model tier: its model's device)
    exit_threshold: float | None = None  # a drafter's early exit (ModelTier's doc); None: drafts every position asked
    switch_rows: tuple[int, ...] = ()  # row counts at which its forward changes regime (ModelTier's: weight-only Linears)

    def __init__(self) -> None:
        self.busy_s = 0.0  # wall time spent in forwards / lookups
        self.forwards = 0
        self.forwarded_tokens = 0  # tokens its forwards took in (prefills and blocks): what a cached prefix saves
        # seq_id -> an early-exit threshold for that sequence alone (ModelTier.exit_threshold's test): an
        # approximate mode's drafter stopping when unsure (BiLD's fallback)
        self.exit_by_seq: dict = {}


class ModelTier(Tier):
    """A causal LM from transformers, loaded, and where it runs.

    `exit_threshold` (a trained early-exit drafter, polyspec.workers.tiers.drafters): a drafting tier stops a
    block early, after the first token its own (temperature-1) top probability puts below the threshold. The
    block length then depends only on the drafter's distributions, so verification stays exact."""

    def __init__(self, name: str, model, vocab_size: int, device: torch.device, threads: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.device = device
        self.threads = threads
        self.max_context = getattr(model.config, "max_position_embeddings", None)

    @property
    def switch_rows(self) -> tuple[int, ...]:
        """Where its weight-only Linears leave their kernel for the block path (`weight_only.switch_rows`): the
        start-up profile measures on both sides of each (orchestrator/tuning/profiler.py)."""
        return switch_rows(self.model)


def copy_forward(context: list[int], start: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens copied from `context[start:]`, continuing into the copy itself when
    the context runs out (an overlapping copy, as in LZ77): a loop of period p shorter than
    the block is proposed for the whole block, not cut at the end of the context."""
    copied: list[int] = []
    for offset in range(num_tokens):
        position = start + offset
        if position >= len(context) and not copied:
            break
        copied.append(context[position] if position < len(context) else copied[position - len(context)])
    return copied


class NGramTier(Tier):
    """The model-free prompt-lookup drafter: continues the latest earlier occurrence of the context's suffix
    (`batched.NGramIndex`). Its proposals are a deterministic function of the context, i.e. drawn from a point
    mass, so their draft rows are one-hot and verification stays exact."""

    can_verify = False
    deterministic_drafts = True
    has_weights = False

    def __init__(self, name: str, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"tier {name!r}: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = name
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
