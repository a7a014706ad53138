"""Draft trees on a device tier (polyspec.workers.tiers.static_tier: `StaticModelTier` mixes these steps in).

- `draft_tree_batch`: each request's tree of `width` chains sharing the root, one static step per
  level for every request at once (device_step.tree_root_step, tree_level_step);
- `_verify_trees`: every request's tree in ONE step (device_step.target_tree_step: tree attention,
  the warp, polyspec.workers.core.device_tree_verify's walk), one copy of each path and next token;
- `accept_path` / `_compact`: keep the accepted path, its nodes' keys and values moved from
  prefix + node index to prefix + depth for every slot at once (one gather / scatter per layer).

A tree's node j is cached at the row's prefix length + j (a drafter's level L node of chain w at
prefix + L * width + w), not at prefix + depth where a linear context keeps it; until
`accept_path` the nodes are pending (`PendingTree`, outside the slot's tokens). The moves are made
before the next step reads the pool: the verifier's right after its verdicts, a drafter's at its
next call. The methods use the tier's slots and bookkeeping (`slot_table`, `_trees`,
`_moves`, `_prepare`, `_drafting`, `_column`, `_sampling`, `_streams`, `_span`, `_timed`).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from polyspec.workers.core.device_tree_verify import pack_trees
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import DraftTree, path_rows, tree_allowed
from polyspec.workers.tiers.batched import BatchedTier, Verdict
from polyspec.workers.tiers.device_step import (DRAFT_TAIL, GREEDY, MAX_BLOCK_TOKENS, bucket, sampling_mode, target_tree_step,
                                                tree_level_step, tree_root_step)


@dataclasses.dataclass
class PendingTree:
    """A slot's tree nodes cached past its context: not context until `accept_path` keeps a path (module docstring)."""

    prefix_len: int  # the context the tree hangs off (the slot's tokens)
    columns: dict[int, int]  # node index -> where its KV sits in the slot, for the nodes fed
    tokens: list[int]  # the tree's tokens


