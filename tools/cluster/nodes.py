"""Simulated nodes: Node objects the real scheduler treats as Ready, schedulable targets."""

from __future__ import annotations

from typing import Any

from kubernetes import client


def create_simulated_node(
    api: Any,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "110",
    taints: list[dict[str, str]] | None = None,
) -> Any:
    """Creates (or replaces) a Node and marks it Ready, without the not-ready taint and with
    ``taints`` (as a GPU node pool carries them)."""
    core = client.CoreV1Api(api)
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **(labels or {}),
    }
    body = client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=all_labels))
    try:
        core.create_node(body)
    except client.ApiException as err:
        if err.status != 409:
            raise
        core.patch_node(name, {"metadata": {"labels": all_labels}})
    capacity = {"cpu": cpu, "memory": memory, "pods": pods}
    core.patch_node_status(name, {"status": {"capacity": capacity, "allocatable": capacity}})
    return mark_node_ready(api, name, taints=taints)


def mark_node_ready(api: Any, name: str, *, taints: list[dict[str, str]] | None = None) -> Any:
    """Reports an existing Node Ready as its kubelet would (condition and node info), drops
    the not-ready taint and adds ``taints``; capacity and other taints are left as they are
    (a Node an autoscaler created keeps what it set)."""
    core = client.CoreV1Api(api)
    status = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "simulated node",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
            "nodeInfo": _node_info(name),
        }
    }
    core.patch_node_status(name, status)
    # The TaintNodesByCondition admission plugin adds the not-ready taint at creation; the node
    # lifecycle controller would lift it once Ready, but it does not run here (no kubelets).
    node: Any = core.read_node(name)
    kept = [
        {"key": t.key, "value": t.value, "effect": t.effect}
        for t in (node.spec.taints or [])
        if t.key != "node.kubernetes.io/not-ready"
        and all(t.key != new["key"] for new in taints or [])
    ]
    return core.patch_node(name, {"spec": {"taints": [*kept, *(taints or [])] or None}})


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _node_info(name: str) -> dict[str, str]:
    return {
        "machineID": name,
        "systemUUID": name,
        "bootID": name,
        "kernelVersion": "6.1",
        "osImage": "flexgpu simulated node",
        "containerRuntimeVersion": "sim://1",
        "kubeletVersion": "v1.37.2",
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": "amd64",
    }
