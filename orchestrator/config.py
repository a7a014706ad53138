"""The chain config: a typed, validated object built once from YAML.

    tiers:
      - {name: target, model: <hf id | path>, dtype: float32, device: auto}
      - {name: mid,    model: <same as target>, quantize: int8}
      - {name: small,  model: ngram}
    speculation: {lengths: [4, 4], tree_width: 1, verifier: specinfer}
    sampling: {temperature: 0.0, top_p: 1.0, top_k: 0, max_new_tokens: 64}
    runtime: {backend: local}
    server: {host: 127.0.0.1, port: 50051}
    batching: {enabled: true, max_requests: 64, max_batched_tokens: 2048, kv_memory_mb: null, round: auto, max_context: null}
    tuning: {max_length: 8, explore_every: 64}   # optional: the goodput planner's knobs (lengths: auto)
    approximate: {mode: bild, rollback_threshold: 2.0}  # optional, NOT lossless: docs/approximate.md (default exact)

Every mistake is a `ConfigError` with one line that names the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from polyspec.workers.core.approximate_mode import ApproximateMode
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.tiers.model_cache import NGRAM_MODEL, resolve_zoo_reference

DTYPES = ("float32", "bfloat16", "float16")
ROUNDS = ("auto", "device", "ragged")
AUTO = "auto"  # dtype / threads: measured at start-up (polyspec.orchestrator.tuning.autoconf)
QUANTIZE = ("int8", "fp8", "int4", "int8w", "gguf")  # int8: dynamic; int8w / int4: weight-only (workers/tiers/weight_only.py); gguf: the file's own blocks on those kernels (gguf_model.py)
GROUP_SIZES = (32, 64, 128, 256)  # int4: inputs per scale and zero (what torch's int4 kernels accept)
SCHEMES = ("specinfer", "rsd", "spectr", "importance")
BACKENDS = ("local", "ray")
DEFAULT_SPECULATION_LENGTH = 4


@dataclasses.dataclass(frozen=True)
class TierConfig:
    name: str
    model: str
    dtype: str = "float32"  # or "auto"
    device: str = "auto"
    quantize: str | None = None
    group_size: int | None = None  # quantize: int4 only; None: weight_only.DEFAULT_GROUP_SIZE
    threads: int | str | None = None  # or "auto"
    max_ngram: int = 3  # n-gram tiers only
    min_ngram: int = 1
    resources: dict | None = None  # Ray custom resources (ray backend)
    # trained drafters (`model: {feature_head: PATH}` / `model: {early_exit: PATH, ...}`): `model` is PATH
    drafter: str | None = None  # "feature" | "early_exit"
    layers: int | None = None  # early_exit: the target layers the adapter reads (checked against the checkpoint)
    exit_threshold: float | None = None  # early_exit: stop a block after a token drafted below this confidence

    @property
    def is_ngram(self) -> bool:
        return self.model == NGRAM_MODEL


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    lengths: tuple[int, ...] | str = "default"  # one per verifying tier, or "auto" (the goodput planner)
    tree_width: int = 1
    verifier: str = "specinfer"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    backend: str = "local"
    address: str | None = None
    pipeline: bool = True
    tensor_transport: str = "auto"
    placement: str = "pack"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_queue: int = 256


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """How many requests one batched step may carry (docs/serving.md, "Admission")."""

    enabled: bool = True  # local chains step all their requests in one batched round (draft trees included)
    max_requests: int = 64  # requests holding caches and stepping together; more wait
    max_batched_tokens: int = 2048  # new positions one forward may carry (rows x padded block), prefill included
    kv_memory_mb: int | None = None  # bound on the KV caches of all requests; lowers max_requests to fit
    # how model tiers decode: "device" (static-shape steps over a pool allocated once, replayed as CUDA graphs on
    # CUDA, logits, draws and verdicts on the device; a block wider than a step, a prompt, or a model the step
    # does not cover goes through the ragged forward), "ragged" (the ragged forward throughout), "auto": device on CUDA
    round: str = "auto"
    max_context: int | None = None  # a stepping tier's KV pool holds this many positions per request (None: the model's)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """The goodput planner's knobs (`speculation.lengths: auto`; polyspec.orchestrator.tuning.options says which
    it reads on which path). The defaults suit any chain; docs/time-model.md explains each."""

    max_length: int = 8  # the longest speculation length a plan asks for
    switch_hysteresis: float = 0.2  # speculation is switched on at (1 + this) times off's measured tokens/s (set: read)
    decay: float = 0.93  # what a pair's acceptance counts keep per round (set: read; the planner's own default otherwise)
    prior_mean: float = 0.6  # prior acceptance of a drafter (set: read) ...
    prior_strength: float = 2.0  # ... and its weight, in tokens (set: read)
    allow_bypass: bool = True  # plans may leave tiers out of the chain
    explore_every: int = 64  # the most probes' times between re-probes of the side of the A/B not taken (0: never)
    shadow: bool = True  # hear what the lookup tiers a step leaves out would have proposed
    # the options the config file wrote (set by parsing): the planner reads some only where written
    # (polyspec.orchestrator.tuning.options: which option it reads, on which path)
    given: frozenset = dataclasses.field(default=frozenset(), compare=False)


# key -> (kind, lowest, highest, whether the lowest value itself is allowed): the checks of each tuning knob
_TUNING_RANGES = {
    "max_length": (int, 1, None, True),
    "switch_hysteresis": (float, 0.0, 1.0, True),
    "decay": (float, 0.0, 1.0, False),
    "prior_mean": (float, 0.0, 1.0, False),
    "prior_strength": (float, 0.0, None, False),
    "allow_bypass": (bool, None, None, True),
    "explore_every": (int, 0, None, True),
    "shadow": (bool, None, None, True),
}


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    tiers: tuple[TierConfig, ...]
    speculation: SpeculationConfig = SpeculationConfig()
    sampling: SamplingConfig = SamplingConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    server: ServerConfig = ServerConfig()
    batching: BatchingConfig = BatchingConfig()
    tuning: TuningConfig = TuningConfig()
    # the decoding mode of requests that name none (docs/approximate.md); exact unless the config names another
    approximate: ApproximateMode = ApproximateMode()
    source: str | None = None  # the file it was read from

    def speculation_lengths(self) -> list[int]:
        """Fixed lengths, one per verifying tier (the planner replaces them when 'auto')."""
        lengths = self.speculation.lengths
        if isinstance(lengths, str):
            return [DEFAULT_SPECULATION_LENGTH] * (len(self.tiers) - 1)
        return list(lengths)

    def target_only(self) -> "ChainConfig":
        # the target alone writes its own text: exact, whatever mode the chain would run
        return dataclasses.replace(self, tiers=self.tiers[:1], speculation=SpeculationConfig(lengths=()), approximate=ApproximateMode())


# ------------------------------------------------------------------------- parsing


def _check_keys(section: str, raw: Any, cls, internal: tuple[str, ...] = ()) -> dict:
    """`raw` as a dict of the keys `cls` has; `internal`: fields set by parsing, never written in a config."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config section '{section}' must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} - {"source", *internal}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown config key '{section}.{unknown[0]}' ({_did_you_mean(unknown[0], known)}known keys: {', '.join(sorted(known))})")
    return dict(raw)


