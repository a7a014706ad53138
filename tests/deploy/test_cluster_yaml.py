"""Every `ray up` cluster YAML passes Ray's own cluster-config validation (the schema Ray
ships, plus the launcher's config preparation), and every resource a shipped chain config
pins exists on a node of every cluster YAML."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from polyspec.orchestrator.config import load_config
from polyspec.orchestrator.validate import cluster_node_types, validate_cluster_yaml
from polyspec.workers.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((REPO / "cluster").glob("*.yaml"))
CHAIN_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
TIER_RESOURCES = {"tier_target", "tier_mid", "tier_small"}


def test_the_cluster_yamls_are_there():
    assert {p.name for p in CLUSTER_YAMLS} >= {"aws.yaml", "gcp.yaml", "local.yaml"}


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_passes_rays_validation(path):
    validate_cluster_yaml(path)  # raises ConfigError naming the offending key


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_every_tier_resource_is_on_its_own_node(path):
    nodes = cluster_node_types(path)
    for resource in TIER_RESOURCES:
        holders = [n.name for n in nodes if resource in n.resources]
        assert len(holders) == 1, f"{path.name}: {resource} on {holders}"
    assert all(len(set(n.resources) & TIER_RESOURCES) <= 1 for n in nodes), "two tiers share a node type"


@pytest.mark.parametrize(
    "mutation, message",
    [
        (lambda c: c.__setitem__("head_start_ray_comands", c.pop("head_start_ray_commands")), "head_start_ray_comands"),
        (lambda c: c["available_node_types"]["gpu_mid"].pop("node_config"), "node_config"),
        (lambda c: c["available_node_types"]["gpu_mid"].__setitem__("resources", {"tier_mid": "one"}), "one"),
        (lambda c: c.__setitem__("head_node_type", "haed"), "head_node_type"),
    ],
    ids=["typo'd key", "missing node_config", "non-integer resource", "unknown head type"],
)
def test_a_typo_fails_validation(tmp_path, mutation, message):
    config = yaml.safe_load((REPO / "cluster" / "aws.yaml").read_text())
    mutation(config)
    broken = tmp_path / "aws.yaml"
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="fails Ray's validation") as caught:
        validate_cluster_yaml(broken)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_typo_in_the_local_provider_fails_validation(tmp_path):
    config = yaml.safe_load((REPO / "cluster" / "local.yaml").read_text())
    config["provider"]["worker_ip"] = config["provider"].pop("worker_ips")
    broken = tmp_path / "local.yaml"
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="worker_ips"):
        validate_cluster_yaml(broken)


@pytest.mark.parametrize("config_path", CHAIN_CONFIGS, ids=lambda p: p.name)
def test_every_pinned_resource_exists_in_every_cluster_yaml(config_path):
    config = load_config(str(config_path))
    for cluster in CLUSTER_YAMLS:
        offered = {r for node in cluster_node_types(cluster) for r in node.resources}
        for tier in config.tiers:
            missing = set(tier.resources or {}) - offered
            assert not missing, f"{config_path.name}: tier {tier.name} pins {missing}, not in {cluster.name}"


def test_the_paper_families_pin_one_tier_per_node():
    for name in ("llama2-chat-7b", "llama3-8b-instruct", "vicuna-7b", "qwen2-7b-instruct"):
        config = load_config(str(REPO / "configs" / f"{name}.yaml"))
        assert [list(t.resources) for t in config.tiers] == [["tier_target"], ["tier_mid"], ["tier_small"]]
        assert config.tiers[1].quantize == "int4" and config.tiers[1].model == config.tiers[0].model
        assert config.speculation.lengths == "auto" and config.runtime.backend == "ray"


# ------------------------------------------------------------------------ try-local.sh

TRY_LOCAL = REPO / "cluster" / "try-local.sh"


def test_try_local_is_valid_bash():
    subprocess.run(["bash", "-n", str(TRY_LOCAL)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(TRY_LOCAL)], check=True)


def test_try_local_renders_a_valid_three_node_cluster(tmp_path):
    out = tmp_path / "local.yaml"
    env = {**os.environ, "POLYSPEC_TRY_LOCAL_DIR": str(tmp_path / "state")}
    subprocess.run(["bash", str(TRY_LOCAL), "render", str(out)], check=True, env=env, timeout=60)
    rendered = yaml.safe_load(out.read_text())
    assert rendered["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": ["127.0.0.2", "127.0.0.3"]}
    nodes = cluster_node_types(out)  # Ray-validated
    placed = {}
    for tier in load_config(str(REPO / "configs" / "demo-ray.yaml")).tiers:
        holders = [n.name for n in nodes if all(n.resources.get(r, 0) >= a for r, a in tier.resources.items())]
        assert len(holders) == 1, (tier.name, holders)
        placed[tier.name] = holders[0]
    assert placed == {"target": "head 127.0.0.1", "mid": "worker 127.0.0.2", "small": "worker 127.0.0.3"}
    addresses = yaml.safe_dump(rendered)
    assert all(ip.startswith("127.") for ip in [rendered["provider"]["head_ip"], *rendered["provider"]["worker_ips"]])
    assert "192.168." not in addresses  # nothing of the template's example network is left


def test_try_local_without_a_command_prints_usage():
    result = subprocess.run(["bash", str(TRY_LOCAL)], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr
