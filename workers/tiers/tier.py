"""Tiers: the models of the chain behind one small interface (the seam between the
scheduler and the models: the scheduler sees only this interface).

The scheduler never touches a model. It asks a tier to

- `draft(seq_id, context, num_tokens, ...)`: sample a chain block autoregressively
  (only the last tier of a chain drafts this way; middle tiers emit through verification);
- `draft_tree(seq_id, context, width, depth, ...)`: propose a token tree;
- `score(seq_id, context, tree)`: run ONE forward over the uncached tail of `context` plus
  the draft tree and return the tier's warped probability rows, one at the root (the last
  context token) and one per tree node: [len(tree) + 1, V] float32;
- `accept_path(seq_id, path)`: after a tree verdict, keep only the accepted path's KV.

Every call carries the full context the tier should be conditioned on; the tier keeps
the KV of the longest prefix it already has and drops the rest (exact rollback, no
re-prefill). Calls are per block, never per token, so the same calls, batched, can be served
by a remote actor (polyspec.orchestrator.distributed.transport.RemoteTier). Each tier is used by one thread at a time.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import time

import torch

from polyspec.workers.core.kv_cache import SequenceCache
from polyspec.workers.tiers.lean_llama import LeanCache, LeanLlama
from polyspec.workers.core.sampling import SamplingParams, warp_logits
from polyspec.workers.core.tree import DraftTree, grow_level, tree_attention_mask, windowed_mask
from polyspec.workers.core.verification import draw_without_replacement
from polyspec.workers.tiers.model_cache import NGRAM_MODEL  # noqa: F401 - tiers name the n-gram tier too



SCRATCH_SEQUENCE = "scratch-score"  # the sequence ids `scratch_score` keeps a request's scored prompts under
_scratch_ids = itertools.count()


def scratch_sequence(seq_id) -> tuple:
    """The one-request tier's sequence a request's `scratch_score` calls keep their KV under (to release with the request)."""
    return (SCRATCH_SEQUENCE, seq_id)


def scratch_score(tier: "Tier", context: list[int], seq_id=None, temperature: float = 1.0) -> torch.Tensor:
    """`tier`'s distribution after `context` [V], from its one-sequence model on a sequence of its own (no batch
    slot taken): SpecReason's utility score, embedded and on a worker. With the request's `seq_id` the scored KV
    stays on `scratch_sequence(seq_id)`, so the request's next score computes only what its context does not
    share with this one (the problem and the reasoning so far) until the request is released; without, nothing
    is kept."""
    scratch = scratch_sequence(("once", next(_scratch_ids)) if seq_id is None else seq_id)
    try:
        return tier.score(scratch, list(context), DraftTree([], [], None), SamplingParams(temperature=temperature))[-1]
    finally:
        if seq_id is None:
            tier.release(scratch)

class Tier(abc.ABC):
    """One model (or model-free drafter) of the chain."""

    name: str
    vocab_size: int
    max_context: int | None  # positions the model can attend over; None = unbounded
    can_verify: bool = True
    deterministic_drafts: bool = False  # drafts are a function of the context (n-gram lookup)
    has_weights: bool = True  # its forwards stream model weights through the caches (not the n-gram lookup)

    def __init__(self) -> None:
        self.busy_s = 0.0  # wall time spent in forwards / lookups
        self.forwards = 0
        # seq_id -> an early-exit threshold for that sequence alone (ModelTier.exit_threshold's
        # test): an approximate mode's drafter stopping when unsure (BiLD's fallback)
        self.exit_by_seq: dict = {}
        self.forwarded_tokens = 0  # tokens its forwards took in (prefills and blocks): what a cached prefix saves

    @abc.abstractmethod
    def draft(self, seq_id, context: list[int], num_tokens: int, params: SamplingParams, generator) -> tuple[list[int], torch.Tensor | None]:
        """Sample up to `num_tokens` tokens continuing `context`, with the rows they were drawn from ([k, V] float32; None when greedy)."""

    @abc.abstractmethod
    def draft_tree(self, seq_id, context: list[int], width: int, depth: int, params: SamplingParams, scheme: str, generator) -> DraftTree:
        """`width` candidate chains of `depth` tokens sharing the root."""

    def score(self, seq_id, context: list[int], tree: DraftTree, params: SamplingParams) -> torch.Tensor:
        raise NotImplementedError(f"tier {self.name!r} cannot verify")

    def accept_path(self, seq_id, path: list[int]) -> None:
        """Keep only the accepted tree path (node indices, root to leaf)."""

    def release(self, seq_id) -> None:
        """Forget a sequence and free its cache."""

    def truncate(self, seq_id, length: int) -> None:
        """Cut a sequence's cached state back to its first `length` tokens (nothing to cut by default)."""


