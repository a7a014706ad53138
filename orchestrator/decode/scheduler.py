"""The chain scheduler: staged polybasic speculative decoding, serial form (DESIGN §3).

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
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import torch

from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.tier import Tier
from polyspec.workers.core.tree import DraftTree, verify_tree
from polyspec.workers.core.verification import verify_chain, verify_greedy

_sequence_ids = itertools.count()


@dataclasses.dataclass
class StageStats:
    """One verifying stage: tier `tier` verifies the blocks of tier `drafter`."""

    tier: str
    drafter: str
    blocks: int = 0
    proposed: int = 0
    accepted: int = 0
    time_s: float = 0.0
    lengths: list[int] = dataclasses.field(default_factory=list)  # speculation length each time it changed
    accepted_counts: list[int] = dataclasses.field(default_factory=list)  # [j] = blocks with exactly j accepted

    def record(self, proposed: int, accepted: int, length: int, seconds: float) -> None:
        self.blocks += 1
        self.proposed += proposed
        self.accepted += accepted
        self.time_s += seconds
        if not self.lengths or self.lengths[-1] != length:
            self.lengths.append(length)
        while len(self.accepted_counts) <= accepted:
            self.accepted_counts.append(0)
        self.accepted_counts[accepted] += 1

    def as_dict(self) -> dict:
        return {
            "tier": self.tier,
            "drafter": self.drafter,
            "blocks": self.blocks,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "mean_accepted_length": round(self.accepted / self.blocks, 4) if self.blocks else 0.0,
            "lengths": list(self.lengths),
            "accepted_counts": list(self.accepted_counts),
            "time_s": round(self.time_s, 6),
        }


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "cancelled"
    stats: dict


@dataclasses.dataclass
class RequestState:
    """One request between `ChainScheduler.start` and `finish`."""

    run: "_Run"
    committed: list[int]  # prompt + accepted tokens
    max_new_tokens: int
    tier_busy_s: list[float]  # model time spent on this request, per tier
    new_tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "length" | "eos" | "cancelled" once done
    plans: list[dict] = dataclasses.field(default_factory=list)  # with a tuner: lengths / tiers each time they changed
    started: float = dataclasses.field(default_factory=time.perf_counter)
    request: object = None  # the caller's request object, carried along (Engine keeps its GenerationRequest here)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Run:
    """Everything one request's generation mutates."""

    seq_id: int
    params: SamplingParams
    generators: list[torch.Generator]
    stages: list[StageStats]
    limit: int  # no position may reach this (the smallest model context)
    bypass_stages: dict[tuple[int, int], StageStats] = dataclasses.field(default_factory=dict)  # (tier, drafter) when a tier is bypassed


