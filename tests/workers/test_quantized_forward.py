"""Quantized tiers in the static-shape forward: `quantize: fp8` (polyspec.workers.tiers.fp8_linear) and the int8 copy.

- `Fp8Linear`'s weight-only forward equals `F.linear` of the weight dequantized by hand (the e4m3
  bits decoded one field at a time, times the row's scale) bit for bit, in float32 and bfloat16;
  the quantization round trip stays within half a unit in e4m3's last place.
- The static step (`BatchedLlama.step`) over the int8 copy of a tiny model gives the ragged `BatchedLlama` forward's
  logits bit for bit (tolerance 0): both make the same quantized call per projection, and with
  the same rows (no padding) and the attended span equal to the ragged forward's, the same
  attention. The rows must be the same because int8 dynamic quantization takes one activation
  scale per tensor: a row's logits depend on the other rows of its batch (the transformers
  forward of one row alone differs by up to ~0.75 in a logit here), which is why the fp8 path
  scales per row.
- The static step (`BatchedLlama.step`) over an fp8 model (Llama; Qwen2 with biases and a tied LM head) matches the
  model's own transformers forward, whose `Fp8Linear`s run weight-only (tolerance 1e-4, as
  tests/workers/test_static_step.py: the same forward with batched products that may round
  differently in the last bits), and a decode step compiles whole, once per bucket.
- A chain target <- fp8 copy <- small through `polyspec generate` gives the target's own
  greedy tokens, and so does the device round over target <- int8 / fp8 copy; a device that
  cannot run fp8 is refused in one line.
- The fp8 GEMM path (`torch._scaled_mm`, row-wise scales) matches the weight-only forward within
  fp8's activation rounding: its arithmetic through the CPU's `_scaled_mm`, and on a CUDA GPU of
  compute capability 8.9 or more the forward itself (skipped elsewhere).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from core_helpers import CompiledGraphs
from family_chains import tier_specs
from polyspec.orchestrator.cli import main
from polyspec.orchestrator.config import TierConfig, parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.workers.core.errors import ModelLoadError
from polyspec.workers.tiers import fp8_linear, loading
from polyspec.workers.tiers.fp8_linear import FP8_MAX, Fp8Linear, fp8_problem, quantize_weight
from polyspec.workers.tiers.batched_llama import BatchedLlama, step_unsupported

TOLERANCE = 1e-4  # the static step against transformers' forward of the same weights (tests/workers/test_static_step.py)
CPU = torch.device("cpu")


def decode_e4m3(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values decoded from their bits (sign, 4 exponent bits with bias 7, 3 mantissa bits), as float32."""
    bits = weight.view(torch.uint8).to(torch.int32)
    sign = 1.0 - 2.0 * (bits >> 7).float()
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).float()
    normal = (1.0 + mantissa / 8.0) * torch.pow(2.0, exponent.float() - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    assert not ((exponent == 0xF) & (bits & 0x7 == 0x7)).any(), "NaN in a quantized weight"
    return sign * torch.where(exponent == 0, subnormal, normal)


def test_decoding_by_hand_agrees_with_torch_on_every_finite_value():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = every[~every.float().isnan()]
    assert torch.equal(decode_e4m3(finite), finite.float())


def spread_linear(rows: int, columns: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    """A Linear whose rows span 8 decades of magnitude, with a zero row and one outlier per row
    (the absmax scale's hard cases: subnormals, the exact maximum)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(columns, rows, bias=bias)
    with torch.no_grad():
        row_sizes = torch.logspace(-6, 2, rows)[:, None]
        weight = torch.randn(rows, columns, generator=generator) * row_sizes
        weight[:, 0] *= 50.0
        weight[3] = 0.0
        linear.weight.copy_(weight)
        if bias:
            linear.bias.copy_(torch.randn(rows, generator=generator))
    return linear.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_forward_equals_dequantizing_by_hand(dtype):
    fp8 = Fp8Linear.from_linear(spread_linear(40, 96, dtype))
    assert fp8.gemm_dtype is None  # the CPU: weight-only
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.scale.dtype == torch.float32 and fp8.bias.dtype == dtype
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(1)).to(dtype)  # [B, T, K]
    by_hand = decode_e4m3(fp8.weight).to(dtype) * fp8.scale.to(dtype)[:, None]  # [N, K]
    assert torch.equal(fp8(x), F.linear(x, by_hand, fp8.bias))
    assert torch.equal(Fp8Linear.from_linear(spread_linear(40, 96, dtype, bias=False))(x), F.linear(x, by_hand))


def test_the_round_trip_is_within_half_a_unit_in_the_last_place():
    """|dequantized - w| <= |w| / 16 (3 mantissa bits) + scale / 1024 (half the subnormal spacing 2^-9, in units
    of the row's scale); each row's largest weight maps to +-448, and a zero row stays zero."""
    weight = spread_linear(40, 96, torch.float32).weight.detach()
    quantized, scale = quantize_weight(weight)
    assert torch.equal(scale, weight.abs().amax(dim=1).clamp_min(fp8_linear.MIN_SCALE) / FP8_MAX)
    dequantized = decode_e4m3(quantized) * scale[:, None]
    bound = weight.abs() / 16 + scale[:, None] / 1024
    assert ((dequantized - weight).abs() <= bound * (1 + 1e-6)).all()
    largest = decode_e4m3(quantized).abs().gather(1, weight.abs().argmax(dim=1, keepdim=True)).flatten()  # [N]
    nonzero = weight.abs().amax(dim=1) > 0
    assert (largest[nonzero] == FP8_MAX).all() and not decode_e4m3(quantized)[~nonzero].any()


# ------------------------------------------------------------------ the static step over quantized models


def load_quantized(path: str, quantize: str):
    return loading.load_model(TierConfig(name="q", model=path, quantize=quantize, device="cpu"))


def test_static_forward_on_the_int8_copy_equals_the_ragged_forward(tiny_family):
    model = load_quantized(tiny_family["target"], "int8")
    assert step_unsupported(model, CPU) is None and step_unsupported(model, torch.device("cuda")) is not None  # int8: CPU only
    static, ragged = BatchedLlama(model), BatchedLlama(model)
    pool, cache = static.new_cache(4, margin=8, scratch=True), ragged.new_cache()
    pool.allocate()
    slots = [cache.slot(request) for request in range(3)]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (9,), generator=generator).tolist() for _ in slots]
    blocks = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    with torch.inference_mode():
        for start, rows in ((0, prompts), (9, blocks)):  # a prefill, then a block after it
            width = len(rows[0])
            positions = (start + torch.arange(width)).expand(len(rows), width)
            static_logits, _ = static.step(pool, torch.tensor(rows), positions, positions, torch.tensor(slots), span=start + width)  # [B, T, V]
            ragged_logits = ragged.forward(cache, slots, rows, [0] * len(rows))  # per row [T, V]
            for row in range(len(rows)):
                assert torch.equal(static_logits[row], ragged_logits[row])


@pytest.fixture(scope="module", params=["llama", "qwen2-tied"])
def fp8_model(request, tiny_family, tmp_path_factory):
    if request.param == "llama":
        path = tiny_family["target"]
    else:
        from tests.workers.test_forward_qwen2 import make_qwen2

        path = make_qwen2(tmp_path_factory.mktemp("qwen2") / "m", tied=True)
    model = load_quantized(path, "fp8")
    assert isinstance(model.lm_head, Fp8Linear) and model.model.embed_tokens.weight.dtype == torch.float32  # the lookup stays float
    return model


def reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # [T, V]: transformers' forward, Fp8Linear weight-only


def test_static_forward_on_an_fp8_model_matches_its_weight_only_forward(fp8_model):
    assert step_unsupported(fp8_model, CPU) is None and step_unsupported(fp8_model, torch.device("cuda")) is None
    assert BatchedLlama.supports(fp8_model, CPU) and BatchedLlama.supports(fp8_model, torch.device("cuda"))
    static = BatchedLlama(fp8_model)
    pool = static.new_cache(4, margin=8, scratch=True)
    pool.allocate()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (5, 12)]
    ids = torch.tensor([prompt + [0] * (12 - len(prompt)) for prompt in prompts])  # right-padded to one bucket
    positions = torch.arange(12).expand(2, 12)
    logits, _ = static.step(pool, ids, positions, positions, torch.tensor([1, 0]), span=16)
    for row, prompt in enumerate(prompts):
        assert torch.allclose(logits[row, : len(prompt)], reference(fp8_model, prompt), atol=TOLERANCE)


def test_an_fp8_decode_step_compiles_whole_and_once_per_bucket(fp8_model):
    static = BatchedLlama(fp8_model)
    pool = static.new_cache(4, margin=4, scratch=True)
    pool.allocate()
    step = CompiledGraphs(static.step)
    tokens = [3, 4, 5, 6]
    static.step(pool, torch.tensor([tokens]), torch.arange(4)[None], torch.arange(4)[None], torch.tensor([1]), 16)
    for _ in range(3):  # one bucket (1 row, 1 token, span 16), new values each step
        position = torch.tensor([[len(tokens) - 1]])
        out, _ = step(pool, torch.tensor([[tokens[-1]]]), position, position, torch.tensor([1]), 16)
        assert torch.allclose(out[0, 0], reference(fp8_model, tokens)[-1], atol=TOLERANCE)
        tokens.append(int(out[0, 0].argmax()))
    assert len(step.graphs) == 1, f"{len(step.graphs)} graphs for one bucket (a graph break or a recompilation)"
    step.close()


# ------------------------------------------------------------------ the chain and its refusals, through the CLI


def chain_config(tiny_family, tmp_path, names=("target", "fp8", "small"), **tier_extra) -> str:
    tiers = tier_specs(tiny_family, names)
    tiers[1].update(tier_extra)
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump({"tiers": tiers, "speculation": {"lengths": [4, 2][: len(names) - 1]}}))
    return str(path)


def test_a_chain_through_the_fp8_copy_gives_the_target_greedy_tokens(tiny_family, tmp_path, capsys):
    command = ["generate", "-c", chain_config(tiny_family, tmp_path), "-p", "def add(a, b):\n    return", "-n", "32", "--json"]
    assert main(command) == 0
    chain = capsys.readouterr()
    assert "fp8 copy of" in chain.err  # the start-up line names the tier's kind
    assert main(command + ["--no-speculation"]) == 0
    result = json.loads(chain.out)
    assert result["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert [stage["drafter"] for stage in result["stats"]["stages"]] == ["fp8", "small"]


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_the_device_round_runs_a_quantized_drafter(tiny_family, quantize):
    """`batching.round: device` refuses a chain it cannot run: here it runs target <- quantized copy, greedy-equal to the target."""
    config = parse_config({"tiers": tier_specs(tiny_family, ["target", quantize]), "speculation": {"lengths": [3]},
                           "batching": {"round": "device", "max_requests": 2, "max_context": 128}})
    engine, target = Engine(config), Engine(config, speculative=False)
    for prompt in ("def add(a, b):\n    return", "import os\n"):
        request = {"prompt": prompt, "max_new_tokens": 16}
        assert engine.generate(engine.parse_request(request))["token_ids"] == target.generate(target.parse_request(request))["token_ids"]


def test_a_device_that_cannot_run_fp8_is_one_line_through_the_cli(tiny_family, tmp_path, capsys):
    config = chain_config(tiny_family, tmp_path, names=("target", "fp8"), device="mps")
    assert main(["generate", "-c", config, "-p", "x", "-n", "4"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "polyspec: error: tier 'fp8': quantize: fp8 runs on CPU or CUDA, not mps"


def test_a_torch_without_float8_is_one_line(tiny_family, tmp_path, monkeypatch, capsys):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert "needs a torch with float8 dtypes" in fp8_problem(CPU)
    with pytest.raises(ModelLoadError) as caught:
        loading.load_model_tier(TierConfig(name="mid", model=tiny_family["target"], quantize="fp8", device="cpu"))
    assert str(caught.value).startswith("tier 'mid': quantize: fp8 needs a torch with float8 dtypes") and "\n" not in str(caught.value)
    assert main(["generate", "-c", chain_config(tiny_family, tmp_path, names=("target", "fp8")), "-p", "x", "-n", "4"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("polyspec: error: tier 'fp8': quantize: fp8 needs a torch with float8 dtypes")


def test_a_device_whose_float8_conversion_fails_is_named(monkeypatch):
    def no_float8(tensor, *args, **kwargs):
        raise RuntimeError("\"copy_\" not implemented for 'Float8_e4m3fn'\nmore detail")

    monkeypatch.setattr(torch.Tensor, "to", no_float8)
    assert fp8_problem(CPU) == "cannot run on cpu: \"copy_\" not implemented for 'Float8_e4m3fn'"


# ------------------------------------------------------------------ the fp8 GEMM (CUDA, compute capability >= 8.9)


def relative_error(fast: torch.Tensor, reference: torch.Tensor) -> float:
    return float((fast.float() - reference.float()).norm() / reference.float().norm())


# activations rounded to e4m3 per row carry a relative error of at most 1/16 per element, about 1/40 RMS,
# which sums over K like the signal does: the output's relative error is ~0.03 (0.027 measured on the CPU)
GEMM_TOLERANCE = 0.06


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_paths_scales_are_the_ones_scaled_mm_reads(dtype):
    """The fp8 GEMM path's arithmetic (row-wise scales [M, 1] and [1, N], the weight's column-major view), run
    through this torch's CPU `_scaled_mm`: within fp8's activation rounding of the weight-only forward."""
    fp8 = Fp8Linear.from_linear(spread_linear(512, 256, dtype))
    x = torch.randn(2, 7, 256, generator=torch.Generator().manual_seed(1)).to(dtype)  # 14 rows: M needs no multiple of 16
    try:
        fast = fp8.scaled_mm_forward(x)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no row-wise _scaled_mm on the CPU: {exc}")
    assert fast.shape == (2, 7, 512) and fast.dtype == dtype
    assert relative_error(fast, fp8(x)) < GEMM_TOLERANCE


def fp8_gemm_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= fp8_linear.GEMM_CAPABILITY


@pytest.mark.skipif(not fp8_gemm_device(), reason="needs a CUDA GPU of compute capability >= 8.9 (torch._scaled_mm)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_matches_the_weight_only_forward(dtype):
    """On the GPU the forward takes the fp8 GEMM: within GEMM_TOLERANCE of the weight-only forward, compiled whole."""
    cuda = torch.device("cuda")
    linear = torch.nn.Linear(256, 512, bias=True).to(cuda, dtype)
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.gemm_dtype is not None, "torch._scaled_mm did not run on this device"
    x = torch.randn(2, 7, 256, device=cuda, dtype=dtype)  # 14 rows: no multiple of 16 needed for M
    with torch.inference_mode():
        fast = fp8(x)
        weight_only = F.linear(x, fp8.dequantized(dtype), fp8.bias)
    assert fast.shape == weight_only.shape and fast.dtype == dtype
    assert relative_error(fast, weight_only) < GEMM_TOLERANCE
    step = CompiledGraphs(fp8.forward)  # no host sync, no graph break
    assert torch.equal(step(x), fast)
    step.close()
