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

from tests.node.support import (
    create_claim,
    delete_pods,
    one_claim_pod,
    run_pod,
    wait_report,
)
from tests.nvidia_ctk import tools_dir
from tests.nvidia_machine import machine
from tests.nvidia_plugin import nvidia_binary
from tests.nvml_library import ENV_CONFIG, ENV_STATE
from tools.cluster.process import Component
from tools.node import report
from tools.node.node import RealNode
from tools.nvidia_twin import NVIDIA_DRIVER, STATIC_GATES, node_plugin

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvidia-differential.md"
START, END = "<!-- nvidia-node:start -->", "<!-- nvidia-node:end -->"
ABSENT = "(absent)"
NAMESPACE = "nvtwin-node"
FLEXGPU = "gpu.flexgpu.dev"
# Each driver's names: DeviceClass prefix-free domain, opaque config apiVersion.
API_VERSIONS = {NVIDIA_DRIVER: "resource.nvidia.com/v1beta1", FLEXGPU: "gpu.flexgpu.dev/v1alpha1"}
CLAIMS = ("gpu", "mig", "time-slicing")
LABELS = ("nvidia", "flexgpu")
# The MIG capability files every container may get (config, monitor): not a partition's own.
SHARED_CAPS = {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"}


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
    node = plugin
    root = node.layout.root / "nvidia-plugin"
    made = machine(Path(tmp_path_factory.mktemp("nvtwin-node")), mig_layouts=True)
    component = node_plugin.start(
        node,
        root,
        binary=nvidia_binary(),
        cdi_hook=tools_dir() / "nvidia-cdi-hook",
        machine_env={k: v for k, v in made.env().items() if k in (ENV_CONFIG, ENV_STATE)},
        feature_gates=STATIC_GATES,
    )
    node_plugin.create_device_classes(node.api)
    core: Any = client.CoreV1Api(node.api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    try:
        yield component
    finally:
        component.stop()
        node_plugin.remove(node.api, node)


def _reduce(rep: report.Report, claim: str) -> dict[str, str]:
    """The report with what differs by pod replaced: the GPU's (or MIG device's) UUID and
    /dev/nvidiaN, a partition's own capability nodes, device names, the claim's name and uid;
    the pod's own name (HOSTNAME) is left out."""
    uuids = rep.visible_devices
    gpu_nodes = [p for p in rep.devices if re.fullmatch(r"/dev/nvidia\d+", p)]
    caps = sorted(
        (p for p in rep.devices if p.startswith("/dev/nvidia-caps/") and p not in SHARED_CAPS),
        key=lambda p: int(re.sub(r"\D", "", p) or 0),
    )
    cap_names = dict(zip(caps, ("<gi-cap>", "<ci-cap>", "<cap3>", "<cap4>"), strict=False))

    def template(text: str) -> str:
        for uuid in uuids:
            text = text.replace(uuid, "<uuid>")
        # Other UUIDs (a MIG device's parent) by kind.
        text = re.sub(r"\bGPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<gpu-uuid>", text)
        for path in gpu_nodes:
            text = re.sub(rf"{re.escape(path)}\b", "/dev/nvidia<N>", text)
        for path, name in cap_names.items():
            text = re.sub(rf"{re.escape(path)}\b", f"/dev/nvidia-caps/{name}", text)
        text = re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<uid>", text)
        # Variable names spell a uid in capitals with underscores.
        text = re.sub(r"[0-9A-F]{8}(_[0-9A-F]{4}){3}_[0-9A-F]{12}", "<UID>", text)
        # Which GPU and placement the scheduler picked is not the driver's doing.
        text = re.sub(r"\bgpu-\d+-mig-[0-9a-z]+-\d+\b", "gpu-<N>-mig-<profile>-<start>", text)
        text = re.sub(r"_GPU_\d+_MIG_[0-9A-Z]+_\d+\b", "_GPU_<N>_MIG_<PROFILE>_<START>", text)
        text = re.sub(r"_GPU_\d+\b", "_GPU_<N>", re.sub(r"\bgpu-\d+\b", "gpu-<N>", text))
        return text.replace(f"{NAMESPACE}/{claim}", f"{NAMESPACE}/<claim>")

    out: dict[str, str] = {}
    for name, value in rep.env.items():
        if name != "HOSTNAME":
            out[f"env {template(name)}"] = template(value)
    for path, device in rep.devices.items():
        out[f"device {template(path)}"] = "opens" if device.cgroup_allows else "denied"
    for path in rep.files:
        out[f"file {template(path)}"] = "present"
    for mount in rep.mounts:
        out[f"mount {template(mount)}"] = "present"
    return out


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
                got[claim][label] = _reduce(wait_report(plugin, NAMESPACE, name), name)
        yield got
    finally:
        # The session's other tests count on the node's GPUs: give them back (each plugin
        # unprepares while the pod goes) before NVIDIA's plugin stops.
        delete_pods(api, NAMESPACE, *[p.metadata.name for p in _pods(api)])
        client.ResourceV1Api(api).delete_collection_namespaced_resource_claim(NAMESPACE)


def _pods(api: Any) -> list[Any]:
    return list(client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items)


Row = tuple[str, str, str, str]


def _documented() -> dict[Row, str]:
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index(START) + len(START) : text.index(END)]
    rows: dict[Row, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("Claim", "") or set(cells[0]) <= {"-"}:
            continue
        claim, seen, theirs, ours, why = (c.strip("`") for c in cells)
        rows[(claim, seen, theirs, ours)] = why
    return rows


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
    measured: set[Row] = set()
    for claim, by_driver in reports.items():
        theirs, ours = by_driver["nvidia"], by_driver["flexgpu"]
        measured |= {
            (claim, k, theirs.get(k, ABSENT), ours.get(k, ABSENT))
            for k in theirs.keys() | ours.keys()
            if theirs.get(k, ABSENT) != ours.get(k, ABSENT)
        }
    listed = _documented()
    unlisted = sorted(measured - listed.keys())
    stale = sorted(listed.keys() - measured)
    table = "\n".join(f"| {c} | {k} | `{a}` | `{b}` | |" for c, k, a, b in unlisted)
    assert not unlisted and not stale, f"unlisted:\n{table}\nstale: {stale}"
    for row in measured:
        assert listed[row], f"{row}: the table must give the reason for the difference"
