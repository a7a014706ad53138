"""`quantize: fp8`: a Linear whose weight is stored as float8 (e4m3) with one float32 scale per output channel.

The GPU middle tier of the paper's chain (target <- quantized copy of the target <- small
model). Weights are quantized once, at load, per output channel: `scale = absmax / 448`
(448 is e4m3's largest finite value), so each row's largest weight maps to +-448 and every
weight keeps e4m3's 3 mantissa bits relative to its own size:
`|dequantized - weight| <= |weight| / 16 + scale / 1024` (half a unit in the last place;
the second term covers e4m3's subnormals).

The forward takes one of two paths, fixed when the module is made (`Fp8Linear.from_linear`):

- fp8 GEMM (`torch._scaled_mm`), on a CUDA device of compute capability 8.9 or more where a
  probe call succeeds and both weight dimensions are multiples of 16 (`_scaled_mm` requires
  them). The activations are quantized on the fly with one scale per row (per token): the
  "row-wise" scaling of `_scaled_mm` takes `scale_a [M, 1]` and `scale_b [1, N]` (float32,
  contiguous), which is exactly this module's per-channel weight scale. Per-row rather than
  one per tensor so that a row's result does not depend on the other rows of its batch
  (the padding rows of a bucket, other requests). The output dtype is the tier's where
  `_scaled_mm` accepts it (bfloat16 always; float16 / float32 on newer builds), else
  bfloat16 cast to the tier's; the bias is added after, in the tier's dtype.
- weight-only everywhere else (CPU, GPUs before Ada / Hopper): the weight is dequantized to
  the activation dtype and multiplied with `F.linear`. It saves weight memory, not time (the
  dequantized copy is made in every call).

Neither path reads a tensor's value on the host or branches on one, so a forward can be
captured in a CUDA graph or compiled whole (`torch.compile(fullgraph=True)`).
tests/workers/test_quantized_forward.py checks the weight-only forward bit for bit against
a dequantization by hand (decoding the e4m3 bits), the round-trip bound above, and the
`_scaled_mm` path against the weight-only one on a GPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
MIN_SCALE = 1e-12  # an all-zero row (weight or activation) still gets a positive scale
GEMM_MULTIPLE = 16  # torch._scaled_mm needs both weight dimensions divisible by 16
GEMM_CAPABILITY = (8, 9)  # Ada and Hopper on: fp8 tensor cores


def fp8_problem(device: torch.device) -> str | None:
    """Why an fp8 tier cannot run on `device` (None: it can), as the end of one sentence."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"needs a torch with float8 dtypes (2.1 or later); this is torch {torch.__version__}"
    if device.type not in ("cpu", "cuda"):
        return f"runs on CPU or CUDA, not {device.type}"
    try:
        torch.ones(1, device=device).to(torch.float8_e4m3fn).float()
    except (RuntimeError, TypeError, AssertionError) as exc:  # AssertionError: torch built without CUDA
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"cannot run on {device}: {first}"
    return None


@functools.lru_cache(maxsize=None)
def scaled_mm_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The output dtype `torch._scaled_mm` gives for `dtype` activations on `device` (the same, else
    bfloat16); None where it does not run (a CPU, a GPU before compute capability 8.9, a build without it).
    Probed once per device and dtype, at load, never in a forward."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < GEMM_CAPABILITY:
        return None
    side = GEMM_MULTIPLE
    rows = torch.zeros(side, side, device=device).to(torch.float8_e4m3fn)
    weight = torch.zeros(side, side, device=device).to(torch.float8_e4m3fn)
    row_scale, column_scale = torch.ones(side, 1, device=device), torch.ones(1, side, device=device)
    for out_dtype in dict.fromkeys((dtype, torch.bfloat16)):
        try:
            torch._scaled_mm(rows, weight.t(), scale_a=row_scale, scale_b=column_scale, out_dtype=out_dtype)
            torch.cuda.synchronize(device)
            return out_dtype
        except (RuntimeError, ValueError, NotImplementedError):
            continue
    return None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as float8_e4m3fn [N, K] and its per-output-channel float32 scale [N]."""
    rows = weight.detach().float()
    scale = rows.abs().amax(dim=1).clamp_min(MIN_SCALE) / FP8_MAX  # [N]
    quantized = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


class Fp8Linear(torch.nn.Module):
    """`y = x W^T + b` with W stored as float8_e4m3fn [N, K] times a float32 scale per output channel [N].

    Not a `torch.nn.Linear` subclass on purpose: code that treats a `Linear` as a float weight
    (oneDNN packing, `quantize_dynamic`, the lean forward's `F.linear`) must not take it for one."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, gemm_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [N, K] float8_e4m3fn
        self.register_buffer("scale", scale)  # [N] float32
        self.register_buffer("bias", bias)  # [N] in the activation dtype, or None
        self.gemm_dtype = gemm_dtype  # torch._scaled_mm's output dtype on this device; None: weight-only

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear) -> Fp8Linear:
        """The fp8 copy of a float `Linear`, on its device, computing in its dtype."""
        weight, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        gemm_dtype = None
        if all(size % GEMM_MULTIPLE == 0 for size in weight.shape):
            gemm_dtype = scaled_mm_dtype(weight.device, linear.weight.dtype)
        return cls(weight, scale, bias, gemm_dtype)

    def extra_repr(self) -> str:
        path = "weight-only" if self.gemm_dtype is None else f"_scaled_mm -> {self.gemm_dtype}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {path}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`: e4m3 converts to every float dtype exactly; one rounding, of the product."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm_dtype is not None and x.is_cuda:
            return self.scaled_mm_forward(x)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def scaled_mm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fp8 GEMM path (`forward` takes it on a CUDA device where it runs; a test may call it anywhere)."""
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(MIN_SCALE) / FP8_MAX  # [M, 1]
        quantized = (rows / row_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # the weight [N, K] row-major is [K, N] column-major, the layout _scaled_mm wants for its second operand
        out = torch._scaled_mm(quantized, self.weight.t(), scale_a=row_scale, scale_b=self.scale[None, :],
                               out_dtype=self.gemm_dtype or x.dtype)
        out = out.to(x.dtype)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Every `Linear` of `model` replaced by its `Fp8Linear` (for Llama / Qwen2: the seven projections of
    each decoder layer and the LM head), in place, one module at a time.

    The LM head is quantized too, also where it is tied to the embedding (which keeps its float
    table for the lookup): Qwen's 152k-row head is 15-27 % of the 0.5B-1.5B models' weights and the
    largest single read of a decode step, which fp8 halves against bfloat16."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.is_floating_point():
                setattr(parent, name, Fp8Linear.from_linear(child))
    return model
