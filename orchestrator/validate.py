"""`polyspec validate`: check a chain config offline and print its placement plan.

Nothing here loads weights or contacts the Hub. It checks the config (schema, tier
order, quantization against device), checks that every Ray resource a tier pins exists
on some node of the cluster YAMLs (`cluster/*.yaml` by default, each validated with
Ray's own cluster-config schema), and prints which node type each tier lands on with
the memory it needs: parameters x bytes per parameter, plus the KV cache for
`KV_CONTEXT_TOKENS` tokens and an activation margin.

Parameter counts come from, in order: the safetensors headers of a local model
directory (exact), its config.json, the Hugging Face cache if the model was downloaded
before, a built-in table of the paper's models, or "unknown".
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import re
import struct
from pathlib import Path

import yaml

from polyspec.orchestrator.config import ChainConfig, TierConfig, load_config
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.tiers.model_cache import fetch_hint

CLUSTER_DIR = Path(__file__).resolve().parent.parent / "cluster"
KV_CONTEXT_TOKENS = 4096  # the KV cache is sized for one sequence of this many tokens
ACTIVATION_MARGIN = 0.10  # of the weights: activations, CUDA context, allocator slack
GIB = 1024**3

# bytes per parameter for each dtype and quantization
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
QUANTIZE_BYTES = {"int8": 1.0, "fp8": 1.0, "int4": 0.5, "int8w": 1.0, "gguf": 1.0}  # gguf: int4 where the file's blocks map, int8 elsewhere: at most 1


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs to know about a model."""

    params: int
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    max_positions: int | None = None
    source: str = "config.json"


# The paper's families (parameter counts from the model cards / safetensors index).
KNOWN_MODELS = {
    "meta-llama/Llama-2-7b-chat-hf": ModelShape(6_738_415_616, 32, 32, 128, 4096, "built-in table"),
    "lmsys/vicuna-7b-v1.5": ModelShape(6_738_415_616, 32, 32, 128, 4096, "built-in table"),
    "meta-llama/Meta-Llama-3-8B-Instruct": ModelShape(8_030_261_248, 32, 8, 128, 8192, "built-in table"),
    "Qwen/Qwen2-7B-Instruct": ModelShape(7_615_616_512, 28, 4, 128, 32768, "built-in table"),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": ModelShape(1_100_048_384, 22, 4, 64, 2048, "built-in table"),
    "meta-llama/Llama-3.2-1B-Instruct": ModelShape(1_235_814_400, 16, 8, 64, 131072, "built-in table"),
    "double7/vicuna-68m": ModelShape(68_030_208, 2, 12, 64, 2048, "built-in table"),
    "Qwen/Qwen2-0.5B-Instruct": ModelShape(494_032_768, 24, 2, 64, 32768, "built-in table"),
}

# GPU memory of the instance types the shipped cluster YAMLs use (to say whether a tier fits).
INSTANCE_GPUS = {
    "g5.xlarge": ("A10G", 24), "g5.2xlarge": ("A10G", 24), "g5.4xlarge": ("A10G", 24),
    "g4dn.xlarge": ("T4", 16), "g4dn.2xlarge": ("T4", 16),
    "g6.xlarge": ("L4", 24), "g6.2xlarge": ("L4", 24),
    "p4d.24xlarge": ("8x A100", 320), "p5.48xlarge": ("8x H100", 640),
}
GCP_ACCELERATORS = {
    "nvidia-tesla-t4": ("T4", 16), "nvidia-l4": ("L4", 24), "nvidia-tesla-v100": ("V100", 16),
    "nvidia-tesla-a100": ("A100", 40), "nvidia-a100-80gb": ("A100", 80), "nvidia-h100-80gb": ("H100", 80),
}


