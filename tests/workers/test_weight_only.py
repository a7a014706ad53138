"""Weight-only int4 / int8 tiers (polyspec.workers.tiers.weight_only), against a slow, obvious reference.

- The quantizers' round trip: int8 within half a scale step per weight; int4 within half a step plus
  the bfloat16 rounding of the group's scale and zero (`INT4_SLACK`).
- The quantized kernels and the block path against `x @ dequantized(W)^T` in float32 (the weights
  dequantized by hand from the quantizer's output, not through any packing): the block path on float32
  activations within `FLOAT32_TOLERANCE` of the products' magnitude `|x| @ |W|^T`; bfloat16, and the
  kernels on any activations (they compute in bf16), within `BFLOAT16_TOLERANCE` of it (bf16's 8-bit
  mantissa, a few roundings deep).
- A model quantized int4: through polyspec (one request, the batched engine) its greedy tokens are its
  own one-token-at-a-time greedy decode through the same modules, and a chain target <- int4 copy of
  it gives the target's greedy tokens.
- Config: `quantize: int4` with `group_size`, `int8w`, one-line refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from family_chains import tier_specs
from polyspec.orchestrator.cli import main
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import ConfigError, ModelLoadError
from polyspec.workers.tiers import loading
from polyspec.workers.tiers import weight_only as wo
from polyspec.workers.tiers.batched import BatchedModelTier
from reference_tier import greedy_one_token_at_a_time

FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 2**-6
INT4_SLACK = 2**-8  # relative rounding of a bfloat16 scale / zero
PROMPTS = ("def add(a, b):\n    return", "import os\n")


def spread_weight(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Weights whose rows span very different magnitudes, with an outlier per row: per-channel / per-group scales matter."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * torch.logspace(-2, 0, rows)[:, None]
    weight[:, 0] *= 8
    return weight


def within(fast: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor, tolerance: float) -> None:
    error = (fast.float() - reference).abs()
    bound = tolerance * magnitude + 1e-6
    assert bool((error <= bound).all()), f"max error {error.max().item():.3g}, at most {(error / bound).max().item():.3g} of the bound"


# ------------------------------------------------------------------------------ round trips


def test_int8_round_trip_is_within_half_a_step():
    weight = spread_weight(96, 200)
    quantized = wo.quantize_int8_channels(weight)
    assert quantized.q.dtype == torch.int8 and quantized.q.abs().max() <= wo.INT8_MAX
    error = (wo.dequantize_int8(quantized) - weight).abs()
    assert bool((error <= quantized.scale[:, None] * 0.5 * (1 + 1e-5)).all())


@pytest.mark.parametrize("group_size", wo.GROUP_SIZES)
def test_int4_round_trip_is_within_half_a_step(group_size):
    weight = spread_weight(64, 512)
    quantized = wo.quantize_int4_groups(weight, group_size)
    assert quantized.q.dtype == torch.uint8 and quantized.q.max() <= 15
    scale = quantized.scale.float().repeat_interleave(group_size, dim=1)
    zero = quantized.zero.float().repeat_interleave(group_size, dim=1)
    error = (wo.dequantize_int4(quantized) - weight).abs()
    assert bool((error <= 0.5 * scale + INT4_SLACK * (zero.abs() + 16 * scale)).all())
    assert error.max() < weight.abs().max() / 15  # a real 4-bit grid, not a degenerate one


def test_a_group_size_that_does_not_divide_the_inputs_is_refused():
    with pytest.raises(ValueError, match="multiple of group_size"):
        wo.quantize_int4_groups(torch.randn(16, 96), 64)


# --------------------------------------------------------------------- kernels vs reference


def modules(kind: str, weight: torch.Tensor, bias: torch.Tensor, group_size: int = 64):
    """(module, reference weight [N, K] float32) for `kind` on the CPU."""
    if kind == "int8w":
        quantized = wo.quantize_int8_channels(weight)
        return wo.WeightOnlyLinear.from_int8(quantized, bias), wo.dequantize_int8(quantized)
    quantized = wo.quantize_int4_groups(weight, group_size)
    return wo.WeightOnlyLinear.from_int4(quantized, bias), wo.dequantize_int4(quantized)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8w", "int4"])
@pytest.mark.parametrize("out_features", [64, 96, 8960])
def test_kernel_and_block_path_match_the_dequantized_reference(kind, out_features, dtype):
    """out_features 96 is one full 64-row block and a tail on AVX-512 (the block path is off there; the kernel runs)."""
    weight, bias = spread_weight(out_features, 256, seed=out_features), torch.randn(out_features)
    module, reference_weight = modules(kind, weight, bias.to(dtype))
    for rows in (1, 3, 17):
        x = torch.randn(rows, 256).to(dtype)
        reference = x.float() @ reference_weight.T + bias.to(dtype).float()
        magnitude = x.float().abs() @ reference_weight.abs().T + bias.abs()
        for path in ("kernel", "block"):
            # the kernels compute float32 activations in bf16 (their float32 paths are far slower)
            widened = path == "block" and (kind == "int8w" or module._block is not None)  # else the block path is the kernel
            tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 and widened else BFLOAT16_TOLERANCE
            module.dense_rows = 1 if path == "block" else wo.NEVER
            out = module(x)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            within(out, reference, magnitude, tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features, group_size", [(64, 96, 32), (192, 320, 64), (320, 384, 128), (8960, 256, 32)])
def test_the_block_paths_widened_weights_are_the_references_bit_for_bit(out_features, in_features, group_size, dtype):
    """`widened_int4` is `dequantize_int4(...)` (float32) rounded once to the activations' dtype, bit for bit, slice by
    slice (odd block counts, every group size); its GEMM then differs from the slow reference's `F.linear` only by the
    order of float32 sums (one rounding of the output in bf16)."""
    quantized = wo.quantize_int4_groups(spread_weight(out_features, in_features, seed=in_features), group_size)
    module = wo.WeightOnlyLinear.from_int4(quantized, None)
    if module._block is None:
        pytest.skip("this CPU's int4 packing is not the split-halves layout: the block path is the kernel")
    reference = wo.dequantize_int4(quantized).to(dtype)  # [N, K]
    blocks = out_features // module._block
    for per_slice in (1, 3, blocks):
        widened = torch.cat([module.widened_int4(start, per_slice, dtype) for start in range(0, blocks, per_slice)], dim=1)
        assert widened.dtype == dtype and torch.equal(widened, reference.T)
    x = torch.randn(37, in_features).to(dtype)
    obvious = torch.nn.functional.linear(x, reference)
    magnitude = x.float().abs() @ reference.float().abs().T
    within(module.block_path(x), obvious.float(), magnitude, FLOAT32_TOLERANCE if dtype == torch.float32 else 2**-8)


def test_the_block_path_is_on_where_the_layout_is_uniform():
    assert wo.WeightOnlyLinear.from_int4(wo.quantize_int4_groups(torch.randn(128, 64), 32), None)._block is not None
    assert wo.cpu_int4_layout(8960) is not None and 8960 % wo.cpu_int4_layout(8960)[0] == 0


def test_forward_keeps_leading_dimensions_and_switches_at_dense_rows():
    module, _ = modules("int4", spread_weight(64, 128), None, group_size=32)
    module.dense_rows = 4
    few, many = torch.randn(1, 3, 128), torch.randn(2, 3, 128)
    assert torch.equal(module(few), module.kernel(few.reshape(3, 128)).view(1, 3, 64))
    assert torch.equal(module(many), module.block_path(many.reshape(6, 128)).view(2, 3, 64))


def test_the_measured_threshold_can_be_forced(monkeypatch):
    module, _ = modules("int8w", spread_weight(32, 64), None)
    monkeypatch.setenv("POLYSPEC_WEIGHT_ONLY_BLOCK", "kernel")
    assert wo.measured_dense_rows(module, torch.float32) == wo.NEVER
    monkeypatch.setenv("POLYSPEC_WEIGHT_ONLY_BLOCK", "dense")
    assert wo.measured_dense_rows(module, torch.float32) == 1
    monkeypatch.delenv("POLYSPEC_WEIGHT_ONLY_BLOCK")
    chosen = wo.measured_dense_rows(module, torch.float32)  # a probed row count, or one bisected below it
    assert chosen == wo.NEVER or 1 <= chosen <= wo.PROBE_ROWS[-1]


def sleeping_paths(kernel_ms_per_row: float, block_ms: float, stalled_rows: int = 0):
    """A stand-in for a WeightOnlyLinear whose kernel costs `kernel_ms_per_row` per row and block path `block_ms` flat
    (the kernel at `stalled_rows` rows: 20 ms every time, as if a busy machine stalled each timing of it)."""
    import time
    import types

    return types.SimpleNamespace(
        in_features=8,
        kernel=lambda x: time.sleep((20.0 if x.shape[0] == stalled_rows else kernel_ms_per_row * x.shape[0]) / 1000),
        block_path=lambda x: time.sleep(block_ms / 1000),
    )


@pytest.mark.parametrize("kernel_ms_per_row, block_ms, low, high", [(0.1, 6.0, 48, 72), (0.02, 8.0, 256, 512), (0.001, 8.0, wo.NEVER, wo.NEVER)])
def test_the_switch_is_where_the_costs_cross_up_to_prefill_sizes(kernel_ms_per_row, block_ms, low, high):
    """Costs crossing at 60 rows: the switch is bisected near it (not the next power of two only); crossing at 400
    rows (a kernel cheap up to 256): a prefill still takes the block path; never crossing: the kernel always."""
    chosen = wo.first_block_rows(sleeping_paths(kernel_ms_per_row, block_ms), torch.float32)
    assert low <= chosen <= high


def test_one_stalled_timing_of_the_kernel_does_not_switch_early():
    """The block path must win at the next probed row count too: a kernel timed slow at 4 rows alone (a busy machine)
    would otherwise put every 4-row block on the widening."""
    assert 48 <= wo.first_block_rows(sleeping_paths(0.1, 6.0, stalled_rows=4), torch.float32) <= 72


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch's _weight_int4pack_mm)")
def test_the_cuda_int4_kernel_matches_the_reference():
    weight, bias = spread_weight(256, 1024), torch.randn(256)
    quantized = wo.quantize_int4_groups(weight.cuda(), 128)
    module = wo.WeightOnlyLinear.from_int4(quantized, bias.cuda().bfloat16())
    reference_weight = wo.dequantize_int4(quantized).cpu()
    for rows in (1, 5, 32):
        x = torch.randn(rows, 1024).bfloat16()
        reference = x.float() @ reference_weight.T + bias.bfloat16().float()
        within(module(x.cuda()).cpu(), reference, x.float().abs() @ reference_weight.abs().T + bias.abs(), BFLOAT16_TOLERANCE)


# ------------------------------------------------------------------------------ whole models


def int4_tier(family: dict, name: str = "int4", group_size: int = 32) -> dict:
    return {"name": name, "model": family["target"], "quantize": "int4", "group_size": group_size}


def test_an_int4_model_quantizes_every_projection_it_can(tiny_family):
    config = parse_config({"tiers": [int4_tier(tiny_family)]})
    model = loading.load_model(config.tiers[0])
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, wo.WeightOnlyLinear) and isinstance(layer.mlp.down_proj, wo.WeightOnlyLinear)
    assert model.weight_only_skipped == 1  # the 257-row LM head: not a multiple of 16 rows, kept float
    assert "int4 weights" in loading.weight_only_note(model)


def test_int4_target_through_polyspec_is_its_own_greedy_decode(tiny_family, tmp_path):
    """One request (polyspec generate, int4 target <- small) and the batched engine: the int4 model's own tokens."""
    from transformers import AutoTokenizer

    tiers = [int4_tier(tiny_family, "target"), *tier_specs(tiny_family, ["small"])]
    config_path = tmp_path / "int4.yaml"
    config_path.write_text(yaml.safe_dump({"tiers": tiers, "speculation": {"lengths": [4]}}))
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["target"])
    model = loading.load_model(parse_config({"tiers": tiers[:1]}).tiers[0])
    command = [sys.executable, "-m", "polyspec", "generate", "-c", str(config_path), "-p", PROMPTS[0], "-n", "24", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "int4 copy of" in done.stderr and "int4 weights" in done.stderr
    expected = greedy_one_token_at_a_time(model, tokenizer(PROMPTS[0])["input_ids"], 24, tokenizer.eos_token_id)
    assert json.loads(done.stdout)["token_ids"] == expected

    batched = parse_config({"tiers": tiers, "speculation": {"lengths": [4]}, "batching": {"round": "ragged", "max_requests": 2}})
    engine = Engine(batched, batched=True)
    assert isinstance(engine.scheduler.tiers[0], BatchedModelTier)  # the int4 target on the one forward
    for prompt in PROMPTS:
        result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": 16}))
        assert result["token_ids"] == greedy_one_token_at_a_time(model, tokenizer(prompt)["input_ids"], 16, tokenizer.eos_token_id)


def test_an_int4_target_on_the_block_path_everywhere_is_its_own_greedy_decode(tiny_family, monkeypatch):
    """POLYSPEC_WEIGHT_ONLY_BLOCK=dense: every forward of the int4 target widens its weights (the block path from one
    row); through the batched engine its tokens are still its own one-token-at-a-time greedy decode, and the start-up
    profile finds the switch on the batched tier's loaded tier (`Tier.switch_rows`: its `model` is a forward, the modules
    its loaded tier's)."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("POLYSPEC_WEIGHT_ONLY_BLOCK", "dense")
    tiers = [int4_tier(tiny_family, "target"), *tier_specs(tiny_family, ["small"])]
    config = parse_config({"tiers": tiers, "speculation": {"lengths": [4]}, "batching": {"round": "ragged", "max_requests": 2}})
    engine = Engine(config, batched=True)
    target = engine.scheduler.tiers[0]
    assert isinstance(target, BatchedModelTier) and target.tier.switch_rows == (1,)
    model, tokenizer = target.tier.model, AutoTokenizer.from_pretrained(tiny_family["target"])
    widened = [m for m in model.modules() if isinstance(m, wo.WeightOnlyLinear) and m._block is not None]  # the head: 257 rows
    assert widened and all(m.dense_rows == 1 for m in widened)
    for prompt in PROMPTS:
        result = engine.generate(engine.parse_request({"prompt": prompt, "max_new_tokens": 16}))
        assert result["token_ids"] == greedy_one_token_at_a_time(model, tokenizer(prompt)["input_ids"], 16, tokenizer.eos_token_id)


@pytest.mark.parametrize("kind", ["int4", "int8w"])
def test_a_chain_through_a_weight_only_copy_gives_the_target_greedy_tokens(tiny_family, tmp_path, kind, capsys):
    copy = int4_tier(tiny_family) if kind == "int4" else {"name": "int8w", "model": tiny_family["target"], "quantize": "int8w"}
    config_path = tmp_path / "chain.yaml"
    config_path.write_text(yaml.safe_dump({"tiers": [*tier_specs(tiny_family, ["target"]), copy], "speculation": {"lengths": [4]}}))
    command = ["generate", "-c", str(config_path), "-p", PROMPTS[0], "-n", "32", "--json"]
    assert main(command) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(command + ["--no-speculation"]) == 0
    assert result["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert [stage["drafter"] for stage in result["stats"]["stages"]] == [kind]


def test_a_quantized_copy_shares_the_targets_embedding(tiny_family):
    config = parse_config({"tiers": [*tier_specs(tiny_family, ["target"]), int4_tier(tiny_family)]})
    tiers, _ = loading.load_tiers(config.tiers)
    target, copy = (tier.model for tier in tiers)
    assert copy.get_input_embeddings().weight is target.get_input_embeddings().weight


# ----------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"quantize": "int4", "group_size": 48}, "group_size must be one of 32, 64, 128, 256"),
        ({"quantize": "int4", "group_size": "128"}, "group_size must be one of"),
        ({"quantize": "int8w", "group_size": 64}, "group_size applies to quantize: int4 only"),
        ({"quantize": "int5"}, "quantize must be one of int8, fp8, int4, int8w"),
    ],
)
def test_bad_quantize_options_are_one_line(tiny_family, extra, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], **extra}]})
    assert "\n" not in str(error.value)


def test_int8w_off_the_cpu_is_one_line(tiny_family):
    tier = parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], "quantize": "int8w", "device": "meta"}]}).tiers[0]
    with pytest.raises(ModelLoadError, match="int8w .* runs on CPU only"):
        loading.load_model(tier)