def _did_you_mean(key, known) -> str:
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _typed(section: str, key: str, value, kind, *, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config key '{section}.{key}' must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"config key '{section}.{key}' must be a number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"config key '{section}.{key}' must be a string, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"config key '{section}.{key}' must be true or false, got {value!r}")
    return float(value) if kind is float else value


def resolve_model_path(model: str, base_dir: Path | None) -> str:
    """`zoo:NAME` is the folder `polyspec zoo fetch NAME` wrote; `~` is expanded; a relative
    path is looked up next to the config file, then in the working directory; anything
    else is passed to from_pretrained as is (a hub id)."""
    model = resolve_zoo_reference(model)
    if model.startswith("~"):
        model = os.path.expanduser(model)
    if model == NGRAM_MODEL or os.path.isabs(model):
        return model
    if base_dir is not None and (base_dir / model).exists():
        return str((base_dir / model).resolve())
    if Path(model).exists():
        return str(Path(model).resolve())
    return model


DRAFTER_KEYS = {"feature_head": "feature", "early_exit": "early_exit"}
DRAFTER_FIELDS = ("drafter", "layers", "exit_threshold")


def _parse_drafter(section: str, model: dict, values: dict, base_dir: Path | None) -> None:
    """`model: {feature_head: PATH}` or `model: {early_exit: PATH, layers: L, exit_threshold: x}` into `values`."""
    kinds = [key for key in DRAFTER_KEYS if key in model]
    if len(kinds) != 1:
        raise ConfigError(f"{section}.model as a mapping needs exactly one of feature_head: PATH or early_exit: PATH, got keys {sorted(model)}")
    key = kinds[0]
    allowed = {key} | ({"layers", "exit_threshold"} if key == "early_exit" else set())
    unknown = sorted(set(model) - allowed)
    if unknown:
        raise ConfigError(f"unknown config key '{section}.model.{unknown[0]}' (known keys: {', '.join(sorted(allowed))})")
    path = _typed(f"{section}.model", key, model[key], str)
    values["drafter"] = DRAFTER_KEYS[key]
    resolved = resolve_model_path(path, base_dir)
    if not Path(resolved).is_dir():
        raise ConfigError(f"{section}.model.{key}: drafter checkpoint {path!r} is not a directory (train one with `polyspec train-draft`)")
    values["model"] = resolved
    if "layers" in model:
        values["layers"] = _typed(f"{section}.model", "layers", model["layers"], int)
        if values["layers"] < 1:
            raise ConfigError(f"config key '{section}.model.layers' must be >= 1, got {values['layers']}")
    if "exit_threshold" in model:
        threshold = _typed(f"{section}.model", "exit_threshold", model["exit_threshold"], float)
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"config key '{section}.model.exit_threshold' must be a probability in [0, 1], got {threshold}")
        values["exit_threshold"] = threshold