@dataclasses.dataclass(frozen=True)
class NodeType:
    """One kind of node a cluster YAML can start, with the custom resources it offers."""

    cluster: str  # the YAML's file name
    name: str  # node type name (cloud) or "head <ip>" / "worker <ip>" (on-premises)
    resources: dict
    gpu: tuple[str, int] | None = None  # (model, GiB) when known

    @property
    def label(self) -> str:
        gpu = f" ({self.gpu[0]} {self.gpu[1]} GiB)" if self.gpu else ""
        return f"{self.cluster}:{self.name}{gpu}"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: float | None
    kv_bytes: float | None
    note: str  # where the parameter count came from, or why it is unknown
    kv_tokens: int = 0
    params: int | None = None

    @property
    def total_bytes(self) -> float | None:
        if self.weights_bytes is None:
            return None
        return self.weights_bytes * (1 + ACTIVATION_MARGIN) + (self.kv_bytes or 0.0)


@dataclasses.dataclass(frozen=True)
class TierPlacement:
    tier: TierConfig
    nodes: tuple[NodeType, ...]  # node types offering every resource the tier pins
    memory: MemoryEstimate


# ------------------------------------------------------------------------ cluster YAMLs

_CASE_ARM = re.compile(r"(\S+)\)\s*RESOURCES='(\{[^']*\})'")
_RESOURCES_FLAG = re.compile(r"--resources=(['\"])(\{.*?\})\1")


def validate_cluster_yaml(path: Path) -> dict:
    """The cluster YAML, checked with Ray's own cluster-config schema (what `ray up` runs)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"cluster YAML not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"cluster YAML {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError:
        return raw  # without Ray the pins are still checked; the schema check needs it
    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)  # its INFO lines are not for this report
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            validate_config(prepare_config(json.loads(json.dumps(raw))))  # the launcher's "PANIC" lines go too
    except Exception as exc:  # jsonschema.ValidationError, ValueError, click's abort
        message = getattr(exc, "message", None) or str(exc).strip().splitlines()[0]
        where = "/".join(str(p) for p in getattr(exc, "absolute_path", []))
        raise ConfigError(f"cluster YAML {path} fails Ray's validation{' at ' + where if where else ''}: {message}") from None
    return raw


def _json_resources(text: str, where: str) -> dict:
    try:
        resources = json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"{where}: resources {text!r} are not a JSON mapping") from None
    if not isinstance(resources, dict):
        raise ConfigError(f"{where}: resources {text!r} are not a JSON mapping")
    return resources


def _gpu_of(node_config: dict) -> tuple[str, int] | None:
    if node_config.get("InstanceType") in INSTANCE_GPUS:
        return INSTANCE_GPUS[node_config["InstanceType"]]
    for accelerator in node_config.get("guestAccelerators") or []:
        known = GCP_ACCELERATORS.get(accelerator.get("acceleratorType"))
        if known:
            count = int(accelerator.get("acceleratorCount", 1))
            return (known[0] if count == 1 else f"{count}x {known[0]}", known[1] * count)
    return None


def cluster_node_types(path: Path) -> list[NodeType]:
    """Node types of one cluster YAML. Cloud providers declare resources per node type;
    the on-premises provider has one node type, so each machine's resources are read
    from the `--resources` of the head start command and the `case` arms of the worker
    start command (see cluster/local.yaml)."""
    raw = validate_cluster_yaml(path)
    name = path.name
    provider = raw.get("provider") or {}
    if provider.get("type") != "local":
        return [
            NodeType(name, node_name, dict(spec.get("resources") or {}), _gpu_of(spec.get("node_config") or {}))
            for node_name, spec in (raw.get("available_node_types") or {}).items()
        ]
    nodes = []
    head_commands = " ".join(raw.get("head_start_ray_commands") or [])
    head = _RESOURCES_FLAG.search(head_commands)
    nodes.append(NodeType(name, f"head {provider.get('head_ip')}", _json_resources(head.group(2), name) if head else {}))
    worker_commands = " ".join(raw.get("worker_start_ray_commands") or [])
    arms = {ip: _json_resources(text, name) for ip, text in _CASE_ARM.findall(worker_commands)}
    for ip in provider.get("worker_ips") or []:
        nodes.append(NodeType(name, f"worker {ip}", arms.get(ip, arms.get("*)", {}))))
    return nodes


def default_cluster_paths() -> list[Path]:
    return sorted(CLUSTER_DIR.glob("*.yaml"))


# ------------------------------------------------------------------------ memory


def _shape_from_config(config: dict, params: int | None, source: str) -> ModelShape | None:
    text = config.get("text_config") or config
    hidden, layers = text.get("hidden_size"), text.get("num_hidden_layers")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    if params is None:
        vocab, inter = text.get("vocab_size"), text.get("intermediate_size")
        if not all(isinstance(v, int) for v in (hidden, layers, heads, vocab, inter)):
            return None
        # a Llama-style decoder: attention (q, o full; k, v per KV head), gated MLP, two norms
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        per_layer = attention + 3 * hidden * inter + 2 * hidden
        embeddings = vocab * hidden * (1 if text.get("tie_word_embeddings", True) else 2)
        params = layers * per_layer + embeddings + hidden
        source = "config.json (estimated)"
    return ModelShape(params, layers, kv_heads, head_dim, text.get("max_position_embeddings"), source)


def _safetensors_params(directory: Path) -> int | None:
    """Exact parameter count from the safetensors headers (8-byte length + JSON), no weights read."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def _cached_hub_config(model_id: str) -> Path | None:
    """config.json of a hub model already in the local Hugging Face cache (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid hub id (HFValidationError): nothing cached under it
        return None
    return Path(found) if isinstance(found, str) else None


def _gguf_shape(path: Path) -> ModelShape | None:
    """Parameter count and attention shape from a GGUF file's header (one pass for the architecture, one for
    its fields; the weights stay on disk, and neither torch nor gguf's reader, which decodes every field, loads)."""
    from polyspec.workers.tiers.gguf_header import read_file

    try:
        architecture = read_file(str(path), {"general.architecture"}, tensors=False)[0].get("general.architecture") or ""
        names = {f"{architecture}.{key}": key for key in ("attention.head_count", "attention.head_count_kv", "embedding_length",
                                                          "block_count", "context_length")}
        found, tensors = read_file(str(path), set(names))
    except Exception:  # noqa: BLE001 - a damaged file: the loader will say so
        return None
    field = {key: found.get(name) for name, key in names.items()}
    params = sum(int(math.prod(tensor.shape)) for tensor in tensors.values())
    heads, hidden = field["attention.head_count"], field["embedding_length"]
    head_dim = hidden // heads if hidden and heads else None
    return ModelShape(params, field["block_count"], field["attention.head_count_kv"] or heads, head_dim,
                      field["context_length"], "GGUF header (dequantized)")


