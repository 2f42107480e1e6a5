"""What a container really receives on the real node from NVIDIA's own DRA kubelet plugin
(v0.4.1, the gates a GPU user turns on: TimeSlicingSettings, MPSSupport, NVMLDeviceHealthCheck)
and from flexgpu's, for the same claims: one whole GPU, one 1g.10gb MIG device, one GPU shared
by time-slicing (interval Long, as NVIDIA's quickstart gpu-test5 asks). NVIDIA's plugin runs
inside the node's namespaces as its DaemonSet would (tools/nvidia_twin/node_plugin.py), over the
NVML mock library serving a DGX H100 whose GPUs 6 and 7 carry the MIG layouts mig-parted leaves
(tests/nvidia_machine.py); flexgpu's is the chart-installed plugin of the session's node, whose
MIG devices are partitioned on demand on GPU 4. One pod per claim and driver; each container
reports its environment, device nodes (and whether its device cgroup lets them open), driver
files and mounts from inside. The differences are listed with their reasons in
docs/nvidia-differential.md ("On the real node"); an unlisted or stale one fails."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.node.nvidia_node import differences, documented, nvidia_plugin, reduce
from tests.node.support import (
    create_claim,
    delete_pods,
    one_claim_pod,
    run_pod,
    wait_report,
)
from tests.nvidia_machine import machine
from tools.cluster.process import Component
from tools.node.node import RealNode
from tools.nvidia_twin import NVIDIA_DRIVER

pytestmark = pytest.mark.integration

START, END = "<!-- nvidia-node:start -->", "<!-- nvidia-node:end -->"
NAMESPACE = "nvtwin-node"
FLEXGPU = "gpu.flexgpu.dev"
# Each driver's names: DeviceClass prefix-free domain, opaque config apiVersion.
API_VERSIONS = {NVIDIA_DRIVER: "resource.nvidia.com/v1beta1", FLEXGPU: "gpu.flexgpu.dev/v1alpha1"}
CLAIMS = ("gpu", "mig", "time-slicing")
LABELS = ("nvidia", "flexgpu")


def claim_devices(claim: str, driver: str) -> dict[str, Any]:
    """The claim's ``spec.devices`` as written for ``driver``: NVIDIA's quickstart shapes, with
    only the driver's names changed for flexgpu."""
    if claim == "mig":
        profile = f"device.attributes['{driver}'].profile == '1g.10gb'"
        exactly = {"deviceClassName": f"mig.{driver.split('.', 1)[1]}", "count": 1}
        exactly["selectors"] = [{"cel": {"expression": profile}}]
        return {"requests": [{"name": "mig", "exactly": exactly}]}
    request = {"name": "gpu", "exactly": {"deviceClassName": driver, "count": 1}}
    if claim == "gpu":
        return {"requests": [request]}
    sharing = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    parameters = {"apiVersion": API_VERSIONS[driver], "kind": "GpuConfig", "sharing": sharing}
    config = {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}
    return {"requests": [request], "config": [config]}


@pytest.fixture(scope="module")
def nvidia_on_node(
    plugin: RealNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Component]:
    folder = Path(tmp_path_factory.mktemp("nvtwin-node"))
    with nvidia_plugin(plugin, machine(folder, mig_layouts=True)) as component:
        core: Any = client.CoreV1Api(plugin.api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        yield component


Reports = dict[str, dict[str, dict[str, str]]]


@pytest.fixture(scope="module")
def reports(plugin: RealNode, nvidia_on_node: Component) -> Iterator[Reports]:
    """claim -> driver label -> what its container reported (reduced)."""
    api = plugin.api
    got: Reports = {claim: {} for claim in CLAIMS}
    try:
        for claim in CLAIMS:
            for label, driver in zip(LABELS, (NVIDIA_DRIVER, FLEXGPU), strict=True):
                name = f"{label}-{claim}"
                create_claim(api, NAMESPACE, name, claim_devices(claim, driver))
                try:
                    run_pod(api, NAMESPACE, one_claim_pod(plugin, name, name), timeout_s=120)
                except BaseException:
                    print(nvidia_on_node.log_tail(60))
                    raise
                got[claim][label] = reduce(wait_report(plugin, NAMESPACE, name))
        yield got
    finally:
        # The session's other tests count on the node's GPUs: give them back (each plugin
        # unprepares while the pod goes) before NVIDIA's plugin stops.
        delete_pods(api, NAMESPACE, *[p.metadata.name for p in _pods(api)])
        client.ResourceV1Api(api).delete_collection_namespaced_resource_claim(NAMESPACE)


def _pods(api: Any) -> list[Any]:
    return list(client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items)


def _gpu_nodes(seen: dict[str, str]) -> list[str]:
    return [k for k in seen if k.startswith("device /dev/nvidia<N>")]


@pytest.mark.parametrize("claim", ["gpu", "time-slicing"])
def test_each_container_gets_exactly_its_gpu(reports: Reports, claim: str) -> None:
    for label, seen in reports[claim].items():
        assert _gpu_nodes(seen) == ["device /dev/nvidia<N>"], f"{label}: {_gpu_nodes(seen)}"
        assert seen["device /dev/nvidia<N>"] == "opens", f"{label}: its GPU is denied"
        others = [k for k in seen if re.fullmatch(r"device /dev/nvidia\d+", k)]
        assert not others, f"{label}: other GPUs' nodes visible: {others}"


def test_mig_containers_get_their_partition_only(reports: Reports) -> None:
    """Each driver's MIG container gets its parent GPU's node and the partition's own GPU- and
    compute-instance capability nodes, all opening, and no other GPU's or partition's."""
    for label, seen in reports["mig"].items():
        assert _gpu_nodes(seen) == ["device /dev/nvidia<N>"], f"{label}: {_gpu_nodes(seen)}"
        own = sorted(k for k in seen if re.fullmatch(r"device /dev/nvidia-caps/<\w+-cap>", k))
        assert own == ["device /dev/nvidia-caps/<ci-cap>", "device /dev/nvidia-caps/<gi-cap>"], (
            f"{label}: {own}"
        )
        assert all(seen[k] == "opens" for k in [*own, *_gpu_nodes(seen)]), f"{label}: {seen}"
        extra = [k for k in seen if re.fullmatch(r"device /dev/nvidia-caps/<cap\d>", k)]
        assert not extra, f"{label}: other partitions' nodes visible: {extra}"


def test_containers_differ_only_where_documented(reports: Reports) -> None:
    measured: set[tuple[str, ...]] = set()
    for claim, by_driver in reports.items():
        found = differences(by_driver["nvidia"], by_driver["flexgpu"])
        measured |= {(claim, *row) for row in found}
    listed = documented(START, END, cells=5)
    unlisted = sorted(measured - listed.keys())
    stale = sorted(listed.keys() - measured)
    table = "\n".join(f"| {c} | {k} | `{a}` | `{b}` | |" for c, k, a, b in unlisted)
    assert not unlisted and not stale, f"unlisted:\n{table}\nstale: {stale}"
    for row in measured:
        assert listed[row], f"{row}: the table must give the reason for the difference"
