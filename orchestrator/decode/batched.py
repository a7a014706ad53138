"""The batched scheduler: one verification round of every active request per step.

`BatchedScheduler.step_all(states)` runs the round of `ChainScheduler.step` for all the
given requests together: each tier's forward of the round takes every request's block at
once (ragged blocks and contexts, `polyspec.workers.tiers.batched`). Per request the round
is the serial one — same blocks, same verification rule, same draws from the same
per-tier generators — so a request's output does not depend on what else is in the batch
(up to the last bits of batched float arithmetic) and seeds mean what they mean alone.

    round_batch(level, R):  blocks = emit_batch(below, R, k_level)      # one block per request
                            rows   = tier[level].score_batch(R, blocks)  # ONE forward
                            verify each request against its own rows and generator
    emit_batch(level, R, need): bottom tier: draft_batch (one forward per position)
                            otherwise: round_batch(level, those still short) until each has `need`

With `tree_width > 1` the bottom tier proposes a draft tree per request instead of a chain
(`draft_tree_batch`: one forward per tree level, all requests in it), as `ChainScheduler`
does; the tier above scores every request's tree in its one forward (tree rows beside
chain rows), each request walks its own tree with its own generator (`verify_tree`, the
config's scheme) and both tiers keep only the accepted path (`accept_path`).

Requests join and leave between steps (continuous batching): `start` opens one, `prefill`
caches new prompts within a token budget before they join the rounds (chunked prefill),
`finish` / `cancel` free its slots. The lengths and tiers of the round are the same for
every request of a step; a planner (polyspec.orchestrator.tuning.batch_model) sets them
for the current batch size before each step (with trees, the depth of the bottom
drafter's trees; their width stays the config's).
"""

from __future__ import annotations

import time

import torch

from polyspec.orchestrator.decode.contract import GenerationOutput, RequestState, commit, finish_if_full, note_plan, remaining, stage_of
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.orchestrator.decode.approximate import scoring, verdict
from polyspec.workers.core.tree import DraftTree
from polyspec.workers.tiers.batched import BatchedTier

DEFAULT_PREFILL_BUDGET = 512  # prompt tokens cached per step for joining requests
CATCH_UP_GAP = 16  # a drafting tier this many tokens behind a request is caught up before the round, not in it


