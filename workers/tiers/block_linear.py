"""Projections of a few rows at a time (a verified block) on the CPU.

`F.linear(x, W)` lowers to BLAS `sgemm(x, W^T)`. For one row that is a matrix-vector
product bound by reading W once; for the 2-17 rows of a verified block it should cost
barely more, since W is still read once. Some BLAS builds take a slow path for this skinny
shape instead: MKL on AMD processors, which it does not give its AVX2 kernels, costs about
one matrix-vector product per row and uses one thread for it, so verifying a block of k
tokens costs nearly k single-token forwards and speculation cannot pay. oneDNN (PyTorch's
`mkldnn` backend) has its own kernels for every x86 CPU and reads W once for the block.

oneDNN needs the weight in its own tensor type, a copy. Keeping both would double a
model's memory, so a weight that oneDNN serves better is moved: the oneDNN copy is kept on
the module (`PACKED`) and the dense weight is released (an LM head tied to the embedding
keeps its dense tensor, which the embedding reads). Weights that `from_pretrained` maps from
a safetensors file stay mapped as clean page cache, which the kernel reclaims under memory
pressure; only the oneDNN copies are the process's own memory. From then on the model runs only
through polyspec's forward (batched_llama), which every model tier uses.

Which backend is faster depends on the CPU, the BLAS and the thread count, so it is
measured once per weight shape, on the machine that runs the model, for a block and for one
row: oneDNN is taken where it is at least 15 % faster for a block and at most 25 % slower for
one row (a drafted chain's target verifies blocks; one-row forwards are its exception). Only large weights are considered: where a projection is small, Python overhead and
the conversions cost more than the kernel choice saves.

`POLYSPEC_BLOCK_LINEAR=blas` turns the choice off (always `F.linear`), `=onednn` takes
oneDNN for every large weight; unset or `auto` measures. Either way the numbers differ from
`F.linear`'s only in rounding (kernels sum in different orders), as a block's logits always
differ from one-row products' in rounding.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

PACKED = "polyspec_onednn_weight"  # attribute of a Linear whose weight moved to oneDNN
MIN_ELEMENTS = 1 << 21  # 8 MB of fp32
PROBE_ROWS = 6  # a typical verified block (k drafted tokens + 1)
PROBE_REPEATS = 5
BLOCK_GAIN = 0.85
ROW_LOSS = 1.25

_choices: dict[tuple, bool] = {}


def _mode() -> str:
    mode = os.environ.get("POLYSPEC_BLOCK_LINEAR", "auto")
    return mode if mode in ("blas", "onednn") else "auto"


def best_of(function, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `function`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def _measured_faster(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN (`packed`, the weight's oneDNN copy) beats `F.linear` for a block and stays
    close for one row, on this machine."""
    with torch.inference_mode():
        for rows, bound in ((PROBE_ROWS, BLOCK_GAIN), (1, ROW_LOSS)):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            blas = best_of(lambda: F.linear(x, weight), PROBE_REPEATS)
            onednn = best_of(lambda: torch.ops.aten.mkldnn_linear.default(x.to_mkldnn(), packed).to_dense(), PROBE_REPEATS)
            if onednn >= bound * blas:
                return False
    return True


def eligible(module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, torch.nn.Linear)
        and weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.numel() >= MIN_ELEMENTS
        and torch.backends.mkldnn.is_available()
    )


@torch.no_grad()
def pack(module, keep_dense: bool = False) -> None:
    """Move a large fp32 `Linear`'s weight to oneDNN where that measured faster (see the module doc).

    The verdict is kept per (shape, dtype, threads); the weight that measures a new shape
    lends its oneDNN copy to the measurement, so no weight is converted twice."""
    if getattr(module, PACKED, None) is not None or not eligible(module):
        return
    weight, packed, mode = module.weight, None, _mode()
    if mode == "auto":
        key = (tuple(weight.shape), weight.dtype, torch.get_num_threads())
        if key not in _choices:
            packed = weight.detach().to_mkldnn()
            _choices[key] = _measured_faster(weight, packed)
        faster = _choices[key]
    else:
        faster = mode == "onednn"
    if not faster:
        return
    setattr(module, PACKED, packed if packed is not None else weight.detach().to_mkldnn())
    if not keep_dense:
        module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def linear_of(module):
    """`module(x)` for a float `Linear`, through its oneDNN weight when `pack` moved it."""
    packed = getattr(module, PACKED, None)
    # detached: a step writes its KV pool in place and must never make it part of an autograd graph
    bias = None if module.bias is None else module.bias.detach()
    if packed is None:
        weight = module.weight.detach()
        return lambda x: F.linear(x, weight, bias)
    onednn_linear = torch.ops.aten.mkldnn_linear.default

    def linear(x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x.contiguous().to_mkldnn(), packed, bias).to_dense()

    return linear
