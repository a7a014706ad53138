"""`quantize: gguf`: a GGUF file's blocks straight onto the weight-only kernels (workers/tiers/gguf_file.py, gguf_model.py).

- Unpacking: every block type polyspec reads gives, level * scale + offset, the values of gguf's own
  `gguf.quants.dequantize`, on synthetic blocks (random bytes, finite float16 scales) and on a real file.
- Mapping: Q4_0 / Q4_1 / Q4_K keep the file's levels on the int4 kernel (only scale and zero are rounded to
  bfloat16, bounded here; exact where those are bfloat16 numbers); other types re-quantize to int8 per
  channel within half a step, and Q8_0 rows whose blocks share one scale keep their levels.
- A tiny synthetic llama GGUF (every type, written with gguf's GGUFWriter): close to transformers' float32
  load of the same file, and through the engine its greedy tokens are its own one-token-at-a-time decode.
- The real SmolLM2 file (opt-in: -m real_models): teacher-forced on the float32-dequantized file's greedy tokens, within
  stated logit and top-1 tolerances (as close as transformers' own bfloat16 load of the file).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from polyspec.orchestrator.config import parse_config  # noqa: E402
from polyspec.workers.core.errors import ConfigError, ModelLoadError  # noqa: E402
from polyspec.workers.tiers import gguf_file, gguf_header, loading  # noqa: E402
from polyspec.workers.tiers.gguf_model import _unpermute_rows, load_gguf_weight_only  # noqa: E402
from polyspec.workers.tiers.weight_only import WeightOnlyLinear, dequantize_int4, dequantize_int8  # noqa: E402
from reference_tier import greedy_one_token_at_a_time  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
SMOLLM2 = Path.home() / ".cache/polyspec/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
BF16_STEP = 2.0**-8  # a bfloat16 number's relative rounding


def random_blocks(qtype: str, rows: int, cols: int, rng, d_scale: float = 0.004) -> np.ndarray:
    """[rows, bytes per row] of random bytes (every level, scale and min pattern) with finite float16 d / dmin."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    halves = (rng.uniform(0.5, 1.5, size=(raw.shape[0], 2)) * d_scale * rng.choice([-1, 1], size=(raw.shape[0], 2)))
    halves = halves.astype(np.float16).view(np.uint8).reshape(-1, 4)
    if qtype == "Q6_K":
        raw[:, 208:210] = halves[:, :2]
    else:
        raw[:, 0:2] = halves[:, :2]
        if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            raw[:, 2:4] = np.abs(halves.view(np.float16)[:, 1:2]).view(np.uint8)  # dmin / m: ggml writes them >= 0
    return raw.reshape(rows, -1)


def shape_for(qtype: str) -> tuple[int, int]:
    return (32, 512) if qtype.endswith("_K") else (32, 96)


# ------------------------------------------------------------------------------ unpacking


@pytest.mark.parametrize("qtype", TYPES)
def test_unpacking_gives_ggufs_own_dequantized_values(qtype):
    rng = np.random.default_rng(TYPES.index(qtype))
    rows, cols = shape_for(qtype)
    raw = random_blocks(qtype, rows, cols, rng)
    expected = gguf.quants.dequantize(raw, T[qtype]).reshape(rows, cols)
    levels = gguf_file.unpack(qtype, raw, (rows, cols))
    got = levels.dequantize()
    # equal as numbers (np.array_equal: ggml's d * (q - 8) is -0.0 where d < 0 and q = 8, ours +0.0)
    assert np.isfinite(expected).all() and np.array_equal(got, expected)
    assert levels.levels.shape == (rows, cols) and levels.scale.shape == (rows, cols // levels.group)


def test_a_real_files_tensors_unpack_as_gguf_reads_them():
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not here (polyspec zoo fetch smollm2)")
    _, tensors = gguf_header.read_file(str(SMOLLM2), set())
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):  # Q8_0, Q4_1, Q4_1
        tensor = tensors[name]
        rows = 64
        part = np.asarray(tensor.data).reshape(tensor.shape[0], -1)[:rows]
        expected = gguf.quants.dequantize(part, T[tensor.qtype]).reshape(rows, -1)
        assert np.array_equal(gguf_file.float_rows(tensor.qtype, tensor.data, tensor.matrix_shape, 0, rows), expected), name


