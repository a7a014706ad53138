"""The slow, obvious reference for the one forward: transformers' own forward over one sequence.

`ReferenceTier` runs a model's `forward` (transformers, on its `DynamicCache`) for one request at a
time: the uncached tail of a context plus a block, a draft tree under a 4-D tree mask with per-node
positions, the accepted path kept afterwards. It answers the runtime tier's questions
(`score_batch`, `draft_batch`, `draft_tree_batch`, `accept_path`) row by row, so a test can put it
beside polyspec's model tier and compare logits, drafts and trees. Nothing in the runtime uses it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from polyspec.workers.core.sampling import warp_logits
from polyspec.workers.core.tree import Blocks, DraftTree, tree_allowed
from polyspec.workers.core.verdicts import Draws


def hidden_states(model, tokens: list[int]) -> torch.Tensor:
    """The last hidden states after the final norm (what the LM head reads) of every position, from scratch; [T, H]."""
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).last_hidden_state[0].float()


class _Sequence:
    def __init__(self, model) -> None:
        self.kv = DynamicCache(config=model.config)
        self.tokens: list[int] = []
        self.tree_prefix: int | None = None  # linear length under an unaccepted tree
        self.node_slots: dict[int, int] = {}


class ReferenceTier:
    """transformers' forward, one sequence per call (see the module docstring)."""

    def __init__(self, model, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size or model.config.vocab_size
        self.dtype = next(model.parameters()).dtype
        self.sequences: dict[object, _Sequence] = {}
        self.logits: list[torch.Tensor] = []  # every forward's raw logits [T, V] float32, in order
        self.exit_threshold: float | None = None  # an early-exit drafter's: a block ends after a token drafted below it

    def _sequence(self, seq_id) -> _Sequence:
        if seq_id not in self.sequences:
            self.sequences[seq_id] = _Sequence(self.model)
        return self.sequences[seq_id]

    def release(self, seq_id) -> None:
        self.sequences.pop(seq_id, None)

    def _truncate(self, seq: _Sequence, length: int) -> None:
        if length < len(seq.tokens):
            seq.kv.crop(length - len(seq.tokens))  # transformers 5: a negative count of tokens to drop
            del seq.tokens[length:]

    def _sync(self, seq: _Sequence, context: list[int]) -> list[int]:
        if seq.tree_prefix is not None:
            self._truncate(seq, seq.tree_prefix)
            seq.tree_prefix, seq.node_slots = None, {}
        keep = 0
        while keep < min(len(seq.tokens), len(context) - 1) and seq.tokens[keep] == context[keep]:
            keep += 1
        self._truncate(seq, keep)
        return context[keep:]

    @torch.inference_mode()
    def _forward(self, seq: _Sequence, tokens: list[int], positions: list[int], mask=None) -> torch.Tensor:
        device = self.model.device
        kwargs = {} if mask is None else {"attention_mask": mask.to(device)}
        out = self.model(input_ids=torch.tensor([tokens], device=device), position_ids=torch.tensor([positions], device=device),
                         past_key_values=seq.kv, use_cache=True, **kwargs)
        seq.tokens.extend(tokens)
        logits = out.logits[0, :, : self.vocab_size].float().cpu()  # [T, V], sampled on the CPU as the runtime tiers do
        self.logits.append(logits)
        return logits

    def _linear(self, seq: _Sequence, tokens: list[int]) -> torch.Tensor:
        start = len(seq.tokens)
        return self._forward(seq, tokens, list(range(start, start + len(tokens))))

    def _tree(self, seq: _Sequence, tail: list[int], tree: DraftTree, nodes: list[int], depths: list[int]) -> torch.Tensor:
        cached = len(seq.tokens)
        first = cached + len(tail)
        for offset, node in enumerate(nodes):
            seq.node_slots[node] = first + offset
        positions = list(range(cached, first)) + [seq.tree_prefix + depths[n] for n in nodes]
        allowed = tree_allowed(tree.parents, seq.node_slots, nodes, prefix_len=seq.tree_prefix - len(tail), tail_len=len(tail),
                               total_len=first + len(nodes))
        # transformers' additive 4-D mask [1, 1, queries, keys]
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]
        return self._forward(seq, tail + [tree.tokens[n] for n in nodes], positions, mask)

    def score_batch(self, seq_ids, contexts, blocks, params) -> list[torch.Tensor]:
        out = []
        for seq_id, context, tree, p in zip(seq_ids, contexts, blocks, params):
            seq = self._sequence(seq_id)
            tail = self._sync(seq, context)
            if tree.is_chain():
                logits = self._linear(seq, tail + tree.tokens)[len(tail) - 1:]
            else:
                seq.tree_prefix = len(context)
                logits = self._tree(seq, tail, tree, list(range(len(tree))), tree.depths())[len(tail) - 1:]
            out.append(warp_logits(logits, p))
        return out

    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        out = []
        for seq_id, context, count, p, generator in zip(seq_ids, contexts, counts, params, generators):
            seq = self._sequence(seq_id)
            feed, tokens, rows = self._sync(seq, context), [], []
            draws = Draws.of([p], [generator], [count], "cpu")  # the runtime's draw rule, one request at a time
            for step in range(count):
                logits = self._linear(seq, feed)[-1]
                token, probs = draws.draw(logits[None].float(), torch.tensor([0]), step)
                token = int(token)
                tokens.append(token)
                rows.append(probs[0])
                feed = [token]
                if self.exit_threshold is not None and float(torch.softmax(logits, -1).max()) < self.exit_threshold:
                    break
            out.append(DraftTree.chain(tokens, None if p.greedy or not rows else torch.stack(rows)))
        return Blocks.of(out)

    def draft_tree_batch(self, seq_ids, contexts, width, depths, params, scheme, generators):
        out = []
        for seq_id, context, depth, p, generator in zip(seq_ids, contexts, depths, params, generators):
            seq = self._sequence(seq_id)
            tail = self._sync(seq, context)
            tree, rows = DraftTree([], [], None), []
            if depth > 0:
                root_logits = self._linear(seq, tail)[-1]
                seq.tree_prefix = len(context)
                draws = Draws.of([p], [generator], [depth], "cpu")  # the runtime's draw rule, one request at a time
                candidates, valid, root_rows = draws.roots(root_logits[None].float(), torch.tensor([0]), width, scheme == "rsd")
                for token, ok in zip(candidates[0].tolist(), valid[0].tolist()):
                    if ok:
                        tree.tokens.append(token)
                        tree.parents.append(-1)
                        rows.append(root_rows[0])
                frontier = list(range(len(tree.tokens)))
                node_depths = [0] * len(frontier)
                for level in range(1, depth):
                    if not frontier:
                        break
                    logits = self._tree(seq, [], tree, frontier, node_depths).float()  # [len(frontier), V]
                    drawn, probs = draws.draw(logits, torch.zeros(len(frontier), dtype=torch.long), level,
                                              torch.arange(len(frontier)) * logits.shape[-1])
                    grown = []
                    for w, parent in enumerate(frontier):
                        tree.tokens.append(int(drawn[w]))
                        tree.parents.append(parent)
                        rows.append(probs[w])
                        node_depths.append(level)
                        grown.append(len(tree.tokens) - 1)
                    frontier = grown
                tree.draft_rows = None if p.greedy or not rows else torch.stack(rows)
            out.append(tree)
        return Blocks.of(out)

    def accept_path(self, seq_id, path: list[int]) -> None:
        """Keep the linear context and the accepted path: recomputed from scratch (slow and obvious)."""
        seq = self.sequences.get(seq_id)
        if seq is None or seq.tree_prefix is None:
            return
        kept = seq.tokens[: seq.tree_prefix] + [seq.tokens[seq.node_slots[n]] for n in path if n in seq.node_slots]
        self.sequences[seq_id] = fresh = _Sequence(self.model)
        self._linear(fresh, kept)
        self.logits.pop()  # not a forward the runtime tier makes