def _parse_tier(index: int, raw: Any, base_dir: Path | None) -> TierConfig:
    section = f"tiers[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{section} must be a mapping like {{name: target, model: <path>}}, got {raw!r}")
    misplaced = sorted(set(raw) & set(DRAFTER_FIELDS))
    if misplaced:
        raise ConfigError(f"unknown config key '{section}.{misplaced[0]}' (a trained drafter is written model: {{early_exit: PATH, layers: L, exit_threshold: x}})")
    values = _check_keys(section, raw, TierConfig, internal=DRAFTER_FIELDS)
    if isinstance(values.get("model"), dict):
        _parse_drafter(section, values["model"], values, base_dir)
    if "model" not in values:
        raise ConfigError(f"{section} has no 'model' (a Hugging Face id, a local path, or 'ngram')")
    values.setdefault("name", f"tier{index}")
    for key, kind in (("name", str), ("model", str), ("dtype", str), ("device", str), ("max_ngram", int), ("min_ngram", int)):
        if key in values:
            _typed(section, key, values[key], kind)
    if values.get("threads") != AUTO and "threads" in values:
        values["threads"] = _typed(section, "threads", values["threads"], int, allow_none=True)
        if values["threads"] is not None and values["threads"] < 1:
            raise ConfigError(f"config key '{section}.threads' must be >= 1 or auto, got {values['threads']}")
    if values.get("dtype", "float32") not in (*DTYPES, AUTO):
        raise ConfigError(f"{section}.dtype must be one of {', '.join(DTYPES)} or {AUTO}, got {values['dtype']!r}")
    if values.get("quantize") is not None and values["quantize"] not in QUANTIZE:
        raise ConfigError(f"{section}.quantize must be one of {', '.join(QUANTIZE)}, got {values['quantize']!r}")
    if values.get("group_size") is not None:
        if values.get("quantize") != "int4":
            raise ConfigError(f"{section}.group_size applies to quantize: int4 only (this tier's quantize is {values.get('quantize')})")
        if type(values["group_size"]) is not int or values["group_size"] not in GROUP_SIZES:
            raise ConfigError(f"{section}.group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {values['group_size']!r}")
    if values.get("resources") is not None and not isinstance(values["resources"], dict):
        raise ConfigError(f"{section}.resources must be a mapping of Ray resource names to amounts")
    if values.get("drafter") is None:
        values["model"] = resolve_model_path(values["model"], base_dir)
        check_gguf_quantize(section, values.get("quantize"), values["model"])
    elif values.get("quantize") is not None:
        raise ConfigError(f"{section}: a trained drafter shares the target's weights; quantize the target instead")
    return TierConfig(**values)


