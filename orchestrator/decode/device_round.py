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
as they drive `BatchedScheduler`. It covers chains of Llama / Qwen2 model tiers with float
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
    StageStats,
    commit,
    finish_if_full,
    generate,
    mark_cancelled,
    output,
    remaining,
)
from polyspec.workers.core.device_verify import (
    DOMAIN_ACCEPT,
    DOMAIN_DRAFT,
    DOMAIN_NEXT,
    emitted_tokens,
    stream_exponentials,
    stream_uniforms,
    verify_chains,
    verify_greedy_chains,
    warp_batch,
)
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.tiers.static_llama import KVPool, StaticLlama

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


# ------------------------------------------------------------------------------ the steps


GREEDY, PLAIN, TRUNCATED = "greedy", "plain", "truncated"  # a step's sampling: every request greedy; no top-k / top-p; some


def sampling_mode(params: list[SamplingParams]) -> str:
    """The cheapest warp that serves every request of a step (a static choice: one graph each)."""
    if all(p.greedy for p in params):
        return GREEDY
    return TRUNCATED if any(p.top_k > 0 or p.top_p < 1.0 for p in params) else PLAIN


def target_step(model: StaticLlama, pool: KVPool, ids, positions, slots, span: int, mode: str, temperature, top_k, top_p, greedy,
                draft_tokens, draft_probs, num_draft, seeds, counters):
    """The target's step: forward of [B, k + 1] tokens, warp, verification. Returns
    (tokens [B, k + 1]: accepted drafts, then the correction / bonus token, then padding; num_accepted [B])."""
    logits = model.forward(pool, ids, positions, slots, span)  # [B, k + 1, V]
    rows, width, vocab = logits.shape
    block = width - 1
    cu_num_draft = torch.arange(rows + 1, device=ids.device) * block  # the padded layout: k slots per request
    flat_tokens = draft_tokens.reshape(-1)
    if mode == GREEDY:
        num_accepted, next_tokens = verify_greedy_chains(logits, draft_tokens, num_draft)
        return emitted_tokens(flat_tokens, cu_num_draft, num_accepted, next_tokens, block), num_accepted

    def per_row(values):  # a request's value on each of its k + 1 rows
        return values[:, None].expand(rows, width).reshape(-1)

    target_probs = warp_batch(logits.reshape(rows * width, vocab), per_row(temperature), per_row(top_k), per_row(top_p),
                              truncate=mode == TRUNCATED)
    uniforms = stream_uniforms(seeds, counters, DOMAIN_ACCEPT, block).reshape(-1)  # [B * k]
    exponentials = stream_exponentials(seeds, counters, DOMAIN_NEXT, vocab)  # [B, V]
    num_accepted, next_tokens = verify_chains(target_probs, draft_probs.reshape(rows * block, vocab), flat_tokens, cu_num_draft,
                                              greedy, uniforms, exponentials, num_draft)
    return emitted_tokens(flat_tokens, cu_num_draft, num_accepted, next_tokens, block), num_accepted


def draft_step(model: StaticLlama, pool: KVPool, ids, positions, slots, span: int, mode: str, temperature, top_k, top_p, greedy, seeds,
               draw_counters):
    """A drafter's step: forward, warp of the last column, one draw per request. Returns (tokens [B], probs [B, V];
    all-greedy steps return the logits instead of probabilities: the target's greedy verification reads none)."""
    logits = model.forward(pool, ids, positions, slots, span)[:, -1]  # [B, V]
    if mode == GREEDY:
        return logits.argmax(dim=-1), logits.float()
    probs = warp_batch(logits, temperature, top_k, top_p, truncate=mode == TRUNCATED)
    sampled = torch.argmax(probs / stream_exponentials(seeds, draw_counters, DOMAIN_DRAFT, probs.shape[-1]), dim=-1)
    return torch.where(greedy, probs.argmax(dim=-1), sampled), probs