class ChainScheduler:
    def __init__(
        self,
        tiers: list[Tier],
        lengths: list[int],
        tree_width: int = 1,
        scheme: str = "specinfer",
        eos_token_ids: tuple[int, ...] = (),
        tuner=None,
        draft_ahead: bool = False,
    ) -> None:
        """`draft_ahead`: the pipelined form (DESIGN §4). A fully accepted block gets no bonus
        token: the drafter has already drafted past it, and its continuation is verified next
        (still lossless: each drafted token is verified against the verifier's own row)."""
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
        # optional polyspec.orchestrator.tuning.tuner.Tuner: sets lengths / active tiers before each target round
        # (plan) and hears every round (observe_round, observe_draft, observe_commit)
        self.tuner = tuner
        self.draft_ahead = draft_ahead
        contexts = [t.max_context for t in tiers if t.max_context]
        self.max_context = min(contexts) if contexts else None

    # ------------------------------------------------------------------------- API

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        seed: int | None = None,
        on_commit: Callable[[list[int]], None] | None = None,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` after `prompt_ids`; `on_commit` sees each round's new tokens."""
        state = self.start(prompt_ids, max_new_tokens, params, seed)
        try:
            while not state.done:
                emitted = self.step(state)
                if on_commit is not None and emitted:
                    on_commit(emitted)
        except BaseException:
            self.cancel(state)
            raise
        return self.finish(state)

    def start(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None) -> "RequestState":
        """Open a request; advance it with `step` (one target round each), close it with `finish`.

        Requests are independent, so a caller may interleave the steps of many of them (a
        server does, round by round). All calls must come from one thread at a time.
        """
        base = torch.Generator()
        if seed is None:
            base.seed()
        else:
            base.manual_seed(seed)
        generators = [torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=base))) for _ in self.tiers]
        run = _Run(
            seq_id=next(_sequence_ids),
            params=params,
            generators=generators,
            stages=[StageStats(self.tiers[i].name, self.tiers[i + 1].name) for i in range(len(self.tiers) - 1)],
            limit=self.max_context or 1 << 62,
        )
        return RequestState(run=run, committed=list(prompt_ids), max_new_tokens=max_new_tokens, tier_busy_s=[0.0] * len(self.tiers))

    def step(self, state: "RequestState") -> list[int]:
        """One verification round of the target; returns the newly committed tokens."""
        if state.done:
            return []
        if len(state.new_tokens) >= state.max_new_tokens or len(state.committed) >= state.run.limit:
            state.finish_reason = "length"
            return []
        run = state.run
        busy_before = [t.busy_s for t in self.tiers]
        if self.tuner is not None:
            self._apply_plan(run, len(state.committed), len(state.new_tokens), state.plans)
        remaining = state.max_new_tokens - len(state.new_tokens)
        emitted, _ = self._round(run, 0, state.committed, min(self._length(0), remaining - 1))
        emitted = emitted[:remaining]
        eos_at = next((j for j, t in enumerate(emitted) if t in self.eos_token_ids), None)
        if eos_at is not None:
            emitted = emitted[: eos_at + 1]
        state.committed += emitted
        state.new_tokens += emitted
        for i, (tier, before) in enumerate(zip(self.tiers, busy_before)):
            state.tier_busy_s[i] += tier.busy_s - before
        if self.tuner is not None:
            self.tuner.observe_commit(emitted)
        if eos_at is not None:
            state.finish_reason = "eos"
        elif len(state.new_tokens) >= state.max_new_tokens or len(state.committed) >= run.limit:
            state.finish_reason = "length"
        return emitted

    def finish(self, state: "RequestState") -> GenerationOutput:
        """Release the request's caches and return its tokens and stats."""
        for tier in self.tiers:
            tier.release(state.run.seq_id)
        elapsed = time.perf_counter() - state.started
        run = state.run
        stats = {
            "tokens_per_s": round(len(state.new_tokens) / elapsed, 3) if elapsed > 0 else 0.0,
            "new_tokens": len(state.new_tokens),
            "time_s": round(elapsed, 6),
            "stages": [stage.as_dict() for stage in run.stages + list(run.bypass_stages.values())],
            "tiers": [{"tier": t.name, "busy_s": round(busy, 6)} for t, busy in zip(self.tiers, state.tier_busy_s)],
        }
        if self.tuner is not None:
            stats["plans"] = state.plans
        return GenerationOutput(list(state.new_tokens), state.finish_reason or "length", stats)

    def cancel(self, state: "RequestState") -> GenerationOutput:
        """Stop a request now: its caches are freed and it finishes as "cancelled"."""
        if not state.done:
            state.finish_reason = "cancelled"
        return self.finish(state)

    # ------------------------------------------------------------------- internals

    def _apply_plan(self, run: _Run, committed_len: int, new_tokens: int, plans: list[dict]) -> None:
        lengths, active = self.tuner.plan(run.params, committed_len)
        self.lengths, self.active = list(lengths), tuple(active)
        shown = {"lengths": [self.lengths[level] for level in self.active[:-1]], "tiers": [self.tiers[t].name for t in self.active]}
        if not plans or {k: plans[-1][k] for k in shown} != shown:
            plans.append({"new_tokens": new_tokens, **shown})

    def _below(self, level: int) -> int | None:
        """The tier that drafts for tier `level` (None: `level` is the bottom of the chain)."""
        return next((t for t in self.active if t > level), None)

    def _stage(self, run: _Run, level: int, drafter: int) -> StageStats:
        if drafter == level + 1:
            return run.stages[level]
        key = (level, drafter)
        if key not in run.bypass_stages:
            run.bypass_stages[key] = StageStats(self.tiers[level].name, self.tiers[drafter].name)
        return run.bypass_stages[key]

    def _length(self, level: int) -> int:
        return self.lengths[level] if level < len(self.lengths) else 0

    def _room(self, run: _Run, context: list[int]) -> int:
        """Draft tokens that fit: the block plus the token after it must stay inside the context."""
        return max(0, run.limit - len(context) - 1)

    def _emit(self, run: _Run, level: int, context: list[int], need: int) -> tuple[list[int], torch.Tensor | None]:
        """At least `need` tokens from tier `level` (fewer only at EOS or the context limit), with its rows."""
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
            emitted, emitted_rows = self._round(run, level, ctx, min(self._length(level), self._room(run, ctx)))
            tokens += emitted
            if emitted_rows is not None:
                rows.append(emitted_rows)
            if any(t in self.eos_token_ids for t in emitted):
                break  # nothing after an end of sequence will be kept
        tokens = tokens[: self._room(run, context)]  # rounds overshoot `need`; keep what fits
        stacked = torch.cat(rows)[: len(tokens)] if rows else None
        return tokens, stacked

    def _propose(self, run: _Run, level: int, context: list[int], length: int) -> DraftTree:
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
        tokens, rows = self._emit(run, level, context, length)
        return DraftTree.chain(tokens, rows)

    def _round(self, run: _Run, level: int, context: list[int], length: int) -> tuple[list[int], torch.Tensor | None]:
        """One verification forward of tier `level`: returns the emitted tokens and its rows for them."""
        tier = self.tiers[level]
        generator = run.generators[level]
        below = self._below(level)
        block = self._propose(run, below, context, length) if below is not None else DraftTree([], [], None)
        started = time.perf_counter()
        target_probs = tier.score(run.seq_id, context, block, run.params)  # [len(block) + 1, V]
        if block.is_chain():
            draft_tokens = torch.tensor(block.tokens, dtype=torch.long)
            if run.params.greedy:
                accepted, next_token = verify_greedy(target_probs.argmax(dim=-1), draft_tokens)
            else:
                draft_rows = block.draft_rows if block.draft_rows is not None else target_probs[:0]
                accepted, next_token = verify_chain(target_probs, draft_rows, draft_tokens, generator)
            path = list(range(accepted))
        else:
            path, next_token = verify_tree(target_probs, block, self.scheme, run.params.greedy, generator)
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
