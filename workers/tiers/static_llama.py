"""A static-shape forward of Llama-architecture models (Llama, Qwen2) over a KV pool allocated once.

The round that stays on the device needs a forward whose shapes depend only on its bucket,
so that it can be replayed as a CUDA graph (or compiled whole on the CPU):

- `KVPool`: per layer one key and one value buffer `[slots + 1, kv_heads, capacity, head_dim]`,
  allocated once and never grown. A request owns a slot; its length is host bookkeeping, so a
  rollback is free. The extra last slot is scratch: the padding rows of a batch bucket write
  there. `capacity` is the model context plus the widest block, so the padding columns of a
  row (written past its tokens, never read before they are overwritten) stay inside.
- `StaticLlama.forward(pool, ids [B, T], positions [B, T], slots [B], span)`: row b writes its T
  tokens' keys and values into slot `slots[b]` at `positions[b]` and attends to that slot's
  positions 0 .. its own (the first `span` positions of the slot are read: a static bucket of
  the longest context). Logits [B, T, V] stay on the device. With `ancestors` a row's new tokens
  are a draft tree instead (each sees the cached context and its own ancestors, at position
  prefix length + depth), as in `BatchedLlama`'s tree rows (`RowLayout`), or the next level of a
  tree whose earlier levels are cached (`tree_start`: a drafter grows its tree one level a step).

The operations are `BatchedLlama`'s (the weights, rotary tables and order of operations of
transformers' forward). A float projection is `F.linear` of its weight; a quantized one (the
int8 dynamic copy, CPU only; `Fp8Linear`, CPU or CUDA) is called through
`lean_llama.linear_function`, the ragged forward's call, so both forwards compute the same.
tests/workers/test_static_llama.py checks the logits against transformers' forward and that
a step compiles whole, once per bucket; tests/workers/test_quantized_forward.py the quantized tiers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from polyspec.workers.tiers.batched_llama import grouped_attention, rms_norm, rotate_half
from polyspec.workers.tiers.fp8_linear import Fp8Linear
from polyspec.workers.tiers.block_linear import PACKED
from polyspec.workers.tiers.lean_llama import ARCHITECTURES, layer_projections, linear_function

DEVICES = ("cpu", "cuda")

# a projection: (weight, bias) of a float Linear, applied with F.linear; or a quantized module's forward
Projection = tuple[torch.Tensor, torch.Tensor | None] | Callable[[torch.Tensor], torch.Tensor]


def projection_of(module) -> Projection:
    """A float `Linear` as its detached (weight, bias) (a step writes the pool in place, and must not make it part
    of an autograd graph); a quantized one, or one whose weight moved to oneDNN (block_linear), as the call the
    ragged forward makes."""
    if type(module) is torch.nn.Linear and getattr(module, PACKED, None) is None:
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    return linear_function(module)


def project(x: torch.Tensor, projection: Projection) -> torch.Tensor:
    """`x W^T + b` by the projection's kind (a Python type, fixed when traced: the float path stays one F.linear)."""
    return F.linear(x, *projection) if isinstance(projection, tuple) else projection(x)


def static_projection(module, device: torch.device) -> bool:
    """Can the static forward run this projection on `device`: a float Linear or an fp8 one anywhere, int8 on the CPU."""
    if type(module) is torch.nn.Linear and getattr(module, PACKED, None) is None:
        return module.weight.is_floating_point()
    if isinstance(module, Fp8Linear):
        return True
    return device.type == "cpu" and linear_function(module) is not None