def is_local_path(model: str) -> bool:
    """A model reference that can only mean a file or folder on this machine (not a hub id)."""
    return os.path.isabs(model) or model.startswith((".", "~")) or model.lower().endswith(".gguf")


def check_model_paths(config: ChainConfig) -> None:
    """Every local model path exists (one line naming the tier otherwise; zoo folders say how to fetch them)."""
    for tier in config.tiers:
        if not tier.is_ngram and is_local_path(tier.model) and not os.path.exists(tier.model):
            raise ConfigError(f"tier {tier.name!r}: model path {tier.model!r} does not exist{fetch_hint(tier.model)}")


def model_shape(model: str) -> ModelShape | None:
    directory = Path(model)
    if directory.is_file() and model.lower().endswith(".gguf"):
        return _gguf_shape(directory)
    if is_local_path(model) and not directory.exists():
        return None
    if directory.is_dir():
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        params = _safetensors_params(directory)
        shape = _shape_from_config(config, params, "safetensors headers" if params else "config.json")
        if shape is None and params is not None:
            return ModelShape(params, source="safetensors headers")
        return shape
    cached = _cached_hub_config(model)
    if cached is not None:
        shape = _shape_from_config(json.loads(cached.read_text(encoding="utf-8")), None, "")
        if shape is not None:
            return dataclasses.replace(shape, source="Hugging Face cache, config.json (estimated)")
    return KNOWN_MODELS.get(model)


