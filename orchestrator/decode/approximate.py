"""The approximate decoding modes on the engine's round (docs/approximate.md): where output may differ from the target's.

Two kinds, both driven from `Engine` for a request that names a mode (`exact` never comes here):

- round rules (BiLD, Reflective Verification): the target's check inside the ordinary round
  is swapped for the mode's rule. The round asks `scoring(run, level, context, block)` what
  to score and `verdict(...)` what to accept; for a run without a rule (every exact request)
  both return exactly what the round did before: the same block, params and `verify_blocks`.
  BiLD's fallback is the bottom drafter's per-sequence early exit (`Tier.exit_by_seq`).
- step drivers (SpecReason, Speculative Thinking): a request-level loop over the same round
  API. The "small model" is the drafting sub-chain (tier 1 and below, `emit_batch` at level 1, with
  exact verification inside it), the "large model" the whole chain run exactly (the ordinary
  target round, `scheduler.step`). Both write into the one request state, so every tier keeps
  one cache per request and resyncs to the committed text lazily, as after any rejection.

Terminology as in workers/core/approximate.py (the pure rules this module calls).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import torch

from polyspec.orchestrator.decode.contract import RequestState, commit, first_eos, remaining
from polyspec.workers.core.approximate import (
    BILD, REFLECTIVE, SPECREASON, SPECULATIVE_THINKING, ApproximateMode, accept_step, bild_verdict, expected_utility_score,
    find_reflection_point, find_step_end, reflective_input, reflective_layout, utility_scoring_prompt, verify_reflective,
)
from polyspec.workers.core.context import Context
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree, chain_draft_rows
from polyspec.workers.core.verdicts import ScoredRows, verify_blocks

ROUND_MODES = (BILD, REFLECTIVE)
STEP_MODES = (SPECREASON, SPECULATIVE_THINKING)
STEP_CHUNK = 8  # tokens the small model writes between looks at its text (a step / trigger check)
SOFT = SamplingParams(temperature=1.0)  # a greedy request's rules read the model's own distribution, not its one-hot argmax


# ---------------------------------------------------------------------------------
# Round rules: the target's check swapped inside the ordinary round
# ---------------------------------------------------------------------------------


def scoring(run, level: int, context: list[int], block: DraftTree) -> tuple[DraftTree, SamplingParams]:
    """What tier `level` scores for `block`, and under which params: the block and the request's
    params, unless the run carries an approximate rule and this is the target's check."""
    rule = getattr(run, "rule", None)
    if rule is None or level != 0:
        return block, run.params
    return rule.scored_block(block, context, run.limit), (SOFT if run.params.greedy else run.params)


def verdict(run, level: int, target_probs: torch.Tensor, block: DraftTree, scheme: str, generator) -> tuple[list[int], int]:
    """(accepted path, next token): the round's own rule (`verify_blocks`), unless the run's rule judges the target's
    check."""
    rule = getattr(run, "rule", None)
    if rule is None or level != 0:
        verdict = verify_blocks(ScoredRows.of([target_probs]), Blocks.of([block], target_probs.device), [run.params], [generator], scheme)[0]
        return verdict.path, verdict.next_token
    return rule.verify(target_probs, block, run.params.greedy, generator)


@dataclasses.dataclass(frozen=True)
class BildRule:
    """BiLD's rollback as the target's check: keep the drafted tokens before the first one whose
    cross-entropy under the target exceeds `rollback_threshold`, then the target's own token.
    (The fallback happens earlier, in the drafter: `attach` sets its per-sequence early exit.)"""

    rollback_threshold: float

    def scored_block(self, block: DraftTree, context: list[int], limit: int) -> DraftTree:
        return block

    def verify(self, target_probs: torch.Tensor, block: DraftTree, greedy: bool, generator) -> tuple[list[int], int]:
        draft_tokens = torch.tensor(block.tokens, dtype=torch.long)  # [k]
        accepted, next_token = bild_verdict(target_probs, draft_tokens, self.rollback_threshold, generator, greedy)
        return list(range(accepted)), next_token


