"""The feature drafter's tier as loaded: a trained head over the target's hidden states (EAGLE / FSPAD).

It sits directly under the target (`source`, the target's `ModelTier`), and runs as
polyspec.workers.tiers.batched_feature.BatchedFeatureTier, over its target's runtime tier, whose
slot cache records the features. At position p the head reads the target's feature at p-1 where
the target has computed it, else its own prediction there (docs/drafters.md, "The feature head").
Head positions computed from a predicted feature are provisional: the next call recomputes them
from the target's features (`BatchedFeatureTier.real` counts the others). Its distributions are a
function of the context and of which positions the target had computed, decided before any
token is drawn from them, so verification against them stays exact.
"""

from __future__ import annotations

import types

from polyspec.workers.tiers.tier import ModelTier, Tier


def head_trunk(head):
    """The head's decoder layer in the shape the batched and static Llama forwards read: its layers, rotary
    table and feature norm; its embeddings and LM head are unused (the head's inputs and outputs are its own, and
    the forwards return the layer's raw output to it)."""
    decoder = head.decoder
    shim = type("LlamaForCausalLM", (), {})()
    shim.config = decoder.config
    shim.model = types.SimpleNamespace(embed_tokens=decoder.embed_tokens, layers=decoder.layers, norm=head.feature_norm,
                                       rotary_emb=decoder.rotary_emb)
    shim.lm_head = head.fc
    return shim


class FeatureTier(Tier):
    """A feature head drafting for the target it reads features from."""

    def __init__(self, name: str, head, source: ModelTier, threads: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.head = head.eval()
        self.source = source
        self.vocab_size = source.vocab_size
        self.max_context = source.max_context
        self.device = source.device  # (its head runs beside the target, reading the target's features)
        self.threads = threads
