"""`quantize: int4` / `quantize: int8w`: weight-only quantized `Linear`s over torch's own kernels.

A decode step of a dense bf16 tier reads every weight once per token, so on a CPU it runs at
the memory's speed. Storing the weights in 4 or 8 bits and widening them inside the matrix
product reads 4x / 2x fewer bytes. The activations stay in the tier's dtype (bf16 or float32):
only the weights are rounded, once, at load.

Formats (the quantizers below, pure functions; the tests dequantize their output by hand):

- int8, per output channel, symmetric: `w ~ q * scale[n]`, `q` in [-127, 127],
  `scale = absmax(row) / 127`. Kernel: `torch.ops.aten._weight_int8pack_mm(x, q [N, K], scale [N])`.
- int4, per group of `group_size` consecutive inputs of one output channel, asymmetric:
  `w ~ (q - 8) * scale[n, g] + zero[n, g]`, `q` in [0, 15], with `scale = (max - min) / 15` and
  `zero = min + 8 * scale` (the group's range maps onto q's; gpt-fast's layout), scale and zero
  rounded to bfloat16 *before* `q` is chosen, so that `q` is the best for the values the kernel uses.
  CPU kernel: `_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [K/G, N, 2])`
  with `packed = _convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)`; CUDA:
  `_weight_int4pack_mm(x bf16, _convert_weight_to_int4pack(q nibble pairs uint8 [N, K/2], 8), ...)`.

The kernels pay for one row: on this project's 2-core EPYC (benchmarks/weight_only.md) one row
through int4 costs ~0.2x bf16's `F.linear`, int8 ~0.4-0.7x. But both widen the weights again for
every few rows of activations (dequantizing is compute): int4 costs ~2x its one-row time at 4 rows,
~4x at 8, ~100x at 512 (a prefill: ~6x bf16's `F.linear` there). A verified block of k tokens must not
cost k one-token forwards, so from a row count measured once per weight shape on the machine that runs
the model (`dense_rows`, `first_block_rows`) the forward takes the block path instead: the weights are
widened once, a cache-sized slice of output rows at a time, to the activations' dtype, and multiplied
with one dense GEMM per slice: bf16's cost plus one widening (int4: the widened weights are
`dequantize_int4(...)` rounded once to the activations' dtype, bit for bit, `widened_int4`). Both paths
compute the same function up to the rounding of the sums (tests/workers/test_weight_only.py bounds
both against a float32 reference and the block path's weights against `dequantize_int4` exactly).

Packing happens once, at load; the float weight is dropped. Not a `torch.nn.Linear` subclass on
purpose (as `Fp8Linear`): code that treats a `Linear` as a float weight must not take it for one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import torch
import torch.nn.functional as F

from polyspec.workers.tiers.block_linear import best_of

INT4_KINDS = ("int4",)
INT8_KINDS = ("int8w",)
KINDS = INT4_KINDS + INT8_KINDS
GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept
DEFAULT_GROUP_SIZE = 128
INT4_MID = 8  # q = 8 is the group's `zero`
INT8_MAX = 127
MIN_SCALE = 1e-8
NEVER = 1 << 30  # dense_rows for "always the kernel"
PROBE_ROWS = (2, 4, 8, 16, 32, 64, 128, 256, 512)  # row counts (blocks, batches, prompts: a prefill's hundreds) at which the kernel is timed against the block path
PROBE_REPEATS = 3  # best of
SLICE_BYTES = 8 << 20  # widened weights per slice of the block path (1-8 MiB measured alike on a 2 MiB-L2 Xeon; fewer ops matter on a shared machine)
PACK_ROWS = 4096  # rows packed per call at load: a multiple of any kernel block, so slices pack as the whole


# ------------------------------------------------------------------------------ quantizers


@dataclasses.dataclass(frozen=True)
class Int8Weights:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32


@dataclasses.dataclass(frozen=True)
class Int4Weights:
    q: torch.Tensor  # [N, K] uint8, values 0..15 (one per byte: the packing is the kernel's business)
    scale: torch.Tensor  # [N, K / group_size] bfloat16
    zero: torch.Tensor  # [N, K / group_size] bfloat16
    group_size: int


def quantize_int8_channels(weight: torch.Tensor) -> Int8Weights:
    """`weight` [N, K] per output channel, symmetric: |w - q * scale| <= scale / 2."""
    rows = weight.detach().float()
    scale = rows.abs().amax(dim=1).clamp_min(MIN_SCALE) / INT8_MAX  # [N]
    q = (rows / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weights(q, scale)


def quantize_int4_groups(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weights:
    """`weight` [N, K] group-wise, asymmetric (see the module doc). Rows in chunks: a 152k-row LM head
    in float32 at once would be gigabytes."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    groups = in_features // group_size
    q = torch.empty(out_features, in_features, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out_features, groups, dtype=torch.bfloat16, device=weight.device)
    zero = torch.empty_like(scale)
    for start in range(0, out_features, PACK_ROWS):
        rows = weight[start : start + PACK_ROWS].detach().float().reshape(-1, groups, group_size)  # [n, G, gs]
        low, high = rows.amin(dim=-1), rows.amax(dim=-1)  # [n, G]
        chunk_scale = ((high - low) / 15).clamp_min(MIN_SCALE).to(torch.bfloat16)
        chunk_zero = (low + INT4_MID * chunk_scale.float()).to(torch.bfloat16)
        levels = (rows - chunk_zero.float()[..., None]) / chunk_scale.float()[..., None] + INT4_MID
        q[start : start + PACK_ROWS] = levels.round().clamp(0, 15).to(torch.uint8).reshape(-1, in_features)
        scale[start : start + PACK_ROWS], zero[start : start + PACK_ROWS] = chunk_scale, chunk_zero
    return Int4Weights(q, scale, zero, group_size)


