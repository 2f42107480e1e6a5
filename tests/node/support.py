"""Claims and pods for the real node, and what their containers reported from inside."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.node.conftest import NODE
from tools.node import report
from tools.node.node import RealNode

DRIVER = "gpu.flexgpu.dev"
API_VERSION = "gpu.flexgpu.dev/v1alpha1"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def gpu_request(name: str = "gpu", count: int = 1, device_class: str = DRIVER) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, "count": count}}


def create_claim(api: Any, namespace: str, name: str, devices: dict[str, Any]) -> None:
    client.ResourceV1Api(api).create_namespaced_resource_claim(
        namespace,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": devices},
        },
    )


def sharing_config(sharing: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "opaque": {
                "driver": DRIVER,
                "parameters": {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing},
            }
        }
    ]


def workload_pod(
    node: RealNode,
    name: str,
    containers: dict[str, list[dict[str, str]]],
    claims: dict[str, str],
) -> dict[str, Any]:
    """A pod on the real node whose containers run the reporting workload image.
    ``containers`` maps a container name to its resources.claims entries; ``claims`` maps a
    pod-level claim name to the ResourceClaim it references."""
    image = node.images["workload"].name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": cname,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "env": [{"name": "REPORT_INTERVAL", "value": "2"}],
                    "resources": {"claims": refs},
                }
                for cname, refs in containers.items()
            ],
            "resourceClaims": [{"name": n, "resourceClaimName": c} for n, c in claims.items()],
        },
    }


def one_claim_pod(node: RealNode, name: str, claim: str) -> dict[str, Any]:
    return workload_pod(node, name, {"main": [{"name": "g"}]}, {"g": claim})


def run_pod(api: Any, namespace: str, pod: dict[str, Any], timeout_s: float = 180) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, pod)
    name = pod["metadata"]["name"]

    def running() -> bool:
        p: Any = core.read_namespaced_pod(name, namespace)
        if p.status.phase in ("Failed", "Succeeded"):
            pytest.fail(f"pod {name} ended {p.status.phase}: {p.status.message}")
        return bool(p.status.phase == "Running")

    try:
        wait_for(running, timeout_s=timeout_s, what=f"pod {name} Running")
    except pytest.fail.Exception:
        events = core.list_namespaced_event(namespace).items
        detail = [f"{e.reason}: {e.message}" for e in events if e.involved_object.name == name][-5:]
        pytest.fail(f"pod {name} not Running; events: {detail}")


def wait_report(
    node: RealNode,
    namespace: str,
    pod: str,
    container: str = "main",
    after: int = 0,
    timeout_s: float = 120,
) -> report.Report:
    """The first complete report numbered above ``after`` from the container's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        node.check_running()
        found = [
            r for r in report.parse(node.container_log(namespace, pod, container)) if r.seq > after
        ]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(
        f"{namespace}/{pod}/{container}: no report after #{after} in {timeout_s:.0f}s; log:\n"
        f"{node.container_log(namespace, pod, container)[-2000:]}\n{node.log_tails()}"
    )


def allocated(api: Any, namespace: str, claim: str) -> list[Any]:
    c: Any = client.ResourceV1Api(api).read_namespaced_resource_claim(claim, namespace)
    return list(c.status.allocation.devices.results) if c.status.allocation else []


def device_uuid(api: Any, device: str) -> str:
    for s in (
        client.ResourceV1Api(api)
        .list_resource_slice(field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}")
        .items
    ):
        for d in s.spec.devices or []:
            if d.name == device:
                return str(d.attributes["uuid"].string)
    raise AssertionError(f"no device {device} published by {NODE}")


def claim_uid(api: Any, namespace: str, claim: str) -> str:
    c: Any = client.ResourceV1Api(api).read_namespaced_resource_claim(claim, namespace)
    return str(c.metadata.uid)


def claim_uuids(api: Any, namespace: str, claim: str, request: str | None = None) -> set[str]:
    return {
        device_uuid(api, r.device)
        for r in allocated(api, namespace, claim)
        if request is None or r.request == request
    }


def delete_pods(api: Any, namespace: str, *pods: str) -> None:
    """Deletes the pods and waits until they are gone (their claims unprepared)."""
    core = client.CoreV1Api(api)
    for pod in pods:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)

    def gone() -> bool:
        names = {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
        return not names & set(pods)

    wait_for(gone, timeout_s=90, what=f"pods {pods} deleted")


def assert_control_nodes_usable(rep: report.Report) -> None:
    """The control device nodes are in the container and its device cgroup lets them open."""
    for path in CONTROL_NODES:
        assert path in rep.devices, f"{path} missing; container has {sorted(rep.devices)}"
        assert rep.devices[path].cgroup_allows, (path, rep.devices[path].open_result)
