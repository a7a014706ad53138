"""A lean forward for Llama-architecture tiers (Llama, Qwen2): the same math as transformers, without its per-module overhead.

On the CPU demo family one forward of the 8.7M-parameter target spends about as long in
Python (module dispatch, hooks, mask and rotary construction, cache bookkeeping) and in
copying the growing KV cache (`torch.cat` per layer per forward) as in its matrix
products; for the int8 copy the overhead is twice the kernels' time. This module runs the
same operations, in the same order and dtypes, as `LlamaForCausalLM.forward` with the SDPA
attention of transformers 5.x, from the model's own weights (plain or dynamically
quantized int8 `Linear`s, or `Fp8Linear`s: `quantize: fp8`), on a KV cache preallocated per sequence:

- rotary cos / sin: one table over all positions, computed with transformers' formula
  (an elementwise product per position, so every row is bit-identical);
- attention masks as transformers builds them: none with `is_causal=True` for a prefill,
  none for one new token, a boolean causal mask offset by the cache for a block, and the
  caller's additive 4-D mask for a tree;
- the cache is written in place; keys / values are views of its first n positions, so a
  rollback (`truncate`) costs nothing and `keep` (tree paths) is one gather per layer.

Qwen2 is the same computation with biases on the query / key / value projections (the
`Linear`s carry them) and, for small models, an LM head tied to the embedding (the same
tensor, used as is); its sliding-window layers are not covered. Grouped-query attention
follows transformers' SDPA path too (`enable_gqa` without a mask,
the packed query for one token with a mask, repeated keys / values otherwise).
`tests/workers/test_lean_llama.py` and `test_lean_qwen2.py` check bit-equality of logits with the transformers
forward for prefill, single tokens, blocks, trees and rollbacks. Models this path does not
cover (other architectures, biases, scaled RoPE, bitsandbytes int4 layers) keep the transformers
forward (`LeanLlama.supports`); so does a one-sequence tier on a GPU, where the
bit-equality above is unchecked. The batched forward (`batched_llama`), built from the same
weights and tables, also runs on CUDA (`supports(..., devices=...)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyspec.workers.tiers.block_linear import linear_of, pack
from polyspec.workers.tiers.fp8_linear import Fp8Linear
from polyspec.workers.tiers.weight_only import WeightOnlyLinear

INITIAL_CAPACITY = 256


def linear_function(module):
    """`module(x)` without the module call, for a float `Linear`, a dynamically quantized int8 `Linear` or an
    `Fp8Linear`; None for any other module (this forward does not cover it)."""
    if isinstance(module, (Fp8Linear, WeightOnlyLinear)):
        return module.forward  # its own forward, without nn.Module's call overhead
    if isinstance(module, torch.nn.Linear):
        # a float weight only: bitsandbytes' int4 / int8 layers subclass `Linear` with packed integer weights
        return linear_of(module) if module.weight.is_floating_point() else None
    packed = getattr(module, "_packed_params", None)
    if packed is not None and getattr(packed, "dtype", None) == torch.qint8 and getattr(module, "version", 4) >= 4:
        params = packed._packed_params
        op = torch.ops.quantized.linear_dynamic.default  # the overload itself: no per-call dispatch checks in Python
        return lambda x: op(x, params, True) if x.dtype == torch.float32 else op(x, params, True).to(x.dtype)
    return None


class LeanCache:
    """Per-sequence KV cache in preallocated buffers, with the `SequenceCache` interface the tiers use."""

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, limit: int | None) -> None:
        self.tokens: list[int] = []
        self._shape = (layers, heads, head_dim)
        self._dtype = dtype
        self._limit = limit
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._capacity = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def common_prefix(self, context: list[int]) -> int:
        limit = min(len(self.tokens), len(context))
        n = 0
        while n < limit and self.tokens[n] == context[n]:
            n += 1
        return n

    @torch.inference_mode()
    def reserve(self, length: int) -> None:
        if length <= self._capacity:
            return
        capacity = max(INITIAL_CAPACITY, self._capacity * 2, length)
        if self._limit:
            capacity = max(length, min(capacity, self._limit))
        layers, heads, head_dim = self._shape
        used = len(self.tokens)
        keys, values = [], []
        for layer in range(layers):
            k = torch.empty(1, heads, capacity, head_dim, dtype=self._dtype)
            v = torch.empty(1, heads, capacity, head_dim, dtype=self._dtype)
            if used:
                k[:, :, :used] = self.keys[layer][:, :, :used]
                v[:, :, :used] = self.values[layer][:, :, :used]
            keys.append(k)
            values.append(v)
        self.keys, self.values, self._capacity = keys, values, capacity

    def appended(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            del self.tokens[length:]

    @torch.inference_mode()  # the buffers are inference tensors (made inside the forward)
    def keep(self, positions: list[int]) -> None:
        """Keep only `positions` (strictly increasing), packed to the front."""
        if positions == list(range(len(positions))):
            self.truncate(len(positions))
            return
        index = torch.tensor(positions, dtype=torch.long)
        count = len(positions)
        for k, v in zip(self.keys, self.values):
            k[:, :, :count] = k.index_select(2, index)
            v[:, :, :count] = v.index_select(2, index)
        self.tokens = [self.tokens[p] for p in positions]


ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def layer_projections(layer) -> tuple:
    """A decoder layer's seven projections, in the order the lean forward keeps them."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def _full_attention_only(config) -> bool:
    """Qwen2 layers may use a sliding window (`use_sliding_window`); the lean path attends over everything."""
    if getattr(config, "use_sliding_window", False):
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or [])