def dequantize_int8(weights: Int8Weights) -> torch.Tensor:
    return weights.q.float() * weights.scale[:, None]  # [N, K] float32


def dequantize_int4(weights: Int4Weights) -> torch.Tensor:
    out_features, in_features = weights.q.shape
    levels = weights.q.float().reshape(out_features, -1, weights.group_size) - INT4_MID  # [N, G, gs]
    return (levels * weights.scale.float()[..., None] + weights.zero.float()[..., None]).reshape(out_features, in_features)


# ------------------------------------------------------------------------ the CPU int4 layout


@functools.lru_cache(maxsize=None)
def cpu_int4_layout(out_features: int) -> tuple[int, torch.Tensor] | None:
    """How `_convert_weight_to_int4pack_for_cpu` lays out `out_features` rows: (block, order), where the
    packed bytes are blocks of `block` rows, each `[K, block / 2]` bytes, k-major, and nibble j of a
    k-row (byte j // 2, low nibble first) holds output row `block_start + order[j]`. None where the
    blocks are not all one size (the block path is then off; the kernel still runs).

    The layout depends on the CPU's vector width (64-row blocks with AVX-512, 32 with AVX2), so it is
    read off the kernel's own packing of a probe that encodes each row's index, not assumed."""
    probe_k = 64  # >= any block, so a row's block start is its first nibble's position // probe_k
    rows = torch.arange(out_features, dtype=torch.int64)
    code = torch.zeros(out_features * probe_k, dtype=torch.int64)  # nibble position -> row * probe_k + k
    top = out_features * probe_k
    for shift in range(0, max(top - 1, 1).bit_length(), 4):
        digits = (((rows[:, None] * probe_k + torch.arange(probe_k)) >> shift) & 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digits, 1).reshape(-1)
        nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(-1).to(torch.int64)
        code |= nibbles << shift
    position = torch.empty_like(code)
    position[code] = torch.arange(code.numel())
    position = position.reshape(out_features, probe_k)
    sizes = position[:, 1] - position[:, 0]  # a row's block size: the stride between its k and k + 1
    block = int(sizes[0])
    if not bool((sizes == block).all()) or out_features % block:
        return None
    starts = position[:, 0] // probe_k  # the block's first row
    order = rows - starts  # row offset inside its block ...
    nibble = position[:, 0] % probe_k  # ... at this nibble of the k-row
    block_order = torch.empty(block, dtype=torch.int64)
    block_order[nibble[:block]] = order[:block]
    if not bool((nibble.reshape(-1, block).sort(dim=1).values == torch.arange(block)).all()):
        return None
    expected = block_order[nibble]
    if not torch.equal(expected, order):
        return None
    return block, block_order