def estimate_memory(tier: TierConfig) -> MemoryEstimate:
    if tier.is_ngram:
        return MemoryEstimate(0.0, 0.0, "model-free")
    shape = model_shape(tier.model)
    if shape is None:
        missing = is_local_path(tier.model) and not Path(tier.model).exists()
        return MemoryEstimate(None, None, "unknown (model not present here)" if missing else "unknown (hub id not cached)")
    compute_bytes = DTYPE_BYTES.get(tier.dtype, DTYPE_BYTES["float32"])  # auto: at most float32
    if tier.quantize == "int8":
        compute_bytes = DTYPE_BYTES["float32"]  # the int8 path computes (and keeps its KV) in float32
    weight_bytes = shape.params * (QUANTIZE_BYTES[tier.quantize] if tier.quantize else compute_bytes)
    kv_bytes, tokens = None, 0
    if shape.layers and shape.kv_heads and shape.head_dim:
        tokens = min(KV_CONTEXT_TOKENS, shape.max_positions or KV_CONTEXT_TOKENS)
        kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * compute_bytes
    return MemoryEstimate(weight_bytes, kv_bytes, f"{_count(shape.params)} params, {shape.source}", tokens, shape.params)


# ------------------------------------------------------------------------ checks


def check_tiers(config: ChainConfig) -> list[MemoryEstimate]:
    """Quantization against device, and tier order: no drafter has more parameters than its verifier.

    Parameters, not bytes: a quantized copy of the target (same parameters, fewer bytes)
    may verify for a smaller float model, as in target <- int8 copy <- 0.5B."""
    estimates = [estimate_memory(tier) for tier in config.tiers]
    for tier in config.tiers:
        if tier.quantize == "gguf" and not tier.device.startswith(("cpu", "auto")):
            raise ConfigError(f"tier {tier.name!r}: quantize: gguf runs on CPU only (its non-4-bit tensors use torch's CPU int8 kernel)")
        if tier.quantize == "int8w" and not tier.device.startswith(("cpu", "auto")):
            raise ConfigError(f"tier {tier.name!r}: quantize: int8w (torch's weight-only int8 kernel) runs on CPU only; use fp8 on a GPU")
        if tier.quantize == "int8" and tier.device.startswith("cuda"):
            raise ConfigError(f"tier {tier.name!r}: quantize: int8 (torch dynamic quantization) runs on CPU only; use fp8 or int4 on a GPU")
        if tier.quantize == "fp8" and not tier.device.startswith(("cpu", "cuda", "auto")):
            raise ConfigError(f"tier {tier.name!r}: quantize: fp8 runs on CPU or CUDA, not {tier.device}")
    for i in range(1, len(config.tiers)):
        verifier, drafter = config.tiers[i - 1], config.tiers[i]
        verifier_params, drafter_params = estimates[i - 1].params, estimates[i].params
        if verifier_params is not None and drafter_params is not None and drafter_params > verifier_params:
            raise ConfigError(
                f"tier order: {drafter.name!r} ({_count(drafter_params)} parameters) drafts for the smaller "
                f"{verifier.name!r} ({_count(verifier_params)}); list the tiers target first, cheapest last"
            )
    return estimates


def place(config: ChainConfig, node_types: list[NodeType], cluster_names: list[str]) -> list[TierPlacement]:
    estimates = check_tiers(config)
    placements = []
    for tier, memory in zip(config.tiers, estimates):
        pins = tier.resources or {}
        for resource, amount in pins.items():
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount <= 0:
                raise ConfigError(f"tier {tier.name!r}: resources.{resource} must be a positive number, got {amount!r}")
        nodes = tuple(n for n in node_types if all(n.resources.get(r, 0) >= amount for r, amount in pins.items()))
        if pins and not nodes:
            known = sorted({r for n in node_types for r in n.resources})
            missing = next(r for r in pins if not any(n.resources.get(r, 0) >= pins[r] for n in node_types))
            raise ConfigError(
                f"tier {tier.name!r} pins resource {missing!r}, which no node type of {', '.join(cluster_names)} offers"
                f" (known: {', '.join(known) or 'none'})"
            )
        placements.append(TierPlacement(tier, nodes, memory))
    return placements


# ------------------------------------------------------------------------ report


def _gib(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value / GIB:.2f} GiB" if value >= GIB / 4 else f"{value / 1024**2:.1f} MiB"


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