@dataclasses.dataclass(frozen=True)
class ReflectiveRule:
    """Reflective Verification as the target's check: the target scores [draft, probe, draft] in
    its one forward, and the draft is accepted against the fused original / reflective rows.
    The probe and the copy are scaffolding: the target's cache keeps only what the next
    context shares with them (the accepted tokens), as after any rejected draft."""

    reflective_weight: float
    probe_tokens: tuple[int, ...]

    def scored_block(self, block: DraftTree, context: list[int], limit: int) -> DraftTree:
        num_drafts = len(block.tokens)
        # an empty block has nothing to reflect on; one whose copy would pass the context limit is checked plainly
        if num_drafts == 0 or len(context) + 2 * num_drafts + len(self.probe_tokens) >= limit:
            return block
        return DraftTree.chain(reflective_input(block.tokens, list(self.probe_tokens)), None)

    def verify(self, target_probs: torch.Tensor, block: DraftTree, greedy: bool, generator) -> tuple[list[int], int]:
        num_drafts = len(block.tokens)
        draft_tokens = torch.tensor(block.tokens, dtype=torch.long)  # [k]
        draft_rows = None if greedy else chain_draft_rows(block, target_probs.shape[-1])
        if target_probs.shape[0] == num_drafts + 1:  # scored plainly (see scored_block): no reflective rows, weight 0
            accepted, next_token = verify_reflective(target_probs, target_probs[:num_drafts], draft_tokens, draft_rows, 0.0, generator)
            return list(range(accepted)), next_token
        layout = reflective_layout(1, num_drafts, len(self.probe_tokens))  # rows relative to the one before the draft
        original = target_probs[list(layout.original_rows)]  # [k+1, V]
        reflective = target_probs[list(layout.reflective_rows)]  # [k, V]
        accepted, next_token = verify_reflective(original, reflective, draft_tokens, draft_rows, self.reflective_weight, generator)
        return list(range(accepted)), next_token


# ---------------------------------------------------------------------------------
# Step drivers: the small model writes, the large one judges or takes over
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class StepStats:
    """What a step driver reports in the result's stats (its `approximate` entry, `Attached.detach`)."""

    small_tokens: int = 0  # committed tokens the small model (the drafting sub-chain) wrote
    large_tokens: int = 0  # committed tokens the large model (the exact chain) wrote
    steps_scored: int = 0  # SpecReason: small-model steps the target scored
    steps_accepted: int = 0
    score_failures: int = 0  # SpecReason: scores that could not be read (the step is rewritten)
    takeovers: int = 0  # Speculative Thinking: reflection points handed to the large model

    def as_dict(self, mode: str) -> dict:
        keys = {SPECREASON: ("steps_scored", "steps_accepted", "score_failures"), SPECULATIVE_THINKING: ("takeovers",)}[mode]
        return {"small_tokens": self.small_tokens, "large_tokens": self.large_tokens, **{k: getattr(self, k) for k in keys}}


