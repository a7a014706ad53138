"""A GGUF file's quantized tensors as (integer levels, scale, offset) per group, and their mapping onto
polyspec's weight-only kernels (workers/tiers/weight_only.py) for `quantize: gguf`.

Every GGML block format here stores `w = scale[g] * level + offset[g]` for the `group` consecutive
inputs of a group; this module unpacks the levels, scales and offsets from the bytes (numpy, no
dequantized copy of the tensor) as `GroupedLevels`. Block layouts (ggml's, facts of the format):

| type | bytes / block | group | level     | scale        | offset          |
|------|---------------|-------|-----------|--------------|-----------------|
| Q4_0 | 18 / 32       | 32    | 0..15     | d            | -8 d            |
| Q4_1 | 20 / 32       | 32    | 0..15     | d            | m               |
| Q5_0 | 22 / 32       | 32    | 0..31     | d            | -16 d           |
| Q5_1 | 24 / 32       | 32    | 0..31     | d            | m               |
| Q8_0 | 34 / 32       | 32    | -128..127 | d            | 0               |
| Q4_K | 144 / 256     | 32    | 0..15     | d * sc (6b)  | -dmin * m (6b)  |
| Q5_K | 176 / 256     | 32    | 0..31     | d * sc (6b)  | -dmin * m (6b)  |
| Q6_K | 210 / 256     | 16    | -32..31   | d * sc (i8)  | 0               |

d, dmin and m are float16. scale and offset are exact in float32 (at most 11 + 8 significant bits),
so `scale * level + offset` computed in float64 and rounded once to float32 is bit-for-bit what
`gguf.quants.dequantize` returns (tests/workers/test_gguf_weights.py).

Onto the kernels (`unpack`, `int4_weights`, `int8_weights`):

- Q4_0, Q4_1, Q4_K: 16 levels in groups of 32 are the int4 kernel's group-32 asymmetric format,
  `w = (q - 8) * scale + zero`, with `q` = the file's level and `zero = offset + 8 * scale`. The levels
  are the file's, unchanged. The kernel holds scale and zero in bfloat16 (the activations' dtype), so
  those two numbers per group are rounded once: 8 significant bits instead of the file's 11-19
  (measured: benchmarks/gguf_weights.py, share of weights whose value moves and the logit difference).
- Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 (and float tensors): more than 16 levels or groups of 16 have no
  int4 form; they are re-quantized to int8 per output channel (`quantize_int8_channels` of the float32
  dequantized rows, a few thousand rows at a time): levels change wherever a group's scale is not the
  row's (measured the same way).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from polyspec.workers.tiers.gguf_header import BLOCK_BYTES, QK_K
from polyspec.workers.tiers.weight_only import Int4Weights, Int8Weights, quantize_int8_channels

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # map exactly onto group-32 int4 (levels unchanged)
INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F32", "F16", "BF16")  # re-quantized per channel
INT4_GROUP = 32
ROWS_PER_CHUNK = 4096  # rows dequantized at once when re-quantizing (a 152k-row head in float32 would be ~1 GB)


@dataclasses.dataclass(frozen=True)
class GroupedLevels:
    """One tensor, [rows, cols] (cols = the input dimension): `w[r, c] = scale[r, g] * levels[r, c] + offset[r, g]`
    with `g = c // group`."""

    levels: np.ndarray  # [rows, cols] int16
    scale: np.ndarray  # [rows, cols / group] float32
    offset: np.ndarray  # [rows, cols / group] float32
    group: int

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], each value rounded once from its exact float64 value (as ggml's own dequantizers)."""
        rows, cols = self.levels.shape
        levels = self.levels.reshape(rows, -1, self.group).astype(np.float64)
        exact = levels * self.scale[..., None].astype(np.float64) + self.offset[..., None].astype(np.float64)
        return exact.reshape(rows, cols).astype(np.float32)