def split_halves(block: int, order: torch.Tensor) -> bool:
    """Whether byte j of a packed k-row holds row j in its low nibble and row j + block / 2 in its high
    one (what torch's AVX-512 packing does): then splitting the bytes' nibbles into two halves gives the
    block's rows in order, and the block path widens without a gather. Other layouts keep the kernel."""
    half = block // 2
    expected = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)
    return block % 2 == 0 and torch.equal(order, expected)


def _wide_dtype(half: int) -> torch.dtype:
    """The widest element that a half-block's `half` bytes are a whole number of (for the transposing copy)."""
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16):
        if half % dtype.itemsize == 0:
            return dtype
    return torch.uint8


# ------------------------------------------------------------------------------ the module


class WeightOnlyLinear(torch.nn.Module):
    """`y = x W^T + b` with W stored as int4 (group-wise) or int8 (per channel); see the module doc.

    `forward(x)` takes `[..., in_features]` in bf16 / float32 and returns the same dtype.
    Below `dense_rows` rows it calls the quantized kernel; from there on it widens W once per slice."""

    def __init__(self, kind: str, in_features: int, out_features: int, bias: torch.Tensor | None, group_size: int | None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown weight-only kind {kind!r} (known: {', '.join(KINDS)})")
        self.kind, self.in_features, self.out_features, self.group_size = kind, in_features, out_features, group_size
        self.register_buffer("bias", bias)
        self.dense_rows = NEVER
        self._scales_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self._block = None  # int4 on the CPU: the packing's block of rows, where the block path can widen it (`split_halves`)

    # -- construction

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear, kind: str, group_size: int = DEFAULT_GROUP_SIZE) -> WeightOnlyLinear:
        weight = linear.weight
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if kind in INT8_KINDS:
            return cls.from_int8(quantize_int8_channels(weight), bias)
        return cls.from_int4(quantize_int4_groups(weight, group_size), bias)

    @classmethod
    def from_int8(cls, weights: Int8Weights, bias: torch.Tensor | None) -> WeightOnlyLinear:
        out_features, in_features = weights.q.shape
        module = cls("int8w", in_features, out_features, bias, None)
        module.register_buffer("weight", weights.q.contiguous())  # [N, K] int8
        module.register_buffer("scale", weights.scale)  # [N] float32; the kernel gets it in the activations' dtype
        return module

    @classmethod
    def from_int4(cls, weights: Int4Weights, bias: torch.Tensor | None) -> WeightOnlyLinear:
        out_features, in_features = weights.q.shape
        module = cls("int4", in_features, out_features, bias, weights.group_size)
        device = weights.q.device
        scales_and_zeros = torch.stack((weights.scale, weights.zero), dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
        module.register_buffer("scales_and_zeros", scales_and_zeros)
        if device.type == "cuda":
            pairs = (weights.q[:, ::2] << 4 | weights.q[:, 1::2]).contiguous()  # [N, K/2] uint8, high nibble first
            module.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack(pairs, 8))
            return module
        packed = [
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.q[start : start + PACK_ROWS].to(torch.int32), 1)
            for start in range(0, out_features, PACK_ROWS)
        ]
        module.register_buffer("weight", torch.cat(packed) if len(packed) > 1 else packed[0])  # [N, K/2] uint8
        layout = cpu_int4_layout(out_features)
        if layout is not None and split_halves(*layout):
            module._block = layout[0]
        return module

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        dense = "never" if self.dense_rows >= NEVER else str(self.dense_rows)
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}{group}, bias={self.bias is not None}, dense from {dense} rows"

    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # -- forward

    def _scales(self, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's scales in the activations' dtype (it wants them equal), converted once per dtype."""
        source = self.scale if self.kind in INT8_KINDS else self.scales_and_zeros
        if source.dtype == dtype:
            return source
        if dtype not in self._scales_by_dtype:
            self._scales_by_dtype[dtype] = source.to(dtype)
        return self._scales_by_dtype[dtype]

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through the quantized kernel (no bias). On the CPU float32 activations are
        rounded to bfloat16 for it: both kernels' float32 paths measured 25-50x slower than their bf16 path."""
        if x.dtype == torch.float32 and not x.is_cuda:
            return self.kernel(x.to(torch.bfloat16)).float()
        if self.kind in INT8_KINDS:
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self._scales(x.dtype))
        if x.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.weight, self.group_size, self._scales(x.dtype))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group_size, self._scales(x.dtype))

    def block_path(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] with W widened to x's dtype once, a cache-sized slice of output rows at a time,
        and one dense GEMM per slice (`x @ W^T[:, slice]`, float32 sums: the slow reference's arithmetic)."""
        if self.kind in INT8_KINDS:
            rows = max(1, SLICE_BYTES // (2 * self.in_features))
            outs = [F.linear(x, self.weight[start : start + rows].to(x.dtype)) for start in range(0, self.out_features, rows)]
            out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
            return out * self._scales(x.dtype)
        if self._block is None:
            return self.kernel(x)
        block = self._block
        blocks_per_slice = max(1, SLICE_BYTES // (2 * self.in_features * block))
        outs = [x @ self.widened_int4(start, blocks_per_slice, x.dtype) for start in range(0, self.out_features // block, blocks_per_slice)]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    def widened_int4(self, first_block: int, blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, n] in `dtype` for the output rows of `blocks` packed blocks from `first_block` on (CPU int4
        with the split-halves layout, see `split_halves`): `(q - 8) * scale + zero` computed in float32 and
        rounded once, as `dequantize_int4(...).to(dtype)` rounds it. The passes over the weights are all over
        contiguous memory in K-major order except the one transposing copy, which moves whole half-blocks
        (16-byte elements): torch's elementwise kernels are slow on short strided runs, this keeps them fast."""
        block, in_features = self._block, self.in_features
        half = block // 2
        packed = self.weight.view(-1, in_features, half)[first_block : first_block + blocks]  # [nb, K, half] bytes
        blocks = packed.shape[0]
        wide = _wide_dtype(half)
        low, high = (packed & 15).view(wide), (packed >> 4).view(wide)  # [nb, K, half/w]: rows 0..half-1, half..block-1
        levels = torch.empty(in_features, blocks, block, dtype=torch.uint8)  # W^T's levels, K-major: [K, nb, block]
        split = levels.view(wide)
        step = split.shape[-1] // 2
        split[..., :step].copy_(low.transpose(0, 1))
        split[..., step:].copy_(high.transpose(0, 1))
        levels = levels.sub_(INT4_MID).view(torch.int8)  # q - 8, wrapped: exact in int8
        groups = in_features // self.group_size
        widened = levels.to(dtype).view(groups, self.group_size, blocks * block)
        scales = self._scales(dtype)  # [G, N, 2]: (scale, zero)
        columns = slice(first_block * block, (first_block + blocks) * block)
        # [G, 1, n] each, contiguous: 1/group_size of the weights' size to copy, and an interleaved (stride 2)
        # operand measured ~3x slower in addcmul
        scale, zero = scales[:, None, columns, 0].contiguous(), scales[:, None, columns, 1].contiguous()
        torch.addcmul(zero, widened, scale, out=widened)
        return widened.view(in_features, blocks * block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = self.block_path(rows) if rows.shape[0] >= self.dense_rows else self.kernel(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


# ------------------------------------------------------------------ choosing the block path


_dense_rows: dict[tuple, int] = {}


@torch.inference_mode()
def measured_dense_rows(module: WeightOnlyLinear, dtype: torch.dtype) -> int:
    """The fewest rows from which the block path beats the kernel on this machine (NEVER: it does not
    up to PROBE_ROWS' largest, or the block path is off). Measured once per shape, kind, dtype and
    thread count, at load (`first_block_rows`). `POLYSPEC_WEIGHT_ONLY_BLOCK=kernel` / `=dense` skip the measurement."""
    mode = os.environ.get("POLYSPEC_WEIGHT_ONLY_BLOCK", "auto")
    device = module.weight.device
    if mode == "kernel" or device.type != "cpu" or (module.kind in INT4_KINDS and module._block is None):
        return NEVER
    if mode == "dense":
        return 1
    key = (module.kind, module.out_features, module.in_features, module.group_size, dtype, torch.get_num_threads())
    if key not in _dense_rows:
        _dense_rows[key] = first_block_rows(module, dtype)
    return _dense_rows[key]


def first_block_rows(module: WeightOnlyLinear, dtype: torch.dtype, probe_rows=PROBE_ROWS, repeats: int = PROBE_REPEATS) -> int:
    """The row count from which the block path is measured faster than the kernel (NEVER: at none of `probe_rows`).

    The kernel widens the weights again for every few rows, so its cost grows with the rows; the block path
    widens them once, so its cost is nearly flat (its floor: the widening) until the GEMM dominates. The floor
    is timed once, at the fewest rows; a row count where the kernel costs no more than that floor is the
    kernel's without timing the block path there. Past the switch the kernel's cost grows faster than the
    block path's, so the probe stops at the first row count the block path wins, and wins again at the next
    (then bisects back toward the last one the kernel won, to an eighth of the rows): it runs up to the prefill sizes (512 rows) only for a
    shape whose kernel stays cheap that far."""
    def seconds(path, x) -> float:
        path(x)  # warm
        return best_of(lambda: path(x), repeats)

    most = torch.randn(probe_rows[-1], module.in_features, dtype=dtype)
    floor_s = seconds(module.block_path, most[: probe_rows[0]])

    def block_wins(rows: int) -> bool:
        kernel_s = seconds(module.kernel, most[:rows])
        if kernel_s <= floor_s:
            return False
        return (floor_s if rows == probe_rows[0] else seconds(module.block_path, most[:rows])) < kernel_s

    for index, rows in enumerate(probe_rows):
        if not block_wins(rows):
            continue
        # and confirmed at the next row count (where its lead only grows): on a shared machine one stalled timing of
        # the kernel could otherwise switch early, and every small block would then pay the whole widening, many
        # times the kernel's cost; a switch a probe late costs far less
        if index + 1 < len(probe_rows) and not block_wins(probe_rows[index + 1]):
            continue
        # between the last row count the kernel won and this one, bisected to an eighth: the switch sits near where
        # the two costs cross, so a forward's cost has a kink there, not a step (the planner's profile interpolates it)
        low, high = (probe_rows[index - 1] if index else rows), rows
        while high - low > max(1, high // 8):
            middle = (low + high) // 2
            low, high = (low, middle) if block_wins(middle) else (middle, high)
        return high
    return NEVER


SWITCH_CLUSTER = 1.25  # switch rows within this factor of a smaller one are priced as that one


def switch_rows(model: torch.nn.Module | None) -> tuple[int, ...]:
    """The row counts at which the weight-only Linears of `model` leave their kernel for the block path (sorted;
    none: no such Linear, or all keep the kernel). A forward's cost has a kink at each: the start-up profile
    measures there (orchestrator/tuning/profiler.py) instead of interpolating across it. Each shape bisects its
    own switch to an eighth, so a model's are many near one another: one within `SWITCH_CLUSTER` of a smaller
    one is left out (each kept one costs the profile up to two more forwards per batch)."""
    if model is None or not hasattr(model, "modules"):
        return ()
    kept: list[int] = []
    for rows in sorted({m.dense_rows for m in model.modules() if isinstance(m, WeightOnlyLinear) and m.dense_rows < NEVER}):
        if not kept or rows > kept[-1] * SWITCH_CLUSTER:
            kept.append(rows)
    return tuple(kept)


def quantize_weight_only(model: torch.nn.Module, kind: str, group_size: int = DEFAULT_GROUP_SIZE) -> torch.nn.Module:
    """Every float `Linear` of `model` replaced by its `WeightOnlyLinear`, in place, one at a time (the LM
    head too, also when it is tied to the embedding, which keeps its float table for the lookup: Qwen's
    152k-row head is the largest single read of a decode step; it always takes the kernel). A Linear that the format cannot take
    (int4: in_features not a multiple of group_size, out_features not of 16) stays float; the count
    of those is `model.weight_only_skipped`."""
    dtype = next(model.parameters()).dtype
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skipped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or not child.weight.is_floating_point():
                continue
            out_features, in_features = child.weight.shape
            if kind in INT4_KINDS and (in_features % group_size or out_features % 16):
                skipped += 1
                continue
            module = WeightOnlyLinear.from_linear(child, kind, group_size)
            # the LM head sees only the rows whose logits are wanted (a few per sequence), never a prompt's:
            # it keeps the kernel, and a 152k-row head's block path is not worth seconds of timing at load
            module.dense_rows = NEVER if child is head else measured_dense_rows(module, dtype)
            setattr(parent, name, module)
    model.weight_only_skipped = skipped
    return model
