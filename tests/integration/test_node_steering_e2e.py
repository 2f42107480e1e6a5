"""Node steering against the real scheduler: of two simulated nodes with four whole GPUs
each, the fuller one holds three and the emptier one; the controller steers the emptier
(one DeviceTaintRule for its pool), a new claim lands on the fuller node, and once that node
is full the other nodes have no room for what the steered one holds: the rule is removed.

With eviction on (3s), against the real workload controllers: the steered node's holder, a
Deployment's pod that consented (``flexgpu.dev/movable: "true"``, claim from a
ResourceClaimTemplate), is evicted and its ReplicaSet's new pod gets a GPU of the other node;
a Job's pod, annotated too, is never evicted and the Node says why; and with eviction on, the
node of a Deployment's pods is steered before the node of a Job's pod with fewer holders.

Slices are published straight from the simulated backend, as in test_clearing_e2e.py; the
pods are never started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from flexgpu.controller.taint_rules import (
    GROUP,
    PLURAL,
    STEERING_LABEL,
    STEERING_TAINT_KEY,
    SteeringFor,
    TaintRules,
    steering_rule_body,
)
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher
from tests.conftest import holds_for, wait_for
from tests.integration.gpu_workloads import ensure_device_classes
from tools.cluster import ControlPlane, create_simulated_node

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MOVABLE = {"flexgpu.dev/movable": "true"}
FOUR_H100 = {
    "name": "steering-four-h100",
    "description": "4x H100, whole GPUs",
    "gpus": [{"model": "H100-SXM5-80GB"} for _ in range(4)],
}


def _claim(api: Any, ns: str, name: str, count: int) -> None:
    exactly = {"deviceClassName": "gpu.flexgpu.dev", "count": count}
    client.ResourceV1Api(api).create_namespaced_resource_claim(
        ns,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        },
    )


def _pod(api: Any, ns: str, name: str, selector: dict[str, str]) -> None:
    client.CoreV1Api(api).create_namespaced_pod(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": selector,
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
                ],
                "resourceClaims": [{"name": "g", "resourceClaimName": name}],
            },
        },
    )


def _pool(api: Any, ns: str, claim: str) -> str:
    status = client.ResourceV1Api(api).read_namespaced_resource_claim(claim, ns).status
    if status is None or status.allocation is None:
        return ""
    return str(status.allocation.devices.results[0].pool)


def _steered(api: Any, version: str) -> list[str]:
    listed: Any = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, version, PLURAL, label_selector=f"{STEERING_LABEL}=true"
    )
    return [str(r["spec"]["deviceSelector"].get("pool")) for r in listed["items"]]


@pytest.fixture(scope="module")
def rules_version(api: Any) -> str:
    version = TaintRules(api).version()
    if version is None:
        pytest.skip("the API server serves no DeviceTaintRules")
    return version


@pytest.fixture
def nodes(
    api: Any, cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str, dict[str, str]]]:
    """(namespace, fuller node, emptier node, a selector for both): two nodes of four
    whole H100s."""
    ensure_device_classes(api)
    tmp = tmp_path_factory.mktemp("steering")
    run = uuid.uuid4().hex[:5]
    ns, names = f"nst-{run}", (f"nst-{run}-full", f"nst-{run}-empty")
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns}})
    publishers = []
    topology = tmp / "four.yaml"
    topology.write_text(yaml.safe_dump(FOUR_H100))
    for name in names:
        create_simulated_node(api, name)
        core.patch_node(name, {"metadata": {"labels": {"steering-run": run}}})
        backend = SimulatedBackend(
            load_topology(str(topology)), name, state_path=tmp / f"{name}.json"
        )
        devices = NodeDevices(backend)
        publisher = SlicePublisher(KubeApi.from_kubeconfig(cluster.kubeconfig), name)
        publisher.set_devices(devices.slice_devices(), devices.counter_sets())
        publisher.reconcile_once()
        publishers.append(publisher)
    yield ns, names[0], names[1], {"steering-run": run}
    core.delete_namespace(ns)
    for publisher, name in zip(publishers, names, strict=True):
        publisher.delete_all()
        core.delete_node(name)


@contextlib.contextmanager
def _running_controller(cluster: ControlPlane, log: Path, *flags: str) -> Iterator[Path]:
    """The controller as a process of its own, with ``flags``; its log at ``log``."""
    out = log.open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flexgpu.controller.main",
            f"--kubeconfig={cluster.kubeconfig}",
            "--namespace=default",
            f"--lease-name=nst-{uuid.uuid4().hex[:5]}",
            "--pending-delay=2",
            "--metrics-port=0",
            "--no-webhook",
            *flags,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


@pytest.fixture
def controller(
    cluster: ControlPlane,
    api: Any,
    rules_version: str,
    nodes: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("steering-log") / "controller.log"
    with _running_controller(cluster, log, "--node-steering-share=1"):
        yield log
    objects = client.CustomObjectsApi(api)
    listed: Any = objects.list_cluster_custom_object(
        GROUP, rules_version, PLURAL, label_selector=f"{STEERING_LABEL}=true"
    )
    for rule in listed["items"]:
        objects.delete_cluster_custom_object(GROUP, rules_version, PLURAL, rule["metadata"]["name"])


def test_a_new_claim_lands_on_the_fuller_node_while_the_emptier_is_steered(
    api: Any, nodes: tuple[str, str, str, dict[str, str]], controller: Path, rules_version: str
) -> None:
    ns, full, empty, both = nodes
    for claim, count, node in (("busy", 3, full), ("small", 1, empty)):
        _claim(api, ns, claim, count)
        _pod(api, ns, claim, {"kubernetes.io/hostname": node})
        wait_for(lambda c=claim: _pool(api, ns, c), timeout_s=90, what=f"{claim} allocated")
    steered = wait_for(lambda: _steered(api, rules_version), timeout_s=60, what="a node steered")
    assert steered == [empty], controller.read_text()
    listed: Any = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, rules_version, PLURAL, label_selector=f"{STEERING_LABEL}=true"
    )
    [rule] = listed["items"]
    assert rule["spec"]["deviceSelector"] == {"driver": DRIVER_NAME, "pool": empty}
    assert rule["spec"]["taint"]["key"] == STEERING_TAINT_KEY
    # Either node would do for the scheduler; the steered one is kept off.
    _claim(api, ns, "new", 1)
    _pod(api, ns, "new", both)
    assert wait_for(lambda: _pool(api, ns, "new"), timeout_s=90, what="new allocated") == full
    # The fuller node is full now: nowhere for the steered node's claim to go, so its
    # steering ends.
    wait_for(
        lambda: _steered(api, rules_version) == [],
        timeout_s=60,
        what="the steering rule removed",
    )
    events = client.CoreV1Api(api).list_event_for_all_namespaces(
        field_selector=f"involvedObject.name={empty}"
    )
    reasons = {e.reason for e in events.items}
    assert {"GpuNodeSteering", "GpuNodeSteeringEnded"} <= reasons, controller.read_text()


def test_rules_left_by_steering_turned_off_are_deleted_and_no_one_elses(
    cluster: ControlPlane, api: Any, rules_version: str, tmp_path: Path
) -> None:
    """Steering turned off (the controller restarted without it): the leader deletes the
    rules it left, which would otherwise keep their nodes steered for ever; a rule of
    someone else's, though it names flexgpu's devices, stays."""
    objects: Any = client.CustomObjectsApi(api)
    run = uuid.uuid4().hex[:5]
    left = steering_rule_body(
        rules_version, SteeringFor(f"nst-{run}-gone", "2026-12-07T10:00:00Z"), DRIVER_NAME, run
    )
    foreign = {
        "apiVersion": f"{GROUP}/{rules_version}",
        "kind": "DeviceTaintRule",
        "metadata": {"name": f"maintenance-{run}"},
        "spec": {
            "deviceSelector": {"driver": DRIVER_NAME, "pool": run},
            "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"},
        },
    }
    for body in (left, foreign):
        objects.create_cluster_custom_object(GROUP, rules_version, PLURAL, body)
    try:
        with _running_controller(cluster, tmp_path / "controller.log") as log:
            wait_for(
                lambda: (
                    left["metadata"]["name"]
                    not in {
                        r["metadata"]["name"]
                        for r in objects.list_cluster_custom_object(GROUP, rules_version, PLURAL)[
                            "items"
                        ]
                    }
                ),
                timeout_s=60,
                what="the rule of steering turned off deleted",
                explain=log.read_text,
            )
            assert "which is turned off" in log.read_text()
        assert objects.get_cluster_custom_object(
            GROUP, rules_version, PLURAL, foreign["metadata"]["name"]
        )
    finally:
        objects.delete_cluster_custom_object(
            GROUP, rules_version, PLURAL, foreign["metadata"]["name"]
        )


# --- eviction --------------------------------------------------------------------------------


def _template(api: Any, ns: str, name: str) -> None:
    exactly = {"deviceClassName": "gpu.flexgpu.dev", "count": 1}
    client.ResourceV1Api(api).create_namespaced_resource_claim_template(
        ns,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
        },
    )


def _pod_template(
    name: str, selector: dict[str, str], labels: dict[str, str], restart: str = "Always"
) -> dict[str, Any]:
    """Annotated movable, its claim from template ``name``."""
    return {
        "metadata": {"labels": labels, "annotations": MOVABLE},
        "spec": {
            "nodeSelector": selector,
            "terminationGracePeriodSeconds": 0,
            "restartPolicy": restart,
            "containers": [
                {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
            ],
            "resourceClaims": [{"name": "g", "resourceClaimTemplateName": name}],
        },
    }


def _serve(api: Any, ns: str, replicas: int, selector: dict[str, str]) -> None:
    """Deployment ``serve`` (pods labelled app=serve) of movable pods, claims from template
    ``serve``."""
    client.AppsV1Api(api).create_namespaced_deployment(
        ns,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "serve"},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": "serve"}},
                "template": _pod_template("serve", selector, {"app": "serve"}),
            },
        },
    )


def _train(api: Any, ns: str, node: str) -> None:
    """Job ``train``, its one pod on ``node``, annotated movable too, its claim from template
    ``train``."""
    client.BatchV1Api(api).create_namespaced_job(
        ns,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "train"},
            "spec": {
                "backoffLimit": 0,
                "template": _pod_template(
                    "train", {"kubernetes.io/hostname": node}, {}, restart="Never"
                ),
            },
        },
    )


def _live_pods(api: Any, ns: str, selector: str) -> list[Any]:
    listed = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=selector).items
    return [p for p in listed if p.metadata.deletion_timestamp is None]


def _generated_pool(api: Any, ns: str, pod: Any) -> str:
    """The pool of the claim generated for ``pod``; "" until it is allocated."""
    status = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, ns).status
    for entry in (status.resource_claim_statuses if status else None) or []:
        if entry.resource_claim_name:
            return _pool(api, ns, entry.resource_claim_name)
    return ""


def _node_events(api: Any, node: str, reason: str) -> list[str]:
    events = client.CoreV1Api(api).list_event_for_all_namespaces(
        field_selector=f"involvedObject.name={node}"
    )
    return [str(e.message) for e in events.items if e.reason == reason]


def _steer_with_eviction(cluster: ControlPlane, log: Path, group: dict[str, str]) -> Any:
    """Only this test's two nodes are the group: no other test's node is steered or
    emptied."""
    return _running_controller(
        cluster,
        log,
        "--node-steering-share=1",
        "--node-steering-nodes=" + ",".join(f"{k}={v}" for k, v in group.items()),
        "--node-steering-evict-after=3s",
        "--node-steering-evict-max-in-flight=1",
    )


def _remove_rules(api: Any, version: str) -> None:
    objects = client.CustomObjectsApi(api)
    listed: Any = objects.list_cluster_custom_object(
        GROUP, version, PLURAL, label_selector=f"{STEERING_LABEL}=true"
    )
    for rule in listed["items"]:
        objects.delete_cluster_custom_object(GROUP, version, PLURAL, rule["metadata"]["name"])


def test_a_steered_nodes_deployment_pod_is_evicted_and_runs_on_the_other_node(
    api: Any,
    cluster: ControlPlane,
    nodes: tuple[str, str, str, dict[str, str]],
    rules_version: str,
    tmp_path: Path,
) -> None:
    """The fuller node is filled first, so the Deployment's pod (free to use either node)
    lands on the emptier one; then one GPU of the fuller node is freed and the controller
    starts: the emptier node is steered, and 3s later its only holder is evicted."""
    ns, full, empty, both = nodes
    group = both
    for claim, count in (("busy", 3), ("filler", 1)):
        _claim(api, ns, claim, count)
        _pod(api, ns, claim, {"kubernetes.io/hostname": full})
        wait_for(lambda c=claim: _pool(api, ns, c), timeout_s=90, what=f"{claim} allocated")
    _template(api, ns, "serve")
    _serve(api, ns, 1, both)
    first = wait_for(lambda: _live_pods(api, ns, "app=serve"), timeout_s=60, what="its pod")[0]
    pool = wait_for(lambda: _generated_pool(api, ns, first), timeout_s=90, what="its claim")
    assert pool == empty
    core = client.CoreV1Api(api)
    core.delete_namespaced_pod("filler", ns, grace_period_seconds=0)
    client.ResourceV1Api(api).delete_namespaced_resource_claim("filler", ns)
    wait_for(
        lambda: (
            not [
                c
                for c in client.ResourceV1Api(api).list_namespaced_resource_claim(ns).items
                if c.metadata.name == "filler"
            ]
        ),
        timeout_s=60,
        what="the filler claim gone",
    )
    try:
        with _steer_with_eviction(cluster, tmp_path / "controller.log", group) as log:
            wait_for(
                lambda: (
                    "GpuNodeSteeringEviction"
                    in {
                        e.reason
                        for e in core.list_namespaced_event(ns).items
                        if e.involved_object.name == first.metadata.name
                    }
                ),
                timeout_s=90,
                what="GpuNodeSteeringEviction Event on the Deployment's pod",
                explain=log.read_text,
            )
            assert _steered(api, rules_version) == [empty]
            words = _node_events(api, empty, "GpuNodeSteeringEviction")
            assert any(
                f"emptying node {empty} that flexgpu steers so an autoscaler can remove it" in w
                and 'the pod carries flexgpu.dev/movable: "true"' in w
                for w in words
            ), words
            # Its ReplicaSet makes it again; the new claim goes to the fuller node, away from
            # the steered node's taint.
            second = wait_for(
                lambda: [
                    p
                    for p in _live_pods(api, ns, "app=serve")
                    if p.metadata.uid != first.metadata.uid
                ],
                timeout_s=60,
                what="the Deployment's new pod",
            )[0]
            moved = wait_for(
                lambda: _generated_pool(api, ns, second), timeout_s=90, what="its new claim"
            )
            assert moved == full, log.read_text()
            assert second.spec.node_name in (None, full)
    finally:
        _remove_rules(api, rules_version)


def test_a_steered_node_holding_a_jobs_pod_is_not_emptied_and_says_why(
    api: Any,
    cluster: ControlPlane,
    nodes: tuple[str, str, str, dict[str, str]],
    rules_version: str,
    tmp_path: Path,
) -> None:
    ns, full, empty, group = nodes
    _claim(api, ns, "busy", 3)
    _pod(api, ns, "busy", {"kubernetes.io/hostname": full})
    wait_for(lambda: _pool(api, ns, "busy"), timeout_s=90, what="busy allocated")
    _template(api, ns, "train")
    _train(api, ns, empty)
    train = wait_for(
        lambda: _live_pods(api, ns, "job-name=train"), timeout_s=60, what="the Job's pod"
    )[0]
    assert wait_for(lambda: _generated_pool(api, ns, train), timeout_s=90, what="its claim") == (
        empty
    )
    try:
        with _steer_with_eviction(cluster, tmp_path / "controller.log", group) as log:
            said = wait_for(
                lambda: _node_events(api, empty, "GpuNodeSteeringWaitsForPods"),
                timeout_s=90,
                what="GpuNodeSteeringWaitsForPods Event on the node",
                explain=log.read_text,
            )
            assert f"pod {ns}/{train.metadata.name} belongs to a Job" in said[0], said
            assert _steered(api, rules_version) == [empty]
            holds_for(
                lambda: (
                    [p.metadata.uid for p in _live_pods(api, ns, "job-name=train")]
                    == [train.metadata.uid]
                ),
                seconds=12,
                why="the controller passes at least every 10s once the snapshot changes",
            )
            assert not _node_events(api, empty, "GpuNodeSteeringEviction"), log.read_text()
    finally:
        _remove_rules(api, rules_version)


def test_with_eviction_on_the_node_of_movable_pods_is_steered_before_the_jobs(
    api: Any,
    cluster: ControlPlane,
    nodes: tuple[str, str, str, dict[str, str]],
    rules_version: str,
    tmp_path: Path,
) -> None:
    """One node holds a Job's pod (one holder), the other a Deployment's two pods that
    consented (two holders). By holders alone the Job's node would be steered; with eviction
    on, the controller reads the holders' pods and steers the node eviction can empty. The
    other node then has no room left for what the first holds, so only one is steered."""
    ns, job_node, served, group = nodes
    _template(api, ns, "train")
    _train(api, ns, job_node)
    _template(api, ns, "serve")
    _serve(api, ns, 2, {"kubernetes.io/hostname": served})
    for selector, count in (("job-name=train", 1), ("app=serve", 2)):
        pods = wait_for(
            lambda s=selector, n=count: live if len(live := _live_pods(api, ns, s)) == n else None,
            timeout_s=60,
            what=f"{count} pod(s) of {selector}",
        )
        for p in pods:
            wait_for(lambda p=p: _generated_pool(api, ns, p), timeout_s=90, what="its claim")
    try:
        # Eviction on, but not before the test ends: only the ranking is looked at.
        with _running_controller(
            cluster,
            tmp_path / "controller.log",
            "--node-steering-share=1",
            "--node-steering-nodes=" + ",".join(f"{k}={v}" for k, v in group.items()),
            "--node-steering-evict-after=10m",
        ) as log:
            steered = wait_for(
                lambda: _steered(api, rules_version), timeout_s=60, what="a node steered"
            )
            assert steered == [served], log.read_text()
            holds_for(
                lambda: _steered(api, rules_version) == [served],
                seconds=12,
                why="the controller passes at least every 10s once the snapshot changes",
            )
    finally:
        _remove_rules(api, rules_version)
