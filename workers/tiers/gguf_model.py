"""`quantize: gguf`: a model tier whose Linears are built straight from a GGUF file's quantized blocks.

transformers' GGUF loader dequantizes every tensor to the tier's dtype (a bf16 1.5B: 3.5 GB resident,
~40 s); `quantize: int4` would then round those bf16 weights a second time. Here the model's skeleton
is made without weights (`init_empty_weights`), and each projection becomes a `WeightOnlyLinear` built
from the file's own levels (workers/tiers/gguf_file.py: Q4_0 / Q4_1 / Q4_K unchanged onto the int4
kernel, other types re-quantized to int8 per channel, one tensor at a time in float32). Only the
embedding table, the norms and the biases are dequantized, to the tier's dtype. No bf16 copy of a
quantized projection is ever made.

Architectures: llama and qwen2 (the zoo's SmolLM2 and Qwen2.5-Coder). llama.cpp's converter stores a
llama model's q and k rows in an interleaved rotary order; the rows are put back in Hugging Face's order
(the same permutation transformers' GGUF loader undoes), which moves whole rows and so keeps the blocks.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from polyspec.workers.core.errors import ModelLoadError
from polyspec.workers.tiers import gguf_file, gguf_header
from polyspec.workers.tiers.weight_only import NEVER, WeightOnlyLinear, measured_dense_rows

ARCHITECTURES = ("llama", "qwen2")
PROJECTIONS = {  # GGUF tensor (per block) -> the Hugging Face module under model.layers[i]
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _keys(arch: str) -> set[str]:
    fields = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon")
    return {"general.architecture", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", f"{arch}.rope.scaling.type"} | {f"{arch}.{f}" for f in fields}


def model_config(meta: dict, tensors: dict, arch: str):
    """The transformers config of the file, from its metadata (transformers' own GGUF config reader parses the
    whole tokenizer too: ~20 s for Qwen)."""
    from transformers import LlamaConfig, Qwen2Config

    field = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    heads = field("attention.head_count")
    values = dict(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=field("embedding_length"),
        intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field("attention.head_count_kv", heads),
        max_position_embeddings=field("context_length"),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        rope_theta=field("rope.freq_base", 10000.0),
        tie_word_embeddings=False,  # the head is its own WeightOnlyLinear even where the file ties it
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    if arch == "qwen2":
        return Qwen2Config(**values)
    return LlamaConfig(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False, **values)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: HF row r is file row order[r]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)  # HF (head, pair, i) <- file (head, i, pair)


def _float(tensor: gguf_header.FileTensor, dtype: torch.dtype) -> torch.Tensor:
    shape = tensor.matrix_shape if len(tensor.shape) > 1 else (1, tensor.shape[0])
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], gguf_file.ROWS_PER_CHUNK):  # a 152k-row table in float32 at once is ~1 GB
        stop = min(shape[0], start + gguf_file.ROWS_PER_CHUNK)
        out[start:stop] = torch.from_numpy(gguf_file.float_rows(tensor.qtype, tensor.data, shape, start, stop))
    return out.reshape(tensor.shape)


def weight_only_linear(tensor: gguf_header.FileTensor, bias: torch.Tensor | None, rows: np.ndarray | None = None) -> WeightOnlyLinear:
    """One projection from its blocks: int4 with the file's levels where the type maps, int8 per channel otherwise."""
    shape = tensor.matrix_shape
    if gguf_file.maps_to_int4(tensor.qtype, shape):
        levels = gguf_file.unpack(tensor.qtype, tensor.data, shape)
        return WeightOnlyLinear.from_int4(gguf_file.int4_weights(levels, rows), bias)
    if tensor.qtype not in gguf_file.INT8_TYPES and tensor.qtype not in gguf_file.INT4_TYPES:
        raise ModelLoadError(f"{tensor.name}: GGUF type {tensor.qtype} is not read by quantize: gguf (known: "
                             f"{', '.join(gguf_file.INT4_TYPES + gguf_file.INT8_TYPES)})")
    return WeightOnlyLinear.from_int8(gguf_file.int8_weights(tensor.qtype, tensor.data, shape, rows), bias)


