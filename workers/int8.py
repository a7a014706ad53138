"""int8 `Linear`s for the CPU tiers (`quantize: int8`) whose output rows do not depend on
each other.

Why not torch's dynamic quantization as it comes (`quantize_dynamic`, which this replaced):
it quantizes a forward's activations with one scale per tensor, taken from the largest and
smallest values of the whole forward, so a row's logits depended on the other rows in the
same forward. An int8 drafter's proposals then depended on how many tokens it verified at
once: on the Ray demo chain at T = 0, [6, 6] and [6, 4] ran different target <- int8 rounds
on the same prompts (152-154 against 148 target blocks over the 16 held-out prompts, and
[6, 6] not even the same from one run to the next), which no per-pair acceptance model can
see (docs/time-model.md §6, sessions 20-22).

Here every activation row is divided by its own largest magnitude, so it lies in [-1, 1],
and two anchor rows (1, 0, ...) and (-1, 0, ...) are appended before the same fbgemm kernel (prepacked int8
weights, one scale per output channel, int32 sums): the kernel's per-tensor range is then
always exactly [-1, 1], every row is quantized with the same fixed scale, and the row's
largest magnitude multiplies its output back. A row's output is a function of that row
alone: a token's logits are the same whatever block it is verified in
(`tests/workers/test_int8.py`). Activations keep torch's x86 default of 7 bits
(`reduce_range`: no int16 saturation in the u8 x s8 products on CPUs without VNNI).

`torch._int_mm` with int8 rows would do the same with 8-bit activations, but measured 2x
slower than fbgemm's prepacked kernel on the demo target's weights (it re-lays out the weight
on every call), and the int8 tier is only worth running if it is cheaper than the target.
"""

from __future__ import annotations

import warnings

import torch

QMAX = 127.0
_linear_dynamic = torch.ops.quantized.linear_dynamic.default  # the overload itself: no per-call dispatch checks


def _prepack(weight: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed weight from int8 [out, in] and a float scale per output channel."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized-tensor constructors are marked deprecated; the kernels are not
        quantized = torch._make_per_channel_quantized_tensor(weight, scale.double(), torch.zeros(weight.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(quantized, None)


class Int8Linear(torch.nn.Module):
    """A `Linear` with int8 weights (one scale per output channel); see the module docstring."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [out, in] int8
        self.register_buffer("weight_scale", weight_scale)  # [out] float32
        self.register_buffer("bias", bias)
        anchor = torch.zeros(2, self.in_features)
        anchor[0, 0], anchor[1, 0] = 1.0, -1.0  # in every input, these pin the kernel's per-tensor range to [-1, 1]
        self.register_buffer("anchor", anchor)
        self._packed = _prepack(weight, weight_scale)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> "Int8Linear":
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / QMAX
        quantized = (weight / scale[:, None]).round().to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(quantized, scale, bias)

    @classmethod
    def concat(cls, modules: list["Int8Linear"]) -> "Int8Linear":
        """One module computing `torch.cat([m(x) for m in modules], -1)`, bit for bit (each
        output column has its own weights and scale), with one normalisation of x and one product."""
        biases = [m.bias for m in modules]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            biases = [torch.zeros(m.out_features) if b is None else b for m, b in zip(modules, biases)]
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(torch.cat([m.weight for m in modules]), torch.cat([m.weight_scale for m in modules]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function()(x)

    def function(self):
        """`forward` as a closure over the packed weight (the lean forward calls it directly:
        it runs ~25 times a forward, where attribute look-ups add up)."""
        packed, anchor, bias, width, out = self._packed, self.anchor, self.bias, self.in_features, self.out_features
        cat, kernel = torch.cat, _linear_dynamic

        def apply(x: torch.Tensor) -> torch.Tensor:
            shape, dtype = x.shape, x.dtype
            rows = x.reshape(-1, width)
            if dtype != torch.float32:
                rows = rows.float()
            peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
            y = kernel(cat((anchor, rows / peak)), packed, True)[2:]
            y.mul_(peak)
            if bias is not None:
                y.add_(bias)
            y = y.view(*shape[:-1], out)
            return y if dtype == torch.float32 else y.to(dtype)

        return apply

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8 weights per channel, activations per row"


def quantize_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every `torch.nn.Linear` in `model` (in place) by an `Int8Linear`; the model in float32.
    Tied weights (an lm_head sharing the embedding) are copied: the embedding stays float."""
    model.float()
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, Int8Linear.from_float(child))
        else:
            quantize_linears(child)
    return model
