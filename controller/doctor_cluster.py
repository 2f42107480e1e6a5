"""Cluster-wide preflight for ``flexgpu doctor``: the server's release and the DRA feature gates
it has on (from the API server's ``kubernetes_feature_enabled`` metric), nodes that NVIDIA's
device plugin and flexgpu would both serve, GPU nodes without a flexgpu plugin, and each node's
own preflight verdict (the Event the plugin pod's init container records)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kubernetes import client

from flexgpu.controller.cli_options import Connection, call
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.preflight import Check, Status

OLDEST_MINOR: Final = 34
# Gate -> (what needs it, the first minor where it is on by default).
GATES: Final[Mapping[str, tuple[str, int]]] = {
    "DRAPartitionableDevices": ("on-demand MIG (dynamicMigGpus, DynamicMIG policies)", 36),
    "DRAConsumableCapacity": ("GPU fractions (shared-gpu.flexgpu.dev)", 36),
    "DRADeviceTaints": ("repartitioning without a drain, health taints", 36),
    "DRAExtendedResource": ("nvidia.com/gpu through DRA", 36),
    "ResourceHealthStatus": ("device health in pod status", 36),
}
GPU_NODE_LABELS: Final = (
    ("feature.node.kubernetes.io/pci-10de.present", "true"),
    ("nvidia.com/gpu.present", "true"),
)
PREFLIGHT_REASONS: Final = ("FlexgpuPreflightPassed", "FlexgpuPreflightFailed")
_FEATURE = re.compile(r"^kubernetes_feature_enabled\{([^}]*)\}\s+([0-9.]+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_feature_metrics(text: str) -> dict[str, bool]:
    """Gate name -> enabled, from the Prometheus text of an API server's /metrics."""
    gates: dict[str, bool] = {}
    for labels, value in _FEATURE.findall(text):
        name = dict(_LABEL.findall(labels)).get("name")
        if name:
            gates[name] = float(value) == 1.0
    return gates


def version_check(minor: int, git_version: str) -> Check:
    if minor < OLDEST_MINOR:
        return Check(
            "kubernetes",
            Status.FAIL,
            f"{git_version}: flexgpu needs 1.{OLDEST_MINOR}+ (resource.k8s.io/v1)",
        )
    return Check("kubernetes", Status.OK, git_version)


def gate_checks(minor: int, gates: Mapping[str, bool] | None, why_unknown: str) -> list[Check]:
    checks = []
    for gate, (what, default_from) in GATES.items():
        name = f"gate {gate}"
        if gates is None:
            state = "on by default" if minor >= default_from else "off by default"
            checks.append(Check(name, Status.SKIP, f"{state} on 1.{minor}; {why_unknown}"))
        elif gate not in gates:
            checks.append(Check(name, Status.WARN, f"1.{minor} does not list it: {what} off"))
        elif gates[gate]:
            checks.append(Check(name, Status.OK, f"on: {what}"))
        else:
            checks.append(
                Check(
                    name,
                    Status.WARN,
                    f"off: no {what}; turn it on in every component (see docs/admin.md)",
                )
            )
    return checks


def node_checks(
    nodes: Iterable[Mapping[str, Any]],
    slice_nodes: set[str],
    events: Iterable[Mapping[str, Any]],
) -> list[Check]:
    """Per node (API JSON): both drivers serving it, a GPU node nobody from flexgpu serves,
    and the newest preflight Event of its plugin pod."""
    newest: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for event in events:
        target = str(event.get("involvedObject", {}).get("name", ""))
        stamp = str(
            event.get("lastTimestamp")
            or event.get("eventTime")
            or event.get("metadata", {}).get("creationTimestamp")
            or ""
        )
        if target not in newest or stamp > newest[target][0]:
            newest[target] = (stamp, event)
    checks: list[Check] = []
    for node in nodes:
        name = str(node["metadata"]["name"])
        labels = node["metadata"].get("labels") or {}
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        device_plugin = str(allocatable.get("nvidia.com/gpu", "0")) not in ("0", "")
        gpu_node = any(labels.get(k) == v for k, v in GPU_NODE_LABELS)
        served = name in slice_nodes
        if device_plugin and served:
            checks.append(
                Check(
                    f"node {name}",
                    Status.FAIL,
                    "NVIDIA's device plugin (nvidia.com/gpu allocatable) and flexgpu both serve "
                    "it: the same GPUs can be handed out twice",
                )
            )
        elif gpu_node and not served and not device_plugin:
            checks.append(
                Check(
                    f"node {name}",
                    Status.WARN,
                    "labelled as a GPU node but no flexgpu ResourceSlice: is the plugin running?",
                )
            )
        elif served:
            checks.append(Check(f"node {name}", Status.OK, "served by flexgpu"))
        if name in newest:
            event = newest[name][1]
            failed = event.get("reason") == "FlexgpuPreflightFailed"
            checks.append(
                Check(
                    f"node {name} preflight",
                    Status.FAIL if failed else Status.OK,
                    str(event.get("message") or ""),
                )
            )
    return checks


def _read_metrics(connection: Connection) -> tuple[dict[str, bool] | None, str]:
    api = connection.api
    method, url, headers, _body, _ = api.param_serialize(
        "GET", "/metrics", auth_settings=["BearerToken"]
    )
    try:
        response = api.call_api(method, url, header_params=headers, _request_timeout=30)
        response.read()
    except (client.ApiException, OSError) as err:
        return None, f"the API server's /metrics is not readable ({err})"
    if response.status != 200:
        return None, f"the API server's /metrics is not readable (HTTP {response.status})"
    return parse_feature_metrics((response.data or b"").decode()), ""


def cluster_checks(connection: Connection) -> list[Check]:
    info = call(connection, "read the server version", client.VersionApi(connection.api).get_code)
    minor = int(re.sub(r"\D.*", "", str(info.get("minor", ""))) or 0)
    checks = [version_check(minor, str(info.get("gitVersion", "")))]
    gates, why = _read_metrics(connection)
    checks += gate_checks(minor, gates, why)
    core = client.CoreV1Api(connection.api)
    nodes = call(connection, "list nodes", core.list_node)["items"]
    slices = call(
        connection,
        "list ResourceSlices",
        client.ResourceV1Api(connection.api).list_resource_slice,
        field_selector=f"spec.driver={DRIVER_NAME}",
    )["items"]
    slice_nodes = {str(s["spec"]["nodeName"]) for s in slices if s["spec"].get("nodeName")}
    events = [
        e
        for reason in PREFLIGHT_REASONS
        for e in call(
            connection,
            "list preflight events",
            core.list_namespaced_event,
            "default",
            field_selector=f"reason={reason},involvedObject.kind=Node",
        )["items"]
    ]
    return checks + node_checks(nodes, slice_nodes, events)
