"""A GGUF file's header and tensor table, read in one pass without torch: what `quantize: gguf` loads
(polyspec.workers.tiers.gguf_file) and what `polyspec validate` sizes a model from, before any model library
loads. The tensors stay in the file, mapped read-only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

QK_K = 256  # elements of a K-quant super-block

BLOCK_BYTES = {  # type -> (bytes per block, elements per block)
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, QK_K),
    "Q5_K": (176, QK_K),
    "Q6_K": (210, QK_K),
}


# ------------------------------------------------------------------------ reading the file


@dataclasses.dataclass(frozen=True)
class FileTensor:
    name: str
    qtype: str  # ggml's type name: Q4_K, F32, ...
    shape: tuple[int, ...]  # torch order (rows first): ggml lists the dimensions innermost first
    data: np.ndarray  # the tensor's bytes, a view of the mapped file

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return (int(np.prod(self.shape[:-1])), self.shape[-1])


def read_file(path: str, keys: set[str], tensors: bool = True) -> tuple[dict, dict[str, FileTensor]]:
    """(the metadata values of `keys`, every tensor by name) from one pass over the header, the file mapped
    read-only. gguf's GGUFReader decodes every field on the way (Qwen's 151k tokens and merges: ~8 s on
    this project's 2-core machine); this skips the values it is not asked for. `tensors` False: metadata
    only, the pass ending at the last of `keys` (a few early fields: under a millisecond, not the whole header's 0.4 s)."""
    import struct

    from gguf import GGMLQuantizationType, GGUFValueType

    scalars = {
        GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
        GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
        GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
    }
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    header = memoryview(mapped)
    offset = 0

    def read(fmt):
        nonlocal offset
        (out,) = struct.unpack_from(fmt, header, offset)
        offset += struct.calcsize(fmt)
        return out

    def string(keep: bool):
        nonlocal offset
        size = read("<Q")
        offset += size
        return bytes(header[offset - size : offset]).decode("utf-8", errors="replace") if keep else None

    def value(kind, keep: bool):
        nonlocal offset
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return string(keep)
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(read("<I")), read("<Q")
            if item in scalars and not keep:
                offset += count * struct.calcsize(scalars[item])
                return None
            return [value(item, keep) for _ in range(count)]
        return read(scalars[kind])

    if bytes(header[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    offset = 8
    n_tensors, n_fields = read("<Q"), read("<Q")
    found = {}
    alignment = 32
    for _ in range(n_fields):
        key = string(True)
        kept = value(read("<I"), key in keys or key == "general.alignment")
        if key == "general.alignment":
            alignment = int(kept)
        if key in keys:
            found[key] = kept
            if not tensors and len(found) == len(keys):
                return found, {}
    if not tensors:
        return found, {}
    infos = []
    for _ in range(n_tensors):
        name = string(True)
        dims = [read("<Q") for _ in range(read("<I"))]
        infos.append((name, GGMLQuantizationType(read("<I")).name, tuple(reversed(dims)), read("<Q")))
    start = (offset + alignment - 1) // alignment * alignment
    tensors = {}
    for name, qtype, shape, at in infos:
        elements = int(np.prod(shape))
        if qtype in BLOCK_BYTES:
            block_bytes, block = BLOCK_BYTES[qtype]
            size = elements // block * block_bytes
        elif qtype in ("F32", "F16", "BF16"):
            size = elements * (4 if qtype == "F32" else 2)
        else:
            size = 0  # a type polyspec does not read: the loader names it if a tensor it needs has it
        tensors[name] = FileTensor(name, qtype, shape, mapped[start + at : start + at + size])
    return found, tensors
