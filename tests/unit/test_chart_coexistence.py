"""The chart beside NVIDIA's stack: opt-in DeviceClasses that serve pods asking for
``nvidia.com/gpu`` and ``nvidia.com/mig-<profile>``, a guard that keeps the plugin off nodes
NVIDIA's device plugin serves, and the health settings passed to the plugin."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.allocation import (
    allocate,
    allocated_state,
    parse_claim,
    parse_device_class,
    parse_node,
    parse_slice,
)
from flexgpu.driver.mig_catalog import MIG_PRODUCT_FAMILIES, mig_profiles_for
from flexgpu.driver.resource_slice import slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from tests.unit.test_chart import find, helm, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py

GUARD = {"key": "nvidia.com/gpu.deploy.device-plugin", "operator": "NotIn", "values": ["true"]}


def _classes(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}


def _affinity(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    return dict(spec.get("affinity") or {})


def test_mig_profile_classes_are_opt_in(helm: Path) -> None:
    assert set(_classes(render(helm))) == {
        "gpu.flexgpu.dev",
        "mig.flexgpu.dev",
        "shared-gpu.flexgpu.dev",
    }


def test_every_mig_profile_of_the_catalog_gets_a_class_named_as_nvidia_names_it(
    helm: Path,
) -> None:
    classes = _classes(render(helm, "deviceClasses.migExtendedResources.enabled=true"))
    catalog = {
        p.name for f in MIG_PRODUCT_FAMILIES for p in mig_profiles_for(f) if "+" not in p.name
    }
    served = {
        c["spec"]["extendedResourceName"]: name
        for name, c in classes.items()
        if name.startswith("mig-")
    }
    assert set(served) == {f"nvidia.com/mig-{p}" for p in catalog}
    assert served["nvidia.com/mig-1g.10gb"] == "mig-1g.10gb.flexgpu.dev"


def _allocate(devices: NodeDevices, device_class: dict[str, Any]) -> list[str]:
    """The devices of the node the scheduler's rules give a claim of that class."""
    slices = [
        parse_slice({"metadata": {"name": f"s{i}"}, "spec": spec})
        for i, spec in enumerate(slice_specs("node-a", devices.slice_devices(), 1))
    ]
    name = device_class["metadata"]["name"]
    claim = parse_claim(
        {
            "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
            "spec": {
                "devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": name}}]}
            },
        }
    )
    node = parse_node({"metadata": {"name": "node-a", "labels": {}}})
    verdict = allocate(
        [claim], node, slices, {name: parse_device_class(device_class)}, allocated_state([])
    )
    return [d.device for d in verdict.devices[0]] if verdict.outcome == "allocatable" else []


def test_a_profile_class_selects_exactly_that_profiles_partitions(helm: Path) -> None:
    classes = _classes(render(helm, "deviceClasses.migExtendedResources.enabled=true"))
    backend = SimulatedBackend.from_topology("dgx-a100-8", "node-a")
    backend.set_mig_mode(0, True)  # laid out beforehand, as mig-parted does
    by_name = {p.name: p for p in backend.mig_profiles(0)}
    backend.create_mig_device(0, by_name["2g.10gb"].profile_id, by_name["2g.10gb"].placements[0])
    backend.create_mig_device(0, by_name["1g.5gb"].profile_id, by_name["1g.5gb"].placements[-1])
    devices = NodeDevices(backend)
    assert _allocate(devices, classes["mig-2g.10gb.flexgpu.dev"]) == ["gpu-0-mig-2g10gb-0"]
    assert _allocate(devices, classes["mig-3g.20gb.flexgpu.dev"]) == []
    assert _allocate(devices, classes["gpu.flexgpu.dev"]) == ["gpu-1"]


LABELLED = "kubeletPlugin.devicePluginGuard.labelKey=nvidia.com/gpu.deploy.device-plugin"


def _env(docs: list[dict[str, Any]]) -> dict[str, str | None]:
    spec = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    return {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}


def test_by_default_no_label_keeps_the_plugin_off_an_operator_node(helm: Path) -> None:
    """The GPU Operator labels every GPU node nvidia.com/gpu.deploy.device-plugin=true even
    with its device plugin off: the default affinity must not key on it. The plugin checks
    the Node's allocatable itself (FLEXGPU_DEVICE_PLUGIN_GUARD)."""
    docs = render(helm)
    terms = _affinity(docs)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert not any(k.startswith("nvidia.com/gpu.deploy") for k in keys)
    assert _env(docs)["FLEXGPU_DEVICE_PLUGIN_GUARD"] == "on"
    assert _env(docs)["FLEXGPU_DEVICE_PLUGIN_RECHECK"] == "30s"
    off = render(
        helm,
        "kubeletPlugin.devicePluginGuard.enabled=false",
        "kubeletPlugin.devicePluginGuard.recheckInterval=1m",
    )
    assert _env(off)["FLEXGPU_DEVICE_PLUGIN_GUARD"] == "off"
    assert _env(off)["FLEXGPU_DEVICE_PLUGIN_RECHECK"] == "1m"


def test_a_guard_label_joins_every_term_of_the_default_and_a_custom_affinity(
    helm: Path,
) -> None:
    terms = _affinity(render(helm, LABELLED))["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert len(terms["nodeSelectorTerms"]) == 2
    assert all(GUARD in t["matchExpressions"] for t in terms["nodeSelectorTerms"])
    custom = render(
        helm,
        LABELLED,
        "kubeletPlugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=gpu",
        "kubeletPlugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    )
    required = _affinity(custom)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}, GUARD]}
    ]
    empty = render(helm, LABELLED, "kubeletPlugin.affinity=null")
    required = _affinity(empty)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == [{"matchExpressions": [GUARD]}]


def test_the_guard_label_can_be_switched_off_or_moved_to_another_label(helm: Path) -> None:
    off = _affinity(render(helm, LABELLED, "kubeletPlugin.devicePluginGuard.enabled=false"))
    terms = off["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert all(GUARD not in t["matchExpressions"] for t in terms["nodeSelectorTerms"])
    moved = _affinity(render(helm, "kubeletPlugin.devicePluginGuard.labelKey=example.com/dp"))
    terms = moved["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert all(
        {**GUARD, "key": "example.com/dp"} in t["matchExpressions"]
        for t in terms["nodeSelectorTerms"]
    )


def test_health_settings_reach_the_plugin(helm: Path) -> None:
    docs = render(helm, "kubeletPlugin.healthTaints=off", "kubeletPlugin.healthRecoveryPeriod=90s")
    env = {
        e["name"]: e.get("value")
        for e in find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["FLEXGPU_HEALTH_TAINTS"] == "off"
    assert env["FLEXGPU_HEALTH_RECOVERY_PERIOD"] == "90s"


@pytest.mark.parametrize(
    "value",
    [
        "kubeletPlugin.healthTaints=sometimes",
        "kubeletPlugin.healthRecoveryPeriod=5 minutes",
        "deviceClasses.migExtendedResources.profiles={1g.10gb+me}",
        "deviceClasses.migExtendedResources.prefix=mig-",
        "kubeletPlugin.devicePluginGuard.recheckInterval=often",
    ],
)
def test_bad_values_are_refused(helm: Path, value: str) -> None:
    with pytest.raises(subprocess.CalledProcessError) as err:
        render(helm, value)
    assert "values don't meet the specifications of the schema" in err.value.stderr
