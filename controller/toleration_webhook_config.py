"""The ``MutatingWebhookConfiguration`` that adds the GPU-node tolerations to pods using
flexgpu's claims (gpu_tolerations.py), built for a controller run outside the chart; the
chart renders the same (tests/unit/test_chart_tolerations.py compares them).

One webhook, pods on CREATE (a pod's claims are fixed at creation). ``matchConditions`` send
only pods that name a claim or a claim template, so other pods never wait on the controller.
``failurePolicy`` is the admin's (chart value ``webhook.failurePolicy.tolerations``, default
Ignore): while the controller is down a GPU pod is created without the toleration and waits
Pending with the scheduler's taint message, never blocking pods; Fail makes such pods wait for
the controller instead. The namespace opt-out label of the validating webhooks
(``flexgpu.dev/webhook: disabled``) applies. ``reinvocationPolicy: IfNeeded``: a later
webhook that adds a claim gets the tolerations added too (the patch is idempotent).
"""

from __future__ import annotations

from typing import Any, Final

from flexgpu.controller.gpu_tolerations import GPU_TOLERATIONS_HANDLER
from flexgpu.controller.webhook_config import (
    DEFAULT_NAMESPACE_SELECTOR,
    ClientTarget,
    FailurePolicy,
    client_config,
)
from flexgpu.driver.names import DRIVER_NAME

TOLERATION_CONFIGURATION_NAME: Final = "flexgpu-gpu-tolerations"
# Up to three reads (claim or template, and its classes) per pod.
TOLERATION_TIMEOUT_S: Final = 5
POD_CLAIMS_CONDITION: Final = (
    "has(object.spec.resourceClaims) && object.spec.resourceClaims.exists(c, "
    "has(c.resourceClaimName) || has(c.resourceClaimTemplateName))"
)


def build_toleration_webhook_configuration(
    target: ClientTarget,
    ca_bundle: bytes | None,
    *,
    name: str = TOLERATION_CONFIGURATION_NAME,
    failure_policy: FailurePolicy = "Ignore",
    namespace_selector: dict[str, Any] | None = None,
    object_selector: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The MutatingWebhookConfiguration as a JSON-ready dict (see the module docstring)."""
    webhook: dict[str, Any] = {
        "name": f"tolerations.pods.{DRIVER_NAME}",
        "clientConfig": client_config(target, GPU_TOLERATIONS_HANDLER, ca_bundle),
        "rules": [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "failurePolicy": failure_policy,
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": TOLERATION_TIMEOUT_S,
        "admissionReviewVersions": ["v1"],
        "reinvocationPolicy": "IfNeeded",
        "namespaceSelector": dict(namespace_selector or DEFAULT_NAMESPACE_SELECTOR),
        "matchConditions": [{"name": "pod-with-claims", "expression": POD_CLAIMS_CONDITION}],
    }
    if object_selector is not None:
        webhook["objectSelector"] = object_selector
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/name": "flexgpu",
                "app.kubernetes.io/component": "webhook",
            },
        },
        "webhooks": [webhook],
    }
