"""The tuner's decisions: which tiers to run and at which lengths (the `Planner` part of `Tuner`).

Every round of a class's warm-up (`warmup_rounds`; its searches see acceptance one posterior
sd optimistic, so the deeper positions get tried), then every `retune_every` rounds (as the
re-tune budget allows), the tuner searches lengths for each usable set of tiers: every
combination (time_model.search_lengths) in the warm-up, after a shift and every
FULL_SEARCH_EVERY rounds, else near the set's last lengths (time_model.local_search). It
switches only when the predicted gain exceeds `hysteresis` for new lengths on the same
tiers (none in the full search a detected shift calls for, nor once the plan's own
predicted time has drifted `replan_drift` from its last weighing: `_switch_margin`),
`switch_hysteresis` for another set of tiers (then the best lengths on the current
tiers are still taken if they clear `hysteresis`). A tier that is bypassed gets no data, so
every so often (`_set_probing`) the full chain runs for one round (a probe).

The knobs are `polyspec.orchestrator.config.TuningConfig` (`self.config`); the estimates and
the latency tables it weighs come from the other parts of the tuner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

from polyspec.orchestrator.tuning.estimates import MIN_BLOCKS, AcceptanceEstimate, FillEstimate, ema
from polyspec.orchestrator.tuning.time_model import StageSpec, latency
from polyspec.orchestrator.tuning.chain_model import chain_cost, local_search, round_models, search_lengths
from polyspec.orchestrator.tuning.timing import OVERHEAD_SMOOTHING

RETUNE_BUDGET = 0.02  # routine re-tunes may take this share of the wall time (a search: about a millisecond of Python)
FULL_SEARCH_EVERY = 32  # target rounds between full searches (every length); re-tunes between them search near the last lengths
PROBE_BUDGET = 0.01  # probes of bypassed tiers may cost this share of the predicted time


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the scheduler runs: a length per verifying level and the tiers in use."""

    lengths: tuple[int, ...]  # [level] = block length tier `level` verifies (unused levels keep a value)
    active: tuple[int, ...]  # tier indices in use, target first
    predicted_ms: float = dataclasses.field(default=float("nan"), compare=False)  # predicted ms per target token (C_0)


@dataclasses.dataclass
class ClassState:
    """What the tuner keeps per request class ("greedy" / "sampling"): its estimates, its plan,
    and the counters of its re-tunes and probes."""

    estimates: dict[tuple[int, int], AcceptanceEstimate]  # measured where the pair runs
    shadow_estimates: dict[tuple[int, int], AcceptanceEstimate] = dataclasses.field(default_factory=dict)  # skip pairs, from commits
    fills: dict[int, FillEstimate] = dataclasses.field(default_factory=dict)  # per bottom drafter: proposed / asked
    plan: Plan | None = None
    rounds: int = 0
    probe_every: int = 0  # while bypassing: rounds between probes of all tiers (0: not bypassing)
    since_probe: int = 0
    # the same counts with a long memory (SLOW_DECAY): what a new request of the class starts from
    long_run: dict[tuple[int, int], AcceptanceEstimate] = dataclasses.field(default_factory=dict)
    long_run_fills: dict[int, FillEstimate] = dataclasses.field(default_factory=dict)
    retune_now: bool = False  # a request started (its estimates were reset) or the text shifted: re-tune before the next round
    since_retune: int = 0  # target rounds since the last re-tune
    eager_rounds: int = 0  # after a shift in the text: rounds left that re-tune every round (the estimates are still moving)
    since_full: int = 0  # target rounds since the last full search
    full_now: bool = False  # the text shifted: the next re-tune is a full search
    anchor_ms: float | None = None  # the plan's predicted ms when it was last weighed with no margin (`_switch_margin`)
    set_plans: dict[tuple[int, ...], Plan] = dataclasses.field(default_factory=dict)  # the last search's best plan per set of tiers


