"""The chain scheduler: staged polybasic speculative decoding, one round for every request.

    round_batch(level, R):  blocks   = emit_batch(below, R, k_level)          # one block per request
                            verdicts = tier[level].verify_batch(R, blocks)    # ONE forward, every block verified
    emit_batch(level, R, need): bottom tier: draft_batch (one forward per position)
                            otherwise: round_batch(level, those still short) until each has `need`

docs/architecture.md ("The chain and staged verification", "The round", "Trees") derives why the
chain is lossless and walks through a round. This is the only implementation of that round, and it
always runs on a batch: `step_all` advances every given request by one target round; `step` is a
batch of one. The engine's one request loop drives it, and so does each tier worker of a distributed
chain (its own two-tier chain [this tier, the tier below], one round per VerifyBatch / DraftBatch).
Per request the round is the serial one (same blocks, same verification rule, same draws from the
same per-tier streams), so a request's output does not depend on what else is in the batch (up to
the last bits of batched float arithmetic) and seeds mean what they mean alone. An approximate
mode's rule (polyspec.orchestrator.decode.approximate) takes `score_batch` and its own check.

Requests join and leave between steps (continuous batching): `start` opens one, `prefill` caches new
prompts within a token budget before they join the rounds (chunked prefill), `finish` / `cancel` free
its slots. A planner (`contract.RoundPlanner`) sets a step's lengths and tiers, the same for every
request in it, and observes every round, draft and step; an optional `recorder` observes them too (a
tier worker turns rounds into stage reports).

Prefix reuse (`keep_finished`): a finished request's caches may stay in the tiers, and a later
request whose prompt shares a prefix with its tokens (a conversation's next turn) runs under its
sequence id; every tier keeps the cached prefix and forwards only the rest, so the new request
prefills only its new tokens and computes what it would from scratch.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from polyspec.orchestrator.decode.contract import (
    NO_LIMIT,
    DraftObservation,
    GenerationOutput,
    KeptSequences,
    RequestState,
    RoundObservation,
    ShadowObservation,
    StageStats,
    StepInput,
    StepObservation,
    commit,
    finish_if_full,
    mark_cancelled,
    note_plan,
    note_round,
    output,
    plan_records,
    remaining,
    stage_of,
    tier_seeds,
)
from polyspec.orchestrator.decode.approximate import scoring, verdict
from polyspec.workers.core.context import Context, extended
from polyspec.workers.core.sampling import RandomStream, SamplingParams
from polyspec.workers.core.tree import Blocks, common_prefix, path_rows
from polyspec.workers.core.verdicts import Verdict
from polyspec.workers.tiers.batched import BatchedTier
from polyspec.workers.tiers.tier import scratch_score, scratch_sequence


DEFAULT_PREFILL_BUDGET = 512  # prompt tokens cached per step for joining requests
CATCH_UP_GAP = 16  # a drafting tier this many tokens behind a request is caught up before the round, not in it

_sequence_ids = itertools.count()


@dataclasses.dataclass
class Run:
    """Everything one request's rounds mutate: the unit of the public round API.

    `ChainScheduler.start` makes one per request; a distributed tier worker makes its own
    (one per sequence it serves) and runs `round_batch` / `emit_batch` on it."""

    seq_id: int
    params: SamplingParams
    generators: list[torch.Generator]  # one per tier of the scheduler, target first
    stages: list[StageStats]  # [i]: tier i verifying tier i + 1
    limit: int = NO_LIMIT  # no position may reach this (the smallest model context)
    forwarded_tokens: list[int] = dataclasses.field(default_factory=list)  # [i]: tokens tier i's forwards took for this request
    bypass_stages: dict[tuple[int, int], StageStats] = dataclasses.field(default_factory=dict)  # (tier, drafter) when a tier is bypassed
    # an approximate mode's rule for the target's check (polyspec.orchestrator.decode.approximate); None: exact
    rule: object = None


FROM_TIERS = "tiers"  # `max_context` default: the smallest context among the tiers


def catch_up(tier: BatchedTier, runs: list[Run], contexts: list[list[int]]) -> None:
    """Cache in `tier`, in one forward, the contexts it is more than CATCH_UP_GAP tokens behind on (a joining
    request's prompt), so the round's forwards do not pad every row to that context's length."""
    if not tier.caches_prompts:
        return
    behind = [j for j, (run, context) in enumerate(zip(runs, contexts)) if len(context) - 1 - tier.cached(run.seq_id) > CATCH_UP_GAP]
    if behind:
        tier.prefill([runs[j].seq_id for j in behind], [contexts[j] for j in behind], sum(len(contexts[j]) for j in behind))


class ChainScheduler:
    """The decoder (`polyspec.orchestrator.decode.contract.BatchDecoder`): start / step_all /
    finish / cancel over the chain's tiers, and the round API a tier worker drives on its own
    `Run`s (`round_batch`, `emit_batch`, `length_at`)."""

    concurrent_steps = False  # one step at a time: a step runs every request it is given in one round

    def __init__(
        self,
        tiers: list[BatchedTier],
        lengths: list[int],
        tree_width: int = 1,
        scheme: str = "specinfer",
        eos_token_ids: tuple[int, ...] = (),
        planner=None,
        draft_ahead: bool = False,
        max_context: int | None | str = FROM_TIERS,
        prefill_budget: int = DEFAULT_PREFILL_BUDGET,
        recorder=None,
        keep_finished: int = 0,
        scorer: BatchedTier | None = None,
    ) -> None:
        """`tiers`: the runtime tiers (polyspec.workers.tiers.batched), target first. `planner`: a `contract.RoundPlanner`
        (None: the fixed `lengths`). `draft_ahead`: the pipelined form. A fully accepted block gets
        no bonus token: the drafter has already drafted past it, and its continuation is verified
        next (still lossless: each drafted token is verified against the verifier's own row).
        `max_context`: the longest context a request started here may reach; by default the
        smallest context among the tiers, None for no limit. `recorder`: anything with `observe`,
        told every observation the planner is. `keep_finished`: how many finished requests keep their
        caches for a later prompt that extends them (the module doc's prefix reuse); 0 frees them at once.
        `scorer`: where `target_distribution` scores other prompts (the target's model on a pool of its own, so a
        request's scored prompt takes no slot of the round's; default: the target's tier itself)."""
        if not tiers:
            raise ValueError("a chain needs at least the target tier")
        if len(lengths) != len(tiers) - 1:
            raise ValueError(f"need {len(tiers) - 1} speculation lengths for {len(tiers)} tiers, got {len(lengths)}")
        self.tiers = list(tiers)
        self.lengths = list(lengths)  # k_i for the stage verified by tier i; a planner may move them
        self.tree_width = tree_width
        self.scheme = scheme
        self.eos_token_ids = frozenset(eos_token_ids)
        self.active = tuple(range(len(tiers)))  # tiers in use, target first; a planner may bypass some
        self.planner = planner
        self.vocab_size = self.tiers[0].vocab_size
        self.recorder = recorder
        self.draft_ahead = draft_ahead
        self.prefill_budget = prefill_budget
        if max_context == FROM_TIERS:
            contexts = [t.max_context for t in self.tiers if t.max_context]
            max_context = min(contexts) if contexts else None
        self.max_context = max_context
        self.last_step: dict = {}  # batch size, tokens, seconds and plan of the latest step
        self.scorer = scorer if scorer is not None else self.tiers[0]
        self.kept = KeptSequences(keep_finished, self._release, lambda: next(_sequence_ids))

    # ----------------------------------------------------------------- decoder API

    def close(self) -> None:
        """Nothing to release: the tiers are this process's own."""

    def start(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None) -> RequestState:
        """Open a request; advance it with `step` / `step_all` (one target round each), close it
        with `finish`. Requests are independent, so a caller may interleave or batch their steps.
        All calls must come from one thread at a time."""
        run = Run(
            seq_id=self.kept.sequence_for(prompt_ids),
            params=params,
            generators=[RandomStream(s) for s in tier_seeds(seed, len(self.tiers))],
            stages=[StageStats(self.tiers[i].name, self.tiers[i + 1].name) for i in range(len(self.tiers) - 1)],
            limit=self.max_context or NO_LIMIT,
            forwarded_tokens=[0] * len(self.tiers),
        )
        return RequestState(seq_id=run.seq_id, params=params, committed=list(prompt_ids), max_new_tokens=max_new_tokens,
                            limit=run.limit, run=run, tier_busy_s=[0.0] * len(self.tiers))

    def step(self, state: RequestState) -> list[int]:
        """One target round of one request (a batch of one); the newly committed tokens."""
        return self.step_all([state])[0]

    def prefill_tiers(self) -> list[BatchedTier]:
        """The tiers a joining request's prompt is cached in before it joins the rounds: every model tier
        of a fixed chain; only the target under a planner, since the drafters are not used while
        speculation is off and catch up (`catch_up`) when a plan uses them. A tier served row by
        row (a feature head, another architecture) caches what it is given in its own calls."""
        tiers = self.tiers[:1] if self.planner is not None else self.tiers
        return [t for t in tiers if t.has_weights and t.caches_prompts]

    def ready(self, state: RequestState) -> bool:
        """Has every tier of `prefill_tiers` cached the request's prompt (all but its last token)? A drafting
        tier may be up to CATCH_UP_GAP tokens behind: its first draft forward feeds them. (A block accepted
        whole leaves its drafter one token behind; caching that token before the round cost the drafter a
        forward of its own in every such round: a fifth more forwards of an int8 copy drafting 4.)"""
        need = len(state.committed) - 1
        return all(t.cached(state.run.seq_id) >= need - (0 if t is self.tiers[0] else CATCH_UP_GAP) for t in self.prefill_tiers())

    def prefill(self, states: list[RequestState], budget: int | None = None) -> int:
        """Cache prompts of requests not yet `ready`, oldest first, at most `budget` tokens per tier."""
        budget = self.prefill_budget if budget is None else budget
        waiting = [s for s in states if not s.done and not self.ready(s)]
        fed = 0
        for tier in self.prefill_tiers():
            if waiting:
                fed += tier.prefill([s.run.seq_id for s in waiting], [Context(s.committed) for s in waiting], budget)
        return fed

    def step_all(self, states: list[RequestState]) -> list[list[int]]:
        """One target round for every request in `states`; the newly committed tokens of each."""
        started = time.perf_counter()
        catch_up_s = 0.0
        out: list[list[int]] = [[] for _ in states]
        live = [i for i, state in enumerate(states) if not finish_if_full(state)]
        if not live:
            return out
        drafters: list[int | None] = [self.below(0)] * len(live)  # per live request: the tier drafting its target block
        predicted: list[float | None] = [None] * len(live)  # per live request: the planner's tokens/s under its plan
        if self.planner is not None:
            behind = {level: sum(max(0, len(states[i].committed) - 1 - tier.cached(states[i].run.seq_id)) for i in live)
                      for level, tier in enumerate(self.tiers) if level and tier.has_weights}
            step = StepInput(tuple(states[i].run.params for i in live), tuple(len(states[i].committed) for i in live), behind,
                             tuple(min(remaining(states[i]), states[i].limit - len(states[i].committed)) for i in live),
                             seq_ids=tuple(states[i].run.seq_id for i in live))
            lengths, active = self.planner.plan(step)
            self.lengths, self.active = list(lengths), tuple(active)
            # (a tree's drafter grows the tree the verifier walks: one drafter for the step)
            drafters = list((self.planner.drafters(step) if self.tree_width == 1 else ()) or [self.below(0)] * len(live))
            predicted = self.planner.predicted_tokens_per_s  # (per request where they draft apart)
            if not isinstance(predicted, tuple):
                predicted = [predicted] * len(live)
            for i, drafter in zip(live, drafters):
                tiers = [0, drafter] if drafter != self.below(0) else list(self.active)  # a request drafted apart: its pair
                note_plan(states[i].plans, len(states[i].new_tokens), [self.lengths[t] for t in tiers[:-1]],
                          [self.tiers[t].name for t in tiers])
            # in the step's time, and timed apart: the planner weighs it as the price of switching a plan on, not as the plan's
            caught = time.perf_counter()
            for level in self.active[1:]:  # each drafting tier of the plan
                catch_up(self.tiers[level], [states[i].run for i in live], [Context(states[i].committed) for i in live])
            catch_up_s = time.perf_counter() - caught
        shadows = self._shadow_proposals([states[i] for i in live], drafters)
        busy_before = [t.busy_s for t in self.tiers]
        tokens_before = [t.forwarded_tokens for t in self.tiers]
        forwards_before = [t.forwards for t in self.tiers]
        items = [(states[i].run, Context(states[i].committed), min(self.length_at(0), remaining(states[i]) - 1)) for i in live]
        results = self.round_batch(0, items, want_rows=False, drafters=drafters)
        spent = [t.busy_s - b for t, b in zip(self.tiers, busy_before)]
        forwarded = [t.forwarded_tokens - b for t, b in zip(self.tiers, tokens_before)]
        committed = []
        for i, (emitted, _) in zip(live, results):
            state = states[i]
            emitted = commit(state, emitted, self.eos_token_ids)
            for t, seconds in enumerate(spent):
                state.tier_busy_s[t] += seconds / len(live)  # a shared forward: each request's share
                state.run.forwarded_tokens[t] += forwarded[t] // len(live)
            out[i] = emitted
            committed.append(tuple(emitted))
            for lookup, proposals in shadows.items():
                self._observe_shadow(lookup, proposals[len(committed) - 1], emitted, state.run)
        seconds = time.perf_counter() - started
        if self.planner is not None:  # each request's round, under the plan it ran: its tokens in the step's wall time
            for i, emitted, expected in zip(live, committed, predicted):
                note_round(states[i].plans, len(emitted), seconds, expected)
        lengths = [self.lengths[t] for t in self.active[:-1]]
        self.last_step = {"batch": len(live), "tokens": sum(len(c) for c in committed), "seconds": seconds,
                          "lengths": lengths, "tiers": list(self.active)}
        timed = all(t.timed_here for t in self.tiers)  # (the host's time in a step is what its forwards leave: all timed here)
        self._observe(StepObservation(tuple(committed), seconds, tuple(self.lengths), tuple(self.active), catch_up_s,
                                      sum(spent) if timed else None,
                                      tuple(t.forwards - b for t, b in zip(self.tiers, forwards_before)) if timed else None))
        return out

    def _shadow_proposals(self, states: list[RequestState], drafters: list[int | None]) -> dict[int, list[list[int] | None]]:
        """Per lookup tier: what it would propose at each request's context where it does not draft for the target
        in this step (None where it does), as many tokens as the step can commit (its planner's ShadowObservations:
        a lookup costs next to nothing, and its acceptance grows with the request's own text, so a planner that
        measured it poor early must see it warm up without running it)."""
        if self.planner is None or not self.planner.shadows:
            return {}
        count = self.length_at(0) + 1
        out = {}
        for level, tier in enumerate(self.tiers):
            asked = [j for j, drafter in enumerate(drafters) if drafter != level]
            if level and not tier.has_weights and asked:
                drafted = self._draft(level, [(states[j].run, Context(states[j].committed), count) for j in asked])
                out[level] = [None] * len(states)
                for j, tokens in zip(asked, drafted.host()[0]):
                    out[level][j] = tokens
        return out

    def _observe_shadow(self, lookup: int, proposal: list[int] | None, produced: list[int], run: Run, level: int = 0) -> None:
        """Tell the planner how far lookup tier `lookup`'s `proposal` matched the tokens tier `level` produced at the
        same context (the target: the step's committed tokens; a mismatch is a rejection, and so is a proposal shorter
        than the block the produced tokens cover, as its round would have ended there; where the produced tokens ran
        out first, the match is cut there, with no rejection; nothing proposed: a miss)."""
        if proposal is None or not produced:
            return
        compared = min(len(proposal), len(produced))
        matched = common_prefix(proposal[:compared], produced[:compared])
        # a mismatch ends its round there, and so does a proposal that ran out (none: a miss) short of the block the
        # produced tokens cover (all but their last: a correction or bonus)
        ended = matched < compared or len(proposal) + 1 < len(produced)
        proposed = len(proposal) if ended else matched
        self._observe(ShadowObservation(lookup, proposed, matched, run.params.greedy, run.seq_id, level, ended))

    def _shadow_drafts(self, level: int, items: list[tuple], drafted: list[tuple]) -> None:
        """A model drafter at the bottom of the plan (tier `level`) just drafted each item's block: what each lookup
        tier the plan leaves out below it would have proposed at the same contexts, matched against those blocks
        (ShadowObservations at `level`). A plan that puts the lookup under this drafter is then priced from the
        lookup's acceptance as this drafter measures it now, not as it was when that plan last ran (on code, the
        Qwen 0.5B accepts much of what the n-gram tier copies from the prompt once the output repeats it)."""
        if self.planner is None or not self.planner.shadows or not self.tiers[level].has_weights:
            return
        for lookup, tier in enumerate(self.tiers):
            if lookup <= level or tier.has_weights or lookup in self.active:
                continue
            proposals, _ = self._draft(lookup, items).host()
            for (run, _, _), proposal, tokens in zip(items, proposals, drafted.host()[0]):
                self._observe_shadow(lookup, proposal, tokens, run, level)

    def finish(self, state: RequestState) -> GenerationOutput:
        """Release the request's caches (or keep them: `keep_finished`) and return its tokens and stats."""
        self.kept.put(state.seq_id, state.committed)
        run: Run = state.run
        extra = {"tiers": [{"tier": t.name, "busy_s": round(busy, 6), "forwarded_tokens": tokens}
                           for t, busy, tokens in zip(self.tiers, state.tier_busy_s, run.forwarded_tokens)]}
        if self.planner is not None:
            extra["plans"] = plan_records(state.plans)
        return output(state, run.stages + list(run.bypass_stages.values()), **extra)

    def cancel(self, state: RequestState) -> GenerationOutput:
        """Stop a request now: its caches are freed and it finishes as "cancelled"."""
        mark_cancelled(state)
        return self.finish(state)

    def _release(self, seq_id: int) -> None:
        """Free a kept request's caches (`keep_finished`: it was dropped)."""
        for tier in self.tiers:
            tier.release(seq_id)
        self.scorer.release(scratch_sequence(seq_id))  # a SpecReason request's scored prompts

    # ------------------------------------------------------------ the round

    def _observe(self, observation) -> None:
        if self.planner is not None:
            self.planner.observe(observation)
        if self.recorder is not None:
            self.recorder.observe(observation)

    def below(self, level: int) -> int | None:
        """The tier that drafts for tier `level` (None: `level` is the bottom of the chain)."""
        return next((t for t in self.active if t > level), None)

    def length_at(self, level: int) -> int:
        """The speculation length tier `level` verifies (0 for the bottom tier)."""
        return self.lengths[level] if level < len(self.lengths) else 0

    @staticmethod
    def room(run: Run, context: list[int]) -> int:
        """Draft tokens that fit: the block plus the token after it must stay inside the context."""
        return max(0, run.limit - len(context) - 1)

    def _draft(self, level: int, items: list[tuple]) -> Blocks:
        """Tier `level`'s `draft_batch` over (run, context, count) items, each with its run's stream at that tier."""
        return self.tiers[level].draft_batch([run.seq_id for run, _, _ in items], [context for _, context, _ in items],
                                             [count for _, _, count in items], [run.params for run, _, _ in items],
                                             [run.generators[level] for run, _, _ in items])

    def emit_batch(self, level: int, items: list[tuple]) -> Blocks:
        """At least `need` tokens from tier `level` for each (run, context, need) (fewer only at EOS or
        the context limit), as chains with the tier's rows for them (none when sampling greedily); a tier
        that verifies runs as many rounds as it takes."""
        items = [(run, context, min(need, self.room(run, context))) for run, context, need in items]
        if self.below(level) is None:
            started = time.perf_counter()
            drafted = self._draft(level, items)
            seconds = (time.perf_counter() - started) / max(1, len(items))
            for (run, context, need), tokens in zip(items, drafted.host()[0]):
                self._observe(DraftObservation(level, need, len(context), tuple(tokens), seconds))
            self._shadow_drafts(level, items, drafted)
            return drafted
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
                ctx = extended(context, tokens[j])
                round_items.append((run, ctx, min(self.length_at(level), self.room(run, ctx))))
            for j, (emitted, emitted_rows) in zip(short, self.round_batch(level, round_items)):
                tokens[j] += emitted
                if emitted_rows is not None:
                    rows[j].append(emitted_rows)
                if any(t in self.eos_token_ids for t in emitted):
                    stopped[j] = True  # nothing after an end of sequence will be kept
        kept = [tokens[j][: self.room(run, context)] for j, (run, context, _) in enumerate(items)]  # rounds overshoot `need`
        return Blocks.of_chains(kept, [torch.cat(rows[j])[: len(kept[j])] if rows[j] else None for j in range(len(items))])

    def sub_chain_block(self, state: RequestState, context: list[int], need: int) -> list[int]:
        """At least `need` tokens after `context` from the chain below the target (tier 1 over the tiers
        below it): an approximate step driver's small model (polyspec.orchestrator.decode.approximate)."""
        return self.emit_batch(1, [(state.run, context, need)]).host()[0][0]

    def target_distribution(self, prompt_ids: list[int], seq_id=None) -> torch.Tensor:
        """The target's own distribution (temperature 1) after `prompt_ids` [V], on a sequence of its own in the
        `scorer`'s pool (`tier.scratch_score`: with the request's `seq_id` the scored KV is kept until the request's
        caches go)."""
        return scratch_score(self.scorer, prompt_ids, seq_id)

    def _propose(self, level: int, below: int, items: list[tuple]) -> Blocks:
        """The block tier `below` hands up to tier `level` for each (run, context, length): a chain,
        or a tree from the bottom tier."""
        wanted = [j for j, (_, _, length) in enumerate(items) if length > 0]
        if not wanted:
            return Blocks.empty(len(items))
        if self.tree_width > 1 and self.below(below) is None:
            runs = [items[j][0] for j in wanted]
            started = time.perf_counter()
            blocks = self.tiers[below].draft_tree_batch([r.seq_id for r in runs], [items[j][1] for j in wanted], self.tree_width,
                                                        [items[j][2] for j in wanted], [r.params for r in runs], self.scheme,
                                                        [r.generators[below] for r in runs])
            seconds = (time.perf_counter() - started) / len(wanted)
            for j in wanted:
                self._observe(DraftObservation(below, items[j][2], len(items[j][1]), None, seconds))
        else:
            blocks = self.emit_batch(below, [items[j] for j in wanted])
        return Blocks.gather(len(items), [(wanted, blocks)])

    def round_batch(self, level: int, items: list[tuple], want_rows: bool = True,
                    drafters: list[int | None] | None = None) -> list[tuple[list[int], torch.Tensor | None]]:
        """One verification forward of tier `level` over every (run, context, length): each item's
        emitted tokens (the accepted block, then the correction or bonus token) and the tier's
        rows for them (None when sampling greedily, or when not `want_rows`: the target's own
        round, whose tokens go to no verifier). `drafters`: per item, the tier that drafts its block
        (chains only; None: the plan's, `below(level)`)."""
        tier = self.tiers[level]
        below = self.below(level)
        unders = [d if d is not None else below for d in drafters] if drafters else [below] * len(items)
        groups = [[j for j, d in enumerate(unders) if d == drafter] for drafter in sorted(set(unders) - {None})]
        blocks = Blocks.gather(len(items), [(group, self._propose(level, unders[group[0]], [items[j] for j in group]))
                                            for group in groups])
        started = time.perf_counter()
        runs, contexts = [r for r, _, _ in items], [c for _, c, _ in items]
        if all(level or run.rule is None for run in runs):
            # exact rounds: the tier scores and verifies every block in one call (on the device, for a device tier);
            # after a tree's verdict it and the tier below keep only the accepted path
            verdicts = tier.verify_batch([r.seq_id for r in runs], contexts, blocks, [r.params for r in runs],
                                         [r.generators[level] for r in runs], want_rows=want_rows, scheme=self.scheme,
                                         below=None if below is None else self.tiers[below])
            shared = (time.perf_counter() - started) / len(items)
        else:
            # an approximate mode's rule judges the target's check: each block and params as scored, then its verdict
            scored = [scoring(run, level, context, block) for run, context, block in zip(runs, contexts, blocks)]
            probs = tier.score_batch([r.seq_id for r in runs], contexts, Blocks.of([b for b, _ in scored]), [p for _, p in scored])
            shared = (time.perf_counter() - started) / len(items)
            verdicts = []
            for run, block, target_probs in zip(runs, blocks, probs):
                began = time.perf_counter()
                path, next_token = verdict(run, level, target_probs, block, self.scheme, run.generators[level])
                if not block.is_chain():  # both tiers keep the accepted path
                    tier.accept_path(run.seq_id, path)
                    self.tiers[below].accept_path(run.seq_id, path)
                verdicts.append(Verdict(path, next_token, None if run.params.greedy else path_rows(target_probs, block.is_chain(), path)))
                shared += (time.perf_counter() - began) / len(items)  # each request's share of the walks
        out = []
        for (run, context, length), block, decided, below in zip(items, blocks, verdicts, unders):
            path, next_token = decided.path, decided.next_token
            seconds = shared
            if below is not None:
                stage_of(run.stages, run.bypass_stages, self.tiers, level, below).record(len(block), len(path), length, seconds)
                # a tree's per-depth acceptance prices trees; a walk that ran out of nodes (a lookup's
                # short branch) accepted all it was offered
                depth = None if block.is_chain() else (len(path) if path and not block.children(path[-1])
                                                       else max(block.depths()) + 1)
                self._observe(RoundObservation(level, below, length, len(block), len(path), seconds, run.params.greedy,
                                               len(context), run.seq_id, depth))
            # a drafter that drafts ahead (a remote tier, pipelined) has already gone past a block
            # accepted whole: no bonus token, its continuation is verified next
            no_bonus = (self.draft_ahead and below is not None and self.tiers[below].continues_past(run.seq_id)
                        and 0 < len(path) == len(block) == length)
            if below is not None:
                self.tiers[below].verdict(run.seq_id, len(context), len(block), len(path), None if no_bonus else next_token)
            emitted = [block.tokens[j] for j in path] + ([] if no_bonus else [next_token])
            out.append((emitted, None if decided.rows is None else decided.rows[: len(emitted)]))
        return out