class TreeSteps:
    """The tree calls of a device tier (module docstring)."""

    def accept_path(self, seq_id, path: list[int]) -> None:
        """After a tree verdict keep the context and the accepted path's nodes (node indices, root to leaf; a
        drafter stops at the last node it fed), their KV moved to prefix + depth by the next `_compact`."""
        slot = self.slot_table.slot_of.get(seq_id)
        tree = None if slot is None else self._trees.pop(slot, None)
        if tree is None:
            return  # chains roll back at the next sync
        kept = self.slot_table.tokens[slot]
        del kept[tree.prefix_len:]
        for depth, node in enumerate(path):
            column = tree.columns.get(node)
            if column is None:
                break
            if column != tree.prefix_len + depth:
                self._moves.append((slot, column, tree.prefix_len + depth))
            kept.append(tree.tokens[node])

    def _compact(self) -> None:
        """Make the pending moves of accepted tree nodes, every slot's at once: one gather / scatter per layer."""
        if not self._moves:
            return
        slots, sources, targets = (torch.tensor(column, dtype=torch.long).to(self.device) for column in zip(*self._moves))
        self._moves = []
        with torch.inference_mode():
            for keys, values in zip(self.pool.keys, self.pool.values):
                # [moves, kv_heads, D]: every source is read before any target is written
                keys[slots, :, targets] = keys[slots, :, sources]
                values[slots, :, targets] = values[slots, :, sources]

    def _hold_tree(self, slot: int, context: list[int], tree: DraftTree) -> None:
        """The slot after a step wrote [root, tree nodes]: its context, the nodes pending at prefix + index."""
        self.slot_table.tokens[slot].append(context[-1])
        self._trees[slot] = PendingTree(len(context), {j: len(context) + j for j in range(len(tree))}, list(tree.tokens))

    def _verify_trees(self, seq_ids, contexts, blocks: list[DraftTree], params: list[SamplingParams], generators, want_rows: bool,
                      scheme: str, below: BatchedTier | None) -> list[Verdict]:
        """Every request's tree (or empty block) in ONE step (device_step.target_tree_step); then both tiers keep
        only the accepted path, this tier's nodes moved in one `_compact` for the whole batch."""
        slots = self._prepare(seq_ids, contexts, keep_tail=1)
        count = len(seq_ids)
        rows = bucket(count)
        nodes = max(len(b) for b in blocks)
        assert nodes <= MAX_BLOCK_TOKENS, f"a tree of {nodes} nodes (at most {MAX_BLOCK_TOKENS})"
        max_depth = max((max(b.depths()) + 1 for b in blocks if len(b)), default=0)
        max_width = max(max(collections.Counter(b.parents).values(), default=1) for b in blocks)
        mode = sampling_mode(params)
        ids, positions, ancestors = self._tree_rows(contexts, blocks, rows, nodes)
        # greedy requests read no draft rows (a greedy step none at all: a placeholder keeps the step's signature)
        stripped = [DraftTree(b.tokens, b.parents, None) if p.greedy else b for b, p in zip(blocks, params)]
        padding = [DraftTree([], [], None)] * (rows - count)
        vocab = 1 if mode == GREEDY else self.model.vocab_size
        node_tokens, parents, num_nodes, draft_probs = pack_trees(stripped + padding, nodes, vocab, self.device)
        for r, (b, p) in enumerate(zip(blocks, params)):
            if not p.greedy and len(b) and b.draft_rows is None:  # a lookup's proposals are point masses
                draft_probs[r, : len(b)].scatter_(1, node_tokens[r, : len(b), None], 1.0)
        seeds, counters = self._streams(generators, [1] * count, rows)
        span = self._span(max(len(c) for c in contexts) + nodes)

        def verifying(*tensors):
            return target_tree_step(self.model, self.pool, *tensors[:3], span, mode, scheme, max_depth, max_width, *tensors[3:])

        self._set_threads()
        started = time.perf_counter()
        verdicts, target_rows = self.graphs.run(
            ("tree", rows, nodes, span, mode, scheme, max_depth, max_width), verifying,
            [ids, positions, self._column(slots, rows, torch.long, self.pool.scratch_slot), *self._sampling(params, rows),
             ancestors, node_tokens, parents, num_nodes, draft_probs, seeds, counters])
        host = verdicts[:count].cpu().tolist()  # the step's one copy to the host: [path..., path length, next token] per request
        self._timed(started, rows, nodes + 1)
        self._forwarded += sum(len(b) + 1 for b in blocks)
        out = []
        for r, (seq_id, slot, context, b, p) in enumerate(zip(seq_ids, slots, contexts, blocks, params)):
            path, next_token = host[r][: host[r][max_depth]], host[r][max_depth + 1]
            self._hold_tree(slot, context, b)
            self.accept_path(seq_id, path)
            if below is not None and not b.is_chain():
                below.accept_path(seq_id, path)
            # the verifier's rows at the root and below each accepted node (a copy: the graph's buffers are reused)
            kept_rows = path_rows(target_rows[r], b, path).clone() if want_rows and not p.greedy else None
            out.append(Verdict(path, next_token, kept_rows))
        self._compact()
        return out

    def _tree_rows(self, contexts, blocks: list[DraftTree], rows: int, nodes: int) -> tuple[torch.Tensor, ...]:
        """ids and rotary positions [R, N + 1] and ancestors [R, N + 1, N + 1] of every request's [root, tree nodes]
        (`BatchedLlama.step`'s tree rows: the root at its position, node j at prefix length + its depth, seeing the
        root and its ancestors); padding rows and columns see only themselves."""
        ids = self._column([[c[-1]] + b.tokens + [0] * (nodes - len(b)) for c, b in zip(contexts, blocks)], rows, torch.long,
                           [0] * (nodes + 1))
        positions = self._column([[len(c) - 1] + [len(c) + d for d in b.depths()] + list(range(len(c) + len(b), len(c) + nodes))
                                  for c, b in zip(contexts, blocks)], rows, torch.long, list(range(nodes + 1)))
        ancestors = torch.eye(nodes + 1, dtype=torch.bool).repeat(rows, 1, 1)
        for r, b in enumerate(blocks):
            size = len(b) + 1  # column 0: the root (a linear token), column 1 + j: node j
            ancestors[r, :size, :size] = tree_allowed(b.parents, list(range(1, size)), list(range(len(b))), 0, 1, size)
        return ids, positions, ancestors.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def draft_tree_batch(self, seq_ids, contexts, width: int, depths: list[int], params, scheme: str,
                         generators) -> list[DraftTree]:
        """Each request's draft tree: `width` chains of `depths[r]` tokens sharing the root (`ModelTier.draft_tree`'s
        shape, `first_candidates`' rules: the top `width` when greedy, without replacement for rsd, else i.i.d.), one
        static step per level for every request at once: the root's candidates, then one child below each of the
        `width` frontier nodes. Level L draws from round counter + L of the request's stream, so a seeded request draws
        the same alone or in any batch. One copy of the tokens to the host at the end; the rows stay on the device.
        The nodes fed stay cached, pending, until `accept_path` keeps the accepted path's. With the tier's
        `exit_threshold` (an early-exit drafter) a tree ends below the first level none of whose rows is that sure,
        as `ModelTier.draft_tree`'s: every level is still computed (static), the host cuts the tree."""
        trees = [DraftTree([], [], None) for _ in seq_ids]
        inputs = self._drafting(seq_ids, contexts, depths, params, generators)
        if inputs is None:
            return trees
        live, contexts, slots, params = inputs.live, inputs.contexts, inputs.slots, inputs.params
        rows, mode = inputs.rows, inputs.mode
        ids, positions = inputs.ids, inputs.positions
        count, levels = len(live), max(depths[r] for r in live)
        assert width * levels <= MAX_BLOCK_TOKENS, f"a tree of {width} x {levels} nodes (at most {MAX_BLOCK_TOKENS})"
        longest = max(len(c) for c in contexts)
        span = self._span(longest)
        without_replacement = scheme == "rsd"
        threshold = self.tier.exit_threshold
        exits = threshold is not None

        def rooting(*tensors):
            return tree_root_step(self.model, self.pool, *tensors[:3], span, mode, width, without_replacement, *tensors[3:],
                                  confidence=exits)

        self._set_threads()
        started = time.perf_counter()
        # graph outputs: each level's key is its own, so none is overwritten before the copies below
        tokens, valid, root_probs, *confident = self.graphs.run(
            ("tree root", rows, span, mode, width, without_replacement, exits), rooting,
            [ids, positions, inputs.slot_column, *inputs.sampling, inputs.seeds, inputs.counters])
        level_confidence = confident  # [R] per level: the most confident row its nodes were drawn from
        level_tokens = [tokens]
        level_probs = [root_probs[:, None].expand(rows, width, root_probs.shape[-1])]  # each root candidate's row: the root's
        prefix = self._column([len(c) for c in contexts], rows, torch.long, 0)  # [R] where each tree's first column is cached
        for level in range(1, levels):
            columns = level * width  # level l's node of chain w sits in column l * width + w and sees its own chain's
            ancestors = (torch.arange(columns, device=self.device) % width == torch.arange(width, device=self.device)[:, None])
            level_span = self._span(longest + columns)

            def growing(*tensors, span=level_span):
                return tree_level_step(self.model, self.pool, *tensors[:3], span, mode, *tensors[3:], confidence=exits)

            tokens, probs, *confident = self.graphs.run(
                ("tree level", rows, width, columns, level_span, mode, exits), growing,
                [level_tokens[-1], (prefix + level - 1)[:, None].expand(rows, width), inputs.slot_column,
                 ancestors.expand(rows, width, columns), prefix, *inputs.sampling, inputs.seeds, inputs.counters + level])
            level_confidence += confident
            level_tokens.append(tokens)
            level_probs.append(probs)
        unsure = [(c < threshold).long()[:, None] for c in level_confidence]  # [R, 1] per level (an early exit's)
        # [R, levels * W tokens, W valid (, levels unsure)]
        drafted = torch.cat([torch.stack(level_tokens, dim=1).flatten(1), valid.long(), *unsure], dim=1)[:count]
        host = drafted.cpu().tolist()  # the drafter's one copy to the host
        self._timed(started, rows, levels)
        self._forwarded += count * (DRAFT_TAIL + (levels - 1) * width)
        chains_of = [[w for w in range(width) if host[index][levels * width + w]] for index in range(count)]
        kept_depths = {}  # live index -> its tree's depth: cut after the first level drawn from rows none of which was sure
        for index, r in enumerate(live):
            flags = host[index][(levels + 1) * width:]
            kept_depths[index] = min(depths[r], next((level + 1 for level, flag in enumerate(flags) if flag), depths[r]))
        for index, (r, slot, context) in enumerate(zip(live, slots, contexts)):
            tree, chains, columns = trees[r], chains_of[index], {}
            for level in range(kept_depths[index]):
                for w in chains:
                    if level + 1 < levels:  # fed by the next level's step (the last level's nodes are not)
                        columns[len(tree.tokens)] = len(context) + level * width + w
                    tree.parents.append(-1 if level == 0 else len(tree.tokens) - len(chains))
                    tree.tokens.append(host[index][level * width + w])
            self.slot_table.tokens[slot] = list(context)
            self._trees[slot] = PendingTree(len(context), columns, list(tree.tokens))
        sampled = [index for index in range(count) if not params[index].greedy]
        if mode != GREEDY and sampled:  # every sampled tree's rows in one gather, level by level as its nodes
            picks = [(index, level, w) for index in sampled for level in range(kept_depths[index]) for w in chains_of[index]]
            request, level, chain = torch.tensor(picks, dtype=torch.long).to(self.device).unbind(1)
            node_rows = torch.stack(level_probs, dim=1)[request, level, chain]  # [nodes of every sampled tree, V]
            for index, tree_rows in zip(sampled, node_rows.split([len(trees[live[index]]) for index in sampled])):
                trees[live[index]].draft_rows = tree_rows
        return trees
