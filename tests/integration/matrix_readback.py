"""What the combination matrix reads back from the cluster and the node between and after rows:
Events, claims left, partitions made, refused status writes, the installed driver in each
prepared claim's CDI spec."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

from tools.cluster.gpu_node import SimulatedGpuNode


def pods_by_name(api: Any, namespace: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in client.CoreV1Api(api).list_namespaced_pod(namespace).items}


def pod_events(api: Any, namespace: str, reason: str) -> dict[str, str]:
    """Pod -> the messages of every Event of ``reason`` recorded on it, oldest first, one per
    line. Every one, not one picked by list order: a pod refused for one cause after another
    (the driver not registered during a restart, then the tenant check) has an Event of the
    same reason for each, and a check for the later cause must see it."""
    events = client.CoreV1Api(api).list_namespaced_event(namespace).items
    messages: dict[str, list[str]] = {}
    for e in sorted(events, key=lambda e: str(e.last_timestamp or e.event_time or "")):
        if e.reason == reason and e.involved_object.kind == "Pod":
            messages.setdefault(e.involved_object.name, []).append(e.message or "")
    return {name: "\n".join(lines) for name, lines in messages.items()}


def claims_left(api: Any, namespaces: list[str]) -> list[str]:
    claims = client.ResourceV1Api(api).list_resource_claim_for_all_namespaces().items
    return [
        f"{c.metadata.namespace}/{c.metadata.name}"
        for c in claims
        if c.metadata.namespace in namespaces
    ]


def allocated(api: Any, namespace: str) -> bool:
    claims = client.ResourceV1Api(api).list_namespaced_resource_claim(namespace).items
    return any(c.status and c.status.allocation for c in claims)


def refused_writes(node: SimulatedGpuNode) -> int:
    """Status writes the API server refused, in every log of the node's plugin so far."""
    return sum(
        path.read_text(errors="replace").count("status: 422")
        for path in (node.root / "logs").glob("plugin-*.log")
    )


def partitions_made(node: SimulatedGpuNode) -> list[dict[str, Any]]:
    """MIG instances on the on-demand GPUs, as the simulated hardware holds them."""
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return [i for index in (0, 1) for i in state["gpus"][index]["mig_instances"]]


def specs_not_on(node: SimulatedGpuNode, version: str) -> list[str]:
    """CDI specs of prepared claims that mount a driver library of another version than
    ``version`` (a driver change the plugin has not caught up with)."""
    stale = []
    for path in node.cdi_dir.glob("*.json"):
        mounts = (json.loads(path.read_text()).get("containerEdits") or {}).get("mounts") or []
        libraries = [str(m["containerPath"]) for m in mounts if ".so." in str(m["containerPath"])]
        if not libraries or any(not lib.endswith(f".so.{version}") for lib in libraries):
            stale.append(f"{path.name}: {libraries}")
    return stale
