"""GPU clearing's eviction against the real scheduler and the real workload controllers
(Deployment, ReplicaSet, Job, disruption), with the fixtures of test_clearing_e2e.py: the
controller evicts from a GPU steered for 3s, one pod at a time.

What moves: a Deployment's pod whose owner consented, by the annotation
``flexgpu.dev/movable: "true"`` or by a PodDisruptionBudget that selects it. What never
does: a Job's pod, annotated or not; while it holds the GPU, nobody else there is evicted
either, and the waiting claim is told why. A pod whose claim fits only on the GPU being
cleared is not evicted either: its replacement would have nowhere to go.

The pods never run (the node is simulated, no kubelet): bound and Pending, they are evicted
without the budget's room being counted (the Eviction API's own rule for pods that are not
running). The budget's answer (429 while it has no room) is in the unit tests.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from tests.conftest import holds_for, wait_for
from tests.integration.test_clearing_e2e import (
    ONE_G,
    A,
    _allocated,
    _claim,
    _device,
    _pod,
    _reasons,
    controller,
    node,
    rules_version,
)

__all__ = ["controller", "node", "rules_version"]  # the fixtures, shared

pytestmark = pytest.mark.integration

MOVABLE = {"flexgpu.dev/movable": "true"}


def _template(api: Any, ns: str, name: str, *cel: str) -> None:
    exactly: dict[str, Any] = {"deviceClassName": "mig.flexgpu.dev", "count": 1}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in cel]
    client.ResourceV1Api(api).create_namespaced_resource_claim_template(
        ns,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
        },
    )


def _pod_spec(node: str, template: str, restart: str = "Always") -> dict[str, Any]:
    return {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 0,
        "restartPolicy": restart,
        "containers": [{"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}],
        "resourceClaims": [{"name": "g", "resourceClaimTemplateName": template}],
    }


def _generated_claim(api: Any, ns: str, pod: str) -> str:
    status = client.CoreV1Api(api).read_namespaced_pod(pod, ns).status
    for entry in (status.resource_claim_statuses if status else None) or []:
        if entry.resource_claim_name:
            return str(entry.resource_claim_name)
    return ""


def _live_pods(api: Any, ns: str, selector: str) -> list[Any]:
    listed = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=selector).items
    return [p for p in listed if p.metadata.deletion_timestamp is None]


def _deployment(
    api: Any, ns: str, node: str, annotations: dict[str, str], *cel: str
) -> tuple[Any, str]:
    """Deployment "serve" (one replica) with its claim on GPU 0, asking for a 1g partition
    that also passes ``cel``: (its pod, the claim)."""
    _template(api, ns, "serve", ONE_G, *cel)
    template: dict[str, Any] = {"labels": {"app": "serve"}}
    if annotations:
        template["annotations"] = annotations
    client.AppsV1Api(api).create_namespaced_deployment(
        ns,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "serve"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "serve"}},
                "template": {"metadata": template, "spec": _pod_spec(node, "serve")},
            },
        },
    )
    pod = wait_for(lambda: _live_pods(api, ns, "app=serve"), timeout_s=60, what="its pod")[0]
    claim = wait_for(
        lambda: _generated_claim(api, ns, pod.metadata.name), timeout_s=60, what="its claim"
    )
    return pod, claim


def _job(api: Any, ns: str, node: str) -> Any:
    """Job "train", its pod (made by the Job controller) annotated movable, on GPU 0."""
    _template(api, ns, "train", ONE_G, f"{A}.parentIndex == 0")
    client.BatchV1Api(api).create_namespaced_job(
        ns,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "train"},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"annotations": MOVABLE},
                    "spec": _pod_spec(node, "train", restart="Never"),
                },
            },
        },
    )
    return wait_for(
        lambda: _live_pods(api, ns, "job-name=train"), timeout_s=60, what="the Job's pod"
    )[0]


def _clear_gpu0_past_a_job(
    api: Any, ns: str, name: str, ready: bool, controller: Any, first: Any, claim: str
) -> None:
    """With the Deployment's pod (``first``, ``claim``) on GPU 0: the Job's pod joins it,
    three plain pods fill GPU 1, a whole-GPU claim waits and GPU 0 is steered. Past the bound
    nobody is evicted while the Job's pod is there (the claim is told why); then the Job is
    suspended (its controller deletes its pod), the Deployment's pod is evicted, its
    ReplicaSet makes it again on GPU 1, and the waiting claim gets GPU 0."""
    core = client.CoreV1Api(api)
    device = _allocated(api, ns, claim, ready, pod=first.metadata.name)
    assert device.startswith("gpu-0-mig-1g10gb"), device
    train = _job(api, ns, name)
    train_claim = wait_for(
        lambda: _generated_claim(api, ns, train.metadata.name), timeout_s=60, what="its claim"
    )
    on = _allocated(api, ns, train_claim, ready, pod=train.metadata.name)
    assert on.startswith("gpu-0-mig-1g10gb"), on
    # Three plain holders on GPU 1: GPU 0 (two holders) is the one cleared.
    for plain in ("p1", "p2", "p3"):
        _claim(api, ns, plain, "mig.flexgpu.dev", ONE_G, f"{A}.parentIndex == 1")
        _pod(api, ns, plain, name)
    for plain in ("p1", "p2", "p3"):
        assert _allocated(api, ns, plain, ready).startswith("gpu-1-mig-1g10gb")

    _claim(api, ns, "big", "gpu.flexgpu.dev")
    _pod(api, ns, "big", name)
    try:
        wait_for(
            lambda: "GpuClearingWaitsForPods" in _reasons(api, ns, "ResourceClaim", "big"),
            timeout_s=90,
            what="GpuClearingWaitsForPods Event on the waiting claim",
        )
    except BaseException:
        print(controller.read_text())
        raise
    waits = [
        e.message
        for e in core.list_namespaced_event(ns).items
        if e.reason == "GpuClearingWaitsForPods" and e.involved_object.name == "big"
    ]
    job_pod = f"pod {ns}/{train.metadata.name} belongs to a Job"
    assert any(job_pod in m for m in waits), waits
    # Nobody is evicted while the Job's pod holds GPU 0: two passes' worth past the bound.
    holds_for(
        lambda: (
            [p.metadata.uid for p in _live_pods(api, ns, "app=serve")] == [first.metadata.uid]
            and [p.metadata.uid for p in _live_pods(api, ns, "job-name=train")]
            == [train.metadata.uid]
        ),
        seconds=12,
        why="the controller passes at least every 10s once the snapshot changes",
    )
    assert "GpuClearingEviction" not in _reasons(api, ns, "Pod", train.metadata.name)

    # The Job is suspended: its controller deletes its pod, and only a pod that may move
    # holds GPU 0.
    client.BatchV1Api(api).patch_namespaced_job("train", ns, {"spec": {"suspend": True}})
    try:
        wait_for(
            lambda: "GpuClearingEviction" in _reasons(api, ns, "Pod", first.metadata.name),
            timeout_s=60,
            what="GpuClearingEviction Event on the Deployment's pod",
        )
    except BaseException:
        print(controller.read_text())
        raise
    assert "GpuClearingEviction" not in _reasons(api, ns, "Pod", train.metadata.name)
    assert "GpuClearingEviction" in _reasons(api, "default", "Node", name)
    # Its ReplicaSet makes it again; its new claim goes to GPU 1, away from the taints.
    second = wait_for(
        lambda: [
            p for p in _live_pods(api, ns, "app=serve") if p.metadata.uid != first.metadata.uid
        ],
        timeout_s=60,
        what="the Deployment's new pod",
    )[0]
    new_claim = wait_for(
        lambda: _generated_claim(api, ns, second.metadata.name), timeout_s=60, what="its claim"
    )
    moved = _allocated(api, ns, new_claim, ready, pod=second.metadata.name)
    assert moved.startswith("gpu-1-mig-1g10gb"), moved
    # The waiting claim takes GPU 0; the steering ends.
    assert _allocated(api, ns, "big", ready) == "gpu-0"
    wait_for(
        lambda: "GpuClearingEnded" in _reasons(api, ns, "ResourceClaim", "big"),
        timeout_s=30,
        what="GpuClearingEnded Event on the claim",
    )
    # The plain holders on GPU 1 were never moved.
    for plain in ("p1", "p2", "p3"):
        assert _device(api, ns, plain).startswith("gpu-1-mig-1g10gb")


def _eviction_words(api: Any, ns: str, pod: str) -> list[str]:
    return [
        str(e.message)
        for e in client.CoreV1Api(api).list_namespaced_event(ns).items
        if e.reason == "GpuClearingEviction" and e.involved_object.name == pod
    ]


def test_a_deployments_annotated_pod_moves_and_a_jobs_pod_never_does(
    api: Any, node: tuple[str, str, bool], controller: Any, rules_version: str
) -> None:
    ns, name, ready = node
    first, claim = _deployment(api, ns, name, MOVABLE)
    _clear_gpu0_past_a_job(api, ns, name, ready, controller, first, claim)
    words = _eviction_words(api, ns, first.metadata.name)
    assert any('the pod carries flexgpu.dev/movable: "true"' in w for w in words), words


@pytest.mark.parametrize("node", [False], indirect=True, ids=["binding-conditions-off"])
def test_a_deployments_pod_a_budget_selects_moves_without_the_annotation(
    api: Any, node: tuple[str, str, bool], controller: Any, rules_version: str
) -> None:
    """No annotation on the Deployment's pods: a PodDisruptionBudget (maxUnavailable: 1)
    that selects them is the consent. The Job's pod, annotated, still never moves. One
    binding mode: the other test covers both."""
    ns, name, ready = node
    client.PolicyV1Api(api).create_namespaced_pod_disruption_budget(
        ns,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "serve"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "serve"}}},
        },
    )
    first, claim = _deployment(api, ns, name, {})
    assert not (first.metadata.annotations or {}).get("flexgpu.dev/movable")
    _clear_gpu0_past_a_job(api, ns, name, ready, controller, first, claim)
    words = _eviction_words(api, ns, first.metadata.name)
    assert any(f"PodDisruptionBudget {ns}/serve selects the pod" in w for w in words), words


@pytest.mark.parametrize("node", [False], indirect=True, ids=["binding-conditions-off"])
def test_a_pod_whose_claim_fits_only_on_the_gpu_being_cleared_is_not_evicted(
    api: Any, node: tuple[str, str, bool], controller: Any, rules_version: str
) -> None:
    """The Deployment's template asks for a partition of GPU 0 itself: its replacement could
    go nowhere while GPU 0 is kept clear, so it stays and the waiting claim is told so."""
    ns, name, ready = node
    first, claim = _deployment(api, ns, name, MOVABLE, f"{A}.parentIndex == 0")
    assert _allocated(api, ns, claim, ready, pod=first.metadata.name).startswith("gpu-0-")
    for plain in ("p1", "p2", "p3"):
        _claim(api, ns, plain, "mig.flexgpu.dev", ONE_G, f"{A}.parentIndex == 1")
        _pod(api, ns, plain, name)
    _claim(api, ns, "big", "gpu.flexgpu.dev")
    _pod(api, ns, "big", name)
    core = client.CoreV1Api(api)

    def nowhere() -> list[str]:
        return [
            str(e.message)
            for e in core.list_namespaced_event(ns).items
            if e.reason == "GpuClearingWaitsForPods"
            and e.involved_object.name == "big"
            and "would have nowhere to go" in str(e.message)
        ]

    try:
        said = wait_for(nowhere, timeout_s=90, what="GpuClearingWaitsForPods: nowhere to go")
    except BaseException:
        print(controller.read_text())
        raise
    assert f"claim {ns}/{claim} fits on no device" in said[0], said
    holds_for(
        lambda: [p.metadata.uid for p in _live_pods(api, ns, "app=serve")] == [first.metadata.uid],
        seconds=12,
        why="the controller passes at least every 10s once the snapshot changes",
    )
    assert "GpuClearingEviction" not in _reasons(api, ns, "Pod", first.metadata.name)
