"""Many sequences in one forward of a Llama-architecture tier: a slot KV cache and a ragged batched forward.

`SlotCache` keeps every open sequence of a tier in one buffer per layer,
`[slots, kv_heads, capacity, head_dim]`: a sequence owns a slot, its length is a number
and its tokens a list, so a rollback (`truncate`) is free and exact per sequence, and a
released slot is reused by the next request. The buffers are the tier's one KV pool, allocated
once at the first forward: `max_slots` slots of the whole model context (plus one junk column
that padding writes to). On the CPU they are anonymous memory mappings, zero until written,
that the kernel backs with pages only where positions are written, so a pool of 64 slots of
32k positions costs what its requests hold, never a copy to grow it; on CUDA they are
allocated outright, within what the card has free.

`BatchedLlama.forward` appends a ragged set of rows — row r feeds `tokens[r]` after the
`start[r]` positions its slot already holds — in one forward: the projections and the MLP
run on the rows' real tokens packed one after the other (rows of different lengths pay for
their own tokens, not the longest row's); attention runs with each row right-padded to the
longest, each query attending to its own slot's keys up to its own position (a per-row boolean
mask), and positions (hence rotary angles) are per row. A single chain row (one request's round: the
common case on a CPU) is the same computation with its per-call tensors cut to what one row needs: its
rotary rows a slice of the tables, its keys written as a slice of its slot, no mask for a lone token. On a
model as small as the demo family's (8.75M parameters) the forward's Python and small-tensor work is about
as long as its matrix products, so the norm (`rms_norm`) and the rotation (`rotary`) are written in
fewer kernels, bit for bit transformers' forms.

A row may carry a draft tree instead of a chain (`RowLayout`): its new tokens are still
written one after the other into the slot, but each takes the rotary position and the
attention row the caller gives (`polyspec.workers.core.tree.tree_allowed`: a node sees the
linear context and its own ancestors, at position prefix length + depth), exactly as the
transformers' forward under a 4-D tree mask. `SlotCache.keep` then compacts a slot to the
accepted path after verification (`accept_path`). Chain rows build no extra mask: a batch of
chains costs what it did before trees. Sliding-window layers (Mistral; Qwen2 with
`use_sliding_window`) see the keys within their window of each query, by position.

The operations, their order and dtypes are those of transformers' Llama / Qwen2 forward
(`unsupported` names what is not covered: such a model is refused at load); matrix products
over a different number of rows may round differently in the last bits, which is why
losslessness under batching is tested against the target's own greedy output with the logit
gap at any divergence reported (tests/orchestrator/test_batched.py), and the forward against
transformers' own, through every cache operation (tests/workers/test_forward.py).

The forward runs where the model's weights are, CPU or CUDA (`DEVICES`), in the model's
dtype: the slot buffers, indices and masks are made on that device, and the logits come
back to the CPU in one copy per forward (tests/workers/test_batched_devices.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from polyspec.workers.tiers.block_linear import linear_of, pack
from polyspec.workers.tiers.fp8_linear import Fp8Linear
from polyspec.workers.core.context import Synced
from polyspec.workers.tiers.weight_only import WeightOnlyLinear

GPU_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

DEFAULT_SLOTS = 64  # a pool's slots where its caller sets no bound (batching.max_requests' default)
DEFAULT_CONTEXT = 4096  # positions a slot holds for a model that names no context (its rotary table's length)
INITIAL_CAPACITY = 128  # a slot's recorded features (keep_features) are a buffer grown by doubling from this
CUDA_POOL_SHARE = 0.8  # of the GPU memory free when a KV pool is made (ragged or device round), the most the pools take ...
CUDA_HEADROOM = 2 << 30  # ... less this, for the steps' activations and the CUDA graphs
# a CPU pool's mapping: private anonymous memory, zero until written and backed page by page as it is
# (Linux: MAP_NORESERVE, no swap committed up front; macOS commits lazily as it is); None: no such mappings
LAZY_MAP_FLAGS = ((mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_NORESERVE", 0x4000) if sys.platform.startswith("linux") else 0))
                  if hasattr(mmap, "MAP_ANONYMOUS") else None)
GATHER_SPAN_RATIO = 2  # rows spread over more than this many times their number of slots: gather instead of slicing
DEVICES = ("cpu", "cuda")  # where the batched forward runs (every tensor of a forward is made on the model's device)


ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def linear_function(module):
    """`module(x)` without the module call, for a float `Linear`, a dynamically quantized int8 `Linear`, an
    `Fp8Linear` or a weight-only int4 / int8 one; None for any other module (this forward does not cover it)."""
    if isinstance(module, (Fp8Linear, WeightOnlyLinear)):
        return module.forward  # its own forward, without nn.Module's call overhead
    if isinstance(module, torch.nn.Linear):
        # a float weight only: bitsandbytes' int4 / int8 layers subclass `Linear` with packed integer weights
        return linear_of(module) if module.weight.is_floating_point() else None
    packed = getattr(module, "_packed_params", None)
    if packed is not None and getattr(packed, "dtype", None) == torch.qint8 and getattr(module, "version", 4) >= 4:
        params = packed._packed_params
        op = torch.ops.quantized.linear_dynamic.default  # the overload itself: no per-call dispatch checks in Python
        # and its C++ function: `OpOverload.__call__` first walks the arguments in Python for the fake script objects
        # only tracing passes (a few microseconds a call: a tenth of an int8 drafter's one-token forward)
        call = op._op

        def linear(x: torch.Tensor) -> torch.Tensor:
            out = op(x, params, True) if torch.compiler.is_compiling() else call(x, params, True)
            return out if x.dtype == torch.float32 else out.to(x.dtype)

        return linear
    return None


def layer_projections(layer) -> tuple:
    """A decoder layer's seven projections, in the order the forward keeps them."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def projections(model) -> list:
    """Every projection the forward calls: the LM head and each layer's seven."""
    return [model.lm_head] + [m for layer in model.model.layers for m in layer_projections(layer)]


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding attention window (None: it attends over the whole context). Qwen2 and
    Gemma-style configs name each layer's kind (`layer_types`); Mistral's window covers every layer."""
    window = getattr(config, "sliding_window", None) or None
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def unsupported(model, device: torch.device) -> str | None:
    """Why the forward cannot compute this model's logits on `device` (None: it can)."""
    config = getattr(model, "config", None)
    architecture = type(model).__name__
    if config is None or architecture not in ARCHITECTURES:
        return f"architecture {architecture} is not one polyspec runs ({', '.join(ARCHITECTURES)})"
    if device.type not in DEVICES:
        return f"device {device.type} is not one polyspec runs ({', '.join(DEVICES)})"
    rope = getattr(config, "rope_parameters", None) or {}
    heads = config.num_attention_heads
    # Llama's projections are bias-free unless attention_bias; Qwen2's q / k / v always carry biases
    if rope.get("rope_type", "default") != "default" or getattr(model.model.rotary_emb, "attention_scaling", 1.0) != 1.0:
        return f"scaled rotary embeddings ({rope.get('rope_type')}) are not supported"
    if architecture != "Qwen2ForCausalLM" and getattr(config, "attention_bias", False):
        return "attention biases are not supported"
    if getattr(config, "mlp_bias", False) or config.hidden_act != "silu":
        return f"an MLP with biases or a {config.hidden_act} activation is not supported"
    if heads % (getattr(config, "num_key_value_heads", None) or heads) or getattr(config, "pretraining_tp", 1) != 1:
        return "this attention head layout is not supported"
    if any(linear_function(m) is None for m in projections(model)):
        return "a projection of a kind the forward cannot call (bitsandbytes or another quantizer's layers)"
    return None