class LeanLlama:
    """`LlamaForCausalLM` / `Qwen2ForCausalLM` logits for a batch of one, on a `LeanCache`."""

    @staticmethod
    def supports(model, device: torch.device, devices: tuple[str, ...] = ("cpu",)) -> bool:
        """Does the lean forward compute this model's logits (on `device`, one of the device types `devices`)?"""
        config = getattr(model, "config", None)
        architecture = type(model).__name__
        if config is None or architecture not in ARCHITECTURES or device.type not in devices:
            return False
        rope = getattr(config, "rope_parameters", None) or {}
        heads = config.num_attention_heads
        # Llama's projections are bias-free unless attention_bias; Qwen2's q / k / v always carry biases
        llama_bias = architecture == "LlamaForCausalLM" and getattr(config, "attention_bias", False)
        simple = (
            rope.get("rope_type", "default") == "default"
            and not llama_bias
            and _full_attention_only(config)
            and not getattr(config, "mlp_bias", False)
            and config.hidden_act == "silu"
            and heads % getattr(config, "num_key_value_heads", heads) == 0
            and getattr(config, "_attn_implementation", "sdpa") == "sdpa"
            and getattr(config, "pretraining_tp", 1) == 1
        )
        if not simple:
            return False
        base = model.model
        if getattr(base.rotary_emb, "attention_scaling", 1.0) != 1.0:
            return False
        modules = [model.lm_head]
        for layer in base.layers:
            modules += layer_projections(layer)
        return all(linear_function(m) is not None for m in modules)

    def __init__(self, model) -> None:
        config = model.config
        base = model.model
        # large projections move to oneDNN where it verifies a block faster (block_linear);
        # a head tied to the embedding keeps the dense tensor the embedding reads
        for layer in base.layers:
            for module in layer_projections(layer):
                pack(module)
        pack(model.lm_head, keep_dense=model.lm_head.weight is base.embed_tokens.weight)
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.groups = self.heads // self.kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.limit = getattr(config, "max_position_embeddings", None)
        self.embed = base.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.eps = [(layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon) for layer in base.layers]
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    linear_function(attn.q_proj),
                    linear_function(attn.k_proj),
                    linear_function(attn.v_proj),
                    linear_function(attn.o_proj),
                    layer.post_attention_layernorm.weight,
                    linear_function(mlp.gate_proj),
                    linear_function(mlp.up_proj),
                    linear_function(mlp.down_proj),
                    layer.input_layernorm.variance_epsilon,
                    layer.post_attention_layernorm.variance_epsilon,
                )
            )
        self.norm_weight = base.norm.weight
        self.norm_eps = base.norm.variance_epsilon
        self.lm_head = linear_function(model.lm_head)
        # transformers: freqs = position[..., None].float() * inv_freq; emb = cat(freqs, freqs); cos = emb.cos() * scaling
        inv_freq = base.rotary_emb.inv_freq.float()
        positions = torch.arange(self.limit or 4096, dtype=torch.long, device=inv_freq.device)  # the tables live with the weights
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = base.rotary_emb.attention_scaling
        self.cos = (emb.cos() * scale).to(self.dtype)  # [P, D]
        self.sin = (emb.sin() * scale).to(self.dtype)

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.limit)

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(input_dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _grouped_attention(self, q, key, value, attn_mask, is_causal):
        """transformers' `sdpa_attention_forward` for grouped-query attention on CPU."""
        groups, count = self.groups, q.shape[2]
        kwargs = {}
        if attn_mask is None:
            kwargs["enable_gqa"] = True
        elif count == 1:
            q = q.reshape(1, self.kv_heads, groups, self.head_dim)  # pack_gqa; a [1, 1, ...] mask is shared as is
            if attn_mask.shape[1] != 1:
                attn_mask = attn_mask.reshape(1, self.kv_heads, groups, attn_mask.shape[-1])
        else:
            length = key.shape[2]
            key = key[:, :, None].expand(1, self.kv_heads, groups, length, self.head_dim).reshape(1, self.heads, length, self.head_dim)
            value = value[:, :, None].expand(1, self.kv_heads, groups, length, self.head_dim).reshape(1, self.heads, length, self.head_dim)
        attn = F.scaled_dot_product_attention(q, key, value, attn_mask=attn_mask, dropout_p=0.0, scale=self.scaling, is_causal=is_causal, **kwargs)
        return attn.reshape(1, -1, count, self.head_dim)

    @torch.inference_mode()
    def forward(
        self, cache: LeanCache, tokens: list[int], positions: list[int], mask: torch.Tensor | None, hidden: list | None = None,
        inputs: torch.Tensor | None = None, raw: bool = False,
    ) -> torch.Tensor:
        """Append `tokens` (at `positions`) to `cache`; logits [1, T, V] in the model's dtype.
        `hidden`: a list that receives the last hidden states [T, H] (after the final norm).
        `inputs` [1, T, H]: the layers' input instead of the token embeddings; `raw`: return
        the last layer's output (before the final norm) instead of logits (a feature head's use)."""
        count = len(tokens)
        start = len(cache)
        end = start + count
        cache.reserve(end)
        ids = torch.tensor(tokens, dtype=torch.long)
        position_index = torch.tensor(positions, dtype=torch.long)
        x = F.embedding(ids, self.embed)[None] if inputs is None else inputs  # [1, T, H*D]
        cos = self.cos.index_select(0, position_index)[None, None]  # [1, 1, T, D]
        sin = self.sin.index_select(0, position_index)[None, None]
        if mask is not None:
            attn_mask, is_causal = mask, False  # a tree: the caller's additive mask, as transformers passes it
        elif count == 1:
            attn_mask, is_causal = None, False
        elif start == 0:
            attn_mask, is_causal = None, True
        else:  # a block after cached positions: transformers' boolean causal mask, offset by the cache
            query = torch.arange(start, end)[:, None]
            attn_mask, is_causal = (query >= torch.arange(end)[None, :])[None, None], False
        shape = (1, count, -1, self.head_dim)
        rotate = self._rotate_half
        groups = self.groups
        for index, (w_in, q_proj, k_proj, v_proj, o_proj, w_post, gate, up, down, eps_in, eps_post) in enumerate(self.layers):
            h = self._rms(x, w_in, eps_in)
            q = q_proj(h).view(shape).transpose(1, 2)
            k = k_proj(h).view(shape).transpose(1, 2)
            v = v_proj(h).view(shape).transpose(1, 2)
            q = (q * cos) + (rotate(q) * sin)
            k = (k * cos) + (rotate(k) * sin)
            keys, values = cache.keys[index], cache.values[index]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            key, value = keys[:, :, :end], values[:, :, :end]
            if groups == 1:
                attn = F.scaled_dot_product_attention(q, key, value, attn_mask=attn_mask, dropout_p=0.0, scale=self.scaling, is_causal=is_causal)
            else:
                attn = self._grouped_attention(q, key, value, attn_mask, is_causal)
            attn = attn.transpose(1, 2).contiguous().reshape(1, count, -1).contiguous()
            x = x + o_proj(attn)
            h = self._rms(x, w_post, eps_post)
            x = x + down(F.silu(gate(h)) * up(h))
        if raw:
            return x
        x = self._rms(x, self.norm_weight, self.norm_eps)
        if hidden is not None:
            hidden.append(x[0])
        return self.lm_head(x)