class OneAtATime:
    """A runtime tier asked about one request per call: each row alone in its batch. Beside the same tier
    asked about all rows at once, it checks that a request's drafts, draws and rows do not depend on what
    else is in the batch."""

    def __init__(self, tier) -> None:
        self.inner = tier

    def __getattr__(self, name):  # bookkeeping calls and fields (truncate, release, accept_path, cached, tier) as they are
        return getattr(self.inner, name)

    def draft_batch(self, seq_ids, contexts, counts, params, generators):
        return Blocks.of([self.inner.draft_batch([s], [c], [n], [p], [g])[0]
                          for s, c, n, p, g in zip(seq_ids, contexts, counts, params, generators)])

    def draft_tree_batch(self, seq_ids, contexts, width, depths, params, scheme, generators):
        return Blocks.of([self.inner.draft_tree_batch([s], [c], width, [d], [p], scheme, [g])[0]
                          for s, c, d, p, g in zip(seq_ids, contexts, depths, params, generators)])

    def score_batch(self, seq_ids, contexts, blocks, params):
        return [self.inner.score_batch([s], [c], Blocks.of([b]), [p])[0] for s, c, b, p in zip(seq_ids, contexts, blocks, params)]


def greedy_one_token_at_a_time(model, prompt_ids: list[int], count: int, eos: int) -> list[int]:
    """The model's own greedy decode: the prompt, then one token per forward on transformers' KV cache."""
    cache, out = DynamicCache(), []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids]), cache=cache, use_cache=True).logits[0, -1]
        while len(out) < count:
            token = int(logits.argmax())
            out.append(token)
            if token == eos:
                break
            logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return out