@dataclasses.dataclass
class KVPool:
    """The KV entries of every slot of one model, allocated once (see the module docstring)."""

    keys: list[torch.Tensor]  # per layer [slots + 1, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    slots: int  # usable slots; index `slots` is the scratch slot
    capacity: int

    @property
    def scratch_slot(self) -> int:
        return self.slots

    @staticmethod
    def bytes_per_slot(layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * capacity * torch.tensor([], dtype=dtype).element_size()

    @staticmethod
    def slots_within(memory_mb: float, per_slot: int) -> int:
        """How many slots (besides the scratch one) `memory_mb` holds."""
        return max(0, int(memory_mb * 2**20 // per_slot) - 1)


class StaticLlama:
    """Logits of `LlamaForCausalLM` / `Qwen2ForCausalLM` for static-shape batches on a `KVPool`."""

    @staticmethod
    def supports(model, device: torch.device) -> bool:
        from polyspec.workers.tiers.lean_llama import LeanLlama

        if not LeanLlama.supports(model, device, DEVICES):
            return False
        modules = [model.lm_head] + [m for layer in model.model.layers for m in layer_projections(layer)]
        return all(static_projection(m, device) for m in modules)

    def __init__(self, model) -> None:
        config, base = model.config, model.model
        if type(model).__name__ not in ARCHITECTURES:
            raise ValueError(f"StaticLlama runs {', '.join(ARCHITECTURES)}, not {type(model).__name__}")
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.limit = getattr(config, "max_position_embeddings", None) or 4096
        self.embed = base.embed_tokens.weight.detach()
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.vocab_size = config.vocab_size

        self.layers = []
        for layer in base.layers:
            q, k, v, o, gate, up, down = (projection_of(m) for m in layer_projections(layer))
            self.layers.append((layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon, q, k, v, o,
                                layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon, gate, up, down))
        self.norm_weight, self.norm_eps = base.norm.weight.detach(), base.norm.variance_epsilon
        self.lm_head = projection_of(model.lm_head)
        inv_freq = base.rotary_emb.inv_freq.float()
        positions = torch.arange(self.limit, dtype=torch.long, device=inv_freq.device)
        freqs = positions[:, None].float() * inv_freq  # transformers' formula, so the tables are bit-identical
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = base.rotary_emb.attention_scaling
        self.cos = (emb.cos() * scale).to(self.dtype)  # [P, D]
        self.sin = (emb.sin() * scale).to(self.dtype)

    def new_pool(self, slots: int, max_tokens: int, context: int | None = None) -> KVPool:
        """A pool of `slots` requests (plus the scratch slot), each holding `context` positions (default:
        the model's context) and a block of `max_tokens`."""
        capacity = min(context or self.limit, self.limit) + max_tokens
        shape = (slots + 1, self.kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        return KVPool(keys, values, slots, capacity)

    def bytes_per_slot(self, max_tokens: int, context: int | None = None) -> int:
        capacity = min(context or self.limit, self.limit) + max_tokens
        return KVPool.bytes_per_slot(len(self.layers), self.kv_heads, self.head_dim, capacity, self.dtype)

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[-1]

    def forward(self, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, span: int,
                ancestors: torch.Tensor | None = None, tree_start: torch.Tensor | None = None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] (model dtype, on the device) of every token of `ids` [B, T]; see `hidden_states`.
        `features` [slots + 1, capacity, H] (chains only): each token's last hidden state, after the final norm (what
        the LM head reads, what a feature head below reads: static_feature), is written at [its slot, its position]."""
        normed = rms_norm(self.hidden_states(pool, F.embedding(ids, self.embed), positions, slots, span, ancestors, tree_start),
                          self.norm_weight, self.norm_eps)  # [B, T, H]
        if features is not None:
            assert ancestors is None, "a feature head reads a chain's features"
            features[slots[:, None].expand(positions.shape), positions] = normed
        return project(normed, self.lm_head)

    def hidden_states(self, pool: KVPool, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, span: int,
                      ancestors: torch.Tensor | None = None, tree_start: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers' output [B, T, H] (before the final norm) over the input vectors `x` [B, T, H] of a
        row's tokens (their embeddings; a feature head's fused inputs); see the module docstring.
        Every argument shape is static in a bucket; nothing here reads a tensor's value on the host.

        `ancestors` [B, T, C] bool (C >= T): every row's new tokens are the last T of its C tree columns,
        cached one after the other from position `tree_start` [B] on (default: positions[:, 0], with
        C = T: the new tokens are the whole tree). New token t sees its slot's positions before the tree
        and the tree columns c with ancestors[b, t, c] (itself and its ancestors: `tree.tree_allowed`'s
        rule, a chain being the lower triangle); it is cached at tree_start + C - T + t. `positions` are
        then rotary positions only (prefix length + depth). With C > T the first C - T columns are a
        tree's earlier levels, cached by earlier calls (a drafter growing its tree one level a step)."""
        rows, width = x.shape[:2]
        rotary = positions.clamp_max(self.cos.shape[0] - 1)  # a padding column may run past the table
        cos, sin = self.cos[rotary][:, None], self.sin[rotary][:, None]  # [B, 1, T, D]
        visible = torch.arange(span, device=x.device)
        if ancestors is None:
            mask = (visible[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, span]
        else:
            columns = ancestors.shape[-1]
            first = positions[:, :1] if tree_start is None else tree_start[:, None]  # [B, 1] the tree's first cache position
            # from here on `positions` are where the new tokens are cached: siblings share a position, never a cache column
            positions = first + (columns - width) + torch.arange(width, device=x.device)  # [B, T]
            tree_index = visible[None, :] - first  # [B, span] a column's index among the row's tree columns (< 0: context)
            sees_tree = ancestors.gather(2, tree_index.clamp(0, columns - 1)[:, None, :].expand(rows, width, span))  # [B, T, S]
            mask = ((tree_index < 0)[:, None, :] | (sees_tree & (tree_index < columns)[:, None, :]))[:, None]  # [B, 1, T, span]
        write_slots = slots[:, None].expand(rows, width)  # [B, T]
        shape = (rows, width, -1, self.head_dim)
        for index, (w_in, eps_in, q_w, k_w, v_w, o_w, w_post, eps_post, gate_w, up_w, down_w) in enumerate(self.layers):
            h = rms_norm(x, w_in, eps_in)
            q = project(h, q_w).view(shape).transpose(1, 2)  # [B, heads, T, D]
            k = project(h, k_w).view(shape).transpose(1, 2)  # [B, kv_heads, T, D]
            v = project(h, v_w).view(shape).transpose(1, 2)
            q = (q * cos) + (rotate_half(q) * sin)
            k = (k * cos) + (rotate_half(k) * sin)
            keys, values = pool.keys[index], pool.values[index]
            keys[write_slots, :, positions] = k.transpose(1, 2)  # [B, T, kv_heads, D] into [slot, :, position]
            values[write_slots, :, positions] = v.transpose(1, 2)
            key = keys[:, :, :span].index_select(0, slots)  # [B, kv_heads, span, D]: only the span is copied
            value = values[:, :, :span].index_select(0, slots)
            attn = grouped_attention(q, key, value, mask, self.scaling)
            x = x + project(attn.transpose(1, 2).reshape(rows, width, -1), o_w)
            h = rms_norm(x, w_post, eps_post)
            x = x + project(F.silu(project(h, gate_w)) * project(h, up_w), down_w)
        return x
