"""The round that stays on the device: every running request in one static-shape step per tier.

    round(R requests, length k):
        drafter (optional):  k draft steps, each ONE forward of every request's last token
                             (the first also re-feeds the token before it, so a drafter whose
                             block was accepted whole catches up), warp and draw on the device
        target:              ONE forward of [last committed token, k drafts] per request, warp,
                             verification of every block (device_verify.verify_chains)
        host:                one copy of [R, k + 1] token ids and the accepted counts

Nothing else crosses to the host: token ids, positions, slots and block lengths go in as
tensors, logits never leave the device. Every shape depends only on the step's bucket
(requests padded up to a power of two, the attended span rounded up to a power of two), so
on CUDA each tier's step is captured once per bucket as a CUDA graph and replayed
(`StepGraphs`); on the CPU it runs eagerly (the same tensor program; tests compile it whole).

Randomness comes from counter-based streams keyed by the request's seed and its round number
(device_verify.stream_uniforms): a seeded request draws the same numbers alone or in any
batch. The verification is lossless (chain speculative sampling, greedy acceptance at
temperature 0), so the output is the target's: its greedy text, or its distribution.

`DeviceScheduler` is a `polyspec.orchestrator.decode.contract.Decoder` with the batched
scheduler's calls (`step_all`, `prefill`, `ready`, `last_step`), so the request loops drive it
as they drive the ragged `ChainScheduler`. It covers chains of Llama / Qwen2 model tiers with float
weights (`StaticLlama.supports`), one drafter at most, chain blocks with fixed lengths.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time

import torch

from polyspec.orchestrator.decode.contract import (
    NO_LIMIT,
    GenerationOutput,
    RequestState,
    RoundObservation,
    StepInput,
    StepObservation,
    StageStats,
    commit,
    finish_if_full,
    generate,
    mark_cancelled,
    output,
    remaining,
)
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.device_step import GREEDY, StepGraphs, draft_step, sampling_mode, target_step
from polyspec.workers.tiers.static_llama import StaticLlama

MAX_DRAFT_TOKENS = 16  # the longest block a round verifies (a draft step's counter is round * this + position)
MIN_SPAN = 64  # the smallest attended span bucket
PREFILL_CHUNK = 256  # prompt tokens a prefill forward of one request carries at most
_sequence_ids = itertools.count()


def bucket(value: int, smallest: int = 1) -> int:
    """The power of two at or above `value` (at least `smallest`)."""
    size = smallest
    while size < value:
        size *= 2
    return size


# ---------------------------------------------------------------------------- the decoder


@dataclasses.dataclass
class DeviceRun:
    """What the device scheduler keeps of one request besides its tokens (`RequestState.run`)."""

    seq_id: int
    slot: int
    seed: int  # the request's stream key (63 bits)
    rounds: int = 0  # the counter of its streams
    cached: list[int] = dataclasses.field(default_factory=list)  # per tier: positions whose KV is the committed context's
    stages: list[StageStats] = dataclasses.field(default_factory=list)


class DeviceTier:
    """One model of the chain on its device: its static forward and its KV pool."""

    can_verify = True
    has_weights = True

    def __init__(self, name: str, model: StaticLlama, slots: int, context: int | None = None) -> None:
        self.name = name
        self.model = model
        self.pool = model.new_pool(slots, MAX_DRAFT_TOKENS + 2, context)
        self.vocab_size = model.vocab_size
        self.max_context = min(context or model.limit, model.limit)
        self.busy_s = 0.0
        self.graphs = StepGraphs(model.device.type == "cuda")


class HostDrafter:
    """A model-free drafter (the n-gram lookup) in the device round: its proposals are looked up on
    the host from each request's context (a per-request index) and go to the device as token ids;
    being deterministic, its draft rows are one-hot, made on the device."""

    model = None
    can_verify = False
    has_weights = False

    def __init__(self, name: str, lookup) -> None:
        self.name = name
        self.lookup = lookup  # polyspec.workers.tiers.batched.BatchedNGramTier
        self.max_context = None

    @property
    def busy_s(self) -> float:
        return self.lookup.busy_s

    def propose(self, seq_ids: list, contexts: list[list[int]], counts: list[int]) -> list[list[int]]:
        greedy = [SamplingParams()] * len(seq_ids)  # the rows are made on the device
        return [tokens for tokens, _ in self.lookup.draft_batch(seq_ids, contexts, counts, greedy, [None] * len(seq_ids))]

    def release(self, seq_id) -> None:
        self.lookup.release(seq_id)


class _Step:
    """One round's inputs on the device, every per-request tensor padded to the batch bucket (padding
    rows: the scratch slot, greedy, no draft)."""

    def __init__(self, scheduler: "DeviceScheduler", requests: list[RequestState], block: int) -> None:
        self.requests = requests
        self.block = block
        self.rows = bucket(len(requests))
        self.device = scheduler.device
        self.lengths = [len(s.committed) for s in requests]
        self.mode = sampling_mode([s.params for s in requests])
        params = [s.params for s in requests]
        self.slots = self.column([s.run.slot for s in requests], torch.long, scheduler.tiers[0].pool.scratch_slot)
        self.sampling = (self.column([p.temperature for p in params], torch.float32, 0.0),  # temperature, top_k, top_p, greedy
                         self.column([p.top_k for p in params], torch.long, 0),
                         self.column([p.top_p for p in params], torch.float32, 1.0),
                         self.column([p.greedy for p in params], torch.bool, True))
        self.seeds = self.column([s.run.seed for s in requests], torch.long, 0)
        self.counters = self.column([s.run.rounds for s in requests], torch.long, 0)
        vocab = scheduler.tiers[0].vocab_size
        self.draft_tokens = torch.zeros(self.rows, block, dtype=torch.long, device=self.device)
        # greedy steps read no draft rows: a placeholder keeps the step's signature
        self.draft_probs = torch.zeros(self.rows, block, 1 if self.mode == GREEDY else vocab, dtype=torch.float32, device=self.device)

    def column(self, values: list, dtype: torch.dtype, pad) -> torch.Tensor:
        """One value (or row) per request, padded to the bucket with `pad`, on the device."""
        return torch.tensor(values + [pad] * (self.rows - len(values)), dtype=dtype).to(self.device, non_blocking=True)

    def take_proposals(self, proposals: list[list[int]]) -> None:
        """A host drafter's blocks as the step's drafts; their rows are point masses (one-hot)."""
        self.draft_tokens = self.column([p + [0] * (self.block - len(p)) for p in proposals], torch.long, [0] * self.block)
        if self.mode != GREEDY:
            self.draft_probs.scatter_(2, self.draft_tokens[:, :, None], 1.0)


class DeviceScheduler:
    """Requests of a chain [target, drafter?] advanced together, one device round per step (module docstring)."""

    def __init__(self, tiers: list[DeviceTier], lengths: list[int], eos_token_ids: tuple[int, ...] = (), max_requests: int = 64) -> None:
        if not 1 <= len(tiers) <= 2:
            raise ValueError(f"the device round runs a target and at most one drafter, got {len(tiers)} tiers")
        if len(lengths) != len(tiers) - 1 or any(not 0 <= k <= MAX_DRAFT_TOKENS for k in lengths):
            raise ValueError(f"need {len(tiers) - 1} speculation length(s) in [0, {MAX_DRAFT_TOKENS}], got {lengths}")
        self.tiers = tiers
        self.lengths = list(lengths)
        self.active = tuple(range(len(tiers)))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_requests = max_requests
        self.max_context = min(t.max_context for t in tiers if t.max_context)
        self.device = tiers[0].model.device
        self.free_slots = list(range(max_requests))
        self.last_step: dict = {}
        self.planner = None

    # ----------------------------------------------------------------- decoder API

    def generate(self, prompt_ids, max_new_tokens, params, seed=None, on_commit=None) -> GenerationOutput:
        return generate(self, prompt_ids, max_new_tokens, params, seed, on_commit)

    def start(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None) -> RequestState:
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_requests} request slots are in use")
        run = DeviceRun(seq_id=next(_sequence_ids), slot=self.free_slots.pop(0),
                        seed=(secrets.randbits(63) if seed is None else int(seed) & ((1 << 63) - 1)),
                        cached=[0] * len(self.tiers),
                        stages=[StageStats(self.tiers[i].name, self.tiers[i + 1].name) for i in range(len(self.tiers) - 1)])
        return RequestState(seq_id=run.seq_id, params=params, committed=list(prompt_ids), max_new_tokens=max_new_tokens,
                            limit=self.max_context or NO_LIMIT, run=run, tier_busy_s=[0.0] * len(self.tiers))

    def step(self, state: RequestState) -> list[int]:
        return self.step_all([state])[0]

    @staticmethod
    def misfit(tiers, lengths, tree_width: int) -> str | None:
        """Why the device round cannot run a chain of these (loaded) tiers; None when it can."""
        if len(tiers) > 2:
            return f"it runs a target and at most one drafter, not {len(tiers)} tiers"
        from polyspec.workers.tiers.tier import NGramTier

        for level, tier in enumerate(tiers):
            if level and isinstance(tier, NGramTier):
                continue  # looked up on the host (HostDrafter)
            model = getattr(tier, "model", None)
            if model is None or not StaticLlama.supports(model, torch.device(getattr(tier, "device", "cpu"))):
                return f"tier {tier.name!r} is not a Llama / Qwen2 model with float weights on the CPU or CUDA, nor an n-gram drafter"
        vocabularies = {tier.model.config.vocab_size for tier in tiers if getattr(tier, "model", None) is not None}
        if len(vocabularies) > 1:
            return f"its tiers' logits must have one width, got {sorted(vocabularies)}"
        if tree_width > 1:
            return "it verifies chains, not draft trees (speculation.tree_width > 1)"
        if lengths != "auto" and any(k > MAX_DRAFT_TOKENS for k in lengths):
            return f"its blocks hold at most {MAX_DRAFT_TOKENS} tokens"
        return None

    def finish(self, state: RequestState) -> GenerationOutput:
        run: DeviceRun = state.run
        for tier in self.tiers:
            if isinstance(tier, HostDrafter):
                tier.release(run.seq_id)
        if run.slot is not None:
            self.free_slots.append(run.slot)
            self.free_slots.sort()
            run.slot = None
        extra = {"tiers": [{"tier": t.name, "busy_s": round(busy, 6)} for t, busy in zip(self.tiers, state.tier_busy_s)]}
        return output(state, run.stages, **extra)

    def cancel(self, state: RequestState) -> GenerationOutput:
        mark_cancelled(state)
        return self.finish(state)

    # ------------------------------------------------------------ prefill

    def ready(self, state: RequestState) -> bool:
        """The target holds the context but its last token; a drafter may be one behind (a block
        accepted whole: its first draft step re-feeds that token)."""
        need = len(state.committed) - 1
        return state.run.cached[0] >= need and all(state.run.cached[level] >= need - 1 for level in self.active[1:]
                                                   if self.tiers[level].model is not None)

    def prefill(self, states: list[RequestState], budget: int | None = None) -> int:
        """Cache every tier's KV of each joining prompt (all but its last token), one request and
        chunk at a time (eager: prefill shapes vary)."""
        fed = 0
        for state in states:
            if state.done or self.ready(state):
                continue
            run: DeviceRun = state.run
            for level, tier in enumerate(self.tiers):
                if tier.model is None or level not in self.active:
                    continue  # a host drafter indexes the context when it first drafts; a tier out of the plan catches up when used
                start, end = run.cached[level], len(state.committed) - 1
                if level and end - start <= 1:
                    continue  # the round's first draft step catches up one token
                while start < end:
                    count = min(PREFILL_CHUNK, end - start)
                    width = bucket(count, 16)
                    ids = torch.zeros(1, width, dtype=torch.long)
                    ids[0, :count] = torch.tensor(state.committed[start:start + count])
                    positions = (start + torch.arange(width))[None]
                    begun = time.perf_counter()
                    with torch.inference_mode():
                        tier.model.forward(tier.pool, ids.to(self.device), positions.to(self.device),
                                           torch.tensor([run.slot], device=self.device), self._span(start + width))
                    tier.busy_s += time.perf_counter() - begun
                    fed += count
                    start += count
                run.cached[level] = max(run.cached[level], end)
        return fed

    # ------------------------------------------------------------ the round

    def _span(self, longest: int) -> int:
        return min(bucket(longest, MIN_SPAN), self.tiers[0].pool.capacity)

    @torch.inference_mode()
    def step_all(self, states: list[RequestState]) -> list[list[int]]:
        """One device round of every request in `states`; the tokens each committed."""
        started = time.perf_counter()
        out: list[list[int]] = [[] for _ in states]
        live = [i for i, s in enumerate(states) if not finish_if_full(s)]
        if not live:
            return out
        requests = [states[i] for i in live]
        if self.planner is not None:  # lengths and tiers for this load (polyspec.orchestrator.tuning.batch_model.BatchPlanner)
            lengths, active = self.planner.plan(StepInput(tuple(s.params for s in requests), tuple(len(s.committed) for s in requests)))
            self.lengths, self.active = list(lengths), tuple(active)
        # a request not yet `ready` (a caller that does not prefill, a drafter back in the plan) catches up here
        self.prefill(requests)
        length = self.lengths[0] if len(self.active) > 1 else 0
        num_draft = [max(0, min(length, remaining(s) - 1, s.limit - len(s.committed) - 1)) for s in requests]
        host_drafter = self.tiers[1] if len(self.active) > 1 and isinstance(self.tiers[1], HostDrafter) else None
        proposals = []
        if host_drafter is not None:  # looked up on the host; a request may get fewer tokens than asked, or none
            proposals = host_drafter.propose([s.run.seq_id for s in requests], [s.committed for s in requests], num_draft)
            num_draft = [len(p) for p in proposals]
        step = _Step(self, requests, block=max(num_draft) if len(self.active) > 1 else 0)
        if step.block and host_drafter is not None:
            step.take_proposals(proposals)
        elif step.block:
            self._draft(step)
        tokens, num_accepted = self._verify(step, num_draft)
        committed = 0
        for index, (i, state) in enumerate(zip(live, requests)):
            run: DeviceRun = state.run
            accepted = num_accepted[index]
            if len(self.active) > 1:
                run.stages[0].record(num_draft[index], accepted, length, (time.perf_counter() - started) / len(live))
                if self.planner is not None:
                    self.planner.observe(RoundObservation(0, 1, length, num_draft[index], accepted, (time.perf_counter() - started) / len(live),
                                                          state.params.greedy, len(state.committed), state.seq_id))
            before = len(state.committed)
            out[i] = commit(state, tokens[index][: accepted + 1], self.eos_token_ids)
            committed += len(out[i])
            run.rounds += 1
            # the target holds the committed context but its last token; a drafter what it was fed of it
            run.cached[0] = len(state.committed) - 1
            if len(self.active) > 1 and host_drafter is None and step.block:
                run.cached[1] = min(before + min(accepted, step.block - 1), len(state.committed) - 1)
        seconds = time.perf_counter() - started
        self.last_step = {"batch": len(live), "tokens": committed, "seconds": seconds, "lengths": [length] if len(self.active) > 1 else [],
                          "tiers": list(self.active)}
        if self.planner is not None:
            self.planner.observe(StepObservation(tuple(tuple(out[i]) for i in live), seconds, tuple(self.lengths), tuple(self.active)))
        return out

    def _draft(self, step: "_Step") -> None:
        """The model drafter's block: `step.block` one-token steps of every request (the first re-feeds the
        token before the last, which a drafter whose block was accepted whole has not seen)."""
        drafter = self.tiers[1]
        begun = time.perf_counter()
        first = [[s.committed[-2] if len(s.committed) > 1 else s.committed[-1], s.committed[-1]] for s in step.requests]
        ids = step.column(first, torch.long, [0, 0])  # [B, 2]
        positions = step.column([[max(n - 2, 0), n - 1] for n in step.lengths], torch.long, [0, 1])
        for j in range(step.block):
            span = self._span(max(step.lengths) + j + 1)
            draw_counters = step.counters * MAX_DRAFT_TOKENS + j

            def drafting(*tensors, span=span):
                return draft_step(drafter.model, drafter.pool, *tensors[:3], span, step.mode, *tensors[3:])

            tokens, probs = drafter.graphs.run(("draft", step.rows, ids.shape[1], span, step.mode), drafting,
                                               [ids, positions, step.slots, *step.sampling, step.seeds, draw_counters])
            step.draft_tokens[:, j] = tokens
            if step.mode != GREEDY:
                step.draft_probs[:, j] = probs
            ids = tokens[:, None]
            positions = positions[:, -1:] + 1
        drafter.busy_s += time.perf_counter() - begun

    def _verify(self, step: "_Step", num_draft: list[int]) -> tuple[list[list[int]], list[int]]:
        """The target's step over [last committed token, block]; the round's one copy to the host:
        each request's emitted tokens (padded) and accepted count."""
        target = self.tiers[0]
        begun = time.perf_counter()
        ids = torch.cat([step.column([s.committed[-1] for s in step.requests], torch.long, 0)[:, None], step.draft_tokens], dim=1)
        positions = step.column([n - 1 for n in step.lengths], torch.long, 0)[:, None] + torch.arange(step.block + 1, device=self.device)
        span = self._span(max(step.lengths) + step.block)

        def verifying(*tensors):
            return target_step(target.model, target.pool, *tensors[:3], span, step.mode, *tensors[3:])

        tokens, num_accepted = target.graphs.run(("target", step.rows, step.block, span, step.mode), verifying,
                                                 [ids, positions, step.slots, *step.sampling, step.draft_tokens, step.draft_probs,
                                                  step.column(num_draft, torch.long, 0), step.seeds, step.counters])
        tokens, num_accepted = tokens.cpu().tolist(), num_accepted.cpu().tolist()
        target.busy_s += time.perf_counter() - begun
        return tokens, num_accepted

    def profile(self, batches: list[int], widths: list[int], context: int, repeats: int = 2) -> tuple[list[dict | None], list[float]]:
        """What a planner prices plans with, measured on the steps this round replays: per model tier the ms
        of one forward of (batch, width) new tokens after `context` cached ones (graph-replayed on CUDA),
        {(b, w): ms}; per tier the lookup's ms per request (0 for a model). Needs no request running."""
        tables, lookup = [], []
        prompt = list(range(1, context + 1))
        for tier in self.tiers:
            if tier.model is None:
                started = time.perf_counter()
                for _ in range(8):
                    tier.propose([("profile",)], [prompt], [8])
                tier.release(("profile",))
                lookup.append((time.perf_counter() - started) / 8 * 1000.0)
                tables.append(None)
                continue
            lookup.append(0.0)
            ms = {}
            for b in batches:
                for w in widths:
                    ids = torch.ones(b, w, dtype=torch.long, device=self.device)
                    positions = (context + torch.arange(w, device=self.device))[None].expand(b, w).contiguous()
                    slots = torch.arange(b, device=self.device)
                    span = self._span(context + w)

                    def forward(*tensors, tier=tier, span=span):
                        return tier.model.forward(tier.pool, *tensors, span)

                    best = float("inf")
                    with torch.inference_mode():
                        for _ in range(repeats + 1):  # the first run captures (CUDA) or warms up
                            begun = time.perf_counter()
                            tier.graphs.run(("profile", b, w, span), forward, [ids, positions, slots])
                            if self.device.type == "cuda":
                                torch.cuda.synchronize()
                            best = min(best, (time.perf_counter() - begun) * 1000.0)
                    ms[(b, w)] = best
            tables.append(ms)
        return tables, lookup
