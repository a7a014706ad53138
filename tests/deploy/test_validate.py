"""`polyspec validate`: offline config checks and the placement plan (no weights, no Hub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from polyspec.orchestrator.cli import main
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.validate import KNOWN_MODELS, estimate_memory, model_shape

REPO = Path(__file__).resolve().parents[2]
CHAIN_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
PAPER_FAMILIES = ["llama2-chat-7b", "llama3-8b-instruct", "vicuna-7b", "qwen2-7b-instruct"]


def run_validate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "polyspec.orchestrator.cli", "validate", *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )


def write_config(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def paper_config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())


def names_zoo_models(config_path: Path) -> bool:
    return "zoo:" in config_path.read_text()


@pytest.mark.parametrize("config_path", CHAIN_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(config_path, capsys):
    # the real-model configs name folders `polyspec zoo fetch` writes, which a machine may not have yet
    flags = ["--no-model-check"] if names_zoo_models(config_path) else []
    assert main(["validate", "-c", str(config_path), *flags]) == 0
    report = capsys.readouterr().out
    assert "placement plan:" in report and "OK" in report


def test_a_real_model_config_without_its_models_says_how_to_fetch_them(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSPEC_MODEL_CACHE", str(tmp_path / "empty-cache"))
    result = run_validate("-c", "configs/qwen2.5-coder-4tier.yaml")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"polyspec: error: tier 'target': model path '{tmp_path / 'empty-cache' / 'qwen2.5-coder-1.5b'}' "
                             "does not exist; fetch it first: polyspec zoo fetch qwen2.5-coder-1.5b\n")


def test_a_missing_local_path_is_one_line_not_a_hub_error(tmp_path):
    result = run_validate("-c", write_config(tmp_path, {"tiers": [{"name": "target", "model": str(tmp_path / "no-such-model")}]}))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("polyspec: error: tier 'target': model path") and "does not exist" in result.stderr


def test_an_int8_copy_of_the_target_may_verify_for_a_smaller_float_model(tmp_path, capsys):
    # same parameter count as the target, fewer bytes than the float drafter: the order is by parameters
    raw = {"tiers": [{"name": "target", "model": str(REPO / "models/stdlib/target")},
                     {"name": "int8", "model": str(REPO / "models/stdlib/target"), "quantize": "int8"},
                     {"name": "small", "model": str(REPO / "models/stdlib/small")}]}
    assert main(["validate", "-c", write_config(tmp_path, raw)]) == 0


@pytest.mark.parametrize("name", PAPER_FAMILIES)
def test_the_plan_puts_each_tier_on_its_own_gpu_node_type(name, capsys):
    assert main(["validate", "-c", f"configs/{name}.yaml", "--cluster", "cluster/aws.yaml"]) == 0
    report = capsys.readouterr().out
    for tier, node in (("target", "gpu_target"), ("mid", "gpu_mid"), ("small", "gpu_small")):
        section = report.split(f"  {tier}: ")[1].split("\n  ")[0:4]
        assert any(f"aws.yaml:{node}" in line and "- fits" in line for line in section), report
    assert "int4 weight-only: torch's kernels on the CPU and a CUDA GPU" in report
    assert "unknown" not in report  # the built-in table knows every paper model


def test_the_real_command_line(tmp_path):
    result = run_validate("-c", "configs/demo-ray.yaml", "--cluster", "cluster/local.yaml")
    assert result.returncode == 0, result.stderr
    assert "local.yaml:worker 192.168.1.12" in result.stdout  # mid's node in the on-prem template
    assert "safetensors headers" in result.stdout


def test_a_typod_resource_is_one_line_and_exit_2(tmp_path):
    raw = paper_config("vicuna-7b")
    raw["tiers"][1]["resources"] = {"tier_mdi": 1}
    result = run_validate("-c", write_config(tmp_path, raw))
    assert result.returncode == 2
    assert result.stderr.startswith("polyspec: error: tier 'mid' pins resource 'tier_mdi'")
    assert "known: tier_mid, tier_small, tier_target" in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_a_pin_on_an_amount_no_node_has_fails(tmp_path, capsys):
    raw = paper_config("vicuna-7b")
    raw["tiers"][0]["resources"] = {"tier_target": 2}
    assert main(["validate", "-c", write_config(tmp_path, raw)]) == 2
    assert "tier_target" in capsys.readouterr().err


def test_a_broken_cluster_yaml_is_one_line_and_exit_2(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster" / "gcp.yaml").read_text())
    cluster["available_node_types"]["gpu_small"]["min_worker"] = 1
    path = tmp_path / "gcp.yaml"
    path.write_text(yaml.safe_dump(cluster))
    result = run_validate("-c", "configs/qwen2-7b-instruct.yaml", "--cluster", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith("polyspec: error: cluster YAML") and "min_worker" in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_missing_config_is_one_line_and_exit_2():
    result = run_validate("-c", "configs/nope.yaml")
    assert result.returncode == 2 and result.stderr == "polyspec: error: config file not found: configs/nope.yaml\n"


def test_tier_order_drafter_bigger_than_its_verifier_fails(tmp_path, capsys):
    raw = {
        "tiers": [
            {"name": "target", "model": str(REPO / "models/stdlib/small")},
            {"name": "drafter", "model": str(REPO / "models/stdlib/target")},
        ]
    }
    assert main(["validate", "-c", write_config(tmp_path, raw)]) == 2
    assert "tier order: 'drafter'" in capsys.readouterr().err


def test_int8w_on_a_gpu_is_rejected(tmp_path, capsys):
    raw = paper_config("llama2-chat-7b")
    raw["tiers"][1].update(device="cuda", quantize="int8w")
    assert main(["validate", "-c", write_config(tmp_path, raw)]) == 2
    assert "int8w (torch's weight-only int8 kernel) runs on CPU only" in capsys.readouterr().err


def test_a_local_backend_config_is_embedded(capsys):
    assert main(["validate", "-c", "configs/demo.yaml"]) == 0
    report = capsys.readouterr().out
    assert report.count("node: this process") == 3
    assert "model-free" in report  # the n-gram tier


def test_the_parameter_count_of_a_local_model_is_exact():
    from safetensors.torch import load_file

    directory = REPO / "models/stdlib/target"
    tensors = load_file(str(next(directory.glob("*.safetensors"))))
    assert model_shape(str(directory)).params == sum(t.numel() for t in tensors.values())


def test_an_uncached_unknown_hub_id_is_unknown_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # empty cache
    tier = parse_config({"tiers": [{"name": "t", "model": "someone/never-heard-of-it"}]}).tiers[0]
    memory = estimate_memory(tier)
    assert memory.total_bytes is None and memory.note == "unknown (hub id not cached)"


def test_memory_scales_with_dtype_and_quantization():
    base = {"name": "t", "model": "meta-llama/Llama-2-7b-chat-hf"}
    weights = {}
    for extra in ({"dtype": "float32"}, {"dtype": "float16"}, {"dtype": "float16", "quantize": "int4"},
                  {"dtype": "bfloat16", "quantize": "fp8"}):
        tier = parse_config({"tiers": [{**base, **extra}]}).tiers[0]
        weights[json.dumps(extra)] = estimate_memory(tier).weights_bytes
    fp32, fp16, int4, fp8 = weights.values()
    assert fp32 == 2 * fp16 == 4 * fp8 == 8 * int4 == 4 * KNOWN_MODELS[base["model"]].params


def test_an_fp8_copy_names_its_path_and_runs_on_cpu_or_cuda_only(tmp_path, capsys):
    raw = {"tiers": [{"name": "target", "model": str(REPO / "models/stdlib/target")},
                     {"name": "fp8", "model": str(REPO / "models/stdlib/target"), "quantize": "fp8"}]}
    assert main(["validate", "-c", write_config(tmp_path, raw)]) == 0
    assert "fp8 GEMM (torch._scaled_mm) on CUDA compute capability >= 8.9; weight-only elsewhere" in capsys.readouterr().out
    raw["tiers"][1]["device"] = "mps"
    assert main(["validate", "-c", write_config(tmp_path, raw)]) == 2
    assert capsys.readouterr().err == "polyspec: error: tier 'fp8': quantize: fp8 runs on CPU or CUDA, not mps\n"