class Planner:
    """Searches and switches (part of `Tuner`, which supplies the estimates and latency tables)."""

    def __init__(self) -> None:
        self.retune_ms = 0.0  # a full search's cost (EMA; a local one costs about a third)
        self.history: list[dict] = []  # every plan change: {"class", "round", "lengths", "active", "predicted_ms_per_token"}
        self._retune_credit_ms = 0.0
        self._last_plan_at: float | None = None
        self._optimism = 0.0  # z of the acceptance rates the time model sees (warmup_optimism in a class's warm-up searches)
        self._optimistic_pairs: frozenset[tuple[int, int]] | None = None  # the pairs it applies to (None: all)

    def stages(self, key: str, active: tuple[int, ...], config: tuple[int, ...] | None = None,
               refit: bool = True) -> tuple[list[StageSpec], dict[int, float]]:
        """The time model's inputs for a chain of `active` tiers: stages (first tier first) and the
        bottom's draft_ms, from the latency tables of `config` (the tiers running; default `active`).
        `refit=False`: the drafters' slow-downs as last fitted (the per-block hook)."""
        config = active if config is None else config
        stages = []
        for a, b in zip(active, active[1:]):
            rates, per_text = self.rates_of(key, a, b)
            stages.append(StageSpec(
                self.profile.forward_ms(a, config), rates, self.stage_overhead_ms(a), self.pipelined,
                self.slowdown_of(b, refit) if self.pipelined else 1.0,
                self.fill(key, b) if b == active[-1] and self.tree_width == 1 else 1.0,
                self.jitter_cv if self.pipelined and a == 0 else 0.0, per_text_position=per_text,
                # the target's stage of a pipelined chain: a request's first rounds
                head_start_ms=self.head_start_ms if self.pipelined and a == 0 else 0.0,
                request_tokens=int(round(self.request_tokens)) if self.pipelined and a == 0 else 0))
        return stages, self.profile.draft_ms(active[-1], config)

    def accept_rates(self, key: str, verifier: int, drafter: int) -> tuple[float, ...]:
        """Posterior per-position acceptance (per position of the text, or per round for a
        shadow estimate: `rates_of`)."""
        return self.rates_of(key, verifier, drafter)[0]

    def rates_of(self, key: str, verifier: int, drafter: int) -> tuple[tuple[float, ...], bool]:
        """(posterior per-position acceptance, whether it is per position of the text); an
        unmeasured skip pair's prior is the product of the adjacent pairs' first-position
        rates (pessimistic: no bypass without evidence)."""
        prior = None
        if drafter > verifier + 1:
            prior = 1.0
            for tier in range(verifier, drafter):
                prior *= self.accept_rates(key, tier, tier + 1)[0]
        state = self.class_state(key)
        direct = state.estimates.get((verifier, drafter))
        shadow = state.shadow_estimates.get((verifier, drafter))
        direct_known = direct is not None and direct.blocks >= MIN_BLOCKS
        if not direct_known and shadow is not None and shadow.blocks >= MIN_BLOCKS:
            return shadow.rates(prior), shadow.along_text  # a fallback only (docs/time-model.md, shadow estimates)
        estimate = self.pair_estimate(key, verifier, drafter)
        optimism = self._optimism if self._optimistic_pairs is None or (verifier, drafter) in self._optimistic_pairs else 0.0
        return estimate.rates(prior, optimism), estimate.along_text

    def predict(self, key: str, active: tuple[int, ...], lengths: list[int] | tuple[int, ...]) -> float:
        """Predicted ms per target token for `active` tiers and per-level `lengths` (what the searches
        minimise: `time_model.chain_cost`)."""
        if len(active) == 1:
            return self.alone_ms()
        stages, draft_ms = self.stages(key, active)
        return chain_cost(stages, draft_ms, [lengths[level] for level in active[:-1]], self.tree_width)

    def alone_ms(self) -> float:
        """The target alone: one forward over one new token per token (plus a round's overhead)."""
        return latency(self.profile.forward_ms(0, (0,)), 1) + self.stage_overhead_ms(0)

    def candidate_sets(self, bypass: bool = True) -> list[tuple[int, ...]]:
        """Tier sets the chain can run: the target plus any ordered subset of the others whose
        members above the bottom can verify and whose bottom can draft. With bypass, the target
        alone too (every drafter bypassed): where the drafters' acceptance cannot pay for the
        verification of their blocks (a CPU whose forward grows with the block, a prompt class
        the drafters do not know), `lengths: auto` must not be slower than no speculation."""
        others = range(1, self.num_tiers)
        sizes = range(1, self.num_tiers) if bypass and not self.distributed else [self.num_tiers - 1]
        sets = [(0,)] if bypass and not self.distributed and self.profile.forward[0] is not None else []
        for size in sizes:
            for subset in itertools.combinations(others, size):
                active = (0,) + subset
                if all(self.profile.forward[t] is not None for t in active[:-1]) and self.profile.draft[active[-1]] is not None:
                    sets.append(active)
        return sets

    def choose(self, key: str, bypass: bool | None = None, exclude: int | None = None, only: tuple[int, ...] | None = None) -> Plan:
        """The plan with the lowest predicted C_0 (optionally never using tier `exclude`, or
        only on the tiers `only`)."""
        if bypass is None:
            bypass = self.config.allow_bypass
        sets = [active for active in self.candidate_sets(bypass or exclude is not None or only is not None)
                if not ((exclude is not None and exclude in active) or (only is not None and active != only))]
        plans = self._best_plans(key, sets)
        if not plans:
            raise ValueError("no usable set of tiers")
        return min(plans.values(), key=lambda plan: plan.predicted_ms)

    def _best_plans(self, key: str, sets: list[tuple[int, ...]], near: dict[tuple[int, ...], Plan] | None = None) -> dict[tuple[int, ...], Plan]:
        """The best lengths on each set of tiers: every combination (`time_model.search_lengths`),
        or for a set with a plan in `near`, hill-climbed from that plan's lengths
        (`time_model.local_search`)."""
        current = self.class_state(key).plan
        plans = {}
        for active in sets:
            if len(active) == 1:
                plans[active] = Plan(tuple(current.lengths if current else [self.config.max_length] * (self.num_tiers - 1)), active, self.alone_ms())
                continue
            stages, draft_ms = self.stages(key, active)
            start = (near or {}).get(active)
            if start is None:
                chosen, cost = search_lengths(stages, draft_ms, self.config.max_length, self.tree_width)
            else:
                chosen, cost = local_search(stages, draft_ms, [start.lengths[level] for level in active[:-1]], self.config.max_length, self.tree_width)
            lengths = list(current.lengths if current else [self.config.max_length] * (self.num_tiers - 1))
            for level, k in zip(active, chosen):
                lengths[level] = k
            plans[active] = Plan(tuple(lengths), active, cost)
        return plans

    def retune(self, key: str, state: ClassState) -> None:
        """A full search (`_search`) during the warm-up, after a shift in the text and every
        FULL_SEARCH_EVERY rounds; otherwise (a request's start, the routine re-tunes) a local one
        (`_search(local=True)`): on the demo chain a full search took 0.9-1.8 ms of Python, and at a
        2 % budget the rounds of a 48-token request earned about one, so the lengths stayed
        where the request's start put them (a code prompt ran [3] on target+n-gram for all of
        its 20 rounds with every block accepted)."""
        full = state.plan is None or state.full_now or state.rounds < self.config.warmup_rounds or state.since_full >= FULL_SEARCH_EVERY
        started = self.clock()
        try:
            self._search(key, state, local=not full)
        finally:
            spent_ms = 1000.0 * (self.clock() - started)
            if full:
                self.retune_ms = ema(self.retune_ms or None, spent_ms, OVERHEAD_SMOOTHING)
                state.since_full = 0
                state.full_now = False
            if state.rounds >= self.config.warmup_rounds:  # (a class's warm-up is paid once)
                self._retune_credit_ms -= spent_ms
            state.retune_now = False
            state.since_retune = 0

    def earn_retune_credit(self, state: ClassState) -> None:
        """A target round begins: the budget earns RETUNE_BUDGET of the wall time since the last
        one (capped at two searches' worth, so an idle spell buys no burst of searches)."""
        now = self.clock()
        if self._last_plan_at is not None:
            earned = RETUNE_BUDGET * 1000.0 * (now - self._last_plan_at)
            self._retune_credit_ms = min(self._retune_credit_ms + earned, 2.0 * self.retune_ms)
        self._last_plan_at = now
        state.since_retune += 1
        state.since_full += 1
        state.eager_rounds = max(0, state.eager_rounds - 1)

    def _search(self, key: str, state: ClassState, local: bool = False) -> None:
        """The best plan on each usable set of tiers, and a switch to the best of them if it
        clears the margin (`_switch_margin`). Each set's lengths come from every combination
        (time_model.search_lengths), or with `local` from hill-climbing from the set's lengths
        at the last search (time_model.local_search: on the demo chain's three sets 0.33 ms against
        0.92 for a full search in isolation, 0.48 against 1.2 inside a generating process).
        During a class's warm-up the time model sees acceptance `warmup_optimism` posterior
        standard deviations above the mean: a block of k shows at most k positions, so lengths
        cut from the prior (0.6) leave the deeper positions unseen, and the ramp to long blocks
        took a fresh Ray chain 14 rounds at T = 0; optimistic, it reached [6, 6] in 4, and a
        poor drafter's positions, once seen, lose the optimism as their counts grow.
        (Optimism ends with the warm-up: an opening round at max_length alone instead let one
        early rejection stand for the rest of the request.)
        """
        with self._optimistic(self.config.warmup_optimism if state.rounds < self.config.warmup_rounds else 0.0):
            self._search_plans(key, state, local)

    @contextlib.contextmanager
    def _optimistic(self, z: float, pairs: frozenset[tuple[int, int]] | None = None):
        """Inside the block the time model sees acceptance `z` posterior sd above the mean (for
        the (verifier, drafter) `pairs` only; None: every pair), as it was after."""
        saved = self._optimism, self._optimistic_pairs
        self._optimism, self._optimistic_pairs = z, pairs
        try:
            yield
        finally:
            self._optimism, self._optimistic_pairs = saved

    def _search_plans(self, key: str, state: ClassState, local: bool) -> None:
        bypass = self.config.allow_bypass and state.rounds >= self.config.warmup_rounds
        sets = self.candidate_sets(bypass)
        # one search per set of tiers, reused below; a local one starts from each set's plan at
        # the last search (the current plan for the current set)
        near = {**state.set_plans, state.plan.active: state.plan} if local else None
        plans = self._best_plans(key, sets, near)
        state.set_plans = plans
        best = min(plans.values(), key=lambda plan: plan.predicted_ms)
        current = state.plan
        if current is not None:
            current_ms = self.predict(key, current.active, current.lengths)
            afresh = state.full_now or self._drifted(state, current_ms)  # no margin for new lengths on these tiers
            if not best.predicted_ms < current_ms * (1.0 - self._switch_margin(current.active, best.active, afresh)) and best.active != current.active:
                # another set of tiers is not worth the switch yet; the lengths on these tiers may be
                best = plans.get(current.active) or self.choose(key, only=current.active)
            if not best.predicted_ms < current_ms * (1.0 - self._switch_margin(current.active, best.active, afresh)):
                state.plan = dataclasses.replace(current, predicted_ms=current_ms)
                if afresh:
                    state.anchor_ms = current_ms  # weighed afresh with no margin, and kept
                self._set_probing(key, state, plans)
                return
        self._adopt(key, state, best)
        self._set_probing(key, state, plans)

    def _adopt(self, key: str, state: ClassState, best: Plan) -> None:
        state.plan = best
        state.anchor_ms = best.predicted_ms
        self.history.append(
            {
                "class": key,
                "round": state.rounds,
                "lengths": [best.lengths[level] for level in best.active[:-1]],
                "active": [self.profile.names[t] for t in best.active],
                "predicted_ms_per_token": round(best.predicted_ms, 4),
            }
        )

    def retune_due(self, state: ClassState) -> bool:
        """Every round during the warm-up (a fresh tuner's first plan rests on priors alone, and
        each round's data moves it most: waiting 4 rounds kept the demo chain at [1, 1] for 8
        rounds), when a request starts or the text shifts; and while the re-tune budget allows
        (see __init__), every `retune_every` rounds, or every round for `retune_every` rounds
        after a shift (the forgetting leaves a tenth of the old counts, which the next rounds'
        data outweigh)."""
        if state.plan is None or state.retune_now or state.rounds < self.config.warmup_rounds:
            return True
        return (state.eager_rounds > 0 or state.since_retune >= self.config.retune_every) and self._retune_credit_ms >= 0.0

    def _drifted(self, state: ClassState, current_ms: float) -> bool:
        """The plan's predicted time has moved by more than `replan_drift` since it was last
        weighed with no margin (adopted, or kept by such a search): the estimates it was cut
        for have moved, whether or not the shift detector saw it happen."""
        anchor = state.anchor_ms
        return bool(anchor) and math.isfinite(anchor) and abs(current_ms / anchor - 1.0) > self.config.replan_drift

    def _switch_margin(self, current: tuple[int, ...], new: tuple[int, ...], afresh: bool) -> float:
        """The predicted gain a plan on `new` tiers needs over the current plan on `current`.
        Another set of tiers needs more: a returning tier re-feeds what it missed, and the gain
        rests on ~14 rounds of a bursty drafter's acceptance, read just when it looks best (it
        then regresses): benchmarks/switch-margin-t0.md. That holds for dropping the bottom
        tier too: with 8 % for a drop, a fresh tuner at T = 0 dropped the n-gram tier after the
        first prompt's 8 rounds and ran 0.885x the best fixed lengths on held-out prompts.

        New lengths on the same tiers need none (`afresh`) in the full search a detected shift
        in the text calls for (`state.full_now`): the margin keeps a plan against noise in estimates that
        have not moved, and the plan's claim is void once the text it was cut for is gone (a
        change of lengths costs nothing: the next round asks for other ones). With the margin
        there, the Ray demo chain at T = 1 kept [3, 3] for 62 rounds of prose whose best lengths
        the model put ~3 % lower (the n-gram tier's acceptance fell from 0.77 to 0.11 and the
        shift was seen). Only that search: with no margin in the eager re-tunes after it too
        (every round for `retune_every` rounds, on estimates just forgotten to a tenth), the
        judged runs' plans changed 1.5-2.2 times a held-out prompt at T = 0 against 0.4-0.8
        with the margin, and `lengths: auto` lost 1-14 % more to the best fixed lengths.

        None either once the plan's predicted time has drifted (`_drifted`): a shift the detector
        missed, or a slow one (an n-gram tier that finds no match on prose proposes nothing, so
        the lengths hardly matter and the prose's best led the code's by under 3 %: the
        embedded demo chain at T = 1 kept target+ngram [2] for 79 prose rounds)."""
        if new != current:
            return self.config.switch_hysteresis
        return 0.0 if afresh else self.config.hysteresis

    def _set_probing(self, key: str, state: ClassState, plans: dict[tuple[int, ...], Plan] | None = None) -> None:
        """While the plan bypasses tiers their acceptance goes stale, so every so often a round
        runs all of them (a probe). The closer the plan with all tiers is predicted to come, the
        likelier stale estimates hide a better plan and the cheaper a probe is: probes come
        every (gap + catch-up) / PROBE_BUDGET rounds (at least 2, at most `explore_every`), so
        they cost about PROBE_BUDGET of the predicted time. The catch-up: a bypassed model tier
        re-feeds what it missed in one forward when it returns, measured (`catch_up_ms`; t(1)
        until it is). With short requests that is mostly the prompt: a request that began
        without the tier has it re-fed at the probe (on a chain whose rounds take a few ms,
        probes of an int8 middle tier every 16 rounds cost ~13 ms each, 9 % of the time). An n-gram
        tier (no forward) is probed as often as its gap allows."""
        full_set = tuple(range(self.num_tiers))
        if not self.config.explore_every or state.plan.active == full_set:
            state.probe_every = 0
            return
        plan = state.plan
        # the full chain as it may be: the pairs the plan does not run at acceptance
        # PROBE_OPTIMISM posterior sd above the mean, so a bypassed pair whose counts have thinned
        # to STALE_BLOCKS (what it showed before the bypass, on little weight) is probed sooner
        # than one measured lately
        unrun = frozenset(itertools.combinations(full_set, 2)) - frozenset(zip(plan.active, plan.active[1:]))
        with self._optimistic(self.config.probe_optimism, unrun):
            full = self._best_plans(key, [full_set], near=plans)[full_set]
        gap = max(0.0, full.predicted_ms / plan.predicted_ms - 1.0)
        if len(plan.active) > 1:
            stages, draft_ms = self.stages(key, plan.active)
            round_ms = round_models(stages, draft_ms, [plan.lengths[level] for level in plan.active[:-1]], self.tree_width)[0].round_ms
        else:
            round_ms = latency(self.profile.forward_ms(0, plan.active), 1)
        catch_up_ms = sum(self.catch_up_ms.get(tier, latency(self.profile.forward_ms(tier, full_set), 1))
                          for tier in full_set if tier not in plan.active and self.profile.forward[tier] is not None)
        share = gap + catch_up_ms / max(round_ms, 1e-9)
        state.probe_every = int(min(self.config.explore_every, max(2, math.ceil(share / PROBE_BUDGET))))
