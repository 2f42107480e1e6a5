"""Binding conditions for on-demand MIG (Kubernetes 1.36+) with the real scheduler: the
partition is made before the pod is bound and prepare takes it over; when making it fails on
one node, the claim gets PartitionFailed, the scheduler takes the allocation back, the pod
runs on another node, and nothing is left on the GPU that failed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    DRIVER,
    checkpoint_claims,
    create_claim,
    ensure_device_classes,
    make_pod,
    wait_phase,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.requires_k8s(
        "1.36", why="binding conditions are beta and on by default from 1.36 (off before)"
    ),
]

READY = "gpu.flexgpu.dev/PartitionReady"
FAILED = "gpu.flexgpu.dev/PartitionFailed"
TAINT = "gpu.flexgpu.dev/partition-create-failed"
ARGS = ("--dynamic-mig-gpus=0",)


def mig_claim() -> dict[str, Any]:
    is_1g = f'device.attributes["{DRIVER}"].profile == "1g.18gb"'
    return {
        "requests": [
            {
                "name": "mig",
                "exactly": {
                    "deviceClassName": "mig.flexgpu.dev",
                    "selectors": [{"cel": {"expression": is_1g}}],
                },
            }
        ]
    }


def pod_on(name: str, nodes: list[str]) -> dict[str, Any]:
    pod = make_pod(name, "echo DONE; sleep 120", {"g": {"resourceClaimName": name}})
    term = {
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]
    }
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
        }
    }
    return pod


def instances(node: SimulatedGpuNode) -> list[dict[str, Any]]:
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return [i for g in state["gpus"] for i in g["mig_instances"]]


def partitions(api: Any, node: str) -> list[dict[str, Any]]:
    slices = client.ResourceV1Api(api).list_resource_slice(field_selector=f"spec.nodeName={node}")
    return [
        api.sanitize_for_serialization(d)
        for s in slices.items
        for d in s.spec.devices or []
        if "-mig-" in d.name
    ]


class ConditionLog:
    """Every condition seen on the claim's status entries, polled (the scheduler clears the
    entries when it takes the allocation back, so a failure is visible only for seconds)."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._resource = client.ResourceV1Api(api)
        self._api = api
        self._where = (namespace, name)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        namespace, name = self._where
        while not self._stop.wait(0.2):
            try:
                claim = self._resource.read_namespaced_resource_claim(name, namespace)
            except client.ApiException:
                continue
            for entry in (claim.status.devices if claim.status else None) or []:
                for condition in entry.conditions or []:
                    row = {
                        "pool": entry.pool,
                        "device": entry.device,
                        "type": condition.type,
                        "status": condition.status,
                        "reason": condition.reason,
                        "message": condition.message,
                    }
                    if row not in self.seen:
                        self.seen.append(row)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def node_b(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(cluster, api, "bind-b", "h200-4", plugin_args=ARGS) as sim:
        yield sim


def test_the_partition_is_made_before_binding_and_prepare_takes_it_over(
    api: Any, namespace: str, node_b: SimulatedGpuNode
) -> None:
    wait_for(lambda: bool(partitions(api, node_b.name)), what="partitions published")
    (first, *_) = partitions(api, node_b.name)
    # Detected on this server (auto), not assumed.
    assert first["bindingConditions"] == [READY]
    assert first["bindingFailureConditions"] == [FAILED]
    assert first["bindsToNode"] is True

    create_claim(api, namespace, "ok", mig_claim())
    log = ConditionLog(api, namespace, "ok")
    try:
        client.CoreV1Api(api).create_namespaced_pod(namespace, pod_on("ok", [node_b.name]))
        wait_phase(api, namespace, "ok", {"Running"}, timeout_s=90)
    finally:
        log.stop()
    (made,) = instances(node_b)
    ready = [c for c in log.seen if c["type"] == READY and c["status"] == "True"]
    assert ready and made["uuid"] in ready[0]["message"]
    uid = client.ResourceV1Api(api).read_namespaced_resource_claim("ok", namespace).metadata.uid
    record = checkpoint_claims(node_b)[uid]
    assert record["state"] == "Prepared" and "early" not in record
    assert [m["uuid"] for m in record["created"]["mig_instances"]] == [made["uuid"]]
    client.CoreV1Api(api).delete_namespaced_pod("ok", namespace)
    wait_for(lambda: instances(node_b) == [], timeout_s=90, what="partition destroyed")


def test_a_creation_failure_sends_the_pod_to_another_node_and_leaves_nothing(
    cluster: ControlPlane, api: Any, namespace: str, node_b: SimulatedGpuNode
) -> None:
    ensure_device_classes(api)
    # Node A fails every MIG creation; node B is cordoned meanwhile, so A is tried first.
    core = client.CoreV1Api(api)
    core.patch_node(node_b.name, {"spec": {"unschedulable": True}})
    env = dict(os.environ, FLEXGPU_FAULT_FAIL="create_mig_device:1000")
    started = time.monotonic()
    with running_gpu_node(
        cluster,
        api,
        "bind-a",
        "h200-4",
        plugin_args=(*ARGS, "--partition-failure-cooldown=10m"),
        plugin_env=env,
    ) as node_a:
        create_claim(api, namespace, "moves", mig_claim())
        log = ConditionLog(api, namespace, "moves")
        try:
            core.create_namespaced_pod(namespace, pod_on("moves", [node_a.name, node_b.name]))
            wait_for(
                lambda: any(c["type"] == FAILED for c in log.seen),
                timeout_s=90,
                what="PartitionFailed on the claim",
            )
            # The scheduler takes the allocation back; A's partitions are tainted.
            wait_for(
                lambda: all(
                    any(t["key"] == TAINT for t in p.get("taints") or [])
                    for p in partitions(api, node_a.name)
                ),
                timeout_s=60,
                what="node A's partitions tainted",
            )
            core.patch_node(node_b.name, {"spec": {"unschedulable": False}})
            pod = wait_phase(api, namespace, "moves", {"Running"}, timeout_s=120)
        finally:
            log.stop()
            core.patch_node(node_b.name, {"spec": {"unschedulable": False}})
        assert pod.spec.node_name == node_b.name
        failures = {c["message"] for c in log.seen if c["type"] == FAILED}
        for failed in failures:  # one, unless A was tried again before its taint was out
            assert f"on gpu-0 of node {node_a.name} failed" in failed
            assert "injected failure in create_mig_device" in failed
        assert all(c["pool"] == node_a.name for c in log.seen if c["type"] == FAILED)
        # Nothing leaked on the GPU that failed, nor in its checkpoint.
        assert instances(node_a) == []
        assert checkpoint_claims(node_a) == {}
        assert len(instances(node_b)) == 1
    print(f"failure on A to Running on B: {time.monotonic() - started:.1f} s")


def test_a_plugin_killed_once_the_partition_is_ready_finishes_after_its_restart(
    api: Any, namespace: str, node_b: SimulatedGpuNode
) -> None:
    """SIGKILL after the Ready record, before PartitionReady reached the claim: the restarted
    plugin keeps the partition, reports it, and prepare takes it over (made once)."""
    before = {i["uuid"] for i in instances(node_b)}
    node_b.stop_plugin()
    node_b.plugin_env = dict(os.environ, FLEXGPU_FAULT_CRASH_AT="early-ready")
    node_b.start_plugin()
    create_claim(api, namespace, "crashy", mig_claim())
    client.CoreV1Api(api).create_namespaced_pod(namespace, pod_on("crashy", [node_b.name]))
    crashed = node_b.plugin
    assert crashed is not None
    crashed.proc.wait(60)  # type: ignore[union-attr]
    assert crashed.exit_code() == -signal.SIGKILL
    (made,) = [i for i in instances(node_b) if i["uuid"] not in before]
    uid = client.ResourceV1Api(api).read_namespaced_resource_claim("crashy", namespace).metadata.uid
    assert checkpoint_claims(node_b)[uid]["early"] == "Ready"

    node_b.plugin_env = None
    node_b.start_plugin()
    wait_phase(api, namespace, "crashy", {"Running"}, timeout_s=90)
    assert [i for i in instances(node_b) if i["uuid"] not in before] == [made]
    record = checkpoint_claims(node_b)[uid]
    assert record["state"] == "Prepared"
    assert [m["uuid"] for m in record["created"]["mig_instances"]] == [made["uuid"]]
