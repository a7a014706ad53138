"""The engine: a loaded chain plus request handling (validation, tokenization, results).

It loads the tiers and builds the one decoder over them: the round (`ChainScheduler`) over the
one tier family (the same for one request or many: `batched` only sets how many run at once; on
CUDA its static-shape steps), or a Ray chain's driver; and its planner. `generate`, `chat`,
`batch`, jobs and `serve` all parse requests here (`parse_request`), so a request means the same
thing everywhere:

    request: {id, prompt | prompt_ids | messages, max_new_tokens, temperature, top_p, top_k, seed, approximate,
              json_schema | regex | grammar}
    result:  {id, text, token_ids, finish_reason, stats, mode (only when not exact; stats.approximate too)}

`json_schema`, `regex` or `grammar` (EBNF) constrains the output, losslessly: every tier's rows are
restricted to what the grammar allows (polyspec.workers.core.grammar); it is compiled while the request is
parsed, so a bad one is refused before any model work.

`approximate` ({mode: bild, ...}; docs/approximate.md) picks a decoding mode that is NOT
lossless; without it a request runs the config's `approximate:` mode, exact unless named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import sys
import threading
import time
from typing import Any, Callable

from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.decode.contract import FINISH_EOS, RequestState
from polyspec.orchestrator.decode.scheduler import ChainScheduler
from polyspec.orchestrator.config import ChainConfig
from polyspec.orchestrator.tokenization import encode_chat, encode_prompt, stop_token_ids
from polyspec.orchestrator.tuning.autoconf import needs_choice, resolve_auto
from polyspec.orchestrator.tuning.profile_cache import ProfileCache
from polyspec.workers.core.approximate import ApproximateMode, ApproximateModeError
from polyspec.workers.core.errors import ConfigError, RequestError
from polyspec.workers.core.grammar import FINISH_GRAMMAR, ConstraintSpec, GrammarBook, constraint_from_fields
from polyspec.workers.core.heartbeat import heartbeat
from polyspec.workers.tiers.loading import configured_eos_ids, freeze_heap, load_tiers, quiet_transformers, thaw_heap
from polyspec.workers.core.sampling import SamplingParams

PROFILE_MAX_BATCH = 16  # the batched profile stops here; larger batches are extrapolated in proportion to their rows
SEED_LIMIT = 1 << 63  # seeds are in [0, 2^63): an int64 on the wire, every bit used
MAX_TEMPERATURE = 1000.0  # far past uniform sampling; larger (or inf) is a mistake
REQUEST_FIELDS = ("id", "prompt", "prompt_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "approximate",
                  "json_schema", "regex", "grammar")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams
    seed: int | None = None
    id: str | None = None
    approximate: ApproximateMode = ApproximateMode()  # exact unless the request or the config names a mode
    constraint: ConstraintSpec | None = None  # structured output (json_schema / regex / grammar), compiled; None: free

    def choice(self, index: int) -> "GenerationRequest":
        """Choice `index` of a request asking for several (OpenAI's `n`, gRPC's `n`): choice 0 is the request
        itself, so n = 1 means what it always did; the others sample from independent streams derived from
        (seed, index) (an unseeded request's choices are independent anyway)."""
        if self.seed is None or index == 0:
            return self
        digest = hashlib.blake2b(self.seed.to_bytes(8, "little") + index.to_bytes(4, "little"), digest_size=8, person=b"polyspec-n")
        return dataclasses.replace(self, seed=int.from_bytes(digest.digest(), "little") >> 1)


def _number(name: str, value, kind):
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise RequestError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {str(value)[:40]!r}")
    try:
        return kind(value)
    except OverflowError:  # an int past float's range
        raise RequestError(f"{name} is out of range, got {str(value)[:40]}") from None


def seed_stream(seed: int | None) -> int | None:
    """The seed the chain's generators start from: a hash of all 64 bits of the request's
    seed (torch's CPU generator keeps only the low 32 bits of what it is given)."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(int(seed).to_bytes(8, "little"), digest_size=8).digest(), "little") >> 1


def requests_within_memory(max_requests: int, kv_memory_mb: int | None, bytes_per_request: int) -> int:
    """How many requests may hold caches at once: `max_requests`, lowered so their KV caches (each at
    the full model context) stay within `kv_memory_mb`."""
    if kv_memory_mb is None or bytes_per_request <= 0:
        return max_requests
    fits = kv_memory_mb * 2**20 // bytes_per_request
    if fits < 1:
        raise ConfigError(f"batching.kv_memory_mb ({kv_memory_mb}) holds no request: one request's KV caches "
                          f"at the full model context take {bytes_per_request / 2**20:.1f} MB")
    return int(min(max_requests, fits))


def pool_memory_mb(kv_memory_mb: int | None, device, per_request: int, context: int | None) -> int | None:
    """The KV pools' bound: `batching.kv_memory_mb` where set; on CUDA, where the pools are allocated at
    once, a share of what the card has free; on the CPU none (a pool's pages are backed as they are written)."""
    import torch

    from polyspec.workers.tiers.batched_llama import cuda_pool_budget

    device = torch.device(device)
    if kv_memory_mb is not None or device.type != "cuda":
        return kv_memory_mb
    budget, free = cuda_pool_budget(device)
    kv_memory_mb = max(1, budget // 2**20)
    if per_request > kv_memory_mb * 2**20:
        raise ConfigError(f"one request's KV pool ({per_request / 2**20:.0f} MB at {context} positions) does not fit "
                          f"the GPU's free memory ({free / 2**20:.0f} MB); set batching.max_context lower")
    return kv_memory_mb


class Engine:
    def __init__(self, config: ChainConfig, speculative: bool = True, auto_tune: bool = True, batched: bool = False,
                 log: Callable[[str], None] | None = None, cache_profiles: bool = False, reprofile: bool = False,
                 reuse_prefix: bool = False) -> None:
        """`auto_tune`: with `speculation.lengths: auto`, profile the tiers and let the goodput planner set the lengths.
        `batched`: step many requests per forward (`polyspec batch`, jobs, `serve`), where the config allows it
        (`batching.enabled`, a local chain); otherwise requests take turns, one round each.
        `log(line)`: start-up progress (each tier as it loads, then the profile, with a progress bar on a
        terminal); `cache_profiles`: keep start-up profiles on disk and reuse them (tuning.profile_cache),
        `reprofile`: measure again all the same (and overwrite).
        `reuse_prefix`: keep the last request's caches, so that a next request whose prompt extends
        its tokens (a conversation's next turn) prefills only what is new (every chain can, a Ray chain's
        tiers keeping the caches in their workers: `contract.KeptSequences`).
        Once started, the objects alive in the process are kept out of the garbage collector's full passes
        (`loading.freeze_heap`) until `close`."""
        quiet_transformers()
        started = time.perf_counter()
        self.log, self.cache_profiles, self.reprofile = log, cache_profiles, reprofile
        self.profile_s = 0.0  # the start-up profile of lengths: auto (0 when read from the cache, or none)
        self._decode_lock = threading.Lock()
        self.batched = False
        self.max_requests = 1
        self.exact_only = False  # `serve --exact-only`: requests in an approximate mode are refused
        self._approximate: dict = {}  # seq_id -> polyspec.orchestrator.decode.approximate.Attached (approximate requests only)
        self._grammars: GrammarBook | None = None
        self._grammars_lock = threading.Lock()
        self.config = config if speculative else config.target_only()
        keep_finished = 1 if reuse_prefix else 0
        self._note_tuning(config, speculative, auto_tune)
        if config.runtime.backend == "ray":
            self._start_ray(auto_tune, batched, keep_finished)
            self.load_s = time.perf_counter() - started
            freeze_heap()
            return
        if any(needs_choice(tier) for tier in self.config.tiers):  # dtype / threads: auto
            cache = ProfileCache(self.config.tiers, refresh=reprofile) if cache_profiles else None
            self.config = dataclasses.replace(self.config, tiers=resolve_auto(self.config.tiers, cache, log))
        self.tiers, self.tokenizer = load_tiers(self.config.tiers, log)
        self.load_s = time.perf_counter() - started  # the models (a profile comes after, timed on its own)
        target_model = self.tiers[0].model
        eos = configured_eos_ids((getattr(target_model, "generation_config", None), target_model.config))
        self.batched = batched and self.config.batching.enabled
        eos = stop_token_ids(self.tokenizer, eos)
        self._start(eos, auto_tune, keep_finished)
        freeze_heap()  # (after the profile: what start-up made stays out of the steps' collections)

    @staticmethod
    def _note_tuning(config: ChainConfig, speculative: bool, auto_tune: bool) -> None:
        """Name on stderr, in one line, the `tuning:` options set that the planner this run will have does not read
        (polyspec.orchestrator.tuning.options); `auto_tune` off (polyspec tune builds its own planners): nothing to say."""
        from polyspec.orchestrator.tuning import options

        if not auto_tune:
            return
        planner = options.planner_of(config.speculation.lengths == "auto", speculative, len(config.tiers))
        line = options.note(config.tuning, planner, distributed=config.runtime.backend == "ray")
        if line:
            print(f"polyspec: {line}", file=sys.stderr, flush=True)

    def _steps(self) -> bool:
        """Do the model tiers decode in static-shape steps (`BatchedModelTier`'s `steps`: CUDA graphs, logits, draws
        and verdicts on the device)? `batching.round` decides: device, ragged, or auto: steps on CUDA."""
        mode = self.config.batching.round
        if mode != "auto":
            return mode == "device"
        return str(self.tiers[0].device).startswith("cuda")

    def _start(self, eos: tuple[int, ...], auto_tune: bool, keep_finished: int = 0) -> None:
        """The round over the one tier family (polyspec.workers.tiers.batched): every model tier one forward
        per call over all the requests in it (static steps where `_steps`), on a KV pool of its own; a single
        request is a batch of one. `keep_finished`: finished requests whose caches stay for a next prompt that
        extends them."""
        from polyspec.workers.tiers.batched import BatchedModelTier, batched_tiers

        batching = self.config.batching
        steps = self._steps()  # (batching.max_context bounds a stepping tier's pool)
        tiers = batched_tiers(self.tiers, batching.max_requests + keep_finished, steps, batching.max_context if steps else None)
        per_request = sum(t.bytes_per_request() for t in tiers)
        target = tiers[0].model  # its BatchedLlama: where the pools live
        kv_memory_mb = pool_memory_mb(batching.kv_memory_mb, target.device, per_request, target.limit)
        # open requests the pools hold (requests taking turns, one round each, hold slots too); batched steps take them all
        slots = requests_within_memory(batching.max_requests, kv_memory_mb, per_request)
        self.max_requests = slots if self.batched else 1
        for tier in tiers:
            tier.set_max_slots(slots + keep_finished)
        prefill = max(1, batching.max_batched_tokens - self.max_requests)
        spec = self.config.speculation
        # SpecReason's scores run on the target's BatchedLlama with a pool of its own (allocated at its first score), so a
        # request's scored prompts take no slot of the round's (a kept finished request keeps its scores too)
        scorer = BatchedModelTier(self.tiers[0], self.max_requests + 1, model=target)
        self.scheduler = ChainScheduler(tiers, self.config.speculation_lengths(), eos_token_ids=eos, prefill_budget=prefill,
                                        tree_width=spec.tree_width, scheme=spec.verifier, keep_finished=keep_finished, scorer=scorer)
        if auto_tune and spec.lengths == "auto" and len(self.tiers) > 1:
            self.scheduler.planner = self.make_planner()

    def make_planner(self):
        """Profile each tier's batched forward (a few seconds) and build the goodput planner, with the
        `tuning:` options it reads (`options.goodput_options`; the others, set, were named at start-up).
        One request at a time is a load of one: the profile stops at a batch of one, and each round is a step of one."""
        from polyspec.orchestrator.tuning.batch_model import BatchPlanner
        from polyspec.orchestrator.tuning.options import goodput_options

        tiers, max_batch = self.scheduler.tiers, min(self.max_requests, PROFILE_MAX_BATCH)
        distributed = self.config.runtime.backend == "ray"
        if distributed:  # each tier profiles itself; a distributed round cannot skip a tier (goodput_options: no bypass)
            from polyspec.orchestrator.distributed.driver import profile_grid_remote

            tables, lookup = profile_grid_remote(self.scheduler, max_batch)
        else:
            from polyspec.orchestrator.tuning.profiler import profile_batched

            with self._profiling() as (cache, bar):
                tables, lookup = profile_batched(tiers, self.vocab_size, max_batch, cache=cache, bar=bar, log=self.log)
        return BatchPlanner(tiers, tables, lookup, max_batched_tokens=self.config.batching.max_batched_tokens,
                            tree_width=self.config.speculation.tree_width, **goodput_options(self.config.tuning, distributed))

    def step_all(self, states: list[RequestState]) -> list[list[int]]:
        """One batched round of every request in `states` (one forward per tier); a request in a step-level
        approximate mode takes one of its own driver's steps instead, alone, after the batched round."""
        drivers = [self._driver(state) for state in states]
        rounds = [state for state, driver in zip(states, drivers) if driver is None]
        batched = iter(self.scheduler.step_all(rounds) if rounds else [])
        return [_note_commit(state, next(batched) if driver is None else driver.step(state))
                for state, driver in zip(states, drivers)]

    def _driver(self, state: RequestState):
        """The step-level driver of an approximate request that has one (None: the chain's round steps it)."""
        return getattr(self._approximate.get(state.seq_id), "driver", None)

    def _start_ray(self, auto_tune: bool, batched: bool, keep_finished: int = 0) -> None:
        """The tiers run as Ray actors (polyspec.orchestrator.distributed.ray_runtime); this process only drives them."""
        from polyspec.orchestrator.distributed.ray_runtime import ray_chain
        from polyspec.workers.tiers.loading import describe_chain

        self.tokenizer, eos = describe_chain(self.config.tiers)
        self.scheduler = ray_chain(self.config, stop_token_ids(self.tokenizer, eos), keep_finished)
        self.tiers = self.scheduler.tiers  # TierViews: name, vocab_size, busy_s
        if batched and self.config.batching.enabled:
            # every running request in one VerifyBatch per step; each tier actor scores all their
            # blocks in one forward (polyspec.orchestrator.distributed.worker)
            self.batched = self.scheduler.batched = True
            self.max_requests = self.config.batching.max_requests
        if auto_tune and self.config.speculation.lengths == "auto" and len(self.tiers) > 1:
            if not all(view.up for view in self.tiers):  # each tier profiles itself: one left out at start-up cannot
                print(f"polyspec: speculation.lengths: auto: not every tier is up, so the chain runs lengths "
                      f"{self.scheduler.lengths} untuned", file=sys.stderr, flush=True)
            else:  # the goodput planner (lengths for the load, speculation off included), batched or one request at a time
                self.scheduler.planner = self.make_planner()

    def close(self) -> None:
        """Stop the chain's actors (ray backend) and give the heap back to the collector (`freeze_heap`)."""
        self.scheduler.close()
        thaw_heap()

    @contextlib.contextmanager
    def _profiling(self):
        """The start-up profile's cache (when this engine keeps them) and progress bar (when it logs)."""
        cache = ProfileCache(self.config.tiers, refresh=self.reprofile) if self.cache_profiles else None
        started = time.perf_counter()
        if self.log is None:
            yield cache, None
            self.profile_s = time.perf_counter() - started
            return
        from tqdm import tqdm

        from polyspec.orchestrator.tuning.profiler import ProgressLines

        self.log("profiling the tiers for lengths: auto" + (" (cached profiles are reused; --reprofile measures again)"
                                                            if cache is not None and not self.reprofile else ""))
        if not sys.stderr.isatty():  # a log: a line every few seconds instead of a bar, a beat between (one size may take longer)
            with heartbeat(self.log, "profile"):
                yield cache, ProgressLines(self.log)
        else:
            with tqdm(desc="polyspec: profile", unit="size", file=sys.stderr, leave=False) as bar, \
                    heartbeat(lambda _: bar.refresh(), "profile", every_s=1.0):  # the bar's clock moves between sizes
                yield cache, bar
        self.profile_s = time.perf_counter() - started
        self.log(f"start-up profile done in {self.profile_s:.1f}s")

    @property
    def vocab_size(self) -> int:
        return self.scheduler.vocab_size

    # ------------------------------------------------------------------- requests

    def parse_request(self, raw: dict[str, Any], tokenizer=None) -> GenerationRequest:
        """Validate one request (a JSONL line's object, CLI flags, or an RPC) -> GenerationRequest.
        `tokenizer`: a copy of the target's to tokenize with (the server's request threads use
        their own, so a long prompt never waits on or holds up the model thread's decoding)."""
        if not isinstance(raw, dict):
            raise RequestError(f"a request must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(REQUEST_FIELDS))
        if unknown:
            raise RequestError(f"unknown request field {unknown[0][:64]!r} (known: {', '.join(REQUEST_FIELDS)})")
        defaults = self.config.sampling
        prompt, prompt_ids, messages = raw.get("prompt"), raw.get("prompt_ids"), raw.get("messages")
        if sum(x is not None for x in (prompt, prompt_ids, messages)) > 1:
            raise RequestError("give one of 'prompt', 'prompt_ids' or 'messages', not several")
        if messages is not None:
            if self.tokenizer is None:
                raise RequestError("the target model has no tokenizer; send 'prompt_ids' instead of 'messages'")
            ids = encode_chat(tokenizer or self.tokenizer, messages)
        elif prompt_ids is not None:
            if not isinstance(prompt_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
                raise RequestError("prompt_ids must be a list of integers")
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
            ids = list(prompt_ids)
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise RequestError("the target model has no tokenizer; send 'prompt_ids' instead of 'prompt'")
            ids = encode_prompt(tokenizer or self.tokenizer, prompt) if prompt else []
        else:
            raise RequestError("request has no 'prompt' (or 'prompt_ids' or 'messages')")
        if not ids:
            raise RequestError("prompt is empty")
        limit = self.scheduler.max_context
        if limit is not None and len(ids) >= limit:
            raise RequestError(f"prompt has {len(ids)} tokens but the model context holds {limit} (leave room to generate)")
        max_new = _number("max_new_tokens", raw.get("max_new_tokens", defaults.max_new_tokens), int)
        if max_new <= 0:
            raise RequestError(f"max_new_tokens must be > 0, got {max_new}")
        temperature = _number("temperature", raw.get("temperature", defaults.temperature), float)
        if not math.isfinite(temperature) or temperature > MAX_TEMPERATURE:
            raise RequestError(f"temperature must be finite and <= {MAX_TEMPERATURE:g}, got {temperature!r}")
        top_p = _number("top_p", raw.get("top_p", defaults.top_p), float)
        top_k = _number("top_k", raw.get("top_k", defaults.top_k), int)
        try:
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        seed = raw.get("seed")
        if seed is not None:
            seed = _number("seed", seed, int)
            if not 0 <= seed < SEED_LIMIT:
                raise RequestError(f"seed must be in [0, 2^63), got {str(seed)[:40]}")
        request_id = raw.get("id")
        mode = self._approximate_mode(raw)
        constraint = self._constraint(raw, mode)
        return GenerationRequest(tuple(ids), max_new, params, seed, None if request_id is None else str(request_id), mode, constraint)

    def _constraint(self, raw: dict, mode: ApproximateMode) -> ConstraintSpec | None:
        """The request's structured-output constraint, compiled (bounded in time); refused where it cannot run."""
        spec = constraint_from_fields(raw)
        if spec is None:
            return None
        if not mode.lossless:
            raise RequestError(f"{spec.kind}: structured output is exact only; it cannot run in approximate mode {mode.mode}")
        return self.grammars.compile(spec)

    @property
    def grammars(self) -> GrammarBook:
        """The chain's grammar compiler (over the target's tokenizer and vocabulary), made at its first use."""
        with self._grammars_lock:
            if self._grammars is None:
                # a Ray chain's tiers load the tokenizer from the target's folder (tier.proto's constraint_json)
                self._grammars = GrammarBook(self.tokenizer, self.vocab_size, tuple(self.scheduler.eos_token_ids),
                                             tokenizer_source=self.config.tiers[0].model)
            return self._grammars

    def _approximate_mode(self, raw: dict) -> ApproximateMode:
        """The request's decoding mode: its `approximate` field, else the config's; refused where it cannot run."""
        if "approximate" in raw:
            try:
                mode = ApproximateMode.from_mapping(raw["approximate"])
            except ApproximateModeError as exc:
                raise RequestError(str(exc)) from None
        else:
            mode = self.config.approximate
        if mode.lossless:
            return mode
        from polyspec.orchestrator.decode.approximate import unsupported

        why = unsupported(mode, self)
        if why:
            raise RequestError(f"approximate mode {mode.mode} refused: {why}")
        return mode

    def generate(self, request: GenerationRequest, on_commit: Callable[[list[int]], None] | None = None,
                 stops: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None) -> dict:
        """One request through the one request loop (`batch_runner.run_requests`: a batch of one).
        `on_commit(tokens)`: each round's committed tokens; `on_text(text)`: the new text as it is
        committed; `stops`: stop strings that end it (finish_reason "stop", cut there)."""
        def delta(_, tokens: list[int], text: str) -> None:
            if on_commit is not None and tokens:
                on_commit(tokens)
            if on_text is not None and text:
                on_text(text)

        results: list[dict] = []
        run_requests(self, [request], results.append, max_requests=1, on_delta=delta, stops=stops, stream=on_text is not None)
        return results[0]

    # Round-by-round API for callers that interleave requests (the server). One thread only.

    def start(self, request: GenerationRequest) -> RequestState:
        params = request.params
        if request.constraint is not None:  # the request's own matcher, shared by every tier's rows
            params = dataclasses.replace(params, grammar=self.grammars.start(request.constraint, len(request.prompt_ids)))
        state = self.scheduler.start(list(request.prompt_ids), request.max_new_tokens, params, seed_stream(request.seed))
        state.request = request
        if not request.approximate.lossless:
            from polyspec.orchestrator.decode.approximate import attach

            self._approximate[state.seq_id] = attach(self, state, request.approximate)
        return state

    def step(self, state: RequestState) -> list[int]:
        """One target verification round; the newly committed token ids (empty once done).
        A request in a step-level approximate mode advances by one of its driver's steps instead."""
        return _note_commit(state, (self._driver(state) or self.scheduler).step(state))

    def finish(self, state: RequestState) -> dict:
        output = self.scheduler.finish(state)
        grammar = getattr(state.params, "grammar", None)
        if grammar is not None and output.finish_reason == FINISH_EOS and grammar.ended_unsatisfiable(output.token_ids):
            output = dataclasses.replace(output, finish_reason=FINISH_GRAMMAR)
        return self._result(state, output)

    def cancel(self, state: RequestState) -> dict:
        return self._result(state, self.scheduler.cancel(state))

    def _result(self, state: RequestState, output) -> dict:
        """The request's result; its stats gain the chain's load (and start-up profile) time and the request's
        prefill (start to the first committed tokens: the prompt through every tier, and the first
        round) and decode time (the rest). An approximate request's hooks are removed, its mode and counts
        marked in the result."""
        now = time.perf_counter()
        first_commit = state.first_commit_at or now
        timings = {"load_s": round(self.load_s, 3), "profile_s": round(self.profile_s, 3),
                   "prefill_s": round(first_commit - state.started, 4), "decode_s": round(now - first_commit, 4)}
        result = {
            "text": self.decode(output.token_ids),
            "token_ids": output.token_ids,
            "finish_reason": output.finish_reason,
            "stats": {**output.stats, **timings},
        }
        attached = self._approximate.pop(state.seq_id, None)
        if attached is not None:  # marked in the result and its stats: this text is not the target's own
            result["stats"]["approximate"] = approximate = attached.detach()
            result["mode"] = approximate["mode"]
        if state.request.id is not None:
            result = {"id": state.request.id, **result}
        return result

    def encode(self, text: str) -> list[int]:
        """`text`'s tokens, no special tokens added (an approximate mode's own prompts: a probe, a scoring prompt)."""
        with self._decode_lock:  # batch threads share one tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        with self._decode_lock:  # batch threads share one tokenizer
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _note_commit(state: RequestState, tokens: list[int]) -> list[int]:
    """Remember when `state` first committed tokens (its prefill ends there)."""
    if tokens and state.first_commit_at is None:
        state.first_commit_at = time.perf_counter()
    return tokens
