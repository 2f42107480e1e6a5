"""Hollow GPU nodes on a real control plane: Node objects and the slices a publication renders
for them, claims and pods made as a user makes them, and what the scheduler costs.

Shared by ``bench.scale_scheduling`` and ``bench.packing_churn``; nothing here asserts."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.scale_publications import DYNAMIC, SHARED, NodeInventory, inventory, node_specs
from flexgpu.driver.names import DRIVER_NAME
from tools.cluster import create_simulated_node

PUBLICATION_LABEL = "bench.flexgpu.dev/publication"
WORKERS = 6  # parallel API callers: enough to keep the apiserver busy, few enough for 2 cores
CLASSES = {"gpu.flexgpu.dev": "gpu", "mig.flexgpu.dev": "mig", "shared-gpu.flexgpu.dev": "shared"}
A = f'device.attributes["{DRIVER_NAME}"]'


def parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(fn, items))


def create_nodes(
    api: Any,
    names: Sequence[str],
    folder: Path,
    *,
    labels: dict[str, str] | None = None,
    dynamic: frozenset[int] = DYNAMIC,
    shared: frozenset[int] = SHARED,
) -> dict[str, NodeInventory]:
    parallel(lambda n: create_simulated_node(api, n, labels=labels, pods="500"), names)
    return {n: inventory(n, folder, dynamic, shared) for n in names}


def ensure_classes(api: Any) -> None:
    resource: Any = client.ResourceV1Api(api)
    for name, kind in CLASSES.items():
        expression = f'device.driver == "{DRIVER_NAME}" && {A}.type == "{kind}"'
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }
        try:
            resource.create_device_class(body)
        except client.ApiException as err:
            if err.status != 409:
                raise


def publish(api: Any, publication: str, nodes: dict[str, NodeInventory]) -> None:
    resource: Any = client.ResourceV1Api(api)

    def one(node: str) -> None:
        for i, spec in enumerate(node_specs(publication, node, nodes[node])):
            name = f"{node}-{DRIVER_NAME}-{i}"
            labels = {PUBLICATION_LABEL: publication}
            body = {"metadata": {"name": name, "labels": labels}, "spec": spec}
            resource.create_resource_slice(body)

    parallel(one, list(nodes))


def unpublish(api: Any, deadline_s: float = 300) -> None:
    resource: Any = client.ResourceV1Api(api)
    resource.delete_collection_resource_slice(label_selector=PUBLICATION_LABEL)
    wait_for(lambda: not resource.list_resource_slice(limit=1).items, deadline_s, "slices gone")


def slice_stats(api: Any) -> tuple[int, int, int]:
    """Slices, devices and JSON bytes of every slice as the apiserver returns them."""
    raw: Any = client.ResourceV1Api(api).list_resource_slice(_preload_content=False)
    items = json.loads(raw.data)["items"]
    devices = sum(len(i["spec"].get("devices") or []) for i in items)
    size = sum(len(json.dumps(i, separators=(",", ":"))) for i in items)
    return len(items), devices, size


def wait_for(check: Callable[[], bool], deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not reached in {deadline_s:.0f} s")
        time.sleep(0.1)


def make_namespace(api: Any, name: str) -> None:
    core: Any = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})

    def has_account() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
            return True
        except client.ApiException:
            return False

    wait_for(has_account, 60, f"namespace {name}: default service account")


def claim_body(name: str, request: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "g", "exactly": request}]}},
    }


def pod_body(name: str, claim: str, node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}],
        "resourceClaims": [{"name": "g", "resourceClaimName": claim}],
        "terminationGracePeriodSeconds": 0,
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def hold(api: Any, namespace: str, name: str, node: str, devices: Sequence[str]) -> None:
    """A claim allocated `devices` of `node`, as the scheduler would have written it, so the
    scheduler treats them as taken (cluster load that is already there)."""
    resource: Any = client.ResourceV1Api(api)
    request = {"deviceClassName": "gpu.flexgpu.dev", "count": len(devices)}
    created: Any = resource.create_namespaced_resource_claim(namespace, claim_body(name, request))
    body = client.ApiClient().sanitize_for_serialization(created)
    results = [{"request": "g", "driver": DRIVER_NAME, "pool": node, "device": d} for d in devices]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    body["status"] = {
        "allocation": {
            "devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [term]},
        }
    }
    resource.replace_namespaced_resource_claim_status(name, namespace, body)


def clear_namespace(api: Any, namespace: str, deadline_s: float = 300) -> None:
    """Removes the namespace's pods and claims (no kubelet confirms a pod's end, so pods are
    deleted at once) and waits until the claims are gone, so their devices are free."""
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    resource.delete_collection_namespaced_resource_claim(namespace)
    wait_for(
        lambda: (
            not resource.list_namespaced_resource_claim(namespace, limit=1).items
            and not core.list_namespaced_pod(namespace, limit=1).items
        ),
        deadline_s,
        f"namespace {namespace}: pods and claims gone",
    )
    core.delete_namespace(namespace)


def allocated_device(api: Any, namespace: str, claim: str) -> str | None:
    got: Any = client.ResourceV1Api(api).read_namespaced_resource_claim(claim, namespace)
    allocation = got.status.allocation if got.status else None
    if allocation is None:
        return None
    return str(allocation.devices.results[0].device)


def settle(
    pid: int | None, *, busy: float = 0.1, window_s: float = 1.0, deadline_s: float = 90.0
) -> float:
    """Waits until the process uses under ``busy`` of a core over ``window_s``, so a timed
    batch does not also pay for digesting what came before it (a publication's slices, the
    load's claims, the last batch's deletions). Returns the seconds waited; gives up quietly
    after ``deadline_s`` (a busy machine is then reported as it is)."""
    if pid is None:
        return 0.0
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        cpu0, t0 = process_cpu_s(pid), time.monotonic()
        time.sleep(window_s)  # the sampling window of a rate, not a wait for a result
        if (process_cpu_s(pid) - cpu0) / (time.monotonic() - t0) < busy:
            break
    return time.monotonic() - start


def process_cpu_s(pid: int | None) -> float:
    """User+system CPU seconds a process has used (Linux /proc)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