def _f16(column: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb] float32 (little-endian float16, as ggml writes it)."""
    return np.ascontiguousarray(column).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] bytes of a 32-element block -> [nb, 32]: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per 256-block ([nb, 8] each).
    Sub-blocks 0-3 sit in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their
    low 4 bits from bytes 8-11 and their top 2 from the spare high bits of bytes 0-3 / 4-7."""
    low, high, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate((low & 63, (mixed & 15) | ((low >> 6) << 4)), axis=1)
    mins = np.concatenate((high & 63, (mixed >> 4) | ((high >> 6) << 4)), axis=1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _unpack_blocks(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """[nb, bytes] uint8 -> (levels [nb, block] int16, scale [nb, block/group] f32, offset [nb, block/group] f32, group)."""
    nb = blocks.shape[0]
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        with_min = qtype.endswith("_1")
        d = _f16(blocks[:, 0:2])
        at = 2
        m = None
        if with_min:
            m, at = _f16(blocks[:, 2:4]), 4
        if qtype.startswith("Q5"):
            high = np.ascontiguousarray(blocks[:, at : at + 4]).view("<u4").reshape(nb, 1)  # bit j: element j's fifth bit
            at += 4
        levels = _nibbles_32(blocks[:, at : at + 16]).astype(np.int16)
        if qtype.startswith("Q5"):
            levels |= (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
        mid = 16 if qtype.startswith("Q5") else 8
        offset = m if with_min else -mid * d
        return levels, d[:, None], offset[:, None], 32
    if qtype == "Q8_0":
        d = _f16(blocks[:, 0:2])
        levels = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.int16)
        return levels, d[:, None], np.zeros((nb, 1), np.float32), 32
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mins = _k_scale_min(blocks[:, 4:16])
        if qtype == "Q4_K":
            qh, qs = None, blocks[:, 16:144]
        else:
            qh, qs = blocks[:, 16:48], blocks[:, 48:176]
        # qs: 4 chunks of 32 bytes; chunk i's low nibbles are sub-block 2i, its high nibbles 2i + 1
        chunks = qs.reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        levels = (chunks & 15).reshape(nb, 8, 32).astype(np.int16)
        if qh is not None:  # Q5_K: bit j of qh[l] is the fifth bit of sub-block j's element l
            bits = (qh.reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            levels |= bits.astype(np.int16) << 4
        return levels.reshape(nb, QK_K), d[:, None] * sc, -(dmin[:, None] * mins), 32
    if qtype == "Q6_K":
        ql, qh, sc, d = blocks[:, 0:128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
        # two halves of 128; in each, ql's 64 bytes give low nibbles (elements 0-63) then high nibbles (64-127),
        # qh's 32 bytes give 2 bits for elements l, l+32, l+64, l+96 at shifts 0, 2, 4, 6
        low = (ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15  # [nb, 2, 2, 64]
        top = (qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3  # [nb, 2, 4, 32]
        levels = (low.reshape(nb, 2, 128) | (top.reshape(nb, 2, 128) << 4)).astype(np.int16) - 32
        scale = d[:, None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)  # [nb, 16]
        return levels.reshape(nb, QK_K), scale, np.zeros_like(scale), 16
    raise ValueError(f"GGUF tensor type {qtype} is not unpacked by polyspec (known: {', '.join(INT4_TYPES + INT8_TYPES)})")


def unpack(qtype: str, data: np.ndarray, shape: tuple[int, int]) -> GroupedLevels:
    """A quantized tensor's raw bytes (as `GGUFReader` maps them, [rows, bytes per row] or flat) -> GroupedLevels
    of `shape` = (rows, cols) (torch order: cols is the input dimension, ggml's first)."""
    rows, cols = shape
    raw = np.asarray(data).view(np.uint8).reshape(rows, -1)
    per_row = raw.shape[1]
    block_bytes, block = BLOCK_BYTES[qtype]
    if per_row * block != cols * block_bytes:
        raise ValueError(f"{qtype} tensor of {rows} x {cols}: {per_row} bytes per row, expected {cols // block * block_bytes}")
    levels, scale, offset, group = _unpack_blocks(qtype, raw.reshape(-1, block_bytes))
    return GroupedLevels(levels.reshape(rows, cols), scale.reshape(rows, -1), offset.reshape(rows, -1), group)


# ------------------------------------------------------------------------ onto the kernels


def float_rows(qtype: str, data: np.ndarray, shape: tuple[int, int], start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of a tensor dequantized to float32 (float types are read as they are)."""
    rows, cols = shape
    stop = rows if stop is None else stop
    raw = np.asarray(data)
    if qtype in ("F32", "F16", "BF16"):
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype]
        part = raw.view(dtype).reshape(rows, cols)[start:stop]
        if qtype == "BF16":
            return (part.astype(np.uint32) << 16).view(np.float32)
        return part.astype(np.float32)
    part = raw.view(np.uint8).reshape(rows, -1)[start:stop]
    return unpack(qtype, part, (stop - start, cols)).dequantize()


def int4_weights(levels: GroupedLevels, rows: np.ndarray | None = None) -> Int4Weights:
    """Q4_0 / Q4_1 / Q4_K levels as the int4 kernel's format: q = the file's level, zero = offset + 8 * scale;
    scale and zero rounded to bfloat16 (the kernel's). `rows`: an order of the output rows (llama's q/k)."""
    if levels.group != INT4_GROUP or levels.levels.min() < 0 or levels.levels.max() > 15:
        raise ValueError("only 16-level tensors in groups of 32 map onto the int4 kernel")
    q, scale, offset = levels.levels, levels.scale, levels.offset
    if rows is not None:
        q, scale, offset = q[rows], scale[rows], offset[rows]
    zero = offset.astype(np.float64) + 8 * scale.astype(np.float64)  # exact: rounded once, to bfloat16, below
    return Int4Weights(
        torch.from_numpy(np.ascontiguousarray(q.astype(np.uint8))),
        torch.from_numpy(np.ascontiguousarray(scale)).to(torch.bfloat16),
        torch.from_numpy(np.ascontiguousarray(zero)).to(torch.bfloat16),
        INT4_GROUP,
    )


def int8_weights(qtype: str, data: np.ndarray, shape: tuple[int, int], rows: np.ndarray | None = None) -> Int8Weights:
    """Any tensor re-quantized to int8 per output channel from its float32 values, ROWS_PER_CHUNK rows at a time."""
    n, k = shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, ROWS_PER_CHUNK):
        stop = min(n, start + ROWS_PER_CHUNK)
        part = quantize_int8_channels(torch.from_numpy(float_rows(qtype, data, shape, start, stop)))
        q[start:stop], scale[start:stop] = part.q, part.scale
    if rows is not None:
        index = torch.from_numpy(np.asarray(rows))
        q, scale = q[index].contiguous(), scale[index].contiguous()
    return Int8Weights(q, scale)


def maps_to_int4(qtype: str, shape: tuple[int, int]) -> bool:
    """Does this tensor take the int4 kernel with its own levels (the kernel wants out_features % 16 == 0)?"""
    return qtype in INT4_TYPES and shape[0] % 16 == 0 and shape[1] % INT4_GROUP == 0
