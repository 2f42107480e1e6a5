"""Helpers for end-to-end tests: DeviceClasses, claims and pods that run on simulated nodes."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import wait_for
from tools.cluster.gpu_node import SimulatedGpuNode

DRIVER = "gpu.flexgpu.dev"
REPO = Path(__file__).resolve().parents[2]


def ensure_device_classes(api: Any) -> None:
    resource = client.ResourceV1Api(api)
    for doc in yaml.safe_load_all((REPO / "demo" / "deviceclasses.yaml").read_text()):
        try:
            resource.create_device_class(doc)
        except client.ApiException as err:
            if err.status != 409:
                raise


def make_pod(
    name: str,
    command: str,
    claims: dict[str, dict[str, str]],
    node: str | None = None,
) -> dict[str, Any]:
    """A pod with one container running ``sh -c command`` that uses every listed claim."""
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "main",
                "image": "none",
                "command": ["/bin/sh", "-c", command],
                "resources": {"claims": [{"name": n} for n in claims]},
            }
        ],
        "resourceClaims": [{"name": n, **ref} for n, ref in claims.items()],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


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


def gpu_request(name: str = "gpu", count: int = 1, cel: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.flexgpu.dev", "count": count}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    return {"name": name, "exactly": exactly}


def wait_phase(api: Any, namespace: str, pod: str, phases: set[str], timeout_s: float = 60) -> Any:
    core = client.CoreV1Api(api)

    def current() -> Any:
        p = core.read_namespaced_pod(pod, namespace)
        return p if p.status.phase in phases else None

    try:
        return wait_for(current, timeout_s=timeout_s, what=f"pod {pod} in {sorted(phases)}")
    except pytest.fail.Exception:
        p = core.read_namespaced_pod(pod, namespace)
        events = core.list_namespaced_event(namespace).items
        detail = [f"{e.reason}: {e.message}" for e in events if e.involved_object.name == pod][-5:]
        pytest.fail(f"pod {pod} is {p.status.phase} ({p.status.message}); events: {detail}")


def wait_gone(api: Any, namespace: str, pod: str, timeout_s: float = 60) -> None:
    core = client.CoreV1Api(api)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(pod, namespace)
        except client.ApiException as err:
            return err.status == 404
        return False

    wait_for(gone, timeout_s=timeout_s, what=f"pod {pod} deleted")


def allocated(api: Any, namespace: str, claim: str) -> list[Any]:
    c = client.ResourceV1Api(api).read_namespaced_resource_claim(claim, namespace)
    return list(c.status.allocation.devices.results) if c.status.allocation else []


def device_uuid(api: Any, pool: str, device: str) -> str:
    for s in (
        client.ResourceV1Api(api)
        .list_resource_slice(field_selector=f"spec.nodeName={pool},spec.driver={DRIVER}")
        .items
    ):
        for d in s.spec.devices or []:
            if d.name == device:
                return str(d.attributes["uuid"].string)
    raise AssertionError(f"no device {device} in pool {pool}")


def env_from_log(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def granted(env: dict[str, str]) -> list[dict[str, str]]:
    """What a container was given, one entry per CDI device it received: the fields of its
    ``FLEXGPU_DEVICE_*`` variable (uuid, claim, claimUID, device, share, timeSlice, boot)."""
    return [
        dict(part.split("=", 1) for part in value.split(";") if "=" in part)
        for key, value in sorted(env.items())
        if key.startswith("FLEXGPU_DEVICE_")
    ]


def granted_uuids(env: dict[str, str]) -> list[str]:
    return sorted(d["uuid"] for d in granted(env))


def granted_claim_uid(env: dict[str, str]) -> str:
    """The one claim whose devices the container got."""
    (uid,) = {d["claimUID"] for d in granted(env)}
    return uid


def checkpoint_claims(node: SimulatedGpuNode) -> dict[str, Any]:
    """The node's claim records by UID (one file each under <data dir>/claims)."""
    records = {}
    for path in sorted((node.data_dir / "claims").glob("*.json")):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue  # removed by an unprepare since the listing: not a record any more
        claim = json.loads(text)["data"]["claim"]
        records[claim["uid"]] = claim
    return records


def cdi_specs(node: SimulatedGpuNode) -> list[str]:
    return sorted(p.name for p in node.cdi_dir.glob("*.json")) if node.cdi_dir.exists() else []


def wait_container_output(
    node: SimulatedGpuNode, namespace: str, pod: str, needle: str, timeout_s: float = 30
) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = node.container_log(namespace, pod, "main")
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{pod}: {needle!r} not in container log {text!r}")


def pending_reason(api: Any, namespace: str, pod: str) -> str:
    """The scheduler's message once it has reported ``pod`` unschedulable."""

    def unschedulable() -> str:
        p = client.CoreV1Api(api).read_namespaced_pod(pod, namespace)
        for c in p.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False":
                return str(c.message)
        return ""

    return str(wait_for(unschedulable, what=f"{pod} reported unschedulable"))


@contextlib.contextmanager
def policy_webhook_ignored(api: Any, configuration: str) -> Iterator[None]:
    """No controller pod serves the chart's webhook in this test world (no kubelet runs its
    Deployment), so GpuNodePolicy writes would fail: ignore the webhook's failure meanwhile."""
    admission: Any = client.AdmissionregistrationV1Api(api)
    hooks = admission.read_validating_webhook_configuration(configuration).webhooks
    index = next(i for i, h in enumerate(hooks) if h.name == "gpunodepolicies.flexgpu.dev")
    path = f"/webhooks/{index}/failurePolicy"

    def set_policy(value: str) -> None:
        admission.patch_validating_webhook_configuration(
            configuration, [{"op": "replace", "path": path, "value": value}]
        )

    set_policy("Ignore")
    try:
        yield
    finally:
        set_policy("Fail")


def default_chart_image() -> str:
    """The image the chart runs at its default values: [registry/]repository:appVersion."""
    chart = yaml.safe_load((REPO / "charts/flexgpu/Chart.yaml").read_text())
    image = yaml.safe_load((REPO / "charts/flexgpu/values.yaml").read_text())["image"]
    registry = f"{image['registry']}/" if image.get("registry") else ""
    return f"{registry}{image['repository']}:{chart['appVersion']}"


def scheduling_report(api: Any, namespace: str) -> str:
    """Each pod's phase, node and last scheduling message, and each claim's allocation and
    status conditions: what a failure needs to be understood."""
    events = client.CoreV1Api(api).list_namespaced_event(namespace).items
    reasons: dict[str, str] = {}
    for event in sorted(events, key=lambda e: str(e.last_timestamp or e.event_time or "")):
        if event.involved_object.kind == "Pod" and event.type == "Warning":
            reasons[event.involved_object.name] = f"{event.reason}: {event.message}"
    lines = []
    for pod in client.CoreV1Api(api).list_namespaced_pod(namespace).items:
        name = pod.metadata.name
        lines.append(
            f"{name}: {pod.status.phase} node={pod.spec.node_name} {reasons.get(name, '')}"
        )
    for claim in client.ResourceV1Api(api).list_namespaced_resource_claim(namespace).items:
        results = claim.status.allocation.devices.results if claim.status.allocation else []
        entries = (
            [
                (e.device, [(c.type, c.status) for c in e.conditions or []])
                for e in claim.status.devices or []
            ]
            if claim.status
            else []
        )
        lines.append(
            f"claim {claim.metadata.name}: "
            f"{[(r.device, r.binding_conditions) for r in results or []]} {entries}"
        )
    return "\n".join(lines)
