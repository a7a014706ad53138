"""int8 `Linear`s for the CPU tiers (`quantize: int8`): weights int8 per output channel, each
activation row quantized to int8 on the fly with its own scale, products accumulated exactly
in int32 (`torch._int_mm`).

Why not torch's dynamic quantization (`quantize_dynamic`, which this replaced): it scales the
activations per tensor, one scale from the largest value of the whole forward, so a row's
logits depend on the other rows in the same forward. An int8 drafter's proposals then depended
on how many tokens it verified at once: at T = 0 on the Ray demo chain the target <- int8
acceptance moved with the int8 tier's own drafter's length (greedy near-ties flipping), which
no per-pair acceptance model can see (docs/time-model.md §6, sessions 20-22: [6, 6] and
[6, 4] measured 3-9 % apart on held-out prompts, either way per prompt, within 1.4 % on the
tuning prompts). Here every row is quantized by itself and the int32 sums are exact, so a
row's output does not depend on the rows beside it: a token's logits are the same whatever
block it is verified in (`tests/workers/test_int8.py`). Per-channel weight scales are also
closer to the float model than one scale per tensor.
"""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> ([M, K] int8, [M, 1] float32 scale): symmetric, one scale per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12).div_(QMAX)
    return (x / scale).round_().to(torch.int8), scale


class Int8Linear(torch.nn.Module):
    """A `Linear` whose weight is int8 with one scale per output channel; see the module docstring."""

    def __init__(self, weight_t: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.register_buffer("weight_t", weight_t)  # [in, out] int8, contiguous: `_int_mm`'s right operand
        self.register_buffer("weight_scale", weight_scale)  # [1, out] float32
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> "Int8Linear":
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / QMAX
        weight_t = (weight / scale[:, None]).round().to(torch.int8).t().contiguous()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(weight_t, scale[None].contiguous(), bias)

    @classmethod
    def concat(cls, modules: list["Int8Linear"]) -> "Int8Linear":
        """One module computing `torch.cat([m(x) for m in modules], -1)`, bit for bit (the same
        int32 sums and scales per output column), with one quantization of x and one product."""
        biases = [m.bias for m in modules]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            biases = [torch.zeros(m.out_features) if b is None else b for m, b in zip(modules, biases)]
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(torch.cat([m.weight_t for m in modules], dim=1).contiguous(),
                   torch.cat([m.weight_scale for m in modules], dim=1).contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows, scale = quantize_rows(x.reshape(-1, self.in_features))
        y = torch._int_mm(rows, self.weight_t).float()
        y.mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        y = y.view(*shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8 per channel x per row"


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