def check_gguf_quantize(where: str, quantize: str | None, model: str) -> None:
    """`quantize: gguf` reads the blocks of a .gguf file: on anything else it has nothing to read."""
    if quantize == "gguf" and not str(model).lower().endswith(".gguf"):
        raise ConfigError(f"{where}: quantize: gguf loads a .gguf file's own quantized blocks; model {model!r} is not a .gguf file")


def _check_drafters(tiers: tuple[TierConfig, ...]) -> None:
    if tiers[0].drafter:
        raise ConfigError(f"tier {tiers[0].name!r}: the first tier is the target; a trained drafter goes under it")
    for i, tier in enumerate(tiers):
        if tier.drafter == "feature" and i != 1:
            raise ConfigError(f"tier {tier.name!r}: a feature head reads the target's hidden states, so it must be the second tier (directly under the target)")
        if tier.drafter and (tier.device != "auto" and tier.device != tiers[0].device):
            raise ConfigError(f"tier {tier.name!r}: a trained drafter runs on its target's device ({tiers[0].device})")


def parse_lengths(raw: Any, num_tiers: int):
    if raw is None or raw == "default":
        return "default"
    if raw == "auto":
        return "auto"
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw] * (num_tiers - 1)
    if not isinstance(raw, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in raw):
        raise ConfigError(f"speculation.lengths must be 'auto' or a list of integers, got {raw!r}")
    if len(raw) != num_tiers - 1:
        raise ConfigError(f"speculation.lengths needs one length per verifying tier ({num_tiers - 1} for {num_tiers} tiers), got {len(raw)}")
    if any(k < 0 for k in raw):
        raise ConfigError(f"speculation.lengths must be >= 0, got {raw}")
    return tuple(raw)


def parse_tuning(raw: Any) -> TuningConfig:
    """The `tuning:` section: every knob typed and in range, or a ConfigError naming it."""
    values = _check_keys("tuning", raw, TuningConfig, internal=("given",))
    for key, value in values.items():
        kind, low, high, low_ok = _TUNING_RANGES[key]
        values[key] = value = _typed("tuning", key, value, kind)
        if low is not None and (value < low or (value == low and not low_ok)):
            raise ConfigError(f"config key 'tuning.{key}' must be {'>=' if low_ok else '>'} {low}, got {value}")
        if high is not None and value > high:
            raise ConfigError(f"config key 'tuning.{key}' must be <= {high}, got {value}")
    return TuningConfig(**values, given=frozenset(values))


