"""A per-sequence KV cache with exact rollback, on top of transformers' DynamicCache.

Rollback is what makes speculative decoding cheap: after a verdict a tier keeps the KV
entries of the accepted prefix and drops the rest, instead of re-running the prefill.
Two operations cover every case:

- `truncate(n)`: keep the first n positions (a rejected chain suffix is dropped).
  transformers 5.x `DynamicCache.crop` takes a *negative* count of positions to drop;
  this wrapper speaks absolute lengths and is tested directly.
- `keep(positions)`: keep the listed positions, in order (after a tree verification only
  the accepted path's nodes survive, packed right after the committed prefix).

The wrapper also remembers which token sits at each cached position, so a tier can find
how much of a new context it already has (`common_prefix`).

Sliding-window attention layers (Mistral, Gemma, Qwen2 with `use_sliding_window`) get a
full-length layer here instead of transformers' windowed one, which drops the entries
that slide out and so cannot roll back past them. The window is still applied, by the
attention mask (transformers builds it from the config; a tree forward's own mask gets
it in `polyspec.workers.core.tree.windowed_mask`), so the model computes exactly what it
computes with its own cache, for the price of keeping the whole context's KV.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class SequenceCache:
    def __init__(self, model_config) -> None:
        self.kv = DynamicCache(config=model_config)
        # a full layer for every sliding one (see the module doc): exact rollback past the window
        self.kv.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in self.kv.layers]
        self.tokens: list[int] = []  # token at each cached position (tree nodes included)

    def __len__(self) -> int:
        return len(self.tokens)

    def common_prefix(self, context: list[int]) -> int:
        """Length of the longest prefix of `context` already cached in order."""
        limit = min(len(self.tokens), len(context))
        n = 0
        while n < limit and self.tokens[n] == context[n]:
            n += 1
        return n

    def appended(self, tokens: list[int]) -> None:
        """Record tokens the model just wrote into the cache by a forward."""
        self.tokens.extend(tokens)
        assert self.kv.get_seq_length() == len(self.tokens), (self.kv.get_seq_length(), len(self.tokens))

    def truncate(self, length: int) -> None:
        drop = len(self.tokens) - length
        if drop <= 0:
            return
        self.kv.crop(-drop)
        del self.tokens[length:]
        assert self.kv.get_seq_length() == length

    def keep(self, positions: list[int]) -> None:
        """Keep only `positions` (strictly increasing), packed to the front."""
        if positions == list(range(len(positions))):
            self.truncate(len(positions))
            return
        index = torch.tensor(positions, dtype=torch.long)
        for layer in self.kv.layers:
            if not hasattr(layer, "keys") or type(layer).__name__ != "DynamicLayer":
                raise NotImplementedError(f"tree rollback needs full-attention cache layers, got {type(layer).__name__}")
            index = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)  # [B, H, len(positions), D]
            layer.values = layer.values.index_select(-2, index)
        self.tokens = [self.tokens[p] for p in positions]
