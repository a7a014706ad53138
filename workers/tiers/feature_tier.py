"""The feature drafter's tier: a trained head over the target's hidden states (EAGLE / FSPAD).

It sits directly under the target (`source`, a `ModelTier` with `keep_features`). At
position p the head reads a feature for p-1 and the embedding of token p:

- the target's own feature, for every position the target has computed (the committed
  context, minus its last token, after the first round);
- otherwise the head's own prediction at p-1 (drafted tokens, and tokens the target has
  not verified yet when this tier verifies a cheaper tier's blocks).

Head positions computed from a predicted feature are provisional: at the next call they
are recomputed from the target's features once the target has them (`_HeadSequence.real`
counts the positions computed from real features only). The head's KV cache rolls back
like every tier's; its distributions are a function of the context and of which
positions the target had computed, decided before any token is drawn from them, so
verification against them stays exact.

When the target has nothing cached for a sequence yet (a new prompt), the tier asks it
for the prompt's features: one forward the target's next `score` finds in its cache.

Served batched (polyspec.workers.tiers.batched), the head reads the features from the
batched target's slot cache instead (`read_features_from`): the batched forwards record them
for every position they compute, so the head costs the target no forward of its own.
"""

from __future__ import annotations

import dataclasses
import time
import types

import torch

from polyspec.workers.core.kv_cache import SequenceCache
from polyspec.workers.core.sampling import warp_logits
from polyspec.workers.core.tree import DraftTree, grow_level, tree_attention_mask
from polyspec.workers.tiers.lean_llama import LeanCache, LeanLlama
from polyspec.workers.tiers.tier import ModelTier, Tier, first_candidates


def head_trunk(head):
    """The head's decoder layer in the shape the lean, batched and static Llama forwards read: its layers, rotary
    table and feature norm; its embeddings and LM head are unused (the head's inputs and outputs are its own, and
    the forwards return the layer's raw output to it)."""
    decoder = head.decoder
    shim = type("LlamaForCausalLM", (), {})()
    shim.config = decoder.config
    shim.model = types.SimpleNamespace(embed_tokens=decoder.embed_tokens, layers=decoder.layers, norm=head.feature_norm,
                                       rotary_emb=decoder.rotary_emb)
    shim.lm_head = head.fc
    return shim


@dataclasses.dataclass
class _HeadSequence:
    cache: SequenceCache | LeanCache
    outputs: torch.Tensor  # [capacity, H] the head's predicted feature at each cache slot
    real: int = 0  # cache slots [0, real) were computed from the target's features
    tree_prefix: int | None = None  # linear length under an unaccepted draft tree