def tuning_lines(config: ChainConfig) -> list[str]:
    """The `tuning:` options set that the planner would not read (what the engine names at start-up)."""
    from polyspec.orchestrator.tuning import options

    planner = options.planner_of(config.speculation.lengths == "auto", True, len(config.tiers))
    note = options.note(config.tuning, planner, distributed=config.runtime.backend == "ray")
    return [f"note: {note}"] if note else []


def format_plan(config: ChainConfig, placements: list[TierPlacement], cluster_names: list[str]) -> str:
    lines = [
        f"config {config.source}: OK ({len(config.tiers)} tiers, runtime {config.runtime.backend})",
        f"cluster YAMLs (Ray-validated): {', '.join(cluster_names)}",
        *tuning_lines(config),
        "placement plan:",
    ]
    for placement in placements:
        tier, memory = placement.tier, placement.memory
        kind = "n-gram" if tier.is_ngram else (f"{tier.quantize}" if tier.quantize else tier.dtype)
        if tier.drafter:  # its weights beyond the target's; it computes in the target's dtype
            kind = "feature head" if tier.drafter == "feature" else f"early exit over {tier.layers or 'its'} target layers"
        lines.append(f"  {tier.name}: {tier.model} [{kind}]")
        if memory.weights_bytes is None:
            lines.append(f"    memory: {memory.note}")
        else:
            kv = f" + KV {_gib(memory.kv_bytes)} ({memory.kv_tokens} tokens)" if memory.kv_bytes else ""
            lines.append(
                f"    memory: ~{_gib(memory.total_bytes)} (weights {_gib(memory.weights_bytes)}{kv}"
                f" + {ACTIVATION_MARGIN:.0%} margin; {memory.note})"
            )
        if tier.quantize == "int4":
            lines.append(f"    int4 weight-only: torch's kernels on the CPU and a CUDA GPU (group {tier.group_size or 128})")
        if tier.quantize == "gguf":
            lines.append("    gguf weight-only: the file's Q4_0/Q4_1/Q4_K blocks on the int4 kernel, other types int8 per channel (CPU)")
        if tier.quantize == "int8w":
            lines.append("    int8 weight-only (per channel): torch's kernel, CPU only")
        if tier.quantize == "fp8":
            lines.append("    fp8 GEMM (torch._scaled_mm) on CUDA compute capability >= 8.9; weight-only elsewhere (memory, not speed)")
        if config.runtime.backend == "local":
            lines.append("    node: this process (runtime.backend local: every tier embedded)")
        elif tier.drafter:
            lines.append(f"    node: its target's ({config.tiers[0].name!r}), in the target's actor")
        elif not tier.resources:
            lines.append("    node: any with free CPU/GPU (no resources pinned)")
        else:
            pins = ", ".join(f"{r}={a}" for r, a in tier.resources.items())
            for node in placement.nodes:
                fits = ""
                if node.gpu and memory.total_bytes is not None:
                    fits = " - fits" if memory.total_bytes <= node.gpu[1] * GIB else " - DOES NOT FIT"
                lines.append(f"    node: {node.label} [{pins}]{fits}")
    return "\n".join(lines)


def cmd_validate(args) -> int:
    config = load_config(args.config)
    if not args.no_model_check:
        check_model_paths(config)
    paths = [Path(p) for p in args.cluster] if args.cluster else default_cluster_paths()
    if not paths:
        raise ConfigError(f"no cluster YAMLs given and none in {CLUSTER_DIR}")
    node_types = [node for path in paths for node in cluster_node_types(path)]
    names = [path.name for path in paths]
    placements = place(config, node_types, names)
    print(format_plan(config, placements, names))
    return 0


def add_parser(sub) -> None:
    validate = sub.add_parser("validate", help="check a config offline and print its placement plan (no weights, no Hub)")
    validate.add_argument("-c", "--config", required=True)
    validate.add_argument(
        "--no-model-check", action="store_true",
        help="check structure and placement only, not that local model paths exist (e.g. before `polyspec zoo fetch`)",
    )
    validate.add_argument(
        "--cluster", action="append", help="cluster YAML the resource pins must exist in (repeatable; default: cluster/*.yaml)"
    )