def test_the_file_table_is_ggufs_own(tiny_gguf):
    from gguf import GGUFReader

    meta, tensors = gguf_header.read_file(str(tiny_gguf), {"llama.block_count", "general.architecture"})
    assert meta == {"llama.block_count": 2, "general.architecture": "llama"}
    reader = GGUFReader(str(tiny_gguf))
    assert sorted(tensors) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        mine = tensors[t.name]
        assert mine.qtype == t.tensor_type.name and mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(np.asarray(mine.data).view(np.uint8).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


# ------------------------------------------------------------------------------ onto the kernels


@pytest.mark.parametrize("qtype", gguf_file.INT4_TYPES)
def test_int4_keeps_the_files_levels_and_rounds_only_scale_and_zero(qtype):
    rng = np.random.default_rng(7)
    rows, cols = shape_for(qtype)
    levels = gguf_file.unpack(qtype, random_blocks(qtype, rows, cols, rng), (rows, cols))
    weights = gguf_file.int4_weights(levels)
    assert np.array_equal(weights.q.numpy(), levels.levels)  # the levels are the file's
    scale, zero = levels.scale.astype(np.float64), levels.offset + 8 * levels.scale.astype(np.float64)
    assert np.all(np.abs(weights.scale.double().numpy() - scale) <= BF16_STEP * np.abs(scale))
    assert np.all(np.abs(weights.zero.double().numpy() - zero) <= BF16_STEP * np.abs(zero))
    error = np.abs(dequantize_int4(weights).double().numpy() - levels.dequantize())
    bound = np.repeat(BF16_STEP * (8 * np.abs(scale) + np.abs(zero)), levels.group, axis=1) + 1e-7
    assert np.all(error <= bound)


def test_int4_is_exact_where_scale_and_zero_are_bfloat16_numbers():
    """Q4_K with d, dmin powers of two: d * sc and 8 d sc - dmin m fit bfloat16, so nothing is rounded: the kernel
    multiplies the file's own weights (an identity input reads them back, rounded only as its bf16 output)."""
    rng = np.random.default_rng(3)
    rows, cols = 32, 512
    raw = random_blocks("Q4_K", rows, cols, rng)
    blocks = raw.reshape(-1, 144)
    blocks[:, 0:2] = np.full((blocks.shape[0], 1), 2.0**-8, np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((blocks.shape[0], 1), 2.0**-9, np.float16).view(np.uint8)
    blocks[:, 4:8] &= 0x0F  # 4-bit scales (the top bits of sub-blocks 4-7 too): 16 sc - m stays within 8 bits
    blocks[:, 12:16] &= 0x0F
    levels = gguf_file.unpack("Q4_K", raw, (rows, cols))
    weights = gguf_file.int4_weights(levels)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K).reshape(rows, cols))
    assert torch.equal(dequantize_int4(weights), expected)
    module = WeightOnlyLinear.from_int4(weights, None)
    assert torch.equal(module(torch.eye(cols, dtype=torch.bfloat16)).T, expected.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K"])
def test_other_types_requantize_to_int8_within_half_a_step(qtype):
    rng = np.random.default_rng(11)
    rows, cols = shape_for(qtype)
    raw = random_blocks(qtype, rows, cols, rng)
    weights = gguf_file.int8_weights(qtype, raw, (rows, cols))
    exact = torch.from_numpy(gguf.quants.dequantize(raw, T[qtype]).reshape(rows, cols))
    ratio = (dequantize_int8(weights).double() - exact.double()).abs() / weights.scale.double()[:, None]
    assert ratio.max() <= 0.5 + 1e-5, ratio.max()  # half a step, and float32 rounding of q * scale


def test_q8_0_rows_with_one_scale_keep_their_levels():
    rng = np.random.default_rng(5)
    rows, cols = 16, 128
    raw = random_blocks("Q8_0", rows, cols, rng).reshape(rows, -1, 34)
    raw[:, :, 0:2] = np.full((rows, 1, 1), 0.01, np.float16).view(np.uint8).reshape(rows, 1, 2)
    levels = raw[:, :, 2:]
    levels[levels == 128] = 129  # no -128 (llama.cpp's Q8_0 rounds x / (absmax / 127): it never writes one)
    raw[:, 0, 2] = np.uint8(127)  # a full-scale level: the row's absmax is 127 d, so its int8 scale is d
    raw = raw.reshape(rows, -1)
    weights = gguf_file.int8_weights("Q8_0", raw, (rows, cols))
    assert np.array_equal(weights.q.numpy(), gguf_file.unpack("Q8_0", raw, (rows, cols)).levels)


def test_llama_rows_are_put_back_in_hugging_faces_order():
    """llama.cpp's converter permutes q / k rows (head, pair, i) -> (head, i, pair); the loader undoes it."""
    heads, rows = 4, 64
    hf = np.arange(rows)
    in_file = hf.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)  # what the converter writes
    assert np.array_equal(in_file[_unpermute_rows(rows, heads)], hf)