@dataclasses.dataclass
class _PendingTree:
    prefix_len: int  # linear context length the tree hangs off
    node_slots: dict[int, int]  # node index -> cache position, for nodes already fed


@dataclasses.dataclass
class _Sequence:
    cache: SequenceCache | LeanCache
    pending: _PendingTree | None = None
    features: torch.Tensor | None = None  # [capacity, H] last hidden state per cache slot (keep_features)


class ModelTier(Tier):
    """A causal LM from transformers, with one KV cache per open sequence.

    Llama-architecture models on CPU run through `polyspec.workers.tiers.lean_llama.LeanLlama` (the same
    operations as transformers' forward, bit-identical logits, without its per-module
    overhead, on a preallocated KV cache); `lean=False` or any other model keeps the
    transformers forward on a `DynamicCache`.

    Two options serve the trained drafters (polyspec.workers.tiers.drafters):

    - `keep_features`: record the last hidden state (after the final norm, what the LM
      head reads) of every cached position, rolled back with the KV, so that a feature
      drafter under this tier can read them (`features`);
    - `exit_threshold`: a drafting tier stops a block early, after the first token its
      own (temperature-1) top probability puts below the threshold. The block length
      then depends only on the drafter's distributions, so verification stays exact.
    """

    keep_features = False
    exit_threshold: float | None = None

    def __init__(self, name: str, model, vocab_size: int, device: torch.device, threads: int | None = None, lean: bool = True) -> None:
        super().__init__()
        self.name = name
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.device = device
        self.threads = threads
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        self._dtype = next(model.parameters()).dtype if any(True for _ in model.parameters()) else torch.float32
        if self._dtype not in (torch.float32, torch.bfloat16, torch.float16):
            self._dtype = torch.float32  # dynamically quantized models compute activations in fp32
        self._sequences: dict[object, _Sequence] = {}
        self._lean = LeanLlama(self.model) if lean and LeanLlama.supports(self.model, torch.device(device)) else None

    # ------------------------------------------------------------------ bookkeeping

    def _sequence(self, seq_id) -> _Sequence:
        seq = self._sequences.get(seq_id)
        if seq is None:
            cache = self._lean.new_cache() if self._lean is not None else SequenceCache(self.model.config)
            seq = self._sequences[seq_id] = _Sequence(cache)
        return seq

    def cached_tokens(self, seq_id) -> int:
        """Positions of `seq_id` this tier's cache holds (0 for a sequence it has not seen)."""
        seq = self._sequences.get(seq_id)
        return 0 if seq is None else len(seq.cache)

    def release(self, seq_id) -> None:
        self._sequences.pop(seq_id, None)

    def truncate(self, seq_id, length: int) -> None:
        seq = self._sequences.get(seq_id)
        if seq is not None:
            seq.pending = None  # an unaccepted tree's nodes go with the cut
            seq.cache.truncate(min(length, len(seq.cache)))

    def _sync(self, seq: _Sequence, context: list[int]) -> list[int]:
        """Roll the cache back to what `context` shares with it; return the uncached tail (>= 1 token)."""
        if seq.pending is not None:  # an unaccepted tree: its nodes are not a linear continuation
            seq.cache.truncate(seq.pending.prefix_len)
            seq.pending = None
        keep = min(seq.cache.common_prefix(context), len(context) - 1)
        seq.cache.truncate(keep)
        return context[keep:]

    def _forward(self, seq: _Sequence, tokens: list[int], positions: list[int], mask: torch.Tensor | None) -> torch.Tensor:
        """One model forward appending `tokens` to the cache; logits [len(tokens), V] float32."""
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        started = time.perf_counter()
        start = len(seq.cache)
        self.forwarded_tokens += len(tokens)
        if self._lean is not None:
            hidden: list | None = [] if self.keep_features else None
            logits = self._lean.forward(seq.cache, tokens, positions, mask, hidden)  # [1, T, V]
            seq.cache.appended(tokens)
            if hidden:
                self._store_features(seq, start, hidden[0])
            logits = logits[0, :, : self.vocab_size].float()  # [T, V]
            self.busy_s += time.perf_counter() - started
            self.forwards += 1
            return logits
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)  # [1, T]
        kwargs = {}
        if isinstance(mask, dict):
            kwargs["attention_mask"] = {kind: m.to(self.device) for kind, m in mask.items()}
        elif mask is not None:
            kwargs["attention_mask"] = mask.to(self.device)
        with torch.inference_mode():
            if self.keep_features:  # the decoder then the head, as the model's own forward does
                out = self.model.base_model(input_ids=input_ids, position_ids=position_ids, past_key_values=seq.cache.kv, use_cache=True, **kwargs)
                out.logits = self.model.get_output_embeddings()(out.last_hidden_state)
                self._store_features(seq, start, out.last_hidden_state[0])
            else:
                out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=seq.cache.kv, use_cache=True, **kwargs)
        seq.cache.appended(tokens)
        logits = out.logits[0, :, : self.vocab_size].float().cpu()  # [T, V]
        self.busy_s += time.perf_counter() - started
        self.forwards += 1
        return logits

    @staticmethod
    def _store_features(seq: _Sequence, start: int, hidden: torch.Tensor) -> None:
        """Write the hidden states [T, H] of cache slots start.. (growing the buffer by doubling)."""
        end = start + hidden.shape[0]
        buffer = seq.features
        if buffer is None or buffer.shape[0] < end:
            grown = torch.empty(max(end, 64, 2 * (0 if buffer is None else buffer.shape[0])), hidden.shape[-1], dtype=torch.float32)
            if buffer is not None:
                grown[:start] = buffer[:start]
            seq.features = buffer = grown
        buffer[start:end] = hidden.detach().float().cpu()

    def features(self, seq_id, context: list[int], length: int, compute: bool = False) -> torch.Tensor:
        """The last hidden states of the longest prefix of `context[:length]` this tier has
        computed ([m, H] float32, a fresh tensor). With `compute`, the missing positions
        are computed now, in one forward (then m = length): the next `score` of the same
        context finds them cached. Needs `keep_features`."""
        if not self.keep_features:
            raise RuntimeError(f"tier {self.name!r} does not keep its hidden states (keep_features)")
        seq = self._sequence(seq_id)
        have = seq.cache.common_prefix(context[: max(length, 0)])
        if seq.pending is not None:
            have = min(have, seq.pending.prefix_len)
        if compute and have < length:
            self._linear_forward(seq, self._sync(seq, context[:length] + [0])[:-1])  # [0]: _sync keeps >= 1 token to feed
            have = length
        if have <= 0 or seq.features is None:
            return torch.zeros(0, 0)
        return seq.features[:have].clone()

    def _linear_forward(self, seq: _Sequence, tokens: list[int]) -> torch.Tensor:
        start = len(seq.cache)
        return self._forward(seq, tokens, list(range(start, start + len(tokens))), None)

    def _tree_forward(self, seq: _Sequence, tail: list[int], tree: DraftTree, nodes: list[int], depths: list[int]) -> torch.Tensor:
        """Feed the linear `tail` then tree `nodes` (whose ancestors are cached or fed here)."""
        pending = seq.pending
        cached = len(seq.cache)
        first_slot = cached + len(tail)
        for offset, node in enumerate(nodes):
            pending.node_slots[node] = first_slot + offset
        positions = list(range(cached, first_slot)) + [pending.prefix_len + depths[n] for n in nodes]
        mask = tree_attention_mask(
            tree.parents,
            pending.node_slots,
            nodes,
            prefix_len=pending.prefix_len - len(tail),
            tail_len=len(tail),
            total_len=first_slot + len(nodes),
            dtype=self._dtype,
        )
        window = self._sliding_window()
        if window is not None:
            slot_positions = list(range(first_slot + len(nodes)))
            for node, slot in pending.node_slots.items():
                if slot < len(slot_positions):
                    slot_positions[slot] = pending.prefix_len + depths[node]
            windowed = windowed_mask(mask, positions, slot_positions, window)
            layer_types = getattr(self._text_config(), "layer_types", None)
            # per-layer-type masks where the model mixes full and sliding layers (Qwen2, Gemma);
            # one windowed mask where every layer slides (Mistral)
            mask = {"full_attention": mask, "sliding_attention": windowed} if layer_types is not None else windowed
        return self._forward(seq, tail + [tree.tokens[n] for n in nodes], positions, mask)

    def _text_config(self):
        config = self.model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def _sliding_window(self) -> int | None:
        """The window of the model's sliding-attention layers; None when no layer slides."""
        config = self._text_config()
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if not window or (layer_types is not None and "sliding_attention" not in layer_types):
            return None
        return int(window)

    # ---------------------------------------------------------------------- drafting

    def draft(self, seq_id, context, num_tokens, params, generator):
        seq = self._sequence(seq_id)
        feed = self._sync(seq, context)
        tokens: list[int] = []
        rows = []
        threshold = self.exit_by_seq.get(seq_id, self.exit_threshold)
        for _ in range(num_tokens):
            logits = self._linear_forward(seq, feed)[-1]  # [V]
            probs = warp_logits(logits, params)
            token = int(probs.argmax()) if params.greedy else int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)
            rows.append(probs)
            feed = [token]
            if threshold is not None and confidence(logits) < threshold:
                break
        return tokens, (None if params.greedy or not rows else torch.stack(rows))

    def draft_tree(self, seq_id, context, width, depth, params, scheme, generator):
        seq = self._sequence(seq_id)
        tail = self._sync(seq, context)
        tree = DraftTree([], [], None)
        row_list: list[torch.Tensor] = []
        if depth <= 0:
            return tree
        root_logits = self._linear_forward(seq, tail)[-1]  # [V]
        root_probs = warp_logits(root_logits, params)
        seq.pending = _PendingTree(prefix_len=len(context), node_slots={})
        for token in first_candidates(root_logits, root_probs, width, params, scheme, generator):
            tree.tokens.append(token)
            tree.parents.append(-1)
            row_list.append(root_probs)
        frontier = list(range(len(tree.tokens)))
        depths = [0] * len(frontier)
        sure = self.exit_threshold is None or float(confidence(root_logits)) >= self.exit_threshold
        for level in range(1, depth):
            if not sure:  # early exit: every branch's last token fell below the threshold
                break
            logits = self._tree_forward(seq, [], tree, frontier, depths)  # [len(frontier), V]
            if self.exit_threshold is not None:
                sure = bool((confidence(logits) >= self.exit_threshold).any())
            frontier = grow_level(tree, frontier, logits, level, depths, row_list, params, generator)
        tree.draft_rows = None if params.greedy else torch.stack(row_list)
        return tree

    # ------------------------------------------------------------------ verification

    def score(self, seq_id, context, tree, params):
        seq = self._sequence(seq_id)
        tail = self._sync(seq, context)
        if tree.is_chain():
            logits = self._linear_forward(seq, tail + tree.tokens)[len(tail) - 1 :]  # [k+1, V]
        else:
            seq.pending = _PendingTree(prefix_len=len(context), node_slots={})
            logits = self._tree_forward(seq, tail, tree, list(range(len(tree))), tree.depths())
            logits = logits[len(tail) - 1 :]  # root row + one row per node
        return warp_logits(logits, params)

    def accept_path(self, seq_id, path):
        seq = self._sequences.get(seq_id)
        if seq is None or seq.pending is None:
            return  # chains roll back lazily at the next sync
        pending = seq.pending
        kept = list(range(pending.prefix_len))
        for node in path:
            if node not in pending.node_slots:
                break  # the drafter did not feed its last level
            kept.append(pending.node_slots[node])
        seq.cache.keep(kept)
        if seq.features is not None:
            seq.features[: len(kept)] = seq.features[torch.tensor(kept, dtype=torch.long)]
        seq.pending = None


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """The top probability of each row at temperature 1: an early-exit drafter's stopping signal."""
    return torch.softmax(logits.float(), dim=-1).max(dim=-1).values


def first_candidates(root_logits, root_probs, width: int, params: SamplingParams, scheme: str, generator) -> list[int]:
    """The root's children: top-`width` when greedy, without replacement for RSD, else i.i.d."""
    if params.greedy:
        return [int(t) for t in torch.topk(root_logits, min(width, root_logits.numel())).indices]
    if scheme == "rsd":
        return [int(t) for t in draw_without_replacement(root_probs, width, generator)]
    return [int(t) for t in torch.multinomial(root_probs, width, replacement=True, generator=generator)]


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
    """Model-free prompt-lookup drafter: continues the latest earlier occurrence of the context's suffix.

    Its proposals are a deterministic function of the context, i.e. drawn from a point mass,
    so their draft rows are one-hot and verification stays exact.
    """

    can_verify = False
    deterministic_drafts = True
    has_weights = False

    def __init__(self, name: str, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"tier {name!r}: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = name
        self.vocab_size = vocab_size
        self.max_context = None
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def _continuations(self, context: list[int], num_tokens: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations with distinct first tokens, longest matching n-gram first, latest match first."""
        found: list[list[int]] = []
        first_tokens: set[int] = set()
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context[length - n :]
            for start in range(length - n - 1, -1, -1):
                if context[start : start + n] != suffix:
                    continue
                continuation = copy_forward(context, start + n, num_tokens)
                if continuation and continuation[0] not in first_tokens:
                    first_tokens.add(continuation[0])
                    found.append(continuation)
                    if len(found) == limit:
                        return found
        return found

    def _one_hot(self, tokens: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), self.vocab_size).float()

    def draft(self, seq_id, context, num_tokens, params, generator):
        started = time.perf_counter()
        found = self._continuations(context, num_tokens, 1) if num_tokens > 0 else []
        tokens = found[0] if found else []
        self.busy_s += time.perf_counter() - started
        return tokens, (None if params.greedy or not tokens else self._one_hot(tokens))

    def draft_tree(self, seq_id, context, width, depth, params, scheme, generator):
        started = time.perf_counter()
        tree = DraftTree([], [], None)
        for continuation in self._continuations(context, depth, width) if depth > 0 else []:
            parent = -1
            for token in continuation:
                tree.tokens.append(token)
                tree.parents.append(parent)
                parent = len(tree.tokens) - 1
        # nodes must be stored parents-first; chains appended one after another satisfy that
        if not params.greedy and tree.tokens:
            tree.draft_rows = self._one_hot(tree.tokens)
        self.busy_s += time.perf_counter() - started
        return tree
