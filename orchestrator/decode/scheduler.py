"""The chain scheduler: staged polybasic speculative decoding, serial form.

    emit(i, need):   tier i returns >= `need` tokens, each distributed as tier i's own sampler
        i == n-1:    the last tier drafts autoregressively (or proposes a tree)
        otherwise:   repeat one round until enough: tier i+1 emits a block of k_i tokens,
                     tier i scores it in ONE forward and verifies it; the accepted tokens
                     plus the correction / bonus token are emitted, with tier i's rows

The target (tier 0) runs rounds until the request is done. Every token a tier emits is
distributed exactly as that tier's warped distribution, so when tier i-1 verifies it the
draft rows are tier i's rows — the induction that makes the whole chain lossless. With
one tier the loop is plain autoregressive sampling from the target (the baseline).

The scheduler only talks to `polyspec.workers.tiers.tier.Tier` objects, so the same code drives tiers
in this process or behind remote actors.

Prefix reuse (`keep_finished`): a finished request's caches may stay in the tiers, and a later
request whose prompt shares a prefix with its tokens (a conversation's next turn: the previous
turn's prompt and reply, then the new message) runs under its sequence id. Every tier keeps
the cached prefix a context shares with it and forwards only the rest (the Tier contract),
so the new request prefills only its new tokens, and computes what it would from scratch.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import torch

from polyspec.orchestrator.decode.contract import (
    NO_LIMIT,
    GenerationOutput,
    RequestState,
    StageStats,
    stage_of,
    commit,
    finish_if_full,
    first_eos,
    generate,
    mark_cancelled,
    note_plan,
    output,
    remaining,
    seeded_generator,
    tier_seeds,
)
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import DraftTree, verify_block
from polyspec.workers.tiers.tier import Tier


_sequence_ids = itertools.count()


@dataclasses.dataclass
class Run:
    """Everything one request's rounds mutate: the unit of the public round API.

    `ChainScheduler.start` makes one per request; a distributed tier worker makes its own
    (one per sequence it serves) and runs `verify_round` / `emit` on it."""

    seq_id: int
    params: SamplingParams
    generators: list[torch.Generator]  # one per tier of the scheduler, target first
    stages: list[StageStats]  # [i]: tier i verifying tier i + 1
    limit: int = NO_LIMIT  # no position may reach this (the smallest model context)
    forwarded_tokens: list[int] = dataclasses.field(default_factory=list)  # [i]: tokens tier i's forwards took for this request
    bypass_stages: dict[tuple[int, int], StageStats] = dataclasses.field(default_factory=dict)  # (tier, drafter) when a tier is bypassed


FROM_TIERS = "tiers"  # `max_context` default: the smallest context among the tiers


class ChainScheduler:
    """The embedded decoder (`polyspec.orchestrator.decode.contract.Decoder`): every tier in this
    process (or behind a `Tier` proxy), one request's rounds run by this thread.

    Round API (public: the distributed tier worker runs single rounds of its own two-tier
    chain with it): `verify_round` (one verification forward of a tier), `emit` (enough
    tokens from a tier, by as many rounds as it takes), `length_at` (the speculation
    length a tier verifies), all on a `Run`."""

    def __init__(
        self,
        tiers: list[Tier],
        lengths: list[int],
        tree_width: int = 1,
        scheme: str = "specinfer",
        eos_token_ids: tuple[int, ...] = (),
        tuner=None,
        draft_ahead: bool = False,
        max_context: int | None | str = FROM_TIERS,
        keep_finished: int = 0,
    ) -> None:
        """`draft_ahead`: the pipelined form. A fully accepted block gets no bonus token: the
        drafter has already drafted past it, and its continuation is verified next (still
        lossless: each drafted token is verified against the verifier's own row).
        `max_context`: the longest context a request started here may reach; by default the
        smallest context among the tiers, None for no limit.
        `keep_finished`: how many finished requests keep their caches for a later prompt that
        extends them (the module doc's prefix reuse); 0 frees them at once."""
        if not tiers:
            raise ValueError("a chain needs at least the target tier")
        if len(lengths) != len(tiers) - 1:
            raise ValueError(f"need {len(tiers) - 1} speculation lengths for {len(tiers)} tiers, got {len(lengths)}")
        self.tiers = tiers
        self.lengths = list(lengths)  # k_i for the stage verified by tier i; the tuner may move them
        self.tree_width = tree_width
        self.scheme = scheme
        self.eos_token_ids = frozenset(eos_token_ids)
        self.active = tuple(range(len(tiers)))  # tiers in use, target first; a tuner may bypass some
        # optional polyspec.orchestrator.tuning.tuner.Tuner, or any object with its observe_* calls:
        # sets lengths / active tiers before each target round (plan) and hears every round
        # (observe_round, observe_draft, observe_commit)
        self.tuner = tuner
        self.draft_ahead = draft_ahead
        if max_context == FROM_TIERS:
            contexts = [t.max_context for t in tiers if t.max_context]
            max_context = min(contexts) if contexts else None
        self.max_context = max_context
        self.keep_finished = keep_finished
        self._kept: list[tuple[int, list[int]]] = []  # (seq_id, its tokens) of finished requests, oldest first

    # ----------------------------------------------------------------- decoder API

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None,
                 on_commit: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        """`contract.generate` on this scheduler."""
        return generate(self, prompt_ids, max_new_tokens, params, seed, on_commit)

    def start(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None) -> RequestState:
        """Open a request; advance it with `step` (one target round each), close it with `finish`.

        Requests are independent, so a caller may interleave the steps of many of them (a
        server does, round by round). All calls must come from one thread at a time.
        """
        run = Run(
            seq_id=self._sequence_for(prompt_ids),
            params=params,
            generators=[seeded_generator(s) for s in tier_seeds(seed, len(self.tiers))],
            stages=[StageStats(self.tiers[i].name, self.tiers[i + 1].name) for i in range(len(self.tiers) - 1)],
            limit=self.max_context or NO_LIMIT,
            forwarded_tokens=[0] * len(self.tiers),
        )
        return RequestState(seq_id=run.seq_id, params=params, committed=list(prompt_ids), max_new_tokens=max_new_tokens,
                            limit=run.limit, run=run, tier_busy_s=[0.0] * len(self.tiers))

    def step(self, state: RequestState) -> list[int]:
        """One verification round of the target; returns the newly committed tokens."""
        if finish_if_full(state):
            return []
        run: Run = state.run
        busy_before = [t.busy_s for t in self.tiers]
        tokens_before = [_forwarded(t) for t in self.tiers]
        if self.tuner is not None:
            self._apply_plan(run, len(state.committed), len(state.new_tokens), state.plans)
        emitted, _ = self.verify_round(run, 0, state.committed, min(self.length_at(0), remaining(state) - 1))
        emitted = commit(state, emitted, self.eos_token_ids)
        for i, (tier, before) in enumerate(zip(self.tiers, busy_before)):
            state.tier_busy_s[i] += tier.busy_s - before
            run.forwarded_tokens[i] += _forwarded(tier) - tokens_before[i]
        if self.tuner is not None:
            self.tuner.observe_commit(emitted)
        return emitted

    def finish(self, state: RequestState) -> GenerationOutput:
        """Release the request's caches (or keep them: `keep_finished`) and return its tokens and stats."""
        self._keep_or_release(state.seq_id, state.committed)
        run: Run = state.run
        extra = {"tiers": [{"tier": t.name, "busy_s": round(busy, 6), "forwarded_tokens": tokens}
                           for t, busy, tokens in zip(self.tiers, state.tier_busy_s, run.forwarded_tokens)]}
        if self.tuner is not None:
            extra["plans"] = state.plans
        return output(state, run.stages + list(run.bypass_stages.values()), **extra)

    def cancel(self, state: RequestState) -> GenerationOutput:
        """Stop a request now: its caches are freed and it finishes as "cancelled"."""
        mark_cancelled(state)
        return self.finish(state)

    # -------------------------------------------------------------- prefix reuse

    def _sequence_for(self, prompt_ids: list[int]) -> int:
        """The sequence id a new request runs under: that of the kept request whose tokens share
        the longest prefix with `prompt_ids` (its caches hold that prefix), else a fresh one."""
        shared = [(_common_prefix(tokens, prompt_ids), j) for j, (_, tokens) in enumerate(self._kept)]
        length, best = max(shared, default=(0, None))
        if not length:
            return next(_sequence_ids)
        return self._kept.pop(best)[0]

    def _keep_or_release(self, seq_id: int, tokens: list[int]) -> None:
        """Keep a finished request's caches (dropping the oldest kept past `keep_finished`), or free them."""
        self._kept.append((seq_id, list(tokens)))
        while len(self._kept) > self.keep_finished:
            dropped, _ = self._kept.pop(0)
            for tier in self.tiers:
                tier.release(dropped)

    # ------------------------------------------------------------------- round API

    def length_at(self, level: int) -> int:
        """The speculation length tier `level` verifies (0 for the bottom tier)."""
        return self.lengths[level] if level < len(self.lengths) else 0

    # --------------------------------------------------------- round API: internals

    def _apply_plan(self, run: Run, committed_len: int, new_tokens: int, plans: list[dict]) -> None:
        lengths, active = self.tuner.plan(run.params, committed_len)
        self.lengths, self.active = list(lengths), tuple(active)
        note_plan(plans, new_tokens, [self.lengths[level] for level in self.active[:-1]], [self.tiers[t].name for t in self.active])

    def _below(self, level: int) -> int | None:
        """The tier that drafts for tier `level` (None: `level` is the bottom of the chain)."""
        return next((t for t in self.active if t > level), None)

    def _stage(self, run: Run, level: int, drafter: int) -> StageStats:
        return stage_of(run.stages, run.bypass_stages, self.tiers, level, drafter)

    def _room(self, run: Run, context: list[int]) -> int:
        """Draft tokens that fit: the block plus the token after it must stay inside the context."""
        return max(0, run.limit - len(context) - 1)

    def emit(self, run: Run, level: int, context: list[int], need: int) -> tuple[list[int], torch.Tensor | None]:
        """At least `need` tokens from tier `level` (fewer only at EOS or the context limit), with
        its rows (None when sampling greedily); a non-bottom tier runs as many rounds as it takes."""
        tier = self.tiers[level]
        need = min(need, self._room(run, context))
        if self._below(level) is None:
            started = time.perf_counter()
            tokens, rows = tier.draft(run.seq_id, context, need, run.params, run.generators[level])
            if self.tuner is not None:
                self.tuner.observe_draft(level, need, len(context), tokens, time.perf_counter() - started)
            return tokens, rows
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < need:
            ctx = context + tokens
            emitted, emitted_rows = self.verify_round(run, level, ctx, min(self.length_at(level), self._room(run, ctx)))
            tokens += emitted
            if emitted_rows is not None:
                rows.append(emitted_rows)
            if first_eos(emitted, self.eos_token_ids) is not None:
                break  # nothing after an end of sequence will be kept
        tokens = tokens[: self._room(run, context)]  # rounds overshoot `need`; keep what fits
        stacked = torch.cat(rows)[: len(tokens)] if rows else None
        return tokens, stacked

    def _propose(self, run: Run, level: int, context: list[int], length: int) -> DraftTree:
        """The block tier `level` hands up for verification: a chain, or a tree from the last tier."""
        if length <= 0:
            return DraftTree([], [], None)
        tier = self.tiers[level]
        if self._below(level) is None and self.tree_width > 1:
            started = time.perf_counter()
            tree = tier.draft_tree(run.seq_id, context, self.tree_width, length, run.params, self.scheme, run.generators[level])
            if self.tuner is not None:
                self.tuner.observe_draft(level, length, len(context), None, time.perf_counter() - started)
            return tree
        tokens, rows = self.emit(run, level, context, length)
        return DraftTree.chain(tokens, rows)

    def verify_round(self, run: Run, level: int, context: list[int], length: int) -> tuple[list[int], torch.Tensor | None]:
        """One verification forward of tier `level`: returns the emitted tokens and its rows for them."""
        tier = self.tiers[level]
        generator = run.generators[level]
        below = self._below(level)
        block = self._propose(run, below, context, length) if below is not None else DraftTree([], [], None)
        started = time.perf_counter()
        target_probs = tier.score(run.seq_id, context, block, run.params)  # [len(block) + 1, V]
        path, next_token = verify_block(target_probs, block, self.scheme, run.params.greedy, generator)
        if not block.is_chain():
            tier.accept_path(run.seq_id, path)
            self.tiers[below].accept_path(run.seq_id, path)
        seconds = time.perf_counter() - started
        if below is not None:
            self._stage(run, level, below).record(len(block), len(path), length, seconds)
            if self.tuner is not None:
                self.tuner.observe_round(level, below, length, len(block), len(path), seconds)
        no_bonus = self.draft_ahead and below is not None and self.tiers[below].continues_past(run.seq_id) and 0 < len(path) == len(block) == length
        if below is not None:
            self.tiers[below].verdict(run.seq_id, len(context), len(block), len(path), None if no_bonus else next_token)
        emitted = [block.tokens[j] for j in path] + ([] if no_bonus else [next_token])
        rows = None if run.params.greedy else target_probs[[0] + [j + 1 for j in path]][: len(emitted)]
        return emitted, rows


def _forwarded(tier) -> int:
    """Tokens a tier's forwards have taken in so far (0 for a tier that does not count them: a remote proxy)."""
    return getattr(tier, "forwarded_tokens", 0)


def _common_prefix(tokens: list[int], other: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    length = 0
    for a, b in zip(tokens, other):
        if a != b:
            break
        length += 1
    return length
