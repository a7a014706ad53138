"""The systems `polyspec bench` compares: our engine (the target alone, each two-tier chain,
the full chain, with fixed lengths and `lengths: auto`) and transformers' `generate()`
(plain, assisted by each model drafter, prompt lookup) on the same weights."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import time

from polyspec.orchestrator.config import ChainConfig, TierConfig

HF_PROMPT_LOOKUP_TOKENS = 10  # the value transformers' documentation uses


@dataclasses.dataclass
class RunOutcome:
    """One generation by one system."""

    token_ids: list[int]
    seconds: float
    stages: list[dict] | None = None  # our scheduler's per-stage stats; None for transformers
    tier_busy_s: dict[str, float] | None = None  # our tiers' forward / lookup seconds


@dataclasses.dataclass
class Skipped:
    system: str
    reason: str


class System(abc.ABC):
    """Something that continues a prompt with exactly `max_new_tokens` tokens."""

    name: str
    lengths: list[int] | str | None = None  # our speculation lengths, for the report

    @abc.abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> RunOutcome:
        """Generate and time one continuation."""


class EngineSystem(System):
    """Our engine (target alone, or a chain) with end-of-sequence disabled."""

    def __init__(self, name: str, config: ChainConfig, speculative: bool = True) -> None:
        from polyspec.orchestrator.engine import Engine

        self.name = name
        self.engine = Engine(config, speculative=speculative)
        self.engine.scheduler.eos_token_ids = frozenset()  # generate exactly max_new_tokens
        if speculative:
            self.lengths = "auto" if config.speculation.lengths == "auto" else list(self.engine.scheduler.lengths)

    def generate(self, prompt_ids, max_new_tokens, temperature, seed):
        request = self.engine.parse_request(
            {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0, "top_k": 0, "seed": seed}
        )
        started = time.perf_counter()
        result = self.engine.generate(request)
        seconds = time.perf_counter() - started
        stats = result["stats"]
        busy = {tier["tier"]: tier["busy_s"] for tier in stats.get("tiers", [])} or None  # the Ray driver reports no per-tier time
        return RunOutcome(result["token_ids"], seconds, stats["stages"] or None, busy)


class HFSystem(System):
    """transformers `generate()` on the target, optionally assisted (`assistant_model=` / prompt lookup)."""

    def __init__(self, name: str, model, **generate_kwargs) -> None:
        self.name = name
        self.model = model
        self.generate_kwargs = generate_kwargs

    def generate(self, prompt_ids, max_new_tokens, temperature, seed):
        import torch

        sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)  # [1, T]
        torch.manual_seed(seed)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                **sampling,
                **self.generate_kwargs,
            )
        seconds = time.perf_counter() - started
        return RunOutcome(output[0, len(prompt_ids) :].tolist(), seconds)


def without_eos(model):
    """`eos_token_id=None` in a `generate()` call falls back to the model's generation config, so clear it there."""
    model.generation_config.eos_token_id = None
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = 0  # batch of one: never used, but keeps generate() quiet
    return model


def _hf_model(tier: TierConfig):
    """A tier's model exactly as our loader builds it (dtype, int8), for transformers to drive."""
    from polyspec.workers.tiers.loading import load_model

    return without_eos(load_model(tier))


def _with_lengths(config: ChainConfig, tiers: tuple[TierConfig, ...], lengths) -> ChainConfig:
    speculation = dataclasses.replace(config.speculation, lengths=lengths)
    return dataclasses.replace(config, tiers=tiers, speculation=speculation)


def polyspec_chains(config: ChainConfig) -> list[tuple[str, ChainConfig]]:
    """(system name, config): the target with each drafter, then the full chain.

    A two-tier chain target+X uses the length the full chain gives the stage that verifies X.
    """
    fixed = config.speculation_lengths()
    target = config.tiers[0]
    chains = []
    for index, drafter in enumerate(config.tiers[1:], start=1):
        chains.append((f"polyspec:{target.name}+{drafter.name}", _with_lengths(config, (target, drafter), (fixed[index - 1],))))
    if len(config.tiers) > 2:
        chains.append(("polyspec:" + "+".join(t.name for t in config.tiers), _with_lengths(config, config.tiers, tuple(fixed))))
    return chains


