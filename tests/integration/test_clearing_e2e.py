"""GPU clearing against the real scheduler: small partitions spread over a node's two GPUs
keep a whole-GPU claim waiting; the controller taints the GPU with fewest holders
(DeviceTaintRules), a new small claim goes to the other GPU, the holder ends, the whole-GPU
claim is allocated that GPU and the taints are removed.

Slices are published straight from the simulated backend (no plugin process: nothing has to
run on the node), as in test_controller.py; the pods are never started. Run with the node's
partitions with and without flexgpu's binding conditions (there the test reports each
partition ready, as the plugin would, so the pods are bound).

The controller runs with eviction on (after 3s): this test's holders do not opt in and are
never moved; test_clearing_eviction_e2e.py shows, with the same fixtures, what does move and
what never does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from flexgpu.controller.taint_rules import (
    CLAIM_ANNOTATION,
    GROUP,
    MANAGED_LABEL,
    PLURAL,
    TaintRules,
)
from flexgpu.driver.names import DRIVER_NAME, PARTITION_READY_CONDITION
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher
from tests.conftest import target_minor, wait_for
from tests.integration.gpu_workloads import ensure_device_classes
from tools.cluster import ControlPlane, create_simulated_node

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
A = f'device.attributes["{DRIVER_NAME}"]'
ONE_G = f'{A}.profile == "1g.10gb"'
TWO_H100 = {
    "name": "clearing-two-h100",
    "description": "2x H100, both partitioned on demand",
    "gpus": [{"model": "H100-SXM5-80GB"} for _ in range(2)],
}


def _claim(api: Any, ns: str, name: str, cls: str, *cel: str) -> None:
    exactly: dict[str, Any] = {"deviceClassName": cls, "count": 1}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in cel]
    client.ResourceV1Api(api).create_namespaced_resource_claim(
        ns,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        },
    )


def _pod(api: Any, ns: str, name: str, node: str) -> None:
    """A pod for the claim of the same name, pinned to the test's node."""
    client.CoreV1Api(api).create_namespaced_pod(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
                ],
                "resourceClaims": [{"name": "g", "resourceClaimName": name}],
            },
        },
    )


def _device(api: Any, ns: str, claim: str) -> str:
    """The device the scheduler allocated the claim ("" while it has none)."""
    status = client.ResourceV1Api(api).read_namespaced_resource_claim(claim, ns).status
    if status is None or status.allocation is None:
        return ""
    return str(status.allocation.devices.results[0].device)


def _allocated(api: Any, ns: str, claim: str, ready: bool, pod: str = "") -> str:
    """Waits for the claim's device; with binding conditions, reports the partition ready as
    the node's plugin would once it made it, so the scheduler binds the pod (holders run).
    ``pod``: the claim's pod, when not named as the claim."""
    device = wait_for(lambda: _device(api, ns, claim), timeout_s=90, what=f"{claim} allocated")
    if ready:
        resource = client.ResourceV1Api(api)
        result = resource.read_namespaced_resource_claim(claim, ns).status.allocation.devices
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": PARTITION_READY_CONDITION,
            "status": "True",
            "reason": "Made",
            "message": "made by the test",
            "lastTransitionTime": now,
        }
        devices = [
            {"driver": r.driver, "pool": r.pool, "device": r.device, "conditions": [condition]}
            for r in result.results
        ]
        resource.patch_namespaced_resource_claim_status(claim, ns, {"status": {"devices": devices}})
        wait_for(
            lambda: client.CoreV1Api(api).read_namespaced_pod(pod or claim, ns).spec.node_name,
            timeout_s=60,
            what=f"pod {pod or claim} bound",
        )
    return str(device)


def _rules(api: Any, version: str) -> list[dict[str, Any]]:
    listed: Any = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, version, PLURAL, label_selector=f"{MANAGED_LABEL}=true"
    )
    return list(listed["items"])


def _reasons(api: Any, ns: str, kind: str, name: str) -> set[str]:
    core = client.CoreV1Api(api)
    return {
        str(e.reason)
        for e in core.list_namespaced_event(ns).items
        if e.involved_object.kind == kind and e.involved_object.name == name
    }


@pytest.fixture(scope="module")
def rules_version(api: Any) -> str:
    if target_minor() < 36:
        pytest.skip("on-demand MIG (partitionable devices) works from Kubernetes 1.36")
    version = TaintRules(api).version()
    if version is None:
        pytest.skip("the API server serves no DeviceTaintRules")
    return version


