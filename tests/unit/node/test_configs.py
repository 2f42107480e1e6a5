"""The real node's configuration: everything under its own root, the settings these
machines need."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import yaml

from tools.node import configs, namespace


def test_containerd_config_keeps_everything_under_the_node_root() -> None:
    layout = configs.NodeLayout(Path("/tmp/fgn-x"))
    doc = tomllib.loads(configs.containerd_config(layout, Path("/bin-dir"), "local/pause:1"))
    runtime = doc["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["cdi_spec_dirs"] == ["/tmp/fgn-x/cdi"]
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["BinaryName"] == "/bin-dir/runc"
    assert doc["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == (
        "local/pause:1"
    )
    assert doc["grpc"]["address"].startswith("/tmp/fgn-x/")
    assert doc["root"].startswith("/tmp/fgn-x/") and doc["state"].startswith("/tmp/fgn-x/")


def test_cni_and_kubelet_configs() -> None:
    layout = configs.NodeLayout(Path("/tmp/fgn-x"))
    cni = json.loads(configs.cni_config_text(layout))
    bridge = cni["plugins"][0]
    assert bridge["ipam"]["ranges"] == [[{"subnet": configs.POD_SUBNET}]]
    assert bridge["ipMasq"] is False
    kubelet = yaml.safe_load(
        configs.kubelet_config(layout, Path("/ca.crt"), "/flexgpu-node-x", {"A": True})
    )
    assert kubelet["failCgroupV1"] is False
    assert kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["cgroupRoot"] == "/flexgpu-node-x"
    assert kubelet["podLogsDir"] == "/tmp/fgn-x/pod-logs"
    assert kubelet["featureGates"] == {"A": True}


def test_namespace_enters_with_nsenter_and_holds_the_service_address() -> None:
    assert namespace.enter_argv(42, ["x"]) == ["nsenter", "-t", "42", "-m", "-n", "--", "x"]
    script = namespace.holder_script(Path("/drv/dev"), Path("/w"))
    assert f"ip addr add {configs.API_SERVICE_IP}/32 dev lo" in script
    assert "lowerdir=/drv/dev:/dev" in script


def test_containerd_pulls_from_the_local_registry_over_plain_http() -> None:
    """containerd reads per-registry host settings from the node's own folder, and the
    local registry's hosts.toml sends pulls and resolves to plain HTTP at that address."""
    layout = configs.NodeLayout(Path("/tmp/fgn-x"))
    doc = tomllib.loads(configs.containerd_config(layout, Path("/bin-dir"), "local/pause:1"))
    images = doc["plugins"]["io.containerd.cri.v1.images"]
    assert images["registry"]["config_path"] == "/tmp/fgn-x/etc/certs.d"
    hosts = tomllib.loads(configs.registry_hosts_toml("127.0.0.1:5123"))
    assert hosts["server"] == "http://127.0.0.1:5123"
    assert hosts["host"]["http://127.0.0.1:5123"]["capabilities"] == ["pull", "resolve"]