class StepDriver:
    """One request in SpecReason or Speculative Thinking mode, advanced by `step` like a round:
    each call commits at least one token unless the request is done."""

    def __init__(self, scheduler, mode: ApproximateMode, decode: Callable[[list[int]], str],
                 encode: Callable[[str], list[int]] | None, digit_ids: list[list[int]] | None, question: str) -> None:
        self.scheduler, self.mode, self.decode, self.encode = scheduler, mode, decode, encode
        self.digit_ids = digit_ids  # [d]: the token ids that read as digit d (SpecReason)
        self.question = question
        self.stats = StepStats()
        self.pending: list[int] = []  # the small model's tokens not committed yet
        self.large_left = 0  # Speculative Thinking: tokens the large model still writes in this takeover
        self.large_step_from: int | None = None  # SpecReason: the large model rewrites the step starting at this char
        self.large_step_tokens = 0  # SpecReason: tokens of that rewrite so far
        self.handled_chars = 0  # Speculative Thinking: reflection points before this char are dealt with
        self.reflections = 0

    # ------------------------------------------------------------------ the two writers

    def _large(self, state: RequestState) -> list[int]:
        """One round of the exact chain (the target verifying the sub-chain's drafts)."""
        tokens = self.scheduler.step(state)
        self.stats.large_tokens += len(tokens)
        return tokens

    def _write_small(self, state: RequestState, chunk: int = STEP_CHUNK) -> bool:
        """Add a chunk of up to `chunk` tokens from the drafting sub-chain to `pending` (tier 1's block: exact rounds
        of tier 1 over the tiers below; on a distributed chain, tier 1's worker drafts it); False when the small model
        can write no more (EOS, length, context)."""
        room = remaining(state) - len(self.pending)
        if room <= 0 or first_eos(self.pending, self.scheduler.eos_token_ids) is not None:
            return False
        tokens = self.scheduler.sub_chain_block(state, Context(state.committed, tail=self.pending), min(chunk, room))
        self.pending += tokens[:room]
        return bool(tokens)

    def _commit_small(self, state: RequestState, count: int) -> list[int]:
        """Commit the first `count` pending tokens."""
        taken, self.pending = self.pending[:count], self.pending[count:]
        emitted = commit(state, taken, self.scheduler.eos_token_ids)
        self.stats.small_tokens += len(emitted)
        if state.done:
            self.pending = []
        return emitted

    def _tokens_within(self, state: RequestState, chars: int) -> int:
        """The most pending tokens whose text (after the committed output's) ends at or before char `chars`."""
        count = len(self.pending)
        while count > 0 and len(self.decode(state.new_tokens + self.pending[:count])) > chars:
            count -= 1
        return count

    # ------------------------------------------------------------------ the modes

    def step(self, state: RequestState) -> list[int]:
        if state.done:
            return []
        if self.mode.mode == SPECREASON:
            return self._specreason(state)
        return self._thinking(state)

    def _specreason(self, state: RequestState) -> list[int]:
        delimiter, cap = self.mode.step_delimiter, self.mode.max_step_tokens
        if self.large_step_from is not None:  # the large model is rewriting a rejected step
            tokens = self._large(state)
            self.large_step_tokens += len(tokens)
            if (state.done or find_step_end(self.decode(state.new_tokens), self.large_step_from, delimiter) is not None
                    or (cap and self.large_step_tokens >= cap)):
                self.large_step_from, self.large_step_tokens = None, 0
            return tokens
        done_text = self.decode(state.new_tokens)
        start = len(done_text)
        while True:  # the small model writes one step (no further than its bound: tokens past it would be dropped)
            wrote = self._write_small(state, min(STEP_CHUNK, cap - len(self.pending)) if cap else STEP_CHUNK)
            text = self.decode(state.new_tokens + self.pending)
            end = find_step_end(text, start, delimiter)
            if end is not None and end < len(text):  # the delimiter has run its course (find_step_end absorbs repeats)
                self.pending = self.pending[: max(1, self._tokens_within(state, end))]
                break
            if cap and len(self.pending) >= cap:  # no delimiter yet (code): the step ends at max_step_tokens
                self.pending = self.pending[:cap]
                break
            if not wrote:
                break
        if not self.pending:  # the small model could write nothing here: the large one goes on
            self.large_step_from = start
            return self._specreason(state)
        step_text = self.decode(state.new_tokens + self.pending)[start:]
        score = self._utility(state, done_text, step_text)
        self.stats.steps_scored += 1
        self.stats.score_failures += score is None
        if accept_step(score, self.mode.score_threshold):
            self.stats.steps_accepted += 1
            return self._commit_small(state, len(self.pending))
        self.pending = []  # the caches resync to the committed text at their next call
        self.large_step_from = start
        return self._specreason(state)

    def _utility(self, state: RequestState, previous: str, step_text: str) -> float | None:
        """The target's utility score of a step, read from one forward over the scoring prompt:
        the expected digit under its own distribution (None: no mass on the digits). The target keeps
        the request's scored prompt, so the next step's forward starts where the prompts part."""
        prompt_ids = self.encode(utility_scoring_prompt(self.question, [previous], step_text))
        limit = self.scheduler.tiers[0].max_context
        if limit and len(prompt_ids) >= limit:  # past the target's context: the question's start goes, the step and the ask stay
            prompt_ids = prompt_ids[-(limit - 1):]
        row = self.scheduler.target_distribution(prompt_ids, state.seq_id)  # [V] at temperature 1
        digit_probs = torch.stack([row[ids].sum() if ids else row.new_zeros(()) for ids in self.digit_ids])  # [10]
        return expected_utility_score(digit_probs)

    def _thinking(self, state: RequestState) -> list[int]:
        if self.large_left > 0:
            tokens = self._large(state)
            self.large_left -= len(tokens)
            if self.large_left <= 0 or state.done:
                self.large_left = 0
                self.handled_chars = len(self.decode(state.new_tokens))
            return tokens
        while True:
            wrote = self._write_small(state)
            text = self.decode(state.new_tokens + self.pending)
            point = self._handover_point(text)
            if point is not None:  # keep the small model's text before it; the large model writes from there
                committed = self._commit_small(state, self._tokens_within(state, point))
                self.pending = []
                self.stats.takeovers += 1
                self.reflections += 1
                self.large_left = self.mode.takeover_tokens
                return committed + ([] if state.done else self._thinking(state))
            if not wrote:  # EOS or the length: nothing can follow, so all of it is settled
                committed = self._commit_small(state, len(self.pending))
                return committed if committed or state.done else self._large(state)
            committed = self._commit_small(state, self._tokens_within(state, self._settled_chars(text)))
            if committed or state.done:
                self.handled_chars = max(self.handled_chars, len(self.decode(state.new_tokens)))
                return committed

    def _handover_point(self, text: str) -> int | None:
        """The first reflection point past what was handled (past the reflection limit: any step end).
        A trigger may open the very first paragraph after a takeover; a step end must be past it."""
        mode = self.mode
        over_limit = bool(mode.reflection_limit) and self.reflections >= mode.reflection_limit
        start = max(0, self.handled_chars - len(mode.step_delimiter))
        while True:
            if over_limit:
                point = find_step_end(text, start, mode.step_delimiter)
                if point is not None and point >= len(text):
                    return None  # the delimiter may still grow, and nothing follows it yet
                if point is None or point > self.handled_chars:
                    return point
            else:
                point = find_reflection_point(text, start, mode.trigger_words, mode.step_delimiter)
                if point is None or point >= self.handled_chars:
                    return point
            start = point

    def _settled_chars(self, text: str) -> int:
        """Chars of `text` that no later token can turn into a reflection point: all of it, unless
        it ends in a delimiter followed by (the start of) a trigger word that may yet complete."""
        mode = self.mode
        at = text.rfind(mode.step_delimiter)
        if at < 0:
            return len(text)
        after = at + len(mode.step_delimiter)
        tail = " ".join(text[after:].split()).lower()
        could_trigger = any(" ".join(w.split()).lower().startswith(tail) for w in mode.trigger_words)
        if mode.reflection_limit and self.reflections >= mode.reflection_limit:
            could_trigger = True  # any step end hands over: hold back from the delimiter on
        return at if could_trigger else len(text)


