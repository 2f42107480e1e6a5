"""Pods that ask for GPUs as extended resources (`nvidia.com/gpu: 2`) served by a DeviceClass
(DRAExtendedResource): the scheduler makes their claim only when it binds them, so the
controller explains the claim it would make, and tells the pod."""

from __future__ import annotations

from typing import Any

from controller_builders import NOW, device_classes, load, node, node_slices, pod

from flexgpu.controller.cluster_state import ClusterState
from flexgpu.controller.diagnostics import Diagnostics
from flexgpu.controller.events import EventTarget
from flexgpu.controller.extended_resources import extended_resources, is_extended
from flexgpu.controller.pending import pending_claims


def _containers(*limits: dict[str, str], init: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": f"c{i}", "resources": {"limits": lim}} for i, lim in enumerate(limits)
        ]
    }
    if init is not None:
        spec["initContainers"] = [{"name": "init", "resources": {"limits": init}}]
    return spec


def test_counts_sum_containers_and_take_the_largest_init_container() -> None:
    spec = _containers(
        {"nvidia.com/gpu": "2", "cpu": "4", "memory": "8Gi"},
        {"nvidia.com/gpu": "1", "example.com/fpga": "1"},
        init={"nvidia.com/gpu": "4"},
    )
    assert extended_resources(spec) == {"nvidia.com/gpu": 4, "example.com/fpga": 1}
    assert extended_resources(_containers({"cpu": "1", "hugepages-2Mi": "1Gi"})) == {}


def test_native_names_are_not_extended_but_the_class_names_are() -> None:
    assert not is_extended("cpu") and not is_extended("kubernetes.io/foo")
    assert not is_extended("requests.nvidia.com/gpu")
    assert is_extended("nvidia.com/gpu")
    assert is_extended("deviceclass.resource.kubernetes.io/gpu.flexgpu.dev")


def _gpu_pod(name: str, count: int, resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    body = pod(name)
    body["spec"] = {**_containers({resource: str(count)})}
    return body


def _classes(extended: str = "nvidia.com/gpu") -> list[dict[str, Any]]:
    classes = device_classes()
    for c in classes:
        if c["metadata"]["name"] == "gpu.flexgpu.dev":
            c["spec"]["extendedResourceName"] = extended
    return classes


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
        self.events.append((target.kind, target.name, message))


def _world(*pods: dict[str, Any], classes: list[dict[str, Any]] | None = None) -> Any:
    return load(
        ClusterState(),
        slices=node_slices("h1", "hgx-h100-8") + node_slices("h2", "hgx-h100-8"),
        nodes=[node("h1"), node("h2")],
        pods=list(pods),
        classes=classes if classes is not None else _classes(),
    )


def test_nine_gpus_as_an_extended_resource_get_a_pod_event_that_says_why() -> None:
    """Nine `nvidia.com/gpu` on 8-GPU nodes: the pod's Event names the extended resource and
    says no node has nine; no Event goes to a claim that does not exist."""
    diagnostics = Diagnostics(sink := Sink(), delay_s=30)
    result = diagnostics.run_pass(_world(_gpu_pod("nine", 9)), NOW)
    assert (result.pending, result.unsatisfiable) == (1, 1)
    ((kind, name, message),) = sink.events
    assert (kind, name) == ("Pod", "nine")
    assert message.startswith(
        "The pod's extended resources (nvidia.com/gpu: 9, served by DRA) cannot be allocated"
    )
    assert "no node the pod may use has more than 8 of them" in message


def test_what_fits_and_what_no_class_serves_is_not_reported() -> None:
    snap = _world(
        _gpu_pod("two", 2),
        _gpu_pod("fpga", 1, "example.com/fpga"),
    )
    (item,) = [i for i in pending_claims(snap, NOW, 30) if i.pod.name == "two"]
    assert item.claim.extended_resources == (("nvidia.com/gpu", 2),)
    assert not [i for i in pending_claims(snap, NOW, 30) if i.pod.name == "fpga"]
    diagnostics = Diagnostics(sink := Sink(), delay_s=30)
    diagnostics.run_pass(snap, NOW)
    assert sink.events == []  # two GPUs fit: the scheduler has simply not got to it


def test_the_implicit_class_name_serves_too_and_a_made_claim_is_not_explained_twice() -> None:
    implicit = "deviceclass.resource.kubernetes.io/gpu.flexgpu.dev"
    snap = _world(_gpu_pod("p", 9, implicit), classes=device_classes())
    (item,) = pending_claims(snap, NOW, 30)
    assert item.claim.model.requests[0].exactly is not None
    assert item.claim.model.requests[0].exactly.device_class == "gpu.flexgpu.dev"
    made = _gpu_pod("p", 9, implicit)
    made["status"]["extendedResourceClaimStatus"] = {"resourceClaimName": "p-extended-xyz"}
    assert list(pending_claims(_world(made, classes=device_classes()), NOW, 30)) == []
