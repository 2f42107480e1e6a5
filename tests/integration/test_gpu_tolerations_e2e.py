"""GPU nodes tainted nvidia.com/gpu:NoSchedule (as GPU node pools usually are) run pods that
ask for GPUs through flexgpu's claims without a toleration written by hand: the controller's
pod webhook adds it at admission. Against the real API server and scheduler, with the
plugin on a simulated node and the upstream kubelet code preparing; the webhook runs as the
controller's local process (tests/integration/webhook_process.py)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import make_pod
from tests.integration.webhook_process import run_webhook_for_tests
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.cluster.nodes import mark_node_ready

pytestmark = pytest.mark.integration

NODE = "e2e-tainted-gpus"
VALIDATION = "e2e-tolerations-validation"
TOLERATIONS = "e2e-gpu-tolerations"
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
ADDED = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
WHOLE_GPU = {
    "spec": {
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.flexgpu.dev"}}]
            }
        }
    }
}


@pytest.fixture(scope="module")
def toleration_webhook(cluster: ControlPlane, api: Any) -> Iterator[None]:
    """The controller's webhooks with the pod toleration webhook, as a local process; its
    configurations are removed afterwards so that later modules see none."""
    core = client.CoreV1Api(api)
    secrets = f"flexgpu-tolerations-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": secrets}})
    admission: Any = client.AdmissionregistrationV1Api(api)
    try:
        with run_webhook_for_tests(
            cluster.kubeconfig,
            cluster.workdir / "logs" / "tolerations-webhook.log",
            secret_namespace=secrets,
            configuration_name=VALIDATION,
            extra_args=(f"--toleration-webhook-configuration-name={TOLERATIONS}",),
        ):
            yield
    finally:
        with contextlib.suppress(client.ApiException):
            admission.delete_validating_webhook_configuration(VALIDATION)
        with contextlib.suppress(client.ApiException):
            admission.delete_mutating_webhook_configuration(TOLERATIONS)
        core.delete_namespace(secrets)


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(cluster, api, NODE, "hgx-h100-8") as sim:
        mark_node_ready(api, NODE, taints=[TAINT])
        yield sim


def _tolerations(pod: Any) -> list[dict[str, Any]]:
    """The pod's tolerations of the GPU taint (the API server adds its own for not-ready and
    unreachable nodes, DefaultTolerationSeconds)."""
    return [
        {k: v for k, v in (("key", t.key), ("operator", t.operator), ("effect", t.effect)) if v}
        for t in pod.spec.tolerations or []
        if t.key == TAINT["key"]
    ]


def _dry_run(api: Any, namespace: str, body: dict[str, Any]) -> Any:
    return client.CoreV1Api(api).create_namespaced_pod(namespace, body, dry_run="All")


def test_a_claim_pod_without_the_toleration_runs_on_a_tainted_gpu_node(
    api: Any, namespace: str, toleration_webhook: None, node: SimulatedGpuNode
) -> None:
    """The pod names a template of gpu.flexgpu.dev and no toleration: it is admitted with
    exactly one nvidia.com/gpu toleration, scheduled onto the tainted node and prepared.
    Pods that ask flexgpu for nothing (no claim, another driver's class, a claim not made
    yet) are admitted unchanged, and a toleration the pod has is not added twice."""
    resources = client.ResourceV1Api(api)
    template = {"metadata": {"name": "one-gpu"}, **WHOLE_GPU}
    resources.create_namespaced_resource_claim_template(namespace, template)
    pod = make_pod(
        "trainer", "echo DONE; sleep 300", {"gpu": {"resourceClaimTemplateName": "one-gpu"}}, NODE
    )

    # The API server loads a new configuration a moment after it is written.
    wait_for(
        lambda: _tolerations(_dry_run(api, namespace, pod)) != [],
        timeout_s=30,
        what="the toleration webhook to mutate pods",
    )
    created = client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
    assert ADDED in _tolerations(created)
    wait_for(
        lambda: "DONE" in node.container_log(namespace, "trainer", "main"),
        timeout_s=90,
        what="the pod to run on the tainted GPU node",
    )

    plain = make_pod("no-claim", "true", {}, NODE)
    assert _tolerations(_dry_run(api, namespace, plain)) == []
    other = {
        "metadata": {"name": "other-driver"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "g", "exactly": {"deviceClassName": "example.com"}}]
                }
            }
        },
    }
    resources.create_namespaced_resource_claim_template(namespace, other)
    foreign = make_pod(
        "foreign", "true", {"g": {"resourceClaimTemplateName": "other-driver"}}, NODE
    )
    assert _tolerations(_dry_run(api, namespace, foreign)) == []
    later = make_pod("later", "true", {"g": {"resourceClaimName": "not-made-yet"}}, NODE)
    assert _tolerations(_dry_run(api, namespace, later)) == []
    written = make_pod("written", "true", {"gpu": {"resourceClaimTemplateName": "one-gpu"}}, NODE)
    written["spec"]["tolerations"] = [dict(ADDED)]
    assert _tolerations(_dry_run(api, namespace, written)) == [ADDED]


def test_without_the_webhook_the_same_pod_stays_pending_on_the_taint(
    api: Any, namespace: str, node: SimulatedGpuNode, cluster: ControlPlane
) -> None:
    """The control: with no toleration webhook (its configuration gone) the same pod is not
    scheduled, and the scheduler says it is for the node's taint, so the test above proves the
    webhook."""
    admission: Any = client.AdmissionregistrationV1Api(api)
    with contextlib.suppress(client.ApiException):
        admission.delete_mutating_webhook_configuration(TOLERATIONS)
    resources = client.ResourceV1Api(api)
    resources.create_namespaced_resource_claim_template(
        namespace, {"metadata": {"name": "one-gpu"}, **WHOLE_GPU}
    )
    pod = make_pod(
        "untolerated", "echo DONE", {"gpu": {"resourceClaimTemplateName": "one-gpu"}}, NODE
    )
    wait_for(
        lambda: _tolerations(_dry_run(api, namespace, pod)) == [],
        timeout_s=30,
        what="the toleration webhook's configuration to be unloaded",
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, pod)

    def conditions() -> list[tuple[str, str, str]]:
        status = client.CoreV1Api(api).read_namespaced_pod("untolerated", namespace).status
        return [(c.type, c.reason or "", c.message or "") for c in status.conditions or []]

    def refused() -> bool:
        return any(
            kind == "PodScheduled" and reason == "Unschedulable" and "untolerated taint" in text
            for kind, reason, text in conditions()
        )

    wait_for(refused, timeout_s=60, what="the scheduler to name the taint", explain=conditions)


def test_an_outage_fails_closed_or_open_as_the_failure_policy_says(
    cluster: ControlPlane, api: Any, namespace: str
) -> None:
    """With no controller answering, ``Fail`` refuses a pod whose claims are flexgpu's and
    ``Ignore`` admits it without the toleration; a pod naming no claim is never sent."""
    core = client.CoreV1Api(api)
    admission: Any = client.AdmissionregistrationV1Api(api)
    secrets = f"flexgpu-outage-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": secrets}})
    name = f"{TOLERATIONS}-outage"
    client.ResourceV1Api(api).create_namespaced_resource_claim_template(
        namespace, {"metadata": {"name": "one-gpu"}, **WHOLE_GPU}
    )
    pod = make_pod("gpu", "true", {"gpu": {"resourceClaimTemplateName": "one-gpu"}}, NODE)
    try:
        with run_webhook_for_tests(
            cluster.kubeconfig,
            cluster.workdir / "logs" / "tolerations-outage-webhook.log",
            secret_namespace=secrets,
            configuration_name=f"{VALIDATION}-outage",
            extra_args=(
                f"--toleration-webhook-configuration-name={name}",
                "--toleration-failure-policy=Fail",
            ),
        ):
            wait_for(
                lambda: _tolerations(_dry_run(api, namespace, pod)) == [ADDED],
                timeout_s=30,
                what="the toleration webhook to mutate pods",
            )
        # The process is gone: Fail refuses the pod, and names the webhook.

        def refused() -> str:
            try:
                _dry_run(api, namespace, pod)
            except client.ApiException as error:
                return str(error.body)
            return ""

        message = wait_for(refused, timeout_s=30, what="the pod refused while nobody answers")
        assert "tolerations.pods.gpu.flexgpu.dev" in message, message
        assert _dry_run(api, namespace, make_pod("plain", "true", {}, NODE))
        admission.patch_mutating_webhook_configuration(
            name, [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}]
        )
        wait_for(
            lambda: not refused(),
            timeout_s=30,
            what="the pod admitted under Ignore",
        )
        assert _tolerations(_dry_run(api, namespace, pod)) == []
    finally:
        for kind, config in (("validating", f"{VALIDATION}-outage"), ("mutating", name)):
            with contextlib.suppress(client.ApiException):
                getattr(admission, f"delete_{kind}_webhook_configuration")(config)
        core.delete_namespace(secrets)