def digit_token_ids(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """[d]: the single tokens that read as digit d ("7", and " 7" where a tokenizer has it)."""
    ids: list[list[int]] = []
    for digit in "0123456789":
        found = []
        for text in (digit, " " + digit):
            encoded = encode(text)
            if len(encoded) == 1 and encoded[0] not in found:
                found.append(encoded[0])
        ids.append(found)
    return ids


# ---------------------------------------------------------------------------------
# Attaching a mode to a request (Engine.start) and what it can run on
# ---------------------------------------------------------------------------------


def unsupported(mode: ApproximateMode, engine) -> str | None:
    """Why `engine` cannot run a request in `mode` (one clause), or None."""
    config = engine.config
    if engine.exact_only:
        return "this server runs exact decoding only (serve --exact-only)"
    if len(engine.tiers) < 2:
        return "it needs a chain of at least two tiers (a drafter under the target)"
    if mode.mode in ROUND_MODES and config.speculation.tree_width > 1:
        return "it checks a chain of drafts (speculation.tree_width: 1), not a tree"
    if mode.mode in (REFLECTIVE, *STEP_MODES) and engine.tokenizer is None:
        return "the target model has no tokenizer to write its prompts with"
    small = config.tiers[1]  # embedded or on Ray alike
    if mode.mode in STEP_MODES and small.is_ngram:
        return f"its small model is the second tier, and {small.name!r} is an n-gram lookup, not a model"
    return None


@dataclasses.dataclass
class Attached:
    """An approximate request's hooks: the round rule on its run, the drafters' early exit (BiLD's
    fallback) or its step driver; `detach` removes them and reports the mode for the result."""

    seq_id: int
    mode: ApproximateMode
    driver: StepDriver | None = None
    drafters: list = dataclasses.field(default_factory=list)  # tiers holding this request's early exit

    def detach(self) -> dict:
        for tier in self.drafters:
            tier.exit_by_seq.pop(self.seq_id, None)
        report = self.mode.describe()
        if self.driver is not None:
            report.update(self.driver.stats.as_dict(self.mode.mode))
        return report


def attach(engine, state: RequestState, mode: ApproximateMode) -> Attached:
    """Hook `mode` onto a request the engine's scheduler just started (parse_request has checked it can run)."""
    from polyspec.orchestrator.decode.scheduler import ChainScheduler

    attached = Attached(state.seq_id, mode)
    scheduler = engine.scheduler
    if mode.mode in STEP_MODES:  # a driver on this side, embedded or distributed alike
        digits = digit_token_ids(engine.encode) if mode.mode == SPECREASON else None
        attached.driver = StepDriver(scheduler, mode, engine.decode, engine.encode, digits, engine.decode(list(state.committed)))
    if not isinstance(scheduler, ChainScheduler):
        # a distributed chain (DistributedChain): every tier reads the mode from the request's header (`worker_hooks`)
        scheduler.set_approximate(state, header_json(mode, engine.encode))
        return attached
    probe_tokens = tuple(engine.encode(mode.probe_prompt)) if mode.mode == REFLECTIVE else ()
    state.run.rule = round_rule(mode, probe_tokens)
    if mode.mode == BILD:
        # the fallback: whichever tier drafts at the bottom of the chain stops after a token it is unsure of
        for tier in scheduler.tiers[1:]:
            model_tier = tier.tier  # a batched tier reads its model tier's thresholds
            model_tier.exit_by_seq[state.seq_id] = mode.fallback_threshold
            attached.drafters.append(model_tier)
    return attached


def round_rule(mode: ApproximateMode, probe_tokens: tuple[int, ...]):
    """The target's check for a round mode (BiLD's rollback, Reflective), None for the others."""
    if mode.mode == BILD:
        return BildRule(mode.rollback_threshold)
    if mode.mode == REFLECTIVE:
        return ReflectiveRule(mode.reflective_weight, probe_tokens)
    return None


# ---------------------------------------------------------------------------------
# Distributed chains: the mode travels in every tier's header
# ---------------------------------------------------------------------------------


def header_json(mode: ApproximateMode, encode: Callable[[str], list[int]]) -> str:
    """`SequenceHeader.approximate_json`: the mode's settings, and Reflective's probe as token ids
    (a tier worker has no tokenizer)."""
    data = mode.describe()
    if mode.mode == REFLECTIVE:
        data["probe_tokens"] = list(encode(mode.probe_prompt))
    return json.dumps(data)


def worker_hooks(approximate_json: str, index: int, run, model_tier) -> bool:
    """Hook a header's mode onto tier `index`'s view of a request, as `attach` does embedded: the
    target's round rule on its `run` (BiLD's rollback, Reflective); a drafter's early exit on its
    `model_tier` (BiLD's fallback). Returns whether an early exit was set (`release` takes it off).
    The step modes need nothing here: their driver calls the target's rounds and tier 1's blocks."""
    if not approximate_json:
        return False
    data = json.loads(approximate_json)
    probe_tokens = tuple(data.pop("probe_tokens", ()))
    mode = ApproximateMode.from_mapping(data)
    if index == 0:
        run.rule = round_rule(mode, probe_tokens)
    elif mode.mode == BILD:
        model_tier.exit_by_seq[run.seq_id] = mode.fallback_threshold
        return True
    return False