class FeatureTier(Tier):
    """A feature head drafting for the target it reads features from."""

    def __init__(self, name: str, head, source: ModelTier, threads: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.head = head.eval()
        self.source = source
        source.keep_features = True
        self.features_of = source  # what `features(seq_id, context, length, compute)` is asked of: the target's tier
        self.vocab_size = source.vocab_size
        self.max_context = source.max_context
        self.threads = threads
        self._embed = source.model.get_input_embeddings()
        self._lm_head = source.model.get_output_embeddings()
        self._dtype = next(head.parameters()).dtype
        self._hidden = head.config.hidden_size
        self._device = next(head.parameters()).device  # the target's: inputs and kept features live beside the weights
        self._sequences: dict[object, _HeadSequence] = {}
        self._lean = self._lean_layer(head, source.device)

    @staticmethod
    def _lean_layer(head, device) -> LeanLlama | None:
        """The head's decoder layer through the lean forward (on CPU): the same operations
        without transformers' per-module overhead; it reads the layer's weights only."""
        shim = head_trunk(head)
        try:
            return LeanLlama(shim) if LeanLlama.supports(shim, torch.device(device)) else None
        except AttributeError:
            return None

    def read_features_from(self, provider) -> None:
        """Read the target's features from `provider` (the same target behind another cache, e.g. the
        batched tier's slot cache, with `keep_features`) instead of `source`."""
        self.features_of = provider

    # ------------------------------------------------------------------ bookkeeping

    def _sequence(self, seq_id) -> _HeadSequence:
        seq = self._sequences.get(seq_id)
        if seq is None:
            cache = self._lean.new_cache() if self._lean is not None else SequenceCache(self.head.decoder.config)
            seq = self._sequences[seq_id] = _HeadSequence(cache, torch.zeros(64, self._hidden, device=self._device))
        return seq

    def cached_tokens(self, seq_id) -> int:
        """Positions of `seq_id` the head holds computed from the target's features (the others are recomputed)."""
        seq = self._sequences.get(seq_id)
        return 0 if seq is None else min(seq.real, len(seq.cache))

    def release(self, seq_id) -> None:
        self._sequences.pop(seq_id, None)

    def truncate(self, seq_id, length: int) -> None:
        seq = self._sequences.get(seq_id)
        if seq is not None:
            self._drop_tree(seq)
            seq.cache.truncate(min(length, len(seq.cache)))
            seq.real = min(seq.real, len(seq.cache))

    def accept_path(self, seq_id, path) -> None:
        # accepted nodes were computed from predicted features: the next call recomputes them
        seq = self._sequences.get(seq_id)
        if seq is not None:
            self._drop_tree(seq)

    @staticmethod
    def _drop_tree(seq: _HeadSequence) -> None:
        if seq.tree_prefix is not None:
            seq.cache.truncate(seq.tree_prefix)
            seq.tree_prefix = None

    # ---------------------------------------------------------------------- forwards

    def _forward(self, seq: _HeadSequence, tokens: list[int], positions: list[int], features: torch.Tensor, mask=None):
        """Append `tokens` (inputs: `features` [T, H] for the previous positions); (predicted features, logits) [T, H], [T, V]."""
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        started = time.perf_counter()
        start = len(seq.cache)
        with torch.inference_mode():
            ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
            embeds = self._embed(ids).to(self._dtype)  # [1, T, H]
            features = features[None].to(self._device, self._dtype)
            if self._lean is not None:
                head = self.head
                parts = [features, embeds] + ([features * embeds] if head.sampling else [])
                trunk = self._lean.forward(seq.cache, tokens, positions, mask, inputs=head.fc(torch.cat(parts, dim=-1)), raw=True)
                feature, logit_input = head.outputs(trunk)
            else:
                feature, logit_input = self.head(features, embeds, torch.tensor([positions], dtype=torch.long, device=self._device),
                                                   cache=seq.cache.kv, attention_mask=None if mask is None else mask.to(self._device))
            logits = self._lm_head(logit_input)[0, :, : self.vocab_size].float()  # [T, V]
        seq.cache.appended(tokens)
        end = start + len(tokens)
        if seq.outputs.shape[0] < end:
            grown = torch.zeros(max(end, 2 * seq.outputs.shape[0]), self._hidden, device=self._device)
            grown[:start] = seq.outputs[:start]
            seq.outputs = grown
        seq.outputs[start:end] = feature[0].float()
        self.busy_s += time.perf_counter() - started
        self.forwards += 1
        return feature[0].float(), logits

    def _input_feature(self, seq: _HeadSequence, real: torch.Tensor, position: int) -> torch.Tensor:
        if position == 0:
            return torch.zeros(self._hidden, device=self._device)
        if position - 1 < real.shape[0]:
            return real[position - 1]
        return seq.outputs[position - 1]

    def _condition(self, seq_id, context: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the head's cache up to `context`; the predicted feature and logits at its last position."""
        seq = self._sequence(seq_id)
        self._drop_tree(seq)
        n = len(context)
        real = self.features_of.features(seq_id, context, n - 1, compute=False)
        if real.shape[0] == 0 and n > 1:
            real = self.features_of.features(seq_id, context, n - 1, compute=True)  # a new prompt: the target needs it anyway
        keep = min(seq.cache.common_prefix(context), seq.real, n - 1)
        seq.cache.truncate(keep)
        seq.real = keep
        position = keep
        real_end = min(n, real.shape[0] + 1)  # positions with a target feature for their predecessor
        feature = logits = None
        if position < real_end:  # one forward over every position with real inputs
            inputs = torch.stack([self._input_feature(seq, real, p) for p in range(position, real_end)])
            feature, logits = self._forward(seq, context[position:real_end], list(range(position, real_end)), inputs)
            seq.real = position = real_end
        while position < n:  # the rest, one at a time, each from the head's previous prediction
            feature, logits = self._forward(seq, [context[position]], [position], seq.outputs[position - 1][None])
            position += 1
        return feature[-1], logits[-1]

    # ---------------------------------------------------------------------- drafting

    def draft(self, seq_id, context, num_tokens, params, generator):
        if num_tokens <= 0:
            return [], None
        seq = self._sequence(seq_id)
        feature, logits = self._condition(seq_id, context)
        tokens: list[int] = []
        rows = []
        while True:
            probs = warp_logits(logits, params)
            token = int(probs.argmax()) if params.greedy else int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)
            rows.append(probs)
            if len(tokens) == num_tokens:
                break
            position = len(context) + len(tokens) - 1
            features, all_logits = self._forward(seq, [token], [position], feature[None])
            feature, logits = features[-1], all_logits[-1]
        return tokens, (None if params.greedy else torch.stack(rows))

    def draft_tree(self, seq_id, context, width, depth, params, scheme, generator):
        tree = DraftTree([], [], None)
        if depth <= 0:
            return tree
        seq = self._sequence(seq_id)
        root_feature, root_logits = self._condition(seq_id, context)
        root_probs = warp_logits(root_logits, params)
        prefix = len(context)
        seq.tree_prefix = prefix
        slots: dict[int, int] = {}
        row_list: list[torch.Tensor] = []
        for token in first_candidates(root_logits, root_probs, width, params, scheme, generator):
            tree.tokens.append(token)
            tree.parents.append(-1)
            row_list.append(root_probs)
        frontier = list(range(len(tree.tokens)))
        depths = [0] * len(frontier)
        for level in range(1, depth):
            first = len(seq.cache)
            for offset, node in enumerate(frontier):
                slots[node] = first + offset
            inputs = torch.stack([root_feature if tree.parents[n] < 0 else seq.outputs[slots[tree.parents[n]]] for n in frontier])
            mask = tree_attention_mask(tree.parents, slots, frontier, prefix_len=prefix, tail_len=0, total_len=first + len(frontier), dtype=self._dtype)
            _, logits = self._forward(seq, [tree.tokens[n] for n in frontier], [prefix + depths[n] for n in frontier], inputs, mask)
            frontier = grow_level(tree, frontier, logits, level, depths, row_list, params, generator)
        tree.draft_rows = None if params.greedy else torch.stack(row_list)
        return tree

    # ------------------------------------------------------------------ verification

    def score(self, seq_id, context, tree, params):
        """Rows for a chain block of a cheaper tier: the block's tokens are fed one at a time,
        each from the head's prediction at the position before (no target features exist for them)."""
        if not tree.is_chain():
            raise NotImplementedError(f"tier {self.name!r} (a feature head) verifies chains only; a tree must be verified by the target")
        seq = self._sequence(seq_id)
        feature, logits = self._condition(seq_id, context)
        rows = [logits]
        for offset, token in enumerate(tree.tokens):
            features, all_logits = self._forward(seq, [token], [len(context) + offset], feature[None])
            feature = features[-1]
            rows.append(all_logits[-1])
        return warp_logits(torch.stack(rows), params)