class BatchedScheduler(ChainScheduler):
    """A `polyspec.orchestrator.decode.contract.Decoder`: `ChainScheduler`'s requests (start /
    finish / cancel, its seeds and stats), advanced many per forward by `step_all`."""

    def __init__(self, tiers: list[BatchedTier], lengths: list[int], eos_token_ids: tuple[int, ...] = (), planner=None,
                 prefill_budget: int = DEFAULT_PREFILL_BUDGET, tree_width: int = 1, scheme: str = "specinfer",
                 draft_ahead: bool = False) -> None:
        super().__init__(tiers, lengths, tree_width=tree_width, scheme=scheme, eos_token_ids=eos_token_ids, draft_ahead=draft_ahead)
        self.planner = planner  # polyspec.orchestrator.tuning.batch_model.BatchPlanner or None
        self.prefill_budget = prefill_budget
        self.last_step: dict = {}  # batch size, tokens, seconds and plan of the latest step
        # optional hook on every verification round: (run, level, drafter, length, proposed, accepted, seconds);
        # the distributed tier worker turns rounds into stage reports with it
        self.on_round = None

    # ------------------------------------------------------------------ API

    def step(self, state: RequestState) -> list[int]:
        return self.step_all([state])[0]

    def prefill_tiers(self) -> list[BatchedTier]:
        """The tiers a joining request's prompt is cached in before it joins the rounds: every model tier
        of a fixed chain; only the target under a planner, since the drafters are not used while
        speculation is off and catch up (`catch_up`) when a plan uses them. A tier served row by
        row (a feature head, another architecture) caches what it is given in its own calls."""
        tiers = self.tiers[:1] if self.planner is not None else self.tiers
        return [t for t in tiers if t.has_weights and t.caches_prompts]

    def ready(self, state: RequestState) -> bool:
        """Has every tier of `prefill_tiers` cached the request's prompt (all but its last token)?"""
        need = len(state.committed) - 1
        return all(t.cached(state.run.seq_id) >= need for t in self.prefill_tiers())

    def prefill(self, states: list[RequestState], budget: int | None = None) -> int:
        """Cache prompts of requests not yet `ready`, oldest first, at most `budget` tokens per tier."""
        budget = self.prefill_budget if budget is None else budget
        waiting = [s for s in states if not s.done and not self.ready(s)]
        fed = 0
        for tier in self.prefill_tiers():
            if waiting:
                fed += tier.prefill([s.run.seq_id for s in waiting], [s.committed for s in waiting], budget)
        return fed

    def catch_up(self, states: list[RequestState]) -> None:
        """Cache in each drafting model tier of the plan the contexts it is far behind on, in one
        forward per tier, before the round (whose forwards pad every row to the longest)."""
        for level in self.active[1:]:
            tier = self.tiers[level]
            if not tier.caches_prompts:
                continue
            behind = [s for s in states if len(s.committed) - 1 - tier.cached(s.run.seq_id) > CATCH_UP_GAP]
            if behind:
                tier.prefill([s.run.seq_id for s in behind], [s.committed for s in behind], sum(len(s.committed) for s in behind))

    def step_all(self, states: list[RequestState]) -> list[list[int]]:
        """One target round for every request in `states`; the newly committed tokens of each."""
        started = time.perf_counter()
        out: list[list[int]] = [[] for _ in states]
        live = []
        for index, state in enumerate(states):
            if not finish_if_full(state):
                live.append(index)
        if not live:
            return out
        if self.planner is not None:
            behind = {level: sum(max(0, len(states[i].committed) - 1 - tier.cached(states[i].run.seq_id)) for i in live)
                      for level, tier in enumerate(self.tiers) if level and tier.has_weights}
            self.lengths, self.active = self.planner.plan(len(live), [states[i].run.params for i in live], behind)
            for i in live:
                note_plan(states[i].plans, len(states[i].new_tokens), [self.lengths[t] for t in self.active[:-1]],
                          [self.tiers[t].name for t in self.active])
        if self.planner is not None:  # in the step's time: keeping a drafter's cache up to date is part of what speculating costs
            self.catch_up([states[i] for i in live])
        busy_before = [t.busy_s for t in self.tiers]
        items = []
        for i in live:
            state = states[i]
            items.append((state.run, list(state.committed), min(self.length_at(0), remaining(state) - 1)))
        results = self.round_batch(0, items)
        spent = [t.busy_s - b for t, b in zip(self.tiers, busy_before)]
        committed = 0
        for i, (emitted, _) in zip(live, results):
            state = states[i]
            emitted = commit(state, emitted, self.eos_token_ids)
            for t, seconds in enumerate(spent):
                state.tier_busy_s[t] += seconds / len(live)  # a shared forward: each request's share
            out[i] = emitted
            committed += len(emitted)
        seconds = time.perf_counter() - started
        self.last_step = {"batch": len(live), "tokens": committed, "seconds": seconds,
                          "lengths": [self.lengths[t] for t in self.active[:-1]], "tiers": list(self.active)}
        if self.planner is not None:
            self.planner.observe_step(len(live), committed, seconds, self.lengths, self.active)
        return out

    def finish(self, state: RequestState) -> GenerationOutput:
        result = super().finish(state)
        if self.planner is not None:
            result.stats["plans"] = state.plans
        return result

    # ------------------------------------------------------------ the round

    def below(self, level: int) -> int | None:
        return next((t for t in self.active if t > level), None)

    def length_at(self, level: int) -> int:
        return self.lengths[level] if level < len(self.lengths) else 0

    @staticmethod
    def room(run, context: list[int]) -> int:
        return max(0, run.limit - len(context) - 1)

    def emit_batch(self, level: int, items: list[tuple]) -> list[tuple[list[int], torch.Tensor | None]]:
        """At least `need` tokens from tier `level` for each (run, context, need), with its rows."""
        tier = self.tiers[level]
        items = [(run, context, min(need, self.room(run, context))) for run, context, need in items]
        if self.below(level) is None:
            return tier.draft_batch([r.seq_id for r, _, _ in items], [c for _, c, _ in items], [n for _, _, n in items],
                                    [r.params for r, _, _ in items], [r.generators[level] for r, _, _ in items])
        tokens: list[list[int]] = [[] for _ in items]
        rows: list[list[torch.Tensor]] = [[] for _ in items]
        stopped = [False] * len(items)
        while True:
            short = [j for j, (run, context, need) in enumerate(items) if not stopped[j] and len(tokens[j]) < need]
            if not short:
                break
            round_items = []
            for j in short:
                run, context, _ = items[j]
                ctx = context + tokens[j]
                round_items.append((run, ctx, min(self.length_at(level), self.room(run, ctx))))
            for j, (emitted, emitted_rows) in zip(short, self.round_batch(level, round_items)):
                tokens[j] += emitted
                if emitted_rows is not None:
                    rows[j].append(emitted_rows)
                if any(t in self.eos_token_ids for t in emitted):
                    stopped[j] = True  # nothing after an end of sequence will be kept
        out = []
        for j, (run, context, _) in enumerate(items):
            kept = tokens[j][: self.room(run, context)]  # rounds overshoot `need`; keep what fits
            out.append((kept, torch.cat(rows[j])[: len(kept)] if rows[j] else None))
        return out

    def round_batch(self, level: int, items: list[tuple]) -> list[tuple[list[int], torch.Tensor | None]]:
        """One verification forward of tier `level` over every (run, context, length)."""
        tier = self.tiers[level]
        below = self.below(level)
        blocks = [DraftTree([], [], None) for _ in items]
        if below is not None:
            wanted = [j for j, (_, _, length) in enumerate(items) if length > 0]
            if wanted and self.tree_width > 1 and self.below(below) is None:
                runs = [items[j][0] for j in wanted]
                trees = self.tiers[below].draft_tree_batch([r.seq_id for r in runs], [items[j][1] for j in wanted], self.tree_width,
                                                           [items[j][2] for j in wanted], [r.params for r in runs], self.scheme,
                                                           [r.generators[below] for r in runs])
                for j, tree in zip(wanted, trees):
                    blocks[j] = tree
            elif wanted:
                emitted = self.emit_batch(below, [items[j] for j in wanted])
                for j, (tokens, rows) in zip(wanted, emitted):
                    blocks[j] = DraftTree.chain(tokens, rows)
        started = time.perf_counter()
        # each block and params as scored: (block, run.params) unless an approximate rule applies
        scored = [scoring(run, level, context, block) for (run, context, _), block in zip(items, blocks)]
        probs = tier.score_batch([r.seq_id for r, _, _ in items], [c for _, c, _ in items], [b for b, _ in scored], [p for _, p in scored])
        seconds = (time.perf_counter() - started) / len(items)
        out = []
        for (run, context, length), block, target_probs in zip(items, blocks, probs):
            path, next_token = verdict(run, level, target_probs, block, self.scheme, run.generators[level])
            if not block.is_chain():  # both tiers keep the accepted path, as in ChainScheduler.verify_round
                tier.accept_path(run.seq_id, path)
                self.tiers[below].accept_path(run.seq_id, path)
            if below is not None:
                stage_of(run.stages, run.bypass_stages, self.tiers, level, below).record(len(block), len(path), length, seconds)
                if self.planner is not None:
                    # a tree's per-depth acceptance prices trees; a walk that ran out of nodes (a lookup's
                    # short branch) accepted all it was offered
                    depth = None if block.is_chain() else (len(path) if path and not block.children(path[-1])
                                                           else max(block.depths()) + 1)
                    self.planner.observe_round(level, below, len(block), len(path), run.params.greedy, depth)
                if self.on_round is not None:
                    self.on_round(run, level, below, length, len(block), len(path), seconds)
            # a drafter that drafts ahead (a remote tier, pipelined) has already gone past a block
            # accepted whole: no bonus token, its continuation is verified next (ChainScheduler.verify_round)
            no_bonus = (self.draft_ahead and below is not None and self.tiers[below].continues_past(run.seq_id)
                        and 0 < len(path) == len(block) == length)
            if below is not None:
                self.tiers[below].verdict(run.seq_id, len(context), len(block), len(path), None if no_bonus else next_token)
            emitted = [block.tokens[j] for j in path] + ([] if no_bonus else [next_token])
            if run.params.greedy:
                rows = None
            else:  # the verifier's row at the root and below each accepted node
                rows = target_probs[: len(path) + 1] if block.is_chain() else target_probs[[0] + [j + 1 for j in path]]
                rows = rows[: len(emitted)]
            out.append((emitted, rows))
        return out