# ------------------------------------------------------------------------------ a tiny model


def write_tiny_gguf(path: Path, hidden=256, ffn=512, layers=2, heads=4, kv=2, vocab=272, seed=0, types=TYPES) -> Path:
    """A llama GGUF with every type polyspec reads (K-quants from random bytes, the rest quantized by gguf itself), no tokenizer."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_eos_token_id(vocab - 1)
    writer.add_vocab_size(vocab)

    def tensor(name, qtype, rows, cols, scale=0.05):
        if qtype.endswith("_K"):
            writer.add_tensor(name, random_blocks(qtype, rows, cols, rng, scale / 8), raw_dtype=T[qtype])
        else:
            values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(values, T[qtype]), raw_dtype=T[qtype])

    tensor("token_embd.weight", "Q8_0", vocab, hidden, 0.5)  # no output.weight: the head is tied to it
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden // heads * kv, hidden), "attn_v": (hidden // heads * kv, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(layers):
        for j, (name, (rows, cols)) in enumerate(shapes.items()):
            tensor(f"blk.{i}.{name}.weight", types[(i + j) % len(types)], rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
    return load_gguf_weight_only(str(tiny_gguf), torch.bfloat16)


def test_every_projection_is_weight_only_from_the_file(tiny_model):
    report = tiny_model.gguf_report
    # TYPES cycled over 2 x 7 projections: 5 are Q4_0 / Q4_1 / Q4_K (int4); 9 others and the Q8_0 head are int8
    assert report["linears"] == {"int4": 5, "int8w": 10}
    assert report["file_types"] == {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2, "Q5_0": 2, "Q5_1": 2, "Q5_K": 2, "Q6_K": 1, "Q8_0": 3}
    assert not [name for name, p in tiny_model.named_parameters() if p.dtype != torch.bfloat16]
    assert "(5 int4 + 10 int8w Linears)" in loading.weight_only_note(tiny_model)


def test_the_tiny_model_is_close_to_transformers_float32_load(tiny_gguf, tiny_model):
    """Reference: transformers dequantizes the same file to float32. Differences: the kernels' bfloat16 activations and
    scales (and the int8 re-quantization): logits within 5 % of their largest magnitude; a greedy pick differs only
    where the reference's top two are closer than twice that difference (random weights have near-ties)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 100, 200, 7, 64, 3, 250]])
    with torch.inference_mode():
        expected, got = reference(ids).logits, tiny_model(ids).logits.float()
    difference = (got - expected).abs().max()
    assert difference <= 0.05 * expected.abs().max()
    picked = expected[0].gather(-1, got[0].argmax(-1, keepdim=True)).squeeze(-1)
    assert bool(((expected[0].amax(-1) - picked) <= 2 * difference).all())
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_the_tiny_model_through_the_engine_is_its_own_greedy_decode(tiny_gguf, tiny_model):
    from polyspec.orchestrator.engine import Engine
    from polyspec.workers.tiers.batched import BatchedModelTier

    config = parse_config({"tiers": [{"name": "target", "model": str(tiny_gguf), "quantize": "gguf", "dtype": "bfloat16"},
                                     {"name": "ng", "model": "ngram"}],
                           "speculation": {"lengths": [4]}, "batching": {"round": "ragged", "max_requests": 2}})
    engine = Engine(config, batched=True)
    assert isinstance(engine.scheduler.tiers[0], BatchedModelTier)
    eos = tiny_model.config.eos_token_id
    for prompt in ([1, 5, 9, 33], [200, 7, 7, 7, 64, 3]):
        result = engine.generate(engine.parse_request({"prompt_ids": prompt, "max_new_tokens": 16}))
        assert result["token_ids"] == greedy_one_token_at_a_time(tiny_model, prompt, 16, eos)