def step_unsupported(model, device: torch.device) -> str | None:
    """Why the static step (`BatchedLlama.step`: the round that stays on the device) cannot run this model on `device`
    (None: it can): what the forward does not cover, sliding windows, or int8 layers on CUDA."""
    why = unsupported(model, device)
    if why is not None:
        return why
    if any(layer_windows(model.config)):
        return "sliding-window layers are not run by the static step"
    if device.type != "cpu" and not all(isinstance(m, Fp8Linear) or (type(m) is torch.nn.Linear and m.weight.is_floating_point())
                                        for m in projections(model)):
        return "its quantized layers run on the CPU only"
    return None


def cuda_pool_budget(device) -> tuple[int, int]:
    """(the bytes KV pools allocated outright on this CUDA device may take, the bytes free there now)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * CUDA_POOL_SHARE) - CUDA_HEADROOM, free


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm`, bit for bit (`weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)`), in one
    kernel for the normalisation instead of five, and float32 with its weight in that one kernel (tests/workers/
    test_forward.py checks both against the five ops; in float16 the one kernel rounds the weight's product differently)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], None, eps).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, folded_sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] turned by its positions' angles: transformers' `x * cos + rotate_half(x) * sin`, bit for bit, with
    rotate_half's negation of the second half folded into the table (`folded_sin` = cat(-sin[:D/2], sin[D/2:]),
    exact, as negation is), so the halves are only swapped: one op instead of rotate_half's four."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * folded_sin)


def causal_mask(cache_at: torch.Tensor, span: int) -> torch.Tensor:
    """[B, 1, W, span] bool: query (b, j), cached at position `cache_at[b, j]` ([B, W]), sees positions 0 .. that one."""
    return (torch.arange(span, device=cache_at.device)[None, None, :] <= cache_at[:, :, None])[:, None]


def grouped_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """SDPA of q [B, heads, T, D] over key / value [B, kv_heads, S, D] (grouped-query attention:
    query head h reads key / value head h // groups) under a boolean mask [B, 1, T, S] (None: every query sees every key); [B, heads, T, D].

    Each group's queries are stacked as rows of their key / value head ([B, kv_heads, groups * T, D],
    the mask repeated to match) instead of copying every key / value head `groups` times, as
    transformers' `repeat_kv` does: on the CPU that copy (Qwen2.5-1.5B: 6 copies, 12 MB per layer at
    300 positions for 4 rows in float32) and the attention over it cost as much as the layer's
    projections in an int8 forward. The products per (query, key) pair are the same; a kernel may
    sum them in another order for the taller query block, so logits differ from the copying form's
    in the last bits at most (tests/workers/test_batched_devices.py)."""
    rows, heads, width, head_dim = q.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups == 1:
        return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling)
    stacked = q.reshape(rows, kv_heads, groups * width, head_dim)  # row g * T + t: query head kv * groups + g, token t
    attn = F.scaled_dot_product_attention(stacked, key, value, attn_mask=None if mask is None else mask.repeat(1, 1, groups, 1), dropout_p=0.0, scale=scaling)
    return attn.view(rows, heads, width, head_dim)


@dataclasses.dataclass
class PendingTree:
    """A slot holding tree nodes after its linear context: not a linear continuation until a path is kept."""

    prefix_len: int  # linear context length the tree hangs off
    node_slots: dict[int, int]  # node index -> cache position, for nodes fed so far


@dataclasses.dataclass
class RowLayout:
    """A row's new tokens as a tree: their rotary positions and which of the slot's positions
    (cached and new, [len(positions), start + len(positions)]) each may attend to."""

    positions: list[int]
    allowed: torch.Tensor
    # the rotary position of each of the slot's positions the row may see (a sliding-window layer's distance
    # is in positions, and a tree node's is its prefix length + depth); None: the cache index
    key_positions: list[int] | None = None


class SlotCache:
    """The KV entries of many sequences of one tier, one slot each, with exact per-sequence rollback."""

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, limit: int | None, max_slots: int | None = None,
                 device: torch.device | str = "cpu", margin: int = 1, scratch: bool = False) -> None:
        """`margin`: positions a slot holds past the context (the ragged forward's junk column; a step's widest block);
        `scratch`: one slot more than `max_slots`, which a step's padding rows write (`scratch_slot`)."""
        self.shape = (layers, heads, head_dim)
        self.margin, self.scratch = margin, scratch
        self.dtype = dtype
        self.device = torch.device(device)  # the model's: the buffers live beside its weights
        self.limit = limit
        self.max_slots = max_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = 0  # the pool's, once allocated (`allocate`)
        self.capacity = 0  # positions a slot holds: the model context and one junk column for padding
        self._mappings: list[mmap.mmap] = []  # the CPU pool's memory: the tensors are views of it
        self.tokens: list[list[int] | None] = []  # per slot: the token at each cached position (None: free)
        self.slot_of: dict[object, int] = {}
        self.pending: dict[int, PendingTree] = {}  # slot -> its unverified tree
        self.synced: dict[int, Synced] = {}  # slot -> the context it last synced to (`agreed`)
        # keep_features: every forward also records the last hidden state (after the final norm, what
        # the LM head reads) of each position it writes, per slot [positions, H] float32, rolled back
        # and compacted with the KV (a feature drafter reads them: BatchedModelTier.features)
        self.keep_features = False
        self.features: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------- sequences

    def slot(self, seq_id) -> int:
        """The slot of `seq_id`, taking the lowest free one for a new sequence."""
        slot = self.slot_of.get(seq_id)
        if slot is not None:
            return slot
        free = next((s for s, held in enumerate(self.tokens) if held is None), None)
        if free is None:
            bound = self.slots if self.keys else (self.max_slots or DEFAULT_SLOTS)
            if len(self.tokens) >= bound:
                raise RuntimeError(f"all {bound} cache slots are in use")
            free = len(self.tokens)
            self.tokens.append(None)
        self.tokens[free] = []
        self.synced[free] = Synced()
        self.slot_of[seq_id] = free
        return free

    def release(self, seq_id) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.tokens[slot] = None
            self.synced.pop(slot, None)
            self.pending.pop(slot, None)
            self.features.pop(slot, None)
            while self.tokens and self.tokens[-1] is None:
                self.tokens.pop()

    def length(self, slot: int) -> int:
        return len(self.tokens[slot])

    def truncate(self, slot: int, length: int) -> None:
        del self.tokens[slot][length:]

    def drop_tree(self, slot: int) -> None:
        """Cut an unaccepted tree's nodes off the slot (they are not a linear continuation)."""
        pending = self.pending.pop(slot, None)
        if pending is not None:
            self.truncate(slot, min(pending.prefix_len, self.length(slot)))

    @torch.inference_mode()  # the buffers are inference tensors
    def keep(self, slot: int, positions: list[int]) -> None:
        """Keep only the slot's `positions` (strictly increasing), packed to the front."""
        if positions == list(range(len(positions))):
            self.truncate(slot, len(positions))
            return
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        count = len(positions)
        for k, v in zip(self.keys, self.values):
            k[slot, :, :count] = k[slot].index_select(1, index)
            v[slot, :, :count] = v[slot].index_select(1, index)
        cached = self.tokens[slot]
        self.tokens[slot] = [cached[p] for p in positions]
        features = self.features.get(slot)
        if features is not None:  # kept on the CPU, as ModelTier keeps them
            features[:count] = features.index_select(0, index.cpu())

    def accept_path(self, seq_id, path: list[int]) -> None:
        """After a tree verdict keep the linear context and the accepted path's nodes (node
        indices, root to leaf; a drafter stops at the last node it fed), in order."""
        slot = self.slot_of.get(seq_id)
        pending = None if slot is None else self.pending.pop(slot, None)
        if pending is None:
            return  # chains roll back at the next sync
        kept = list(range(pending.prefix_len))
        for node in path:
            if node not in pending.node_slots:
                break
            kept.append(pending.node_slots[node])
        self.keep(slot, kept)

    def store_features(self, slot: int, start: int, hidden: torch.Tensor) -> None:
        """Record the hidden states [T, H] of the slot's positions start.. (a CPU buffer, grown by doubling)."""
        end = start + hidden.shape[0]
        buffer = self.features.get(slot)
        if buffer is None or buffer.shape[0] < end:
            size = max(end, INITIAL_CAPACITY, 2 * (0 if buffer is None else buffer.shape[0]))
            grown = torch.empty(size, hidden.shape[-1], dtype=torch.float32)
            if buffer is not None:
                grown[:start] = buffer[:start]
            self.features[slot] = buffer = grown
        buffer[start:end] = hidden.float()

    def agreed(self, slot: int, context, sync: bool = True) -> int:
        """The longest common prefix of the slot's tokens and `context` (a `Context`: only what lies past the committed
        tokens the slot last synced to is compared). `sync`: the slot is about to keep that much and be written with
        the rest."""
        return self.synced[slot].agreed(self.tokens[slot], context, remember=sync)

    @property
    def open_sequences(self) -> int:
        return len(self.slot_of)

    def bytes_per_slot(self, hidden_size: int = 0) -> int:
        """A slot's KV entries at the model context, plus its recorded features (`hidden_size` floats per
        position) where kept."""
        layers, heads, head_dim = self.shape
        width = torch.tensor([], dtype=self.dtype).element_size()
        positions = self.limit or self.capacity
        return 2 * layers * heads * head_dim * positions * width + (4 * hidden_size * positions if self.keep_features else 0)

    # ------------------------------------------------------------- buffers

    def allocate(self) -> None:
        """Make the pool, once: `max_slots` slots (DEFAULT_SLOTS where unbounded; and the scratch slot) of the model
        context and its margin (a padding column of a row near the context's end is written there)."""
        if self.keys:
            return
        # the ragged forward's buffers are inference tensors (it runs in inference mode); a step's are plain tensors, so
        # that a step may also be compiled or captured outside it
        with torch.inference_mode(not self.scratch):
            self._allocate()

    def _allocate(self) -> None:
        layers, heads, head_dim = self.shape
        slots = self.max_slots or DEFAULT_SLOTS
        capacity = (self.limit or DEFAULT_CONTEXT) + self.margin
        width = torch.tensor([], dtype=self.dtype).element_size()
        if self.device.type == "cuda":  # real memory at once: as many slots as fit what the card has free
            budget, free = cuda_pool_budget(self.device)
            per_slot = 2 * layers * heads * capacity * head_dim * width
            if budget < per_slot * (slots + self.scratch if self.scratch else 1):
                wanted = f"{slots} requests' KV caches" if self.scratch else "one request's KV cache"
                raise RuntimeError(f"{wanted} at {capacity} positions ({per_slot * (slots if self.scratch else 1) / 2**20:.0f} MB) "
                                   f"do not fit the GPU's free memory ({free / 2**20:.0f} MB)")
            if not self.scratch:  # a step's pool holds exactly its slots; a ragged one as many as fit
                slots = min(slots, budget // per_slot)
        shape = (slots + self.scratch, heads, capacity, head_dim)
        self.keys = [self._zeros(shape, width) for _ in range(layers)]
        self.values = [self._zeros(shape, width) for _ in range(layers)]
        self.slots, self.capacity = slots, capacity

    @property
    def scratch_slot(self) -> int:
        """The slot a step's padding rows write (a pool made with `scratch`)."""
        return self.slots

    def _zeros(self, shape: tuple[int, ...], width: int) -> torch.Tensor:
        if self.device.type != "cpu" or LAZY_MAP_FLAGS is None:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        size = width * math.prod(shape)
        try:
            mapping = mmap.mmap(-1, size, flags=LAZY_MAP_FLAGS)
        except OSError as error:
            raise RuntimeError(f"the KV pool's {size / 2**30:.1f} GiB of address space per layer could not be mapped "
                               f"({error.strerror}); set batching.max_requests or kv_memory_mb lower") from None
        self._mappings.append(mapping)
        return torch.frombuffer(mapping, dtype=torch.uint8).view(self.dtype).view(shape)

    def reserve(self, slots: int, length: int) -> None:
        """Check that `slots` slots of `length` positions fit the pool (allocating it at the first call)."""
        self.allocate()
        if slots > self.slots:
            raise RuntimeError(f"all {self.slots} cache slots are in use")
        if length >= self.capacity:
            raise RuntimeError(f"a context of {length} tokens does not fit the model's {self.capacity - 1} positions")


class BatchedLlama:
    """`LlamaForCausalLM` logits for ragged rows of many sequences, on a `SlotCache`."""

    @staticmethod
    def supports(model, device: torch.device) -> bool:
        return unsupported(model, torch.device(device)) is None

    def __init__(self, model) -> None:
        config, base = model.config, model.model
        # large projections move to oneDNN where it verifies a block faster (block_linear);
        # a head tied to the embedding keeps the dense tensor the embedding reads
        for layer in base.layers:
            for module in layer_projections(layer):
                pack(module)
        pack(model.lm_head, keep_dense=model.lm_head.weight is base.embed_tokens.weight)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.limit = getattr(config, "max_position_embeddings", None)
        self.embed = base.embed_tokens.weight.detach()
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.layers = []
        for layer in base.layers:
            q, k, v, o, gate, up, down = (linear_function(m) for m in layer_projections(layer))
            self.layers.append((layer.input_layernorm.weight.detach(), q, k, v, o, layer.post_attention_layernorm.weight.detach(), gate, up, down,
                                layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon))
        self.windows = layer_windows(config)
        self.hidden_size = self.embed.shape[-1]
        self.vocab_size = config.vocab_size
        self.norm_weight, self.norm_eps = base.norm.weight.detach(), base.norm.variance_epsilon
        self.lm_head = linear_function(model.lm_head)
        # transformers: freqs = position[..., None].float() * inv_freq; emb = cat(freqs, freqs); cos = emb.cos() * scaling
        inv_freq = base.rotary_emb.inv_freq.float()
        positions = torch.arange(self.limit or DEFAULT_CONTEXT, dtype=torch.long, device=inv_freq.device)  # beside the weights
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = base.rotary_emb.attention_scaling
        self.cos = (emb.cos() * scale).to(self.dtype)  # [P, D]
        sin = (emb.sin() * scale).to(self.dtype)
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [P, D], sign-folded for `rotary`

    def step(self, pool: SlotCache, ids: torch.Tensor, rotary: torch.Tensor, write_at: torch.Tensor, slots: torch.Tensor, span: int,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The static-shape forward: every argument's shape is fixed by its bucket and nothing here reads a tensor's
        value on the host, so a step replays as a CUDA graph (or compiles whole). Row b writes its T tokens `ids`
        [B, T] (rotary positions `rotary` [B, T]) into slot `slots[b]` at `write_at` [B, T] and attends to that
        slot's first `span` positions: those at or before its own write position (`mask` None), or as `mask`
        [B, 1, T, span] says (a tree row's). Padding rows write the pool's scratch slot, padding columns past a
        row's tokens (inside the slot's margin: overwritten when real tokens get there). Returns (logits
        [B, T, V] and the last hidden states after the final norm [B, T, H], what the LM head and a feature
        head read), in the model's dtype, on the device."""
        rows, width = ids.shape
        index = rotary.clamp_max(self.cos.shape[0] - 1)
        cos, sin = self.cos[index][:, :, None], self.sin[index][:, :, None]  # [B, T, 1, D]
        if mask is None:
            mask = causal_mask(write_at, span)  # [B, 1, T, span]
        write_slots = slots[:, None].expand(rows, width)  # [B, T]

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # [B, T, kv_heads, D] into [slot, :, position]
            pool.keys[layer][write_slots, :, write_at] = k
            pool.values[layer][write_slots, :, write_at] = v

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:  # [B, T, heads, D] -> [B, T, heads * D]
            key = pool.keys[layer][:, :, :span].index_select(0, slots)  # [B, kv_heads, span, D]: only the span is copied
            value = pool.values[layer][:, :, :span].index_select(0, slots)
            attn = grouped_attention(q.transpose(1, 2), key, value, mask, self.scaling)  # [B, heads, T, D]
            return attn.transpose(1, 2).reshape(rows, width, -1)

        normed = rms_norm(self.decoder(F.embedding(ids, self.embed), cos, sin, store, attend), self.norm_weight, self.norm_eps)
        return self.lm_head(normed), normed

    def new_cache(self, max_slots: int | None = None, context: int | None = None, margin: int = 1, scratch: bool = False) -> SlotCache:
        """The model's KV pool (allocated at its first forward): `max_slots` requests of `context` positions (default:
        the model's) and `margin` more; `scratch`: one slot more, for a step's padding rows (`step`)."""
        limit = self.limit if context is None else min(context, self.limit or context)
        return SlotCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, limit, max_slots, self.device, margin, scratch)

    def decoder(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store, attend) -> torch.Tensor:
        """The decoder layers over the input vectors `x` [*lead, H] (the ragged forward's packed tokens [N], or a
        step's [B, T]), with rotary tables `cos` / `sin` [*lead, 1, D] (`sin` sign-folded, as `rotary` takes it); the
        layers' output [*lead, H] (before the final norm). Where keys and values go and what a query attends to is the
        caller's: `store(layer, k, v)` writes a layer's new keys / values [*lead, kv_heads, D] into the KV pool,
        `attend(layer, q)` turns its queries [*lead, heads, D] into the attention output [*lead, heads * D]."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        for index, (w_in, q_proj, k_proj, v_proj, o_proj, w_post, gate, up, down, eps_in, eps_post) in enumerate(self.layers):
            h = rms_norm(x, w_in, eps_in)
            q = q_proj(h).view(shape)  # [*lead, heads, D]
            k = k_proj(h).view(shape)  # [*lead, kv_heads, D]
            v = v_proj(h).view(shape)
            q = rotary(q, cos, sin)
            k = rotary(k, cos, sin)
            store(index, k, v)
            x = x + o_proj(attend(index, q))
            h = rms_norm(x, w_post, eps_post)
            x = x + down(F.silu(gate(h)) * up(h))
        return x

    @torch.inference_mode()
    def forward(self, cache: SlotCache, slots: list[int], tokens: list[list[int]], outputs: list[int],
                layouts: list[RowLayout | None] | None = None, inputs: list[torch.Tensor] | None = None,
                raw: bool = False) -> list[torch.Tensor]:
        """Append `tokens[r]` to slot `slots[r]` for every row r (>= 1 token each, distinct slots).

        `outputs[r]`: logits are returned for row r's new positions from index `outputs[r]`
        on (len(tokens[r]) for none). `layouts[r]`: row r is a tree (None: a chain). Returns
        one [len(tokens[r]) - outputs[r], V] tensor per row, in the model's dtype, on the CPU
        (one copy for all rows: the tiers sample there, with their CPU generators, as the
        one-sequence tier does). Slot lengths and tokens are updated.

        A feature head's use: `inputs[r]` [len(tokens[r]), H] are row r's
        layer inputs instead of its tokens' embeddings (the tokens are still what the slot records);
        `raw`: each row's last layer output (before the final norm) at those positions instead of
        logits, [len(tokens[r]) - outputs[r], H], on the model's device.
        """
        rows = len(slots)
        starts = [cache.length(s) for s in slots]
        counts = [len(t) for t in tokens]
        width = max(counts)
        end = max(start + count for start, count in zip(starts, counts))
        cache.reserve(max(slots) + 1, end)
        device = self.device
        ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens], dtype=torch.long, device=device)  # [B, W]
        trees = [(r, layout) for r, layout in enumerate(layouts or ()) if layout is not None]
        # one chain row (a single request's round) on full-attention layers: its positions are a slice of the rotary
        # tables, its block is written as a slice of its slot, and its lone token needs no mask; on so small a model
        # as the demo family's the index and mask tensors a ragged batch needs cost as much as a layer
        single = rows == 1 and not trees and not any(self.windows) and end <= self.cos.shape[0]
        if single:
            start = starts[0]
            lo, hi, mode, packed = slots[0], slots[0] + 1, "view", False
            token_ids = ids  # `lead` below: (1, width)
            cos, sin = self.cos[start:end][None, :, None], self.sin[start:end][None, :, None]  # [1, W, 1, D]
            # the general path's causal mask, from the one row's positions
            masks = {None: None if width == 1 else causal_mask(torch.arange(start, end, device=device)[None], end)}  # [1, 1, W, end]
        else:
            start_t = torch.tensor(starts, dtype=torch.long, device=device)
            offsets = torch.arange(width, device=device)
            cache_at = start_t[:, None] + offsets[None, :]  # [B, W] where each new token is cached
            positions = cache_at
            if trees:  # tree nodes sit at prefix length + depth
                positions = cache_at.clone()
                for r, layout in trees:
                    positions[r, : counts[r]] = torch.tensor(layout.positions, dtype=torch.long, device=device)
            rotary_index = positions.clamp_max(self.cos.shape[0] - 1)  # padding may run past the table
            # query (r, j) sees its slot's positions 0 .. start_r + j (a tree row: its layout's)
            mask = causal_mask(cache_at, end)  # [B, 1, W, end]
            for r, layout in trees:
                mask[r, 0, : counts[r]] = False
                mask[r, 0, : counts[r], : starts[r] + counts[r]] = layout.allowed.to(device)
            lo, hi = min(slots), max(slots) + 1
            slot_t = torch.tensor(slots, dtype=torch.long, device=device)
            row_of = slot_t - lo
            if slots == list(range(lo, hi)):
                mode = "view"  # the rows are exactly a slot range: attend over a view of the buffers
            elif hi - lo <= GATHER_SPAN_RATIO * rows:
                mode = "span"  # a view of the slot range; slots not in this call are idle rows
            else:
                mode = "gather"  # few rows far apart: copy their slots
            # Ragged blocks (rows of different lengths): every operation but attention runs on the real
            # tokens only, packed one after the other ([N, ...], N = sum of the rows' lengths), and
            # attention on them scattered into the padded [B, W] layout. Padding a row of one token to
            # a drafted row's 5 cost the projections 5x that row's work. Rows of one length run padded-free as they are.
            packed = sum(counts) < rows * width
            masks = {None: None if rows == 1 and width == 1 and not trees else mask}  # a lone chain token sees all it has
            for window in set(self.windows) - {None}:  # sliding-window layers: keys within `window` positions of the query
                key_positions = torch.arange(end, device=device).expand(rows, end).clone()  # [B, end]
                for r, layout in trees:
                    if layout.key_positions is not None:
                        key_positions[r, : len(layout.key_positions)] = torch.tensor(layout.key_positions, device=device)
                near = (positions[:, :, None] - key_positions[:, None, :]) < window  # [B, W, end]
                masks[window] = mask & near[:, None]
            if mode == "span":
                for window, allowed in masks.items():
                    spread = torch.zeros(hi - lo, 1, width, end, dtype=torch.bool, device=device)
                    spread[:, :, :, 0] = True  # idle rows attend to something (their output is dropped)
                    spread[row_of] = allowed
                    masks[window] = spread
            if packed:
                real = torch.tensor([r * width + j for r in range(rows) for j in range(counts[r])], dtype=torch.long, device=device)
                # `lead` below: (N,) the packed real tokens
                token_ids, rotary_index = ids.view(-1)[real], rotary_index.view(-1)[real]  # [N]
                write_slots = slot_t.repeat_interleave(torch.tensor(counts, device=device), output_size=len(real))
                write_at = cache_at.view(-1)[real]  # real positions only: nothing is written past a row's block
            else:
                token_ids = ids  # `lead` below: (rows, width)
                write_slots = slot_t[:, None].expand(rows, width)
                write_at = cache_at.clamp_max(cache.capacity - 1)  # a row's padding past the context goes to the junk column
            cos = self.cos[rotary_index].unsqueeze(-2)  # [*lead, 1, D]
            sin = self.sin[rotary_index].unsqueeze(-2)
        if inputs is None:
            x = F.embedding(token_ids, self.embed)  # [*lead, H*D]
        else:  # packed: the rows one after the other; else every row is `width` long
            x = torch.cat(inputs) if packed else torch.stack(inputs)  # [*lead, H*D]
        def store(index: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [*lead, kv_heads, D]
            keys, values = cache.keys[index], cache.values[index]
            if single:
                keys[lo, :, starts[0]: starts[0] + width] = k[0].transpose(0, 1)  # [kv_heads, W, D]
                values[lo, :, starts[0]: starts[0] + width] = v[0].transpose(0, 1)
            else:
                keys[write_slots, :, write_at] = k  # into [slot, :, position]
                values[write_slots, :, write_at] = v

        def attend(index: int, q: torch.Tensor) -> torch.Tensor:  # q: [*lead, heads, D] -> [*lead, heads * D]
            keys, values, mask = cache.keys[index], cache.values[index], masks[self.windows[index]]
            if packed:
                q = q.new_zeros(rows * width, *q.shape[1:]).index_copy_(0, real, q).view(rows, width, -1, self.head_dim)
            q = q.transpose(1, 2)  # [B, heads, W, D]
            if mode == "gather":
                key = keys[:, :, :end].index_select(0, slot_t)
                value = values[:, :, :end].index_select(0, slot_t)
            else:
                key, value = keys[lo:hi, :, :end], values[lo:hi, :, :end]
                if mode == "span":
                    spread = q.new_zeros(hi - lo, *q.shape[1:])
                    spread[row_of] = q
                    q = spread
            if q.is_cuda:
                # not cuDNN attention: it builds an execution plan per new shape, and a batched
                # round's shapes change every step (KV length, ragged blocks): ~8 ms of host time a call
                with sdpa_kernel(GPU_ATTENTION):
                    attn = grouped_attention(q, key, value, mask, self.scaling)
            else:
                attn = grouped_attention(q, key, value, mask, self.scaling)
            if mode == "span":
                attn = attn[row_of]
            attn = attn.transpose(1, 2).reshape(rows * width, -1)
            return attn.index_select(0, real) if packed else attn.view(rows, width, -1)

        x = self.decoder(x, cos, sin, store, attend)
        for slot, row_tokens in zip(slots, tokens):
            cache.tokens[slot].extend(row_tokens)
        # where each row's tokens begin in x's rows
        first = list(itertools.accumulate(counts[:-1], initial=0)) if packed else [r * width for r in range(rows)]
        x = x.reshape(-1, x.shape[-1])
        if cache.keep_features:  # what the LM head reads, at every position written (the logits below stay as they were computed)
            normed = rms_norm(x, self.norm_weight, self.norm_eps).float().cpu()  # one copy for all rows
            for r, slot in enumerate(slots):
                cache.store_features(slot, starts[r], normed[first[r]: first[r] + counts[r]])
        wanted = [first[r] + j for r in range(rows) for j in range(outputs[r], counts[r])]
        if not wanted:
            return [torch.zeros(0, 0, dtype=x.dtype) for _ in range(rows)]
        if single:
            picked = x[outputs[0]:]  # [N, H*D], the same rows index_select copies below
        else:
            picked = x.index_select(0, torch.tensor(wanted, dtype=torch.long, device=device))  # [N, H*D]
        per_row = [max(0, c - o) for c, o in zip(counts, outputs)]
        if raw:
            return [picked] if single else list(picked.split(per_row))
        logits = self.lm_head(rms_norm(picked, self.norm_weight, self.norm_eps)).cpu()  # [N, V]
        return [logits] if single else list(logits.split(per_row))