@torch.no_grad()
def load_gguf_weight_only(path: str, dtype: torch.dtype, measure_dense_rows: bool = True):
    """The file as a transformers model whose every projection (and LM head) is a WeightOnlyLinear; embedding,
    norms and biases in `dtype`. `model.gguf_report`: load seconds, resident MB grown, Linears by kind and by
    file type."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    from polyspec.workers.tiers.loading import add_stop_token_ids, gguf_stop_token_ids, return_freed_memory, rss_bytes

    started, rss = time.perf_counter(), rss_bytes()
    meta, tensors = gguf_header.read_file(path, set().union(*(_keys(a) for a in ARCHITECTURES)))  # one pass over the header
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: quantize: gguf reads {', '.join(ARCHITECTURES)} files; this one is {arch!r}")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors or scaling not in (None, "none"):  # Llama 3.1's rope, YaRN, ...: the config here has none
        raise ModelLoadError(f"{path}: quantize: gguf does not read scaled rotary embeddings ({scaling or 'rope_freqs.weight'}); "
                             "load the file without it")
    config = model_config(meta, tensors, arch)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device: no float weights allocated
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    layers = model.model.layers
    kinds: dict[str, int] = {}
    types: dict[str, int] = {}

    def place(parent, name, module, tensor):
        setattr(parent, name, module)
        kinds[module.kind] = kinds.get(module.kind, 0) + 1
        types[tensor.qtype] = types.get(tensor.qtype, 0) + 1

    def param(tensor_name: str) -> torch.nn.Parameter:
        return torch.nn.Parameter(_float(tensors[tensor_name], dtype), requires_grad=False)

    for i, layer in enumerate(layers):
        for gguf_name, path_in_layer in PROJECTIONS.items():
            tensor = tensors.get(f"blk.{i}.{gguf_name}.weight")
            if tensor is None:
                raise ModelLoadError(f"{path}: no tensor blk.{i}.{gguf_name}.weight")
            bias_name = f"blk.{i}.{gguf_name}.bias"
            bias = _float(tensors[bias_name], dtype) if bias_name in tensors else None
            rows = None
            if arch == "llama" and gguf_name in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if gguf_name == "attn_q" else config.num_key_value_heads
                rows = _unpermute_rows(tensor.shape[0], heads)
                bias = None if bias is None else bias[torch.from_numpy(rows)]
            parent_name, _, name = path_in_layer.rpartition(".")
            place(layer.get_submodule(parent_name), name, weight_only_linear(tensor, bias, rows), tensor)
        for gguf_name, module_name in NORMS.items():
            getattr(layer, module_name).weight = param(f"blk.{i}.{gguf_name}.weight")
    model.model.embed_tokens.weight = param("token_embd.weight")
    model.model.norm.weight = param("output_norm.weight")
    head_tensor = tensors.get("output.weight", tensors["token_embd.weight"])  # no output.weight: the file ties the head
    place(model, "lm_head", weight_only_linear(head_tensor, None), head_tensor)
    left = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ModelLoadError(f"{path}: quantize: gguf found no tensor for {', '.join(left[:3])}")
    model.generation_config = GenerationConfig.from_model_config(config)
    add_stop_token_ids(model.generation_config, gguf_stop_token_ids(path))
    model.eval()
    if measure_dense_rows:  # as quantize_weight_only: the head keeps the kernel
        for module in model.modules():
            if isinstance(module, WeightOnlyLinear):
                module.dense_rows = NEVER if module is model.lm_head else measured_dense_rows(module, dtype)
    del tensors, head_tensor, tensor  # the last views of the mapped file: its pages leave the resident set with it
    gc.collect()
    return_freed_memory()  # the float32 chunks of the int8 re-quantization were freed in pieces glibc keeps
    grown = rss_bytes()
    model.weight_only_skipped = 0
    model.gguf_report = {
        "seconds": round(time.perf_counter() - started, 2),
        "resident_mb": None if grown is None or rss is None else round((grown - rss) / 2**20),
        "linears": dict(sorted(kinds.items())),
        "file_types": dict(sorted(types.items())),
    }
    return model