class StepGraphs:
    """Each step captured once per bucket as a CUDA graph and replayed with new inputs (on CUDA);
    called directly elsewhere. The inputs are copied into the graph's own buffers before each
    replay; the outputs are the graph's buffers (read them before the next replay)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.graphs: dict[tuple, tuple] = {}
        self.memory_pool = None

    def run(self, key: tuple, step, tensors: list[torch.Tensor]):
        """`step(*tensors)`, replayed from the graph captured for `key` (the bucket: whatever fixes the shapes)."""
        if not self.enabled:
            return step(*tensors)
        entry = self.graphs.get(key)
        if entry is None:
            buffers = [t.clone() for t in tensors]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (the same inputs: its writes are the replay's)
                step(*buffers)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.memory_pool is None:
                self.memory_pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                outputs = step(*buffers)
            entry = self.graphs[key] = (graph, buffers, outputs)
        graph, buffers, outputs = entry
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=True)
        graph.replay()
        return outputs


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
        """One device round of every request in `states` (all `ready`); the tokens each committed."""
        started = time.perf_counter()
        out: list[list[int]] = [[] for _ in states]
        live = [i for i, s in enumerate(states) if not finish_if_full(s)]
        if not live:
            return out
        requests = [states[i] for i in live]
        if self.planner is not None:  # lengths and tiers for this load (polyspec.orchestrator.tuning.batch_model.BatchPlanner)
            lengths, active = self.planner.plan(len(live), [s.params for s in requests], {})
            self.lengths, self.active = list(lengths), tuple(active)
        # a request not yet `ready` (a caller that does not prefill, a drafter back in the plan) catches up here
        self.prefill(requests)
        length = self.lengths[0] if len(self.active) > 1 else 0
        rows = bucket(len(live))
        device = self.device
        num_draft = [max(0, min(length, remaining(s) - 1, s.limit - len(s.committed) - 1)) for s in requests]
        host_drafter = self.tiers[1] if len(self.active) > 1 and isinstance(self.tiers[1], HostDrafter) else None
        proposals = []
        if host_drafter is not None:  # looked up on the host; a request may get fewer tokens than asked, or none
            proposals = host_drafter.propose([s.run.seq_id for s in requests], [s.committed for s in requests], num_draft)
            num_draft = [len(p) for p in proposals]
        block = max(num_draft) if len(self.active) > 1 else 0

        def column(values, dtype, pad):  # one value per request, padded to the bucket
            return torch.tensor(values + [pad] * (rows - len(values)), dtype=dtype).to(device, non_blocking=True)

        scratch = self.tiers[0].pool.scratch_slot
        slots = column([s.run.slot for s in requests], torch.long, scratch)
        temperature = column([s.params.temperature for s in requests], torch.float32, 0.0)
        top_k = column([s.params.top_k for s in requests], torch.long, 0)
        top_p = column([s.params.top_p for s in requests], torch.float32, 1.0)
        greedy = column([s.params.greedy for s in requests], torch.bool, True)
        seeds = column([s.run.seed for s in requests], torch.long, 0)
        counters = column([s.run.rounds for s in requests], torch.long, 0)
        lengths_now = [len(s.committed) for s in requests]
        vocab = self.tiers[0].vocab_size
        mode = sampling_mode([s.params for s in requests])
        draft_tokens = torch.zeros(rows, block, dtype=torch.long, device=device)
        # greedy steps read no draft rows: a placeholder keeps the step's signature
        draft_probs = torch.zeros(rows, block, 1 if mode == GREEDY else vocab, dtype=torch.float32, device=device)
        if block and host_drafter is not None:
            draft_tokens = torch.tensor([p + [0] * (block - len(p)) for p in proposals] + [[0] * block] * (rows - len(requests)),
                                        dtype=torch.long).to(device)
            if mode != GREEDY:  # a point mass at each proposed token
                draft_probs.scatter_(2, draft_tokens[:, :, None], 1.0)
        elif block:
            drafter = self.tiers[1]
            begun = time.perf_counter()
            # first draft step: the last two committed tokens (a drafter whose block was accepted whole is one behind)
            first = [[s.committed[-2] if len(s.committed) > 1 else s.committed[-1], s.committed[-1]] for s in requests]
            ids = torch.tensor(first + [[0, 0]] * (rows - len(requests)), dtype=torch.long).to(device)
            positions = torch.tensor([[max(n - 2, 0), n - 1] for n in lengths_now] + [[0, 1]] * (rows - len(requests))).to(device)
            for j in range(block):
                span = self._span(max(lengths_now) + j + 1)
                draw_counters = counters * MAX_DRAFT_TOKENS + j

                def drafting(*tensors, span=span):
                    return draft_step(drafter.model, drafter.pool, *tensors[:3], span, mode, *tensors[3:])

                tokens, probs = drafter.graphs.run(("draft", rows, ids.shape[1], span, mode), drafting,
                                                   [ids, positions, slots, temperature, top_k, top_p, greedy, seeds, draw_counters])
                draft_tokens[:, j] = tokens
                if mode != GREEDY:
                    draft_probs[:, j] = probs
                ids = tokens[:, None]
                positions = positions[:, -1:] + 1
            drafter.busy_s += time.perf_counter() - begun
        target = self.tiers[0]
        begun = time.perf_counter()
        ids = torch.cat([column([s.committed[-1] for s in requests], torch.long, 0)[:, None], draft_tokens], dim=1)  # [B, k + 1]
        positions = (column([n - 1 for n in lengths_now], torch.long, 0)[:, None] + torch.arange(block + 1, device=device)[None])
        span = self._span(max(lengths_now) + block)

        def verifying(*tensors):
            return target_step(target.model, target.pool, *tensors[:3], span, mode, *tensors[3:])

        tokens, num_accepted = target.graphs.run(("target", rows, block, span, mode), verifying,
                                                 [ids, positions, slots, temperature, top_k, top_p, greedy, draft_tokens, draft_probs,
                                                  column(num_draft, torch.long, 0), seeds, counters])
        tokens, num_accepted = tokens.cpu().tolist(), num_accepted.cpu().tolist()  # the round's one copy to the host
        target.busy_s += time.perf_counter() - begun
        committed = 0
        for index, (i, state) in enumerate(zip(live, requests)):
            run: DeviceRun = state.run
            accepted = num_accepted[index]
            emitted = tokens[index][: accepted + 1]
            if len(self.active) > 1:
                run.stages[0].record(num_draft[index], accepted, length, (time.perf_counter() - started) / len(live))
                if self.planner is not None:
                    self.planner.observe_round(0, 1, num_draft[index], accepted, state.params.greedy)
            before = len(state.committed)
            out[i] = commit(state, emitted, self.eos_token_ids)
            committed += len(out[i])
            run.rounds += 1
            # the target holds the committed context up to its last token; a drafter what it was fed of it
            run.cached[0] = len(state.committed) - 1
            if len(self.active) > 1 and host_drafter is None:
                run.cached[1] = min(before - 1 + min(accepted, max(block - 1, 0)) + (1 if block else 0), len(state.committed) - 1)
        seconds = time.perf_counter() - started
        self.last_step = {"batch": len(live), "tokens": committed, "seconds": seconds, "lengths": [length] if len(self.active) > 1 else [],
                          "tiers": list(self.active)}
        if self.planner is not None:
            self.planner.observe_step(len(live), committed, seconds, self.lengths, self.active)
        return out

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