@contextlib.contextmanager
def shared_model_tiers(loaded: dict):
    """Engines built inside load each model tier once (`loaded` keeps them between uses).

    Our systems then share their model tiers, as the transformers systems share the target
    model: loading is most of `--quick`'s start-up. Sharing is safe: each engine runs the loaded
    models through runtime tiers of its own (their KV pools its own), and counts busy time per request."""
    import polyspec.workers.tiers.loading as loading

    original = loading.load_model_tier

    def load(tier, vocab_size=None, embedding_source=None):
        key = (tier.name, tier.model, tier.dtype, tier.quantize, tier.group_size, tier.device, tier.threads, vocab_size)
        if key not in loaded:
            loaded[key] = original(tier, vocab_size, embedding_source)
        return loaded[key]

    loading.load_model_tier = load
    try:
        yield
    finally:
        loading.load_model_tier = original


def build_systems(config: ChainConfig, notes: list[str], tuned: bool = True) -> tuple[list[System], list[Skipped]]:
    """Load every system of the comparison; `notes` collects what the report must say.
    `tuned`: also the chains with `lengths: auto` (left out of `--quick`)."""
    loaded: dict = {}
    with shared_model_tiers(loaded):
        systems: list[System] = [EngineSystem("target", config, speculative=False)]
    peers, skipped = hf_systems(config, notes)
    systems += peers
    with shared_model_tiers(loaded):
        for name, chain_config in polyspec_chains(config):
            systems.append(EngineSystem(name, chain_config))
        if tuned:
            systems += auto_systems(config)
        else:
            notes.append("--quick: the chains with lengths: auto are left out (`polyspec bench` without --quick, or `polyspec tune`, measures them)")
    return systems, skipped


def hf_systems(config: ChainConfig, notes: list[str]) -> tuple[list[System], list[Skipped]]:
    """transformers on the same target weights: plain; assisted by each model drafter, with
    its defaults and (`@k<k>`) with the length our two-tier chain uses; prompt lookup."""
    target_model = _hf_model(config.tiers[0])
    systems: list[System] = [HFSystem("hf-generate", target_model)]
    skipped: list[Skipped] = []
    fixed = config.speculation_lengths()
    for index, tier in enumerate(config.tiers[1:]):
        name = f"hf-assisted:{tier.name}"
        if tier.is_ngram:
            skipped.append(Skipped(name, "model-free n-gram tier: transformers' counterpart is hf-prompt-lookup"))
            continue
        if tier.drafter:
            skipped.append(Skipped(name, f"trained {tier.drafter} drafter: it shares the target's weights or features, transformers cannot assist with it"))
            continue
        systems.append(HFSystem(name, target_model, assistant_model=_hf_model(tier)))
        systems.append(HFSystem(f"{name}@k{fixed[index]}", target_model, assistant_model=_fixed_length_assistant(tier, fixed[index])))
    lookup = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}
    ngram = next((t for t in config.tiers if t.is_ngram), None)
    if ngram is not None:
        lookup["max_matching_ngram_size"] = ngram.max_ngram
    systems.append(HFSystem("hf-prompt-lookup", target_model, **lookup))
    notes.append(
        f"hf-prompt-lookup: {json.dumps(lookup)}; hf-assisted:<tier>: transformers defaults (heuristic schedule); "
        "hf-assisted:<tier>@k<k>: num_assistant_tokens k, constant schedule, assistant_confidence_threshold 0"
    )
    return systems, skipped


def _fixed_length_assistant(tier: TierConfig, length: int):
    """An assistant that always drafts `length` tokens, like our fixed-length stage."""
    model = _hf_model(tier)
    model.generation_config.num_assistant_tokens = length
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0  # no early exit on low confidence
    return model


def auto_systems(config: ChainConfig) -> list[System]:
    """The chains again with `lengths: auto` (the goodput planner, one request at a time)."""
    return [EngineSystem(name + "@auto", _with_lengths(chain_config, chain_config.tiers, "auto"))
            for name, chain_config in polyspec_chains(config)]