def parse_config(raw: Any, source: str | None = None) -> ChainConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config must be a YAML mapping with a 'tiers' list")
    known = {"tiers", "speculation", "sampling", "runtime", "server", "batching", "tuning", "approximate"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown config key '{unknown[0]}' ({_did_you_mean(unknown[0], known)}known keys: {', '.join(sorted(known))})")
    base_dir = Path(source).resolve().parent if source else None
    tiers_raw = raw.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("config needs a non-empty 'tiers' list, target first")
    tiers = tuple(_parse_tier(i, t, base_dir) for i, t in enumerate(tiers_raw))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ConfigError(f"tier names must be unique, got {names}")
    for i, tier in enumerate(tiers):
        if tier.is_ngram and i != len(tiers) - 1:
            raise ConfigError(f"tier {tier.name!r}: an n-gram tier can only be the last (cheapest) tier, it cannot verify")
        if tier.is_ngram and tier.quantize:
            raise ConfigError(f"tier {tier.name!r}: an n-gram tier has no weights to quantize")
    if tiers[0].is_ngram:
        raise ConfigError("the first tier is the target and must be a model, not 'ngram'")
    _check_drafters(tiers)

    spec = _check_keys("speculation", raw.get("speculation"), SpeculationConfig)
    spec["lengths"] = parse_lengths(spec.get("lengths"), len(tiers))
    if "tree_width" in spec:
        _typed("speculation", "tree_width", spec["tree_width"], int)
        if spec["tree_width"] < 1:
            raise ConfigError(f"speculation.tree_width must be >= 1, got {spec['tree_width']}")
    if spec.get("verifier", "specinfer") not in SCHEMES:
        raise ConfigError(f"speculation.verifier must be one of {', '.join(SCHEMES)}, got {spec['verifier']!r}")
    speculation = SpeculationConfig(**spec)
    if speculation.tree_width > 1 and tiers[-1].is_ngram and speculation.verifier in ("rsd", "spectr"):
        raise ConfigError(
            f"speculation.verifier {speculation.verifier!r} needs candidates sampled from one drafter distribution; "
            f"the n-gram tier {tiers[-1].name!r} proposes deterministic candidates (use specinfer)"
        )

    samp = _check_keys("sampling", raw.get("sampling"), SamplingConfig)
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("max_new_tokens", int)):
        if key in samp:
            samp[key] = _typed("sampling", key, samp[key], kind)
    sampling = SamplingConfig(**samp)

    run = _check_keys("runtime", raw.get("runtime"), RuntimeConfig)
    if run.get("backend", "local") not in BACKENDS:
        raise ConfigError(f"runtime.backend must be one of {', '.join(BACKENDS)}, got {run['backend']!r}")
    runtime = RuntimeConfig(**run)
    measured = next((t for t in tiers if AUTO in (t.dtype, t.threads)), None)
    if measured is not None and runtime.backend != "local":
        raise ConfigError(f"tier {measured.name!r}: dtype / threads auto are measured in the process that loads the tiers, "
                          "so they need runtime.backend: local; name them for a ray chain")
    trained = next((t for t in tiers if t.drafter), None)
    if trained is not None and runtime.backend != "local":
        # Ray mode: a trained drafter runs in its target's actor (ray_runtime.actor_groups)
        pinned = next((t for t in tiers if t.drafter and t.resources), None)
        if pinned is not None:
            raise ConfigError(f"tier {pinned.name!r}: a trained drafter runs in its target's Ray actor; set resources on the target")
        if runtime.tensor_transport in ("nccl", "gloo"):
            raise ConfigError(f"tier {trained.name!r}: a trained drafter shares its target's process, so rows go inline over gRPC; "
                              f"runtime.tensor_transport must be auto or grpc, got {runtime.tensor_transport!r}")
    feature = next((i for i, t in enumerate(tiers) if t.drafter == "feature"), None)
    if feature is not None and feature < len(tiers) - 1 and speculation.tree_width > 1:
        raise ConfigError(f"tier {tiers[feature].name!r}: a feature head verifies chains only; with tree_width > 1 it must be the last tier")

    srv = _check_keys("server", raw.get("server"), ServerConfig)
    if "port" in srv:
        _typed("server", "port", srv["port"], int)
    server = ServerConfig(**srv)
    batching = _parse_batching(raw.get("batching"))
    tuning = parse_tuning(raw.get("tuning"))
    approximate = ApproximateMode.from_mapping(raw.get("approximate"))
    return ChainConfig(tiers=tiers, speculation=speculation, sampling=sampling, runtime=runtime, server=server,
                       batching=batching, tuning=tuning, approximate=approximate, source=source)


def _parse_batching(raw: Any) -> BatchingConfig:
    values = _check_keys("batching", raw, BatchingConfig)
    if "enabled" in values:
        _typed("batching", "enabled", values["enabled"], bool)
    if "round" in values and values["round"] not in ROUNDS:
        raise ConfigError(f"config key 'batching.round' must be one of {', '.join(ROUNDS)}, got {str(values['round'])[:40]!r}")
    for key in ("max_requests", "max_batched_tokens", "kv_memory_mb", "max_context"):
        if key in values:
            values[key] = _typed("batching", key, values[key], int, allow_none=key in ("kv_memory_mb", "max_context"))
            if values[key] is not None and values[key] < 1:
                raise ConfigError(f"config key 'batching.{key}' must be >= 1, got {values[key]}")
    batching = BatchingConfig(**values)
    if batching.max_batched_tokens < batching.max_requests:
        raise ConfigError(
            f"batching.max_batched_tokens ({batching.max_batched_tokens}) must be >= batching.max_requests "
            f"({batching.max_requests}): every request in a step feeds at least one token"
        )
    return batching


def load_config(path: str) -> ChainConfig:
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "invalid YAML"
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from None
    return parse_config(raw, source=path)