@pytest.fixture(params=[False, True], ids=["binding-conditions-off", "binding-conditions-on"])
def node(
    api: Any,
    cluster: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[str, str, bool]]:
    """(namespace, node, binding conditions): one node with two H100s partitioned on demand,
    their partitions with or without flexgpu's binding conditions (the 1.36+ default; with
    them the test reports each partition ready, as the plugin would, and the pod is bound)."""
    ensure_device_classes(api)
    tmp = tmp_path_factory.mktemp("clearing")
    run = uuid.uuid4().hex[:5]
    ns, name = f"clr-{run}", f"clr-{run}-node"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns}})
    create_simulated_node(api, name)
    topology = tmp / "two.yaml"
    topology.write_text(yaml.safe_dump(TWO_H100))
    backend = SimulatedBackend(load_topology(str(topology)), name, state_path=tmp / "s.json")
    devices = NodeDevices(backend, dynamic_mig={0, 1}, binding_conditions=request.param)
    publisher = SlicePublisher(KubeApi.from_kubeconfig(cluster.kubeconfig), name)
    publisher.set_devices(devices.slice_devices(), devices.counter_sets())
    publisher.reconcile_once()
    yield ns, name, request.param
    core.delete_namespace(ns)
    publisher.delete_all()
    core.delete_node(name)


@pytest.fixture(scope="module")
def controller(
    cluster: ControlPlane, api: Any, rules_version: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("clearing-log") / "controller.log"
    out = log.open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flexgpu.controller.main",
            f"--kubeconfig={cluster.kubeconfig}",
            "--namespace=default",
            f"--lease-name=clr-{uuid.uuid4().hex[:5]}",
            "--pending-delay=2",
            "--metrics-port=0",
            "--no-webhook",
            # Every GPU may be steered: this cluster has few.
            "--clearing-share=1",
            # Pods that opted in may be evicted from a GPU steered this long, one at a time.
            "--clearing-evict-after=3s",
            "--clearing-evict-max-in-flight=1",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    yield log
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.close()
    # Claims of other tests' that waited meanwhile may have had GPUs steered for them.
    objects = client.CustomObjectsApi(api)
    for rule in _rules(api, rules_version):
        objects.delete_cluster_custom_object(GROUP, rules_version, PLURAL, rule["metadata"]["name"])


def test_a_gpu_is_cleared_for_a_waiting_whole_gpu_claim_without_moving_anyone(
    api: Any, node: tuple[str, str, bool], controller: Path, rules_version: str
) -> None:
    ns, name, ready = node
    core = client.CoreV1Api(api)
    # One 1g partition on GPU 0, two on GPU 1: no whole GPU is free.
    holders = {"s0": 0, "s1a": 1, "s1b": 1}
    for claim, gpu in holders.items():
        _claim(api, ns, claim, "mig.flexgpu.dev", ONE_G, f"{A}.parentIndex == {gpu}")
        _pod(api, ns, claim, name)
    for claim, gpu in holders.items():
        assert _allocated(api, ns, claim, ready).startswith(f"gpu-{gpu}-mig-1g10gb")

    _claim(api, ns, "big", "gpu.flexgpu.dev")
    _pod(api, ns, "big", name)

    def steering() -> list[dict[str, Any]]:
        return [
            r
            for r in _rules(api, rules_version)
            if r["metadata"]["annotations"][CLAIM_ANNOTATION] == f"{ns}/big"
        ]

    # The Event comes once every rule of the GPU is made.
    try:
        wait_for(
            lambda: "GpuClearing" in _reasons(api, ns, "Pod", "big"),
            timeout_s=60,
            what="GpuClearing Event on the waiting pod",
        )
    except BaseException:
        print(controller.read_text())
        raise
    rules = steering()
    tainted = {r["spec"]["deviceSelector"]["device"] for r in rules}
    # GPU 0 (one holder) is chosen; all its devices but the whole GPU, the one the waiting
    # claim takes, are tainted, so the claim itself is not kept off.
    published = {
        d.name
        for s in client.ResourceV1Api(api).list_resource_slice().items
        if s.spec.node_name == name
        for d in s.spec.devices or []
    }
    assert tainted == {d for d in published if d.startswith("gpu-0-")}
    assert {r["spec"]["taint"]["effect"] for r in rules} == {"NoSchedule"}
    assert {r["spec"]["taint"]["key"] for r in rules} == {"flexgpu.dev/clearing"}
    assert "GpuClearing" in _reasons(api, "default", "Node", name)
    assert not _device(api, ns, "big")

    # A new 1g claim would fill GPU 0 first (its first free placement comes first); with the
    # taints it goes to GPU 1.
    _claim(api, ns, "late", "mig.flexgpu.dev", ONE_G)
    _pod(api, ns, "late", name)
    late = _allocated(api, ns, "late", ready)
    assert late.startswith("gpu-1-"), late

    # GPU 0's holder ends: the waiting claim takes the whole GPU, the taints go.
    core.delete_namespaced_pod("s0", ns, grace_period_seconds=0)
    client.ResourceV1Api(api).delete_namespaced_resource_claim("s0", ns)
    assert _allocated(api, ns, "big", ready) == "gpu-0"
    wait_for(lambda: not steering(), timeout_s=30, what="the taints removed")
    wait_for(
        lambda: "GpuClearingEnded" in _reasons(api, ns, "ResourceClaim", "big"),
        timeout_s=30,
        what="GpuClearingEnded Event on the claim",
    )
    # Nobody was moved: GPU 1's holders kept their partitions throughout.
    assert _device(api, ns, "s1a").startswith("gpu-1-mig-1g10gb")
    assert _device(api, ns, "s1b").startswith("gpu-1-mig-1g10gb")