# ------------------------------------------------------------------------------ user mistakes


def test_quantize_gguf_on_a_model_folder_is_one_line(tiny_family):
    with pytest.raises(ConfigError, match="quantize: gguf loads a .gguf file's own quantized blocks") as error:
        parse_config({"tiers": [{"name": "t", "model": tiny_family["target"], "quantize": "gguf"}]})
    assert "\n" not in str(error.value)


def test_quantize_gguf_off_the_cpu_is_one_line(tiny_gguf):
    tier = parse_config({"tiers": [{"name": "t", "model": str(tiny_gguf), "quantize": "gguf", "device": "meta"}]}).tiers[0]
    with pytest.raises(ModelLoadError, match="quantize: gguf loads a .gguf file on the CPU"):
        loading.load_model(tier)


def write_one_block_header(path, architecture: str, tensors: dict | None = None) -> str:
    """A GGUF file of one block of `architecture` with only `tensors`: enough for the loader's refusals."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    for name, values in (tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_another_architecture_is_one_line(tmp_path):
    with pytest.raises(ModelLoadError, match="quantize: gguf reads llama, qwen2 files; this one is 'phi3'"):
        load_gguf_weight_only(write_one_block_header(tmp_path / "other.gguf", "phi3"), torch.bfloat16)


def test_scaled_rotary_embeddings_are_refused_in_one_line(tmp_path):
    path = write_one_block_header(tmp_path / "llama3.gguf", "llama",
                                  {"rope_freqs.weight": np.ones(32, np.float32)})  # Llama 3.1's per-frequency factors
    with pytest.raises(ModelLoadError, match="does not read scaled rotary embeddings"):
        load_gguf_weight_only(path, torch.bfloat16)


def test_a_type_polyspec_does_not_read_is_one_line(tmp_path):
    path = write_tiny_gguf(tmp_path / "q3.gguf", layers=1, types=("Q3_K",))
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight: GGUF type Q3_K is not read by quantize: gguf") as error:
        load_gguf_weight_only(str(path), torch.bfloat16)
    assert "\n" not in str(error.value)


def test_the_quantize_flag_on_a_folder_is_one_line_and_fails(tiny_family):
    done = subprocess.run([sys.executable, "-m", "polyspec", "generate", "-m", tiny_family["target"], "--quantize", "gguf", "-p", "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--quantize: quantize: gguf loads a .gguf file" in lines[0]


# ------------------------------------------------------------------------------ a real file


@pytest.mark.real_models
@pytest.mark.slow
def test_smollm2_from_its_blocks_follows_its_float32_dequantized_self():
    """SmolLM2-135M Q4_1 (int4 with the file's levels, a Q8_0 head on int8) against transformers' float32 load of the
    same file, teacher-forced on the reference's own 32 greedy tokens, 2 prompts (~35 s: transformers' load is most of
    it). Greedy sequences are not compared token for token: transformers' own bfloat16 load of this file leaves the
    float32 one at token 12 of the first prompt too (reference margins go down to 0.02). Tolerances, measured
    2026-12-06: max |logit difference| 1.07 (bf16 load: 0.96) -> at most 1.5; top-1 agreement 0.94 (bf16 load:
    0.94-0.97) -> at least 0.9; and a pick may differ only where the reference's top two are within 2x that difference."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not here (polyspec zoo fetch smollm2)")
    ours = load_gguf_weight_only(str(SMOLLM2), torch.bfloat16, measure_dense_rows=False)
    reference = loading.load_gguf_model(str(SMOLLM2), torch.float32)
    tokenizer = loading.load_gguf_tokenizer(str(SMOLLM2))
    for text in ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "import os\nimport sys\n\ndef main():\n"):
        prompt = tokenizer(text)["input_ids"]
        continuation = greedy_one_token_at_a_time(reference, prompt, 32, -1)  # eos -1: all 32
        ids = torch.tensor([prompt + continuation])
        with torch.inference_mode():
            expected = reference(ids).logits[0, len(prompt) - 1 : -1]
            got = ours(ids).logits[0, len(prompt) - 1 : -1].float()
        difference = (got - expected).abs().max()
        assert difference <= 1.5
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
        picked = expected.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
        assert bool(((expected.amax(-1) - picked) <= 2 * difference).all())
